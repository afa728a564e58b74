"""run_sim: the simulator backend of experiments.serve and sweeps (outputs, KV-page rule, profiles, determinism)."""
from __future__ import annotations

import csv
import json
import os

import pytest

from pdjax.config.model_specs import get_model_spec
from pdjax.config.serving import serve_config_from_dict
from pdjax.experiment.run import run_experiment
from pdjax.sim.cost_model import CostParams, kv_cache_capacity_tokens
from pdjax.sim.hardware import HardwareSpec, get_hardware_spec
from pdjax.sim.build import build_setup, resolve_model
from pdjax.sim.profile import Profile, load_profile, profile_for, save_profile


def gpu_config(deployment=None, **sim):
    return {
        "backend": "sim", "seed": 3,
        "model": {"checkpoint": "llama-2-7b"},
        "engine": {"mode": "online", "progress": False},
        "scheduler": {"policy": "sarathi", "token_budget": 512, "max_num_seqs": 64, "max_model_len": 4096,
                      "page_size": 16, "num_pages": 1024},
        "workload": {"preset": "chat", "num_requests": 40, "rate": 2.0, "vocab_size": 32000,
                     "fit_to_model": True},
        "slo": {"ttft": 2.0, "tbt": 0.2},
        "sim": {"hardware": "a100-80gb-sxm", **sim},
        "deployment": {"kind": "colocated", **(deployment or {})},
    }


def read(path):
    with open(path) as f:
        return f.read()


