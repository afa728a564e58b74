"""Workload generation: arrival processes, length distributions, presets and caps, token ids, shared prefixes,
multi-turn sessions, determinism and config validation."""
import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pdjax.workload.tokens import STREAM_BLOCK
from pdjax.workload import (PRESETS, LengthDist, WorkloadConfig, WorkloadRequest, arrival_times, hashed_token_ids,
                            make_workload, sample_lengths)


def _rng(seed=0):
    return np.random.default_rng(seed)


# ---- arrival processes ---------------------------------------------------------------------------------------

def test_poisson_arrivals_mean_gap_and_cv():
    times = arrival_times("poisson", 40_000, rate=4.0, cv=1.0, rng=_rng())
    gaps = np.diff(times)
    assert times[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.03)


@pytest.mark.parametrize("cv", [0.5, 3.0])
def test_gamma_arrivals_have_requested_cv(cv):
    gaps = np.diff(arrival_times("gamma", 60_000, rate=2.0, cv=cv, rng=_rng(1)))
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)


def test_fixed_and_offline_arrivals():
    np.testing.assert_allclose(arrival_times("fixed", 5, rate=2.0, cv=1.0, rng=_rng()), [0, 0.5, 1.0, 1.5, 2.0])
    assert arrival_times("offline", 4, rate=0.0, cv=1.0, rng=_rng()).tolist() == [0.0] * 4
    assert arrival_times("poisson", 0, rate=1.0, cv=1.0, rng=_rng()).shape == (0,)


@pytest.mark.parametrize("kind,rate,cv,match", [("poisson", 0.0, 1.0, "rate=0.0"), ("gamma", 1.0, 0.0, "cv=0.0"),
                                                ("weibull", 1.0, 1.0, "arrival='weibull'")])
def test_arrival_errors(kind, rate, cv, match):
    with pytest.raises(ValueError, match=match):
        arrival_times(kind, 3, rate, cv, _rng())


# ---- length distributions ------------------------------------------------------------------------------------

def test_fixed_and_uniform_lengths():
    assert sample_lengths(LengthDist("fixed", value=7), 5, _rng()).tolist() == [7] * 5
    x = sample_lengths(LengthDist("uniform", low=3, high=6), 4000, _rng())
    assert set(x.tolist()) == {3, 4, 5, 6}


def test_lognormal_median_and_clip():
    x = sample_lengths(LengthDist("lognormal", median=200, sigma=0.8), 40_000, _rng())
    assert np.median(x) == pytest.approx(200, rel=0.03)
    assert np.std(np.log(x)) == pytest.approx(0.8, rel=0.03)
    clipped = sample_lengths(LengthDist("lognormal", median=200, sigma=2.0, low=10, high=300), 5000, _rng())
    assert clipped.min() >= 10 and clipped.max() <= 300 and (clipped == 300).any()


def test_zipf_frequencies_follow_power_law():
    x = sample_lengths(LengthDist("zipf", alpha=1.5, low=1, high=50), 60_000, _rng())
    counts = np.bincount(x, minlength=51)
    # P(1)/P(4) = 4^1.5 = 8 for a Zipf law with exponent 1.5.
    assert counts[1] / counts[4] == pytest.approx(8.0, rel=0.1)
    assert x.min() >= 1 and x.max() <= 50


def test_quantile_table_reproduces_its_quantiles():
    table = ((0.0, 10.0), (0.5, 100.0), (0.9, 1000.0), (1.0, 2000.0))
    x = sample_lengths(LengthDist("quantiles", quantiles=table), 50_000, _rng())
    assert np.percentile(x, 50) == pytest.approx(100, rel=0.03)
    assert np.percentile(x, 90) == pytest.approx(1000, rel=0.03)
    assert x.min() >= 10 and x.max() <= 2000


def test_empirical_resamples_only_given_values():
    x = sample_lengths(LengthDist("empirical", samples=(3, 3, 9)), 3000, _rng())
    assert set(x.tolist()) == {3, 9}
    assert (x == 3).mean() == pytest.approx(2 / 3, abs=0.03)


