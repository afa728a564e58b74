"""kv_centric's measured cost on the real engine (issue 30; pdjax.scheduler.step_fit, pdjax.serving.kv_tier): the
online fit of step seconds against numpy's least squares, the feature counts against brute force, the router ranking
by seconds where tokens disagree, the engine loop feeding the fit, and the config key. No model is compiled here
(tests/test_kv_centric_engine.py serves tiny-llama with the measured default and checks its greedy tokens)."""
from __future__ import annotations

import random

import numpy as np
import pytest
from test_kv_centric_engine import _Clock
from test_simulator import _LandedKV

from pdjax.config.deployment import deployment_from_dict
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.scheduler import Request, SchedulerOutput, make_scheduler
from pdjax.scheduler.block_manager import extend_page_keys
from pdjax.scheduler.kv_tier import HostKVTier
from pdjax.scheduler.routing import InstanceRouter, predicted_ttft
from pdjax.scheduler.step_fit import (FEATURES, MeasuredCost, StepFit, prefill_features, step_features,
                                      typical_step)

THETA = (2e-3, 1e-5, 3e-9, 4e-4, 1e-4)     # seconds per step, token, attention pair, page loaded, page offloaded


def _random_features(rng, n, loads=True):
    x = np.ones((n, len(FEATURES)))
    x[:, 1] = rng.integers(1, 512, n)
    x[:, 2] = x[:, 1] * rng.integers(0, 4096, n)
    x[:, 3] = rng.integers(0, 16, n) if loads else 0
    x[:, 4] = rng.integers(0, 16, n)
    return x


def _fit(x, y, prior, scales, prior_steps):
    fit = StepFit(prior, scales, prior_steps)
    for row, sec in zip(x, y):
        fit.observe(row.tolist(), float(sec))
    return fit


def test_fit_without_prior_is_least_squares_and_recovers_the_coefficients():
    rng = np.random.default_rng(0)
    x = _random_features(rng, 300)
    y = x @ np.array(THETA) * (1 + 0.02 * rng.standard_normal(300))     # 2% timing noise
    fit = _fit(x, y, prior=(0.0,) * 5, scales=typical_step(256, 16), prior_steps=0)
    ref, *_ = np.linalg.lstsq(x, y, rcond=None)
    np.testing.assert_allclose(fit.theta, ref, rtol=1e-7)
    np.testing.assert_allclose(fit.theta, THETA, rtol=0.1)
    mean, rms = fit.residuals()
    assert mean == pytest.approx(y.mean()) and rms == pytest.approx(np.sqrt(np.mean((y - x @ ref) ** 2)), rel=1e-4)
    exact = _fit(x, x @ np.array(THETA), prior=(0.0,) * 5, scales=typical_step(256, 16), prior_steps=0)
    np.testing.assert_allclose(exact.theta, THETA, rtol=1e-7)


def test_prior_is_ridge_towards_it_in_typical_step_units():
    """With a prior, theta is the least-squares solution of the steps plus prior_steps rows per coefficient that say
    'a typical step's worth of this feature costs what the prior says' (numpy on the augmented system)."""
    rng = np.random.default_rng(1)
    x = _random_features(rng, 40)
    y = x @ np.array(THETA)
    prior, scales, lam = (1e-3, 3e-5, 0.0, 1e-3, 1e-3), typical_step(128, 8), 5.0
    fit = _fit(x, y, prior, scales, lam)
    s = np.array(scales)
    z = np.vstack([x / s, np.sqrt(lam) * np.eye(5)])
    target = np.concatenate([y, np.sqrt(lam) * np.array(prior) * s])
    phi, *_ = np.linalg.lstsq(z, target, rcond=None)
    np.testing.assert_allclose(fit.theta, phi / s, rtol=1e-7, atol=1e-15)


def test_prior_before_any_step_for_unexercised_terms_and_fading_with_steps():
    prior = (1e-3, 3e-5, 1e-8, 7e-4, 2e-4)
    fit = StepFit(prior, typical_step(64, 8), prior_steps=8)
    assert fit.theta == prior and fit.predict((1, 10, 0, 0, 0)) == pytest.approx(1e-3 + 3e-4)
    rng = np.random.default_rng(2)
    x = _random_features(rng, 2000, loads=False)     # never loads a host page
    for row in x:
        fit.observe(row.tolist(), float(row @ np.array(THETA)))
    assert fit.theta[3] == prior[3]                  # nothing said otherwise: the prior's price per loaded page
    np.testing.assert_allclose([fit.theta[i] for i in (0, 1, 2, 4)], [THETA[i] for i in (0, 1, 2, 4)], rtol=0.05)