def test_run_sim_writes_the_run_outputs(tmp_path):
    summary = run_experiment(gpu_config(), str(tmp_path))
    for name in ("results.json", "config.json", "requests.csv", "token_times.csv", "iterations.csv"):
        assert os.path.isfile(tmp_path / name), name
    on_disk = json.loads(read(tmp_path / "results.json"))
    assert on_disk["sim"]["num_iterations"] == on_disk["iterations"]["num_iterations"] > 0
    assert on_disk["sim"]["iterations_per_s"] > 0 and on_disk["engine"]["backend"] == "sim"
    assert on_disk["num_completed"] == summary["num_completed"] == 40
    with open(tmp_path / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 40 and all(r["finish_reason"] == "length" for r in rows)
    assert summary["ttft"]["p50"] > 0 and summary["tbt"]["p99"] >= summary["tbt"]["p50"] > 0


def test_kv_pages_rule():
    model, hw = get_model_spec("llama-2-7b"), get_hardware_spec("a100-80gb-sxm")
    cfg = serve_config_from_dict(gpu_config())
    setup = build_setup(cfg)
    capacity = kv_cache_capacity_tokens(model, hw, 1, 1, 0.9, max_num_batched_tokens=512, max_num_seqs=64)
    assert setup.kv_capacity_tokens == capacity
    assert setup.scheduler_config.num_pages == capacity // 16 != cfg.scheduler.num_pages
    # Explicit sim.num_pages wins (a group's num_pages over it); TP2 doubles per-replica KV room (params and KV
    # heads split over 2 devices).
    assert build_setup(serve_config_from_dict(gpu_config(num_pages=777))).scheduler_config.num_pages == 777
    both = gpu_config({"colocated": {"num_pages": 555}}, num_pages=777)
    assert build_setup(serve_config_from_dict(both)).scheduler_config.num_pages == 555
    tp2 = build_setup(serve_config_from_dict(gpu_config({"colocated": {"tp": 2}})))
    assert tp2.scheduler_config.num_pages > 2 * setup.scheduler_config.num_pages
    # host-cpu: the scheduler's num_pages as given (what the CPU engine allocates).
    cpu = build_setup(serve_config_from_dict(gpu_config(hardware="host-cpu")))
    assert cpu.scheduler_config.num_pages == 1024 and cpu.kv_capacity_tokens is None


def test_model_and_profile_resolution(tmp_path):
    cfg = serve_config_from_dict({**gpu_config(), "model": {"checkpoint": "checkpoints/tiny-byte"}})
    assert resolve_model(cfg).name == "tiny-byte"
    cfg = serve_config_from_dict({**gpu_config(model="mistral-7b")})
    assert resolve_model(cfg).name == "mistral-7b"
    cfg = serve_config_from_dict({**gpu_config(), "model": {"checkpoint": str(tmp_path / "mystery")}})
    with pytest.raises(ValueError, match="set sim.model"):
        resolve_model(cfg)
    assert profile_for("", "a100-80gb-pcie").path.endswith("/a100.json")
    assert profile_for("", "a40") is None
    setup = build_setup(serve_config_from_dict(gpu_config(hardware="a40")))
    assert setup.profile == "" and setup.params == CostParams()      # first principles


def test_frozen_profile_makes_host_cpu_runs_deterministic(tmp_path):
    spec = HardwareSpec(name="host-cpu", kind="cpu", peak_flops_bf16=1e11, peak_flops_fp16=1e11, peak_flops_fp32=1e11,
                        hbm_bandwidth=1e10, hbm_capacity=1e10, devices_per_node=1, intra_node_topology="none",
                        intra_node_bandwidth=5e9, intra_node_latency=1e-6, inter_node_bandwidth=1e9,
                        inter_node_latency=1e-5, compute_units=2)
    path = tmp_path / "cpu.json"
    save_profile(path, Profile("host-cpu", CostParams(iteration_overhead_s=2e-3), hardware_spec=spec,
                               padding={"dense_attention": True}, extra={"measurements": []}))
    loaded = load_profile(str(path))
    assert loaded.hardware_spec == spec and loaded.padding == {"dense_attention": True}
    assert loaded.params.iteration_overhead_s == 2e-3
    config = gpu_config(hardware="host-cpu", profile=str(path))
    config["model"] = {"checkpoint": "tiny-llama"}
    config["scheduler"].update(max_model_len=1024, num_pages=512, token_budget=256, max_num_seqs=32)
    config["workload"].update(vocab_size=512, num_requests=20)
    setup = build_setup(serve_config_from_dict(config))
    assert setup.hardware == spec and setup.padding.dense_attention
    assert setup.padding.buckets.tokens == (16, 32, 64, 128, 256) and setup.padding.buckets.pages == (64,)
    a = run_experiment(config, str(tmp_path / "a"))
    b = run_experiment(config, str(tmp_path / "b"))
    for name in ("requests.csv", "token_times.csv", "iterations.csv"):
        assert read(tmp_path / "a" / name) == read(tmp_path / "b" / name), name
    strip = lambda s: {k: v for k, v in s.items() if k not in ("sim", "engine")}  # noqa: E731
    assert strip(a) == strip(b)
    # Every step costs at least the fixed overhead of the profile.
    with open(tmp_path / "a" / "iterations.csv") as f:
        assert min(float(r["step_time"]) for r in csv.DictReader(f)) >= 2e-3


def test_bad_profile_padding_key_is_named(tmp_path):
    path = tmp_path / "bad.json"
    data = Profile("host-cpu", CostParams(), padding={"dense_attention": True}).to_dict()
    data["padding"]["tile"] = 3
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="bad.json.*unknown padding keys \\['tile'\\]"):
        load_profile(str(path))


SHIPPED_HOST_CPU = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pdjax", "sim",
                                "profiles", "host-cpu.json")


def cpu_config(profile):
    return {"backend": "sim", "model": {"checkpoint": "tiny-byte"}, "workload": {"preset": "chat"},
            "scheduler": {"max_model_len": 1024},     # tiny-byte's positions (more is refused)
            "sim": {"hardware": "host-cpu", "profile": profile}}