@pytest.mark.parametrize("kwargs,match", [
    (dict(kind="gaussian"), "kind='gaussian'"), (dict(kind="fixed", value=0), "value=0"),
    (dict(kind="uniform", low=5, high=2), "high=2"), (dict(kind="lognormal", median=0.5, sigma=1), "median=0.5"),
    (dict(kind="quantiles", quantiles=((0.1, 1.0), (1.0, 5.0))), "q values"),
    (dict(kind="quantiles", quantiles=((0.0, 9.0), (1.0, 5.0))), "non-decreasing"),
    (dict(kind="empirical", samples=()), "empirical")])
def test_length_dist_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LengthDist(**kwargs)


# ---- presets, scaling and caps -------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("max_model_len", [64, 512])
def test_presets_fit_tiny_model(preset, max_model_len):
    reqs = make_workload(dict(preset=preset, num_requests=400, fit_to_model=True, max_model_len=max_model_len,
                              vocab_size=256), seed=3)
    assert len(reqs) == 400
    for r in reqs:
        assert 1 <= r.num_prompt_tokens <= max_model_len - 1
        assert 1 <= r.max_tokens and r.num_prompt_tokens + r.max_tokens <= max_model_len
        assert all(0 <= t < 256 for t in r.prompt_token_ids)


def test_fit_scale_preserves_the_preset_shape():
    """chat median prompt 1730 of fit total 8192; fitted to 1024 it must be about 1730/8 = 216."""
    reqs = make_workload(dict(preset="chat", num_requests=4000, fit_to_model=True, max_model_len=1024), seed=0)
    assert np.median([r.num_prompt_tokens for r in reqs]) == pytest.approx(1730 / 8, rel=0.06)


def test_fit_to_model_multiplies_scale():
    cfg = dict(preset="chat", num_requests=4000, fit_to_model=True, max_model_len=1024)
    full, half = make_workload(cfg, 0), make_workload(dict(cfg, scale=0.5), 0)
    assert np.median([r.num_prompt_tokens for r in half]) == pytest.approx(1730 / 16, rel=0.06)
    assert np.median([r.num_prompt_tokens for r in full]) > 1.8 * np.median([r.num_prompt_tokens for r in half])


def test_config_through_serve_config_loader():
    """pdjax.config.serving builds WorkloadConfig with its generic dataclass_from_dict; the types must suit it."""
    serving = pytest.importorskip("pdjax.config.serving")
    cfg = serving.dataclass_from_dict(WorkloadConfig, dict(preset="chat", num_requests=3,
                                                           max_model_len=256, rate=2, allowed_token_ids=[1, 2],
                                                           prompt_len=dict(kind="fixed", value=5)), "workload")
    assert cfg.rate == 2.0 and cfg.allowed_token_ids == (1, 2) and cfg.prompt_len == LengthDist("fixed", value=5)
    assert [r.num_prompt_tokens for r in make_workload(cfg, 0)] == [5, 5, 5]


