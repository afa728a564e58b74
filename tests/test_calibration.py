"""Calibration: the shipped A100 profile reproduces Vidur's measurements; the generic fitter recovers known
parameters; profiles round-trip through JSON with clear errors."""
import dataclasses
import functools
import json

import numpy as np
import pytest

from pdjax.config import get_model_spec
from pdjax.sim import calibration as cal
from pdjax.sim.cost_model import BatchComposition, CostParams, iteration_time
from pdjax.sim.hardware import HardwareSpec, get_hardware_spec
from pdjax.sim.profile import PROFILES_DIR, SCHEMA, Profile, load_profile, save_profile

A100 = get_hardware_spec("a100-80gb-sxm")


# ------------------------------------------------------------------------------------------------ profile files
def test_shipped_a100_profile_loads_and_is_plausible():
    profile = load_profile("a100")
    p = profile.params
    assert profile.hardware == "a100-80gb-sxm"
    assert set(profile.fitted) >= {"gemm_flops_efficiency", "gemm_bandwidth_efficiency", "comm_bandwidth_efficiency"}
    # Efficiencies of big GEMMs on A100 are known to be 60-85% of peak FLOPs and HBM bandwidth.
    assert 0.55 < p.gemm_flops_efficiency < 0.9 and 0.55 < p.gemm_bandwidth_efficiency < 0.95
    assert 0.3 < p.comm_bandwidth_efficiency < 1.0
    assert profile.fit["median_rel_error"] < 0.10


def test_profile_round_trip_and_errors(tmp_path):
    profile = Profile(hardware="h100-sxm", params=CostParams(gemm_flops_efficiency=0.6),
                      fitted=("gemm_flops_efficiency",), fit={"median_rel_error": 0.05}, source="test")
    path = tmp_path / "h100.json"
    save_profile(path, profile)
    assert load_profile(path) == profile
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA
    data["schema"] = "something/v0"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="h100.json.*schema='something/v0'"):
        load_profile(path)
    with pytest.raises(ValueError, match="not found; shipped profiles: \\[.*'a100'"):
        load_profile("b300")


@pytest.mark.parametrize("name", ["a100", "h100", "host-cpu"])
def test_a_profile_loads_the_same_by_name_and_by_path(name):
    """One loader: a shipped name and its file's path give equal profiles, with everything the file holds."""
    by_name, by_path = load_profile(name), load_profile(PROFILES_DIR / f"{name}.json")
    assert by_name == by_path and by_name.path == by_path.path
    data = json.loads((PROFILES_DIR / f"{name}.json").read_text())
    assert (by_name.padding is None) == ("padding" not in data)
    assert len(by_name.step_noise) == len((data.get("step_noise") or {}).get("quantiles", ()))
    assert (by_name.hardware_spec is None) == ("hardware_spec" not in data)
    # Nothing dropped, nothing added (but the CostParams and HardwareSpec fields newer than the file, at their
    # defaults).
    expected = {**data, "cost_params": {**CostParams().to_dict(), **data["cost_params"]}}
    if "hardware_spec" in data:
        newer = {f.name: f.default for f in dataclasses.fields(HardwareSpec) if f.name not in data["hardware_spec"]}
        expected["hardware_spec"] = {**data["hardware_spec"], **newer}
    assert by_name.to_dict() == expected


def test_profile_save_is_atomic_and_round_trips_every_key(tmp_path):
    shipped = load_profile("host-cpu")
    path = tmp_path / "copy.json"
    save_profile(path, shipped)
    assert load_profile(path) == shipped and json.loads(path.read_text()) == shipped.to_dict()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.json"]     # no temporary left behind


# ------------------------------------------------------------------------------------------------ Vidur A100 data
@functools.lru_cache(maxsize=1)
def _load_vidur(path):
    return cal.load_vidur_profiles(path)


@pytest.fixture
def vidur(shared_data):
    return _load_vidur(shared_data / "profiling")


def test_vidur_loader_shapes(vidur):
    # 4 GEMMs and 6 element-wise ops per mlp.csv row; TP shards the GEMMs' model dimensions.
    assert vidur.gemm["seconds"].size == 4 * vidur.layer["seconds"].size
    assert vidur.elementwise["seconds"].size == 6 * vidur.layer["seconds"].size
    qkv_tp1 = vidur.gemm["m"][(vidur.gemm["op"] == "attn_pre_proj") & (vidur.gemm["tp"] == 1)
                              & (vidur.gemm["model"] == "llama-3-8b")]
    assert set(qkv_tp1) == {(32 + 2 * 8) * 128}
    assert vidur.allreduce["seconds"].size > 4000 and set(vidur.allreduce["group"]) == {2, 4}
    assert np.all(vidur.gemm["seconds"] > 0)