def test_bad_prior_or_scales_fail_in_one_line():
    with pytest.raises(ValueError, match="expected 5 values"):
        StepFit((1.0, 2.0), typical_step(8, 4))
    with pytest.raises(ValueError, match="scales > 0"):
        StepFit((0.0,) * 5, (1.0, 0.0, 1.0, 1.0, 1.0))


def _pairs_brute_force(n: int, c: int) -> int:
    """Query-key pairs of n tokens fed after c computed ones: each query at position q sees keys 0..q."""
    return sum(1 for q in range(c, c + n) for k in range(q + 1))


def test_step_features_count_tokens_pairs_and_copies():
    out = SchedulerOutput(step=0, req_ids=["a", "b", "c"], num_computed_tokens=[0, 37, 100], num_new_tokens=[13, 5, 1],
                          swap_in=[(1, 2), (3, 4)], swap_out=[(5, 6)])
    pairs = _pairs_brute_force(13, 0) + _pairs_brute_force(5, 37) + _pairs_brute_force(1, 100)
    assert step_features(out) == (1.0, 19.0, pairs, 2.0, 1.0)
    # A chunked prefill's pairs are its chunks' pairs, however it is cut (prefill_features sums them in one go).
    new, cached, budget = 70, 24, 32
    chunks = [(min(budget, new - i), cached + i) for i in range(0, new, budget)]
    assert prefill_features(new, cached, budget) == (3.0, 70.0, sum(_pairs_brute_force(n, c) for n, c in chunks),
                                                     0.0, 0.0)


# ----------------------------------------------------------------------------------------------- per instance
class _Inst:
    def __init__(self, name, cfg):
        self.name, self.role = name, "colocated"
        self.scheduler = make_scheduler(cfg)
        self.inbox = []


def _cfg(**kw):
    base = dict(policy="sarathi", token_budget=64, max_num_seqs=8, max_model_len=256, page_size=8, num_pages=64,
                enable_prefix_caching=True, watermark=0.0)
    return SchedulerConfig(**{**base, **kw})


def _out(tokens, context=0, loads=0):
    return SchedulerOutput(step=0, req_ids=["r"], num_computed_tokens=[context], num_new_tokens=[tokens],
                           swap_in=[(("x", i), i) for i in range(loads)])


def _teach(cost, inst, theta, steps=60, seed=0):
    """Feed `cost` `steps` back-to-back steps of inst timed by `theta` (features varied)."""
    rng = random.Random(seed)
    t = 0.0
    for _ in range(steps):
        out = _out(rng.randrange(1, 64), rng.randrange(0, 128), rng.randrange(0, 6))
        dt = sum(a * b for a, b in zip(theta, step_features(out)))
        cost.observe_step(inst, out, t, t + dt)
        t += dt


def test_measured_cost_is_per_instance_and_skips_compiles_and_overlap():
    a, b = _Inst("a", _cfg()), _Inst("b", _cfg(token_budget=32))
    cost = MeasuredCost(prior=(0.0,) * 5, prior_steps=1e-9)
    _teach(cost, a, THETA)
    slow = tuple(3 * v for v in THETA)
    _teach(cost, b, slow)
    cost.observe_step(a, _out(8), 100.0, 150.0, num_compiles=1)          # compiled: 50 s of compiler, skipped
    cost.observe_step(a, _out(8), 149.0, 150.0 + THETA[0] + 8 * THETA[1] + 36 * THETA[2])   # queued behind it
    assert cost.instance(a).fit.num_steps == 61 and cost.instance(b).fit.num_steps == 60
    np.testing.assert_allclose(cost.instance(a).fit.theta[:4], THETA[:4], rtol=1e-5)   # (no offloads: their prior)
    np.testing.assert_allclose(cost.instance(b).fit.theta[:4], slow[:4], rtol=1e-5)
    # prefill seconds: ceil(new / budget) steps of that instance
    want = lambda th, chunks: th[0] * chunks + th[1] * 100 + th[2] * (100 * 40 + 100 * 101 / 2)   # noqa: E731
    assert cost.of(a)(100, 40) == pytest.approx(want(THETA, 2), rel=1e-5)
    assert cost.of(b)(100, 40) == pytest.approx(want(slow, 4), rel=1e-5)
    assert cost.fetch.of(b)(2, 3) == pytest.approx(5 * slow[3], rel=1e-5)
    described = cost.describe()["instances"]
    assert described["b"]["num_steps"] == 60 and described["a"]["theta"]["pages_loaded"] == pytest.approx(THETA[3])