@given(max_prompt=st.integers(2, 300), max_output=st.integers(1, 300), max_model=st.integers(3, 600),
       scale=st.floats(0.01, 2.0), seed=st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_caps_hold_for_any_setting(max_prompt, max_output, max_model, scale, seed):
    reqs = make_workload(dict(preset="arxiv", num_requests=30, scale=scale, max_prompt_len=max_prompt,
                              max_output_len=max_output, max_model_len=max_model), seed=seed)
    for r in reqs:
        assert 1 <= r.num_prompt_tokens <= min(max_prompt, max_model - 1)
        assert 1 <= r.max_tokens <= max_output and r.num_prompt_tokens + r.max_tokens <= max_model


def test_scale_multiplies_lengths():
    base = dict(prompt_len=dict(kind="fixed", value=40), output_len=dict(kind="fixed", value=10), num_requests=3)
    reqs = make_workload(dict(base, scale=0.25), seed=0)
    assert [(r.num_prompt_tokens, r.max_tokens) for r in reqs] == [(10, 2)] * 3   # rint(2.5) = 2 (banker's)


# ---- determinism and token ids -------------------------------------------------------------------------------

def _as_tuples(reqs):
    return [dataclasses.astuple(r) for r in reqs]


def test_same_seed_same_workload_other_seed_differs():
    cfg = dict(preset="chat", num_requests=50, fit_to_model=True, max_model_len=256, arrival="gamma", cv=2.0, rate=3.0)
    a, b, c = make_workload(cfg, seed=7), make_workload(cfg, seed=7), make_workload(cfg, seed=8)
    assert _as_tuples(a) == _as_tuples(b)
    assert _as_tuples(a) != _as_tuples(c)
    assert [r.request_id for r in a] == [f"r{i}" for i in range(50)]
    assert all(x.arrival_time <= y.arrival_time for x, y in zip(a, a[1:]))


def test_rate_changes_times_not_prompts():
    cfg = dict(preset="code", num_requests=30, fit_to_model=True, max_model_len=256)
    slow, fast = make_workload(dict(cfg, rate=1.0), 0), make_workload(dict(cfg, rate=10.0), 0)
    assert [(r.prompt_token_ids, r.max_tokens) for r in slow] == [(r.prompt_token_ids, r.max_tokens) for r in fast]
    np.testing.assert_allclose([r.arrival_time / 10 for r in slow], [r.arrival_time for r in fast])


def test_seed_in_config_is_used_and_overridable():
    cfg = WorkloadConfig(preset="conv", num_requests=5, seed=11, fit_to_model=True, max_model_len=128)
    assert _as_tuples(make_workload(cfg)) == _as_tuples(make_workload(dataclasses.replace(cfg, seed=0), seed=11))


def test_token_ids_in_range_and_allowed_list():
    allowed = list(range(32, 127))
    reqs = make_workload(dict(preset="chat", num_requests=20, fit_to_model=True, max_model_len=128, vocab_size=256,
                              allowed_token_ids=allowed), seed=0)
    used = {t for r in reqs for t in r.prompt_token_ids}
    assert used <= set(allowed) and len(used) > 50
    ids = np.array(hashed_token_ids(5, 1, 0, 50_000, vocab_size=10))
    assert np.bincount(ids, minlength=10).min() > 4500     # roughly uniform over the vocab
    assert hashed_token_ids(5, 1, 0, 30, 1000)[:20] == hashed_token_ids(5, 1, 0, 20, 1000)   # prefix-stable


# ---- shared prefixes and sessions ----------------------------------------------------------------------------

def test_shared_system_prompt():
    reqs = make_workload(dict(prompt_len=dict(kind="uniform", low=1, high=40), output_len=dict(kind="fixed", value=4),
                              num_requests=20, shared_prefix_len=32, max_model_len=64, vocab_size=1000), seed=1)
    prefix = reqs[0].prompt_token_ids[:32]
    assert all(r.prompt_token_ids[:32] == prefix and r.shared_prefix_len == 32 for r in reqs)
    assert all(33 <= r.num_prompt_tokens <= 63 for r in reqs)
    assert len({tuple(r.prompt_token_ids[32:]) for r in reqs}) == 20


def test_multi_turn_sessions_extend_previous_prompt():
    cfg = dict(prompt_len=dict(kind="uniform", low=5, high=20), output_len=dict(kind="uniform", low=3, high=9),
               num_requests=40, num_turns=4, turn_gap_s=10.0, rate=2.0, shared_prefix_len=8, vocab_size=500,
               max_model_len=1000)
    reqs = make_workload(cfg, seed=2)
    assert len(reqs) == 40
    by_id = {r.request_id: r for r in reqs}
    checked = 0
    for r in reqs:
        if r.turn == 0:
            continue
        prev = by_id[f"{r.session_id}t{r.turn - 1}"]
        assert r.prompt_token_ids[:prev.num_prompt_tokens] == prev.prompt_token_ids
        growth = r.num_prompt_tokens - prev.num_prompt_tokens
        assert prev.max_tokens + 5 <= growth <= prev.max_tokens + 20    # answer stand-in + new message
        assert r.arrival_time == pytest.approx(prev.arrival_time + 10.0)
        checked += 1
    assert checked >= 25


def test_sessions_end_early_at_the_cap():
    reqs = make_workload(dict(prompt_len=dict(kind="fixed", value=30), output_len=dict(kind="fixed", value=20),
                              num_requests=12, num_turns=5, max_model_len=128), seed=0)
    # Turn prompts: 30, 80, 130 > 127, so each session has 2 turns.
    assert sorted({r.turn for r in reqs}) == [0, 1]
    assert all(r.num_prompt_tokens + r.max_tokens <= 128 for r in reqs)
    assert len(reqs) == 12


def test_mooncake_hash_blocks_share_prompt_prefixes(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("timestamp_ms,input_length,output_length,num_hash_blocks,hash_ids\n"
                    "0,1000,5,2,0 1\n1000,1100,5,3,0 1 2\n2000,1024,5,2,3 4\n")
    reqs = make_workload(dict(kind="trace", trace_path=str(path), arrival="trace", num_requests=3, scale=0.125,
                              vocab_size=50_000), seed=0)
    a, b, c = reqs           # block length 512 * 0.125 = 64 tokens
    assert [r.arrival_time for r in reqs] == [0.0, 1.0, 2.0]
    assert [r.num_prompt_tokens for r in reqs] == [125, 138, 128]
    assert a.prompt_token_ids[:125] == b.prompt_token_ids[:125]
    def block(h):
        return hashed_token_ids(0, STREAM_BLOCK, h, 64, 50_000)
    assert a.prompt_token_ids == block(0) + block(1)[:61]
    assert b.prompt_token_ids == block(0) + block(1) + block(2)[:10]
    assert c.prompt_token_ids == block(3) + block(4)
    assert a.prompt_token_ids[:64] != c.prompt_token_ids[:64]


def test_trace_workload_errors(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("prompt_tokens,output_tokens\n5,1\n6,2\n")
    with pytest.raises(ValueError, match="has only 2 rows"):
        make_workload(dict(kind="trace", trace_path=str(path), num_requests=3))
    offline = make_workload(dict(kind="trace", trace_path=str(path), num_requests=2, arrival="offline"))
    assert [(r.arrival_time, r.num_prompt_tokens, r.max_tokens) for r in offline] == [(0.0, 5, 1), (0.0, 6, 2)]


# ---- config validation ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(kind="replay"), "workload.kind='replay'"),
    (dict(preset="chat", num_requests=0), "workload.num_requests=0"),
    (dict(preset="chat", rate=-1.0), "workload.rate=-1.0"),
    (dict(preset="chat", arrival="gamma", cv=0), "workload.cv=0"),
    (dict(preset="sharegpt"), "workload.preset='sharegpt'"),
    (dict(), "workload.preset=''"),
    (dict(preset="chat", fit_to_model=True), "workload.max_model_len=0"),
    (dict(preset="chat", scale=0), "workload.scale=0"),
    (dict(preset="chat", scale="fit"), "workload.scale='fit'"),
    (dict(preset="chat", max_model_len=1), "workload.max_model_len=1"),
    (dict(preset="chat", shared_prefix_len=64, max_model_len=65), "workload.shared_prefix_len=64"),
    (dict(preset="chat", vocab_size=10, allowed_token_ids=(3, 10)), "workload.allowed_token_ids"),
    (dict(preset="chat", arrival="trace"), "workload.arrival='trace'"),
    (dict(kind="trace"), "workload.trace_path=''"),
    (dict(preset="chat", prompt_len=dict(kind="fixed", value=0)), "workload.prompt_len"),
    (dict(preset="chat", prompt_len=dict(kind="fixed", valu=3)), "unknown keys"),
])
def test_config_errors_name_field_and_value(kwargs, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        WorkloadConfig.from_dict(kwargs)


def test_unknown_config_key():
    with pytest.raises(ValueError, match=r"unknown config key\(s\) workload\.rps;"):
        make_workload({"preset": "chat", "rps": 3})


def test_configdict_input_and_round_trip():
    ml_collections = pytest.importorskip("ml_collections")
    cd = ml_collections.ConfigDict(dict(preset="arxiv", num_requests=4, fit_to_model=True, max_model_len=256,
                                        prompt_len=None, arrival="offline"))
    cfg = WorkloadConfig.from_dict(cd)
    assert cfg.arrival == "offline" and cfg.preset == "arxiv"
    assert WorkloadConfig.from_dict(cfg.to_dict()) == cfg
    assert _as_tuples(make_workload(cd, 0)) == _as_tuples(make_workload(cfg, 0))


def test_request_validation():
    with pytest.raises(ValueError, match="max_tokens=0"):
        WorkloadRequest("x", 0.0, [1], 0)
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        WorkloadRequest("x", 0.0, [], 3)


def test_workload_and_metrics_import_no_jax():
    code = ("import sys, pdjax.workload, pdjax.metrics; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')); "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- joint (prompt, output) sampling from a trace
def _paired_workload(length_sampling, n=400, **kw):
    rng = np.random.default_rng(7)
    prompts = [int(p) for p in rng.integers(1, 2000, size=150)]
    outputs = [max(1, 2000 - p + int(rng.integers(-20, 20))) for p in prompts]   # strongly anti-correlated
    cfg = WorkloadConfig(kind="synthetic", arrival="offline", num_requests=n, seed=3, vocab_size=100,
                         prompt_len={"kind": "empirical", "samples": prompts},
                         output_len={"kind": "empirical", "samples": outputs}, length_sampling=length_sampling, **kw)
    return set(zip(prompts, outputs)), make_workload(cfg)


def test_joint_sampling_draws_rows_of_the_trace_and_keeps_their_correlation():
    rows, joint = _paired_workload("joint")
    pairs = [(r.num_prompt_tokens, r.max_tokens) for r in joint]
    assert all(p in rows for p in pairs)
    _, indep = _paired_workload("independent")
    assert sum((r.num_prompt_tokens, r.max_tokens) in rows for r in indep) < len(indep) / 4
    assert [r.num_prompt_tokens for r in indep] == [r.num_prompt_tokens for r in joint]   # same prompt draws
    def corr(reqs):
        return np.corrcoef([r.num_prompt_tokens for r in reqs], [r.max_tokens for r in reqs])[0, 1]
    assert corr(joint) < -0.95 and abs(corr(indep)) < 0.2


def test_independent_sampling_is_what_it_was():
    from pdjax.workload.generate import _RNG_OUTPUT, _RNG_PROMPT
    from pdjax.workload.lengths import length_dist
    _, indep = _paired_workload("independent", n=50)
    rng = np.random.default_rng(7)
    prompts = [int(p) for p in rng.integers(1, 2000, size=150)]
    outputs = [max(1, 2000 - p + int(rng.integers(-20, 20))) for p in prompts]
    want_p = sample_lengths(length_dist({"kind": "empirical", "samples": prompts}), 50,
                            np.random.default_rng([3, _RNG_PROMPT]))
    want_o = sample_lengths(length_dist({"kind": "empirical", "samples": outputs}), 50,
                            np.random.default_rng([3, _RNG_OUTPUT]))
    assert [r.num_prompt_tokens for r in indep] == list(want_p) and [r.max_tokens for r in indep] == list(want_o)


def test_joint_is_only_for_pairable_columns_and_bad_names_are_refused():
    cfg = WorkloadConfig(kind="synthetic", arrival="offline", num_requests=5, vocab_size=100,
                         prompt_len={"kind": "empirical", "samples": [3, 4, 5]},
                         output_len={"kind": "uniform", "low": 1, "high": 4})
    assert len(make_workload(cfg)) == 5       # joint by default, but a uniform column is drawn on its own
    with pytest.raises(ValueError, match=r"workload.length_sampling='pairs', expected one of"):
        WorkloadConfig(kind="synthetic", preset="chat", length_sampling="pairs")