def test_a_shipped_profile_by_name_is_the_same_profile_by_path():
    """Issue 17 item 1: `sim.profile=host-cpu` (a documented shipped name) lost the profile's padding, its step
    noise and its frozen hardware spec (read only for a value with a file suffix): a different simulation than
    the same file given by path."""
    by_name = build_setup(serve_config_from_dict(cpu_config("host-cpu")))
    by_path = build_setup(serve_config_from_dict(cpu_config(SHIPPED_HOST_CPU)))
    with open(SHIPPED_HOST_CPU) as f:
        shipped = json.load(f)
    assert by_path.padding is not None and by_path.padding.attention == shipped["padding"]["attention"]
    assert len(by_path.step_noise) == len(shipped["step_noise"]["quantiles"]) == 101
    assert by_path.hardware == HardwareSpec(**shipped["hardware_spec"])
    assert by_name.padding == by_path.padding
    assert by_name.step_noise == by_path.step_noise
    assert by_name.hardware == by_path.hardware       # the frozen spec, not a re-measurement of this machine
    assert by_name.params == by_path.params


def test_malformed_profile_fails_in_one_line_naming_the_file(tmp_path):
    """Issue 16 item 8: a malformed profile JSON said only "Expecting ',' delimiter" (after a traceback)."""
    import subprocess
    import sys
    bad = tmp_path / "broken.json"
    bad.write_text('{"schema": "pdjax.machine_profile/v1" "hardware": "a100"}')
    with pytest.raises(ValueError, match=r"broken\.json.*not valid JSON \(Expecting ',' delimiter"):
        load_profile(str(bad))
    data = Profile("host-cpu", CostParams()).to_dict()
    data["hardware_spec"] = {"name": "host-cpu", "flops": 1.0}
    (tmp_path / "spec.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"spec\.json.*unknown config key\(s\) hardware_spec\.flops;"):
        load_profile(str(tmp_path / "spec.json"))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "experiments.serve", "--config=configs/serve.py",
                          "--config.backend=sim", f"--config.sim.profile={bad}", f"--workdir={tmp_path / 'run'}"],
                         capture_output=True, text=True, cwd=repo, timeout=300)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: machine profile") and str(bad) in lines[0], out.stderr
    assert not (tmp_path / "run" / "results.json").exists()


def test_sim_config_validation_names_the_key():
    with pytest.raises(ValueError, match="deployment.router='random'"):
        serve_config_from_dict(gpu_config({"router": "random"}))
    with pytest.raises(ValueError, match="'least_outstanding_tokens' is now 'least_loaded'"):
        serve_config_from_dict(gpu_config({"router": "least_outstanding_tokens"}))
    with pytest.raises(ValueError, match="sim.num_pages=-1"):
        serve_config_from_dict(gpu_config(num_pages=-1))
    with pytest.raises(ValueError, match="deployment.colocated.tp=0, expected a positive int"):
        serve_config_from_dict(gpu_config({"colocated": {"tp": 0}}))


def test_sweep_on_the_sim_backend(tmp_path):
    from pdjax.experiment.sweep import run_sweep
    sweep = {"name": "t", "base": gpu_config({"router": "least_loaded", "colocated": {"num_instances": 2}}),
             "grid": {"policy": ("scheduler.policy", ["sarathi", "vllm_v0"])}}
    sweep["base"]["scheduler"]["token_budget"] = 4096
    sweep["base"]["workload"]["num_requests"] = 24
    rows = run_sweep(sweep, str(tmp_path), run_experiment, parallel=1, validate=serve_config_from_dict)
    assert len(rows) == 2 and os.path.isfile(tmp_path / "summary.csv")
    by_policy = {r["policy"]: r for r in rows}
    # vLLM V0 prioritizes whole prefills: faster TTFT, worse TBT tail than Sarathi's stall-free batches.
    assert float(by_policy["vllm_v0"]["tbt_p99"]) > float(by_policy["sarathi"]["tbt_p99"])
    results = json.loads(read(next(p for p in tmp_path.iterdir() if p.is_dir()) / "results.json"))
    assert set(results["iterations"]["per_instance"]) == {"replica0", "replica1"}