def test_shipped_a100_fit_reproduces_the_measurements(vidur):
    params = load_profile("a100").params
    out = cal.predict_operators(vidur, params, A100, get_hardware_spec("a100-80gb-pcie"))
    measured = {"gemm": vidur.gemm, "elementwise": vidur.elementwise, "attention_prefill": vidur.prefill,
                "attention_decode": vidur.decode, "allreduce": vidur.allreduce}
    everything = np.concatenate([cal.relative_errors(out[k], m["seconds"]) for k, m in measured.items()])
    assert np.median(everything) < 0.10
    for key in ("gemm", "attention_decode", "allreduce"):
        assert np.median(cal.relative_errors(out[key], measured[key]["seconds"])) < 0.10, key
    # Prefill attention is held to causal tile skipping (see calibration.A100_FIT_PARAMS): looser, but bounded.
    assert np.median(cal.relative_errors(out["attention_prefill"], vidur.prefill["seconds"])) < 0.25
    # What a simulated iteration mostly is: the per-layer sum of GEMMs and element-wise ops.
    layer = cal.relative_errors(cal.predict_layers(vidur, params, A100), vidur.layer["seconds"])
    assert np.median(layer) < 0.05 and np.percentile(layer, 90) < 0.15
    # The decode regime (1-64 tokens) is fitted as well as the rest, not sacrificed to the many large-batch rows.
    small = vidur.gemm["tokens"] <= 64
    assert np.median(cal.relative_errors(out["gemm"][small], vidur.gemm["seconds"][small])) < 0.10


def test_sanity_points_from_sources_md(vidur):
    """SOURCES.md: Llama-2-7B TP1 mlp_up_proj is ~3.365 ms at 4096 tokens and ~0.116 ms at 1 token."""
    params = load_profile("a100").params
    m = get_model_spec("llama-2-7b")
    up = dict(k=m.hidden_size, m=2 * m.intermediate_size)
    from pdjax.sim import cost_model as cm
    big = cm.gemm_time(4096, up["k"], up["m"], 2, A100.peak_flops_fp16, A100.hbm_bandwidth, A100.compute_units, params)
    one = cm.gemm_time(1, up["k"], up["m"], 2, A100.peak_flops_fp16, A100.hbm_bandwidth, A100.compute_units, params)
    assert big == pytest.approx(3.365e-3, rel=0.10)
    assert one == pytest.approx(0.116e-3, rel=0.10)


def test_refit_from_scratch_matches_the_shipped_profile(shared_data):
    """The fit itself (not just the shipped numbers) reproduces the measurements, and `experiments.fit_profile
    --hardware=a100`'s output is what is shipped (the fit is deterministic)."""
    params, report = cal.fit_vidur_a100(shared_data / "profiling")
    assert report["overall"]["median_rel_error"] < 0.10
    shipped = load_profile("a100").params
    assert params.gemm_flops_efficiency == pytest.approx(shipped.gemm_flops_efficiency, rel=0.02)


# ------------------------------------------------------------------------------------------------ generic fitter
def _grid():
    batches = []
    for tokens in (16, 64, 200, 512, 1000):
        for context in (0, 700):
            batches.append(BatchComposition(((tokens, context),)))
    for count in (1, 4, 16, 48):
        for context in (30, 400, 1500):
            batches.append(BatchComposition((), ((count, context),)))
    batches += [BatchComposition(((100, 50),), ((8, 300),)), BatchComposition(((400, 0),), ((2, 900),))]
    return batches


# A fixed CPU-like spec (not measured, so the test is deterministic).
CPU_LIKE = get_hardware_spec("l4").replace(name="cpu-like", kind="cpu", peak_flops_bf16=2e11, peak_flops_fp16=2e11,
                                           peak_flops_fp32=2e11, peak_flops_tf32=0.0, hbm_bandwidth=2e10,
                                           compute_units=4)   # a CPU: no TF32 tensor cores