def test_kv_centric_ranks_by_measured_seconds_where_tokens_disagree():
    """Instance a holds the prompt's prefix only in a shared host pool (another instance offloaded it: a remote
    fetch), b holds nothing. By tokens a wins (1 token to prefill, the fetch free); measured, a page load costs more
    than recomputing it, so b wins, and the predicted TTFTs are the fitted seconds."""
    ps = 8
    a, b = _Inst("a", _cfg(page_size=ps)), _Inst("b", _cfg(page_size=ps))
    prompt = [random.Random(3).randrange(1, 500) for _ in range(64)]
    keys = []
    extend_page_keys(keys, prompt, ps, 8)
    tier = HostKVTier(16)
    tier.offload_many(keys, owner="elsewhere")
    a.scheduler.block_manager.host_tier, a.scheduler.block_manager.tier_owner = tier, "a"
    req = Request("r", prompt + [7], SamplingParams(max_tokens=2), 0.0)
    assert InstanceRouter("kv_centric", [a, b]).pick(req) is a
    cost = MeasuredCost(prior=(0.0,) * 5, prior_steps=1e-9)
    theta = (1e-3, 1e-5, 1e-9, 5e-3, 1e-4)        # a loaded page: 5 ms, recomputing its 8 tokens: < 0.1 ms
    for inst in (a, b):
        _teach(cost, inst, theta)
    router = InstanceRouter("kv_centric", [a, b], cost=cost, fetch=cost.fetch)
    assert router.pick(req) is b
    seconds = lambda new, cached, loads: (theta[0] * -(-new // 64) + theta[1] * new               # noqa: E731
                                          + theta[2] * (new * cached + new * (new + 1) / 2) + theta[3] * loads)
    assert predicted_ttft(router, a, req) == pytest.approx(seconds(1, 64, 8), rel=1e-5)
    assert predicted_ttft(router, b, req) == pytest.approx(seconds(65, 0, 0), rel=1e-5)


# ----------------------------------------------------------------------------------------------- engine glue
TICK = 1.0 / 1024
FAKE_THETA = (3 * TICK, TICK / 8, TICK / 4096, 2 * TICK, 0.0)


class _FakeRunner:
    """dispatch/collect on a fake device whose step takes FAKE_THETA . step_features (exact in binary)."""
    pp = 1

    def __init__(self, clock):
        self.clock, self.device_free = clock, 0.0

    def dispatch(self, out, prev=None):
        if out.is_empty:
            return out, self.clock.t
        start = max(self.clock.t, self.device_free)
        self.device_free = start + sum(a * b for a, b in zip(FAKE_THETA, step_features(out)))
        return out, self.device_free

    def collect(self, handle):
        from pdjax.sim.simulator import placeholder_sample
        out, end = handle
        self.clock.t = max(self.clock.t, end)
        return placeholder_sample(out)


def test_cluster_engine_feeds_every_step_to_the_measured_cost():
    """Two replicas behind kv_centric with a measured cost: one request at a time (each after the last finished),
    so a step's schedule-to-collect time is its own; the fits recover the fake device's coefficients."""
    from pdjax.serving.cluster import ClusterEngine, Instance
    rng = random.Random(5)
    cfg = _cfg(page_size=16, num_pages=16, token_budget=64)
    clock = _Clock()
    insts = [Instance(f"replica{i}", "colocated", _FakeRunner(clock), make_scheduler(cfg)) for i in range(2)]
    cost = MeasuredCost(prior=(0.0,) * 5, prior_steps=1e-9)
    engine = ClusterEngine(insts, router="kv_centric", clock=clock.clock, sleep=clock.sleep,
                           router_options={"cost": cost, "fetch": cost.fetch})
    reqs = [Request(f"q{i}", [rng.randrange(1, 200) for _ in range(rng.randrange(20, 150))],
                    SamplingParams(max_tokens=rng.randrange(2, 6)), float(i)) for i in range(12)]
    result = engine.run(reqs)
    for inst in insts:
        steps = [it for it in result.iterations if it.instance == inst.name]
        fit = cost.instance(inst).fit
        assert fit.num_steps == len(steps) > 3
        np.testing.assert_allclose([fit.theta[i] for i in (0, 1, 2)], FAKE_THETA[:3], rtol=1e-6)


def test_disaggregated_engine_feeds_the_prefill_steps_to_the_measured_cost(monkeypatch):
    """Two prefill instances and one decode instance behind kv_centric: the routers share the measured cost, and each
    prefill instance's fit (chunks of varied size and context, one request at a time) recovers the fake device's."""
    import dataclasses
    from pdjax.serving import cluster
    from pdjax.serving.disagg import DisaggregatedEngine, Instance
    monkeypatch.setattr(cluster, "scatter_kv_pages", lambda caches, pages, staged: caches)
    rng = random.Random(6)
    cfg = _cfg(policy="prefill_only", page_size=16, num_pages=32, token_budget=64)
    clock = _Clock()

    def inst(name, role, sched_cfg):
        runner = _FakeRunner(clock)
        runner.kv_stages = runner.kv_stage_meshes = None
        return Instance(name, role, runner, make_scheduler(sched_cfg))
    prefill = [inst(f"prefill{i}", "prefill", cfg) for i in range(2)]
    decode = [inst("decode0", "decode", dataclasses.replace(cfg, policy="decode_only"))]
    cost = MeasuredCost(prior=(0.0,) * 5, prior_steps=1e-9)
    engine = DisaggregatedEngine(prefill, decode, router="kv_centric", clock=clock.clock, sleep=clock.sleep,
                                 router_options={"cost": cost, "fetch": cost.fetch},
                                 transfer=lambda src, pages, dst, num_tokens, wait=False: _LandedKV(num_tokens))
    assert engine.entry_router.cost is cost
    reqs = [Request(f"q{i}", [rng.randrange(1, 200) for _ in range(rng.randrange(20, 200))],
                    SamplingParams(max_tokens=3), float(i)) for i in range(14)]
    result = engine.run(reqs)
    assert all(r.finish_reason == "length" for r in result.requests)
    for p in prefill:
        fit = cost.instance(p).fit
        assert fit.num_steps == sum(it.instance == p.name for it in result.iterations) > 3
        np.testing.assert_allclose([fit.theta[i] for i in (0, 1, 2)], FAKE_THETA[:3], rtol=1e-6)


# ----------------------------------------------------------------------------------------------- config
def test_engine_router_options_measured_by_default_tokens_on_request():
    from pdjax.config.model_specs import get_model_spec
    from pdjax.serving.kv_tier import router_options
    spec = get_model_spec("tiny-llama")
    dep = deployment_from_dict({"kind": "colocated", "router": "kv_centric"})
    options = router_options(dep, spec=spec)
    assert isinstance(options["cost"], MeasuredCost) and options["fetch"] is options["cost"].fetch
    tokens = deployment_from_dict({"kind": "colocated", "router": "kv_centric", "router_cost": "tokens"})
    assert "cost" not in router_options(tokens, spec=spec) and "fetch" not in router_options(tokens, spec=spec)
    affinity = deployment_from_dict({"kind": "colocated", "router": "prefix_affinity"})
    assert "cost" not in router_options(affinity, spec=spec)
    given = lambda new, cached: 1.0     # noqa: E731
    assert router_options(dep, given, spec=spec)["cost"] is given


def test_router_cost_tokens_only_with_kv_centric():
    with pytest.raises(ValueError, match=r"router_cost='tokens' with router='prefix_affinity'.*expected"):
        deployment_from_dict({"kind": "colocated", "router": "prefix_affinity", "router_cost": "tokens"})
    with pytest.raises(ValueError, match="router_cost"):
        deployment_from_dict({"kind": "colocated", "router": "kv_centric", "router_cost": "flops"})


def test_roofline_prior_is_the_simulators_default_hardware():
    """The engine's prior (serving may not import sim) uses the figures of sim.hardware's default, and prices the
    model as a roofline there."""
    from pdjax.config.model_specs import get_model_spec
    from pdjax.config.serving import SimConfig
    from pdjax.serving import kv_tier
    from pdjax.sim.hardware import get_hardware_spec
    from pdjax.sim.kv_tier import host_link_bandwidth
    hw = get_hardware_spec(SimConfig().hardware)
    assert (kv_tier.PRIOR_FLOPS, kv_tier.PRIOR_HBM_BYTES_PER_S, kv_tier.PRIOR_HOST_LINK_BYTES_PER_S) == (
        hw.peak_flops_bf16, hw.hbm_bandwidth, host_link_bandwidth(hw))
    spec = get_model_spec("tiny-llama")
    floor, token, pair, load, offload = kv_tier.roofline_prior(spec)(_Inst("a", _cfg(page_size=16)))
    assert token == pytest.approx(2 * spec.num_params() / hw.peak_flops_bf16)
    assert floor == pytest.approx(spec.num_params() * spec.dtype_bytes / hw.hbm_bandwidth)
    assert load == offload == pytest.approx(16 * spec.kv_bytes_per_token() / host_link_bandwidth(hw))
    assert 0 < pair < token


def test_simulator_router_cost_tokens_leaves_the_tokens_ranking():
    from types import SimpleNamespace
    from pdjax.sim.kv_tier import router_options
    dep = deployment_from_dict({"kind": "colocated", "router": "kv_centric", "router_cost": "tokens",
                                "router_balance_abs": 5})
    assert router_options(SimpleNamespace(kv=dep), "colocated", None) == {
        "balance_abs": 5, "balance_rel": dep.router_balance_rel, "cache_threshold": dep.router_cache_threshold}