def test_simulator_modules_import_no_jax():
    import subprocess
    import sys
    code = ("import sys; import pdjax.sim.simulator, pdjax.sim.run, pdjax.sim.build, pdjax.sim.disagg, "
            "pdjax.sim.step_cost, pdjax.sim.capacity, pdjax.sim.profile, pdjax.sim.calibration, "
            "pdjax.scheduler.instances, pdjax.scheduler.routing; "
            "from pdjax.experiment.run import run_experiment; "
            "print('jax' in sys.modules, 'flax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_unsupported_modes_fail_clearly():
    config = gpu_config({"kind": "disaggregated"})
    config["scheduler"]["policy"] = "chunked_only"
    with pytest.raises(ValueError, match="scheduler.policy='chunked_only' with deployment.kind='disaggregated'"):
        build_setup(serve_config_from_dict(config))


@pytest.mark.parametrize("policy", ["sarathi", "vllm_v0", "orca", "chunked_only", "vllm_v1", "decode_first"])
def test_both_backends_build_the_same_scheduler_from_one_config(policy):
    import dataclasses
    from pdjax.scheduler import make_scheduler
    from pdjax.sim.build import build_instances
    config = gpu_config(hardware="host-cpu")
    config["scheduler"]["policy"] = policy
    config["scheduler"]["token_budget"] = 4096
    cfg = serve_config_from_dict(config)
    # What pdjax.serving.run.run_real builds: the scheduler block, vocab_size filled from the model.
    real = make_scheduler(dataclasses.replace(cfg.scheduler, vocab_size=get_model_spec("llama-2-7b").vocab_size))
    setup = build_setup(cfg)
    sim = build_instances(setup)["colocated"][0].scheduler
    assert type(sim) is type(real) and type(sim).name == policy
    assert sim.config == real.config                    # host-cpu: num_pages as given, nothing else changes
    gpu = build_setup(serve_config_from_dict({**config, "sim": {"hardware": "a100-80gb-sxm"}}))
    assert dataclasses.replace(gpu.scheduler_config, num_pages=cfg.scheduler.num_pages) == real.config


def test_every_simulation_reports_energy_and_machine_hours(tmp_path):
    """sim.energy: each instance's GPUs draw prompt power in prefill-bearing steps, token power in decode-only
    steps and idle power otherwise (recomputed here from iterations.csv), on the hardware's machine SKU."""
    from pdjax.sim.machines import get_machine
    cfg = gpu_config({"colocated": {"num_instances": 2, "tp": 2}})
    run_experiment(cfg, str(tmp_path))
    results = json.loads(read(tmp_path / "results.json"))
    energy, duration = results["sim"]["energy"], results["sim"]["simulated_duration_s"]
    machine = get_machine("dgx-a100")
    with open(tmp_path / "iterations.csv") as f:
        rows = list(csv.DictReader(f))
    want = 0.0
    for name in ("replica0", "replica1"):
        mine = [r for r in rows if r["instance"] == name]
        prompt = sum(float(r["end_time"]) - float(r["start_time"]) for r in mine if int(r["num_prefill_tokens"]))
        token = sum(float(r["end_time"]) - float(r["start_time"]) for r in mine if not int(r["num_prefill_tokens"]))
        assert energy["per_instance"][name]["prompt_s"] == pytest.approx(prompt)
        want += 2 * (prompt * machine.prompt_w + token * machine.token_w + (duration - prompt - token) * machine.idle_w)
    assert energy["available"] and energy["energy_j"] == pytest.approx(want)
    assert energy["energy_per_request_j"] == pytest.approx(want / results["num_completed"])
    assert energy["machine_hours"] == pytest.approx(2 * 2 / 8 * duration / 3600)
    assert energy["cost_usd"] == pytest.approx(energy["machine_hours"] * machine.cost_per_hour)
    cpu = gpu_config(hardware="host-cpu")
    cpu["model"] = {"checkpoint": "tiny-byte"}
    cpu["scheduler"].update(max_model_len=1024, token_budget=256)
    run_experiment(cpu, str(tmp_path / "cpu"))
    assert json.loads(read(tmp_path / "cpu" / "results.json"))["sim"]["energy"]["available"] is False