def test_fit_cost_params_recovers_known_parameters():
    model = get_model_spec("tiny-byte")
    # Differs from the default initial guess in every parameter the fit adjusts (and the tile).
    truth = CostParams(gemm_flops_efficiency=0.35, gemm_bandwidth_efficiency=0.5, attn_flops_efficiency=0.2,
                       attn_bandwidth_efficiency=0.6, iteration_overhead_s=3e-3, per_seq_overhead_s=5e-5,
                       gemm_token_tile=8)
    batches = _grid()
    measured = [iteration_time(b, model, CPU_LIKE, params=truth).total for b in batches]
    result = cal.fit_cost_params(zip(batches, measured), model, CPU_LIKE, tiles=(8, 64))
    assert result.median_rel_error < 0.01 and result.p90_rel_error < 0.03
    assert result.params.gemm_token_tile == 8
    assert result.params.iteration_overhead_s == pytest.approx(3e-3, rel=0.05)
    assert result.params.gemm_flops_efficiency == pytest.approx(0.35, rel=0.10)
    assert result.params.attn_flops_efficiency == pytest.approx(0.2, rel=0.10)
    assert result.params.per_seq_overhead_s == pytest.approx(5e-5, rel=0.25)
    # The initial guess was far off: the fit moved it.
    before = cal.relative_errors([iteration_time(b, model, CPU_LIKE).total for b in batches], measured)
    assert np.median(before) > 0.2


def test_fit_cost_params_tolerates_noise():
    model = get_model_spec("tiny-llama")
    truth = CostParams(gemm_flops_efficiency=0.4, iteration_overhead_s=2e-3)
    rng = np.random.default_rng(0)
    batches = _grid()
    measured = [iteration_time(b, model, CPU_LIKE, params=truth).total * float(np.exp(rng.normal(0, 0.05)))
                for b in batches]
    result = cal.fit_cost_params(zip(batches, measured), model, CPU_LIKE, tiles=(64,))
    assert result.median_rel_error < 0.06
    assert result.params.iteration_overhead_s == pytest.approx(2e-3, rel=0.15)


def test_fit_cost_params_rejects_bad_input():
    model = get_model_spec("tiny-llama")
    with pytest.raises(ValueError, match="no measurements"):
        cal.fit_cost_params([], model, CPU_LIKE)
    with pytest.raises(ValueError, match="bad measurement"):
        cal.fit_cost_params([(BatchComposition(((4, 0),)), -1.0)], model, CPU_LIKE)
    with pytest.raises(ValueError, match="cannot fit \\['gemm_token_tile'\\]"):
        cal.fit_cost_params([(BatchComposition(((4, 0),)), 1e-3)], model, CPU_LIKE,
                            fit_names=("gemm_token_tile",))


def test_shipped_host_cpu_profile_follows_the_blocked_engine():
    """host-cpu is fitted on the CPU engine as it runs now: blocked attention (decodes by the longest context
    of the kernel's pass, not dense over the page bucket), the engine's one page bucket, the step-context terms
    (shape switch, idle wake) measured directly, the engine loop's step noise, with its provenance and raw
    measurements."""
    profile = load_profile(PROFILES_DIR / "host-cpu.json")
    assert profile.padding == {"dense_attention": False, "attention": "blocked", "decode_keys": 128}
    assert "blocked attention" in profile.source and "pages=(64,)" in profile.source
    assert profile.command and profile.hardware_spec is not None
    assert profile.fit["num_measurements"] >= 50 and profile.fit["median_rel_error"] < 0.2
    p = profile.params
    assert set(cal.STEP_CONTEXT_PARAMS) <= set(profile.fitted)
    # At most about a millisecond each on this engine (what the direct measurements show; a shape switch measured
    # 0.2-0.4 ms on a loaded machine and nothing on a quiet one, where the profile was last fitted).
    assert 0 <= p.shape_switch_s < 2e-3 and 0 < p.idle_wake_s + p.idle_wake_fixed_s < 3e-3
    data = json.loads((PROFILES_DIR / "host-cpu.json").read_text())
    assert data["step_context"]["switch"] and data["step_context"]["idle"]
    # The engine loop's step noise, from the calibration probe: a factor distribution around 1 with a tail.
    q = profile.step_noise
    assert len(q) == 101 and data["step_noise"]["num_steps"] >= 100
    assert 0.8 < q[50] < 1.3 and q[99] > q[50]
