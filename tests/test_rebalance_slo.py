"""The SLO-tied trigger of online XpYd rebalancing (pdjax.scheduler.rebalance_slo, deployment.rebalance_trigger='slo'):
the quantile rule against an independent reference, the trigger by hand (fires when a side's observed latency is over
for the window, not otherwise; hysteresis), the config refusals, no thrash in the simulator where the load rule
thrashes, and the engine's decisions == the simulator's (fake runners)."""
from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import numpy as np
import pytest

from pdjax.config.deployment import DeploymentConfig, InstanceGroupConfig, instance_scheduler_config
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.config.slo import SLOConfig
from pdjax.scheduler import Request
from pdjax.scheduler.mixed import make_borrowing_scheduler
from pdjax.scheduler.overload import overload_pool_factory, overload_scheduler_maker
from pdjax.scheduler.rebalance import RebalancingPool, rebalancing_pool
from pdjax.scheduler.rebalance_slo import SLOTrigger, nearest_rank, quantile_over
from pdjax.scheduler.request import RequestStatus
from pdjax.sim.disagg import DisaggSimInstance, simulate_disaggregated

TICK = 1.0 / 1024


# ------------------------------------------------------------------------------------------------ the quantile
@pytest.mark.parametrize("n", [1, 2, 9, 10, 11, 57])
@pytest.mark.parametrize("q", [0.5, 0.9, 0.99, 1.0])
def test_quantile_over_is_numpy_nearest_rank(n, q):
    rng = random.Random(n * 100 + int(q * 100))
    samples = [rng.choice([0.1, 0.2, 0.3]) * rng.randint(1, 4) for _ in range(n)]
    ref = float(np.percentile(samples, 100 * q, method="inverted_cdf"))   # the nearest-rank quantile
    assert sorted(samples)[nearest_rank(n, q) - 1] == ref
    for bound in sorted(set(samples)) + [0.0, 10.0]:
        assert quantile_over(samples, q, bound) == (ref > bound), (samples, q, bound)
    assert not quantile_over([], q, 0.0)


# ------------------------------------------------------------------------------------------------ the trigger by hand
def _pool(trigger, **kw):
    cfg = SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=8, max_model_len=512, page_size=16,
                          num_pages=64)
    insts = [SimpleNamespace(name=f"{role}{i}", scheduler=make_borrowing_scheduler(role, cfg))
             for role in ("prefill", "decode") for i in range(2)]
    return RebalancingPool("least_loaded", insts[:2], insts[2:], trigger=trigger, **kw), insts


def _arrive(pool, rid: str, t: float, prompt: int = 300, max_tokens: int = 4) -> Request:
    """An arrival routed by the pool (queued on the prefill instance it picked, as the engines do)."""
    req = Request(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens), t)
    pool.pick_prefill(req, t).scheduler.add_request(req)
    return req


def _handed_off(pool, rid: str, first: float, n: int, ttft: float = 0.01) -> Request:
    """A request the pool routed to prefill at its arrival and to decode at `first` (its first token; n at most)."""
    req = Request(rid, [1] * 8, SamplingParams(max_tokens=n), first - ttft)
    pool.trigger.on_prefill(req, req.arrival_time)
    req.first_token_time, req.token_times, req.status = first, [first], RequestStatus.RUNNING
    pool.pick_decode(req, first, None)
    return req


def _finish(req: Request, gap: float) -> None:
    """It decoded all its tokens `gap` seconds apart (its TPOT is `gap`)."""
    req.token_times = [req.first_token_time + i * gap for i in range(req.max_tokens)]
    req.status, req.finish_reason, req.finish_time = RequestStatus.FINISHED, "length", req.token_times[-1]


def test_prefill_over_its_ttft_for_the_window_takes_a_decode_instance():
    pool, (p0, p1, d0, d1) = _pool(SLOTrigger(ttft_s=0.5, tpot_s=0.1, window_s=1.0), window_s=1.0)
    _arrive(pool, "a", 0.0)
    _arrive(pool, "b", 0.0)
    assert pool.return_idle(0.5) == [] and pool._since["prefill"] is None, "waits of 0.5 s are within 0.5 s"
    assert pool.return_idle(0.6) == [] and pool._since["prefill"] == 0.6, "both prompts are certain misses now"
    assert pool.return_idle(1.5) == [] and not pool.flips, "over for 0.9 s of the 1 s window"
    assert pool.return_idle(1.6) == [d0]
    (flip,) = pool.flips
    assert (flip.instance, flip.src, flip.dst) == ("decode0", "decode", "prefill")
    assert flip.reason.startswith("prefill over for 1.000s: TTFT p90 1.600s (SLO 0.5s)")


def test_queued_prompts_within_the_ttft_never_flip_where_the_load_rule_does():
    """The same queue (600 prompt tokens on two prefill instances, 100 allowed by the load rule) with waits well
    within the TTFT SLO: the load rule takes a decode instance, the SLO trigger does not."""
    for trigger, flips in ((None, 1), (SLOTrigger(ttft_s=5.0, tpot_s=0.1, window_s=1.0), 0)):
        pool, _ = _pool(trigger, prefill_queue_tokens=100, window_s=1.0)
        _arrive(pool, "a", 0.0)
        _arrive(pool, "b", 0.0)
        for t in (0.0, 1.0, 2.0, 3.0):
            pool.return_idle(t)
        assert len(pool.flips) == flips


def test_decode_over_its_tpot_takes_a_prefill_instance_and_old_samples_expire():
    """TPOT SLO 1/16 s; two waves of 4 requests (9 tokens, 1/8 s apart: TPOT 1/8 s) finish at 1.0 and 1.5 s; a side
    is over only while the window (1 s) holds evidence, so one wave alone cannot make it over for a whole window."""
    pool, (p0, p1, d0, d1) = _pool(SLOTrigger(ttft_s=1.0, tpot_s=0.0625, window_s=1.0), window_s=1.0)
    first = [_handed_off(pool, f"a{i}", 0.0, 9) for i in range(4)]
    assert pool.return_idle(0.5) == [] and pool._since == {"prefill": None, "decode": None}, "0.5 / 8 <= 1/16"
    second = [_handed_off(pool, f"b{i}", 0.5, 9) for i in range(4)]
    for req in first:
        _finish(req, 0.125)
    assert pool.return_idle(1.0) == [] and pool._since == {"prefill": None, "decode": 1.0}
    assert pool.trigger.latency("decode") == 0.125
    for req in second:
        _finish(req, 0.125)
    assert pool.return_idle(1.75) == [] and not pool.flips
    assert pool.return_idle(2.0) == [p0] and pool.flips[0].dst == "decode"   # the idle prefill0 flips at once
    assert pool.flips[0].reason == "decode over for 1.000s: TTFT p90 0.000s (SLO 1s), TPOT p90 0.1250s (SLO 0.0625s)"
    pool2, _ = _pool(SLOTrigger(ttft_s=1.0, tpot_s=0.0625, window_s=1.0), window_s=1.0)
    for req in [_handed_off(pool2, f"a{i}", 0.0, 9) for i in range(4)]:
        _finish(req, 0.125)
    assert pool2.return_idle(1.0) == [] and pool2._since["decode"] == 1.0
    assert pool2.return_idle(2.25) == [] and pool2._since["decode"] is None, "finished at 1 s: out of the window"
    assert not pool2.flips


def test_a_side_within_its_slo_but_not_with_one_instance_less_does_not_donate():
    """Decode over; the prefill side's TTFT p90 0.6 s is within its 1 s SLO, but x 2 / 1 it would not be."""
    for ttft, flips in ((0.6, 0), (0.4, 1)):
        pool, (p0, p1, d0, d1) = _pool(SLOTrigger(ttft_s=1.0, tpot_s=0.05, window_s=5.0), window_s=0.0)
        for req in [_handed_off(pool, f"r{i}", 1.0, 9, ttft) for i in range(4)]:
            _finish(req, 0.125)
        pool.return_idle(2.0)
        assert pool.trigger.latency("prefill") == pytest.approx(ttft) and len(pool.flips) == flips, ttft


def test_a_running_decode_counts_once_its_tpot_is_certainly_over():
    """A decode in flight: first token at 0, 11 tokens at most; at t its final TPOT is >= t / 10."""
    trig = SLOTrigger(ttft_s=1.0, tpot_s=0.1, window_s=1.0)
    req = Request("x", [1] * 8, SamplingParams(max_tokens=11), 0.0)
    req.first_token_time, req.token_times, req.status = 0.0, [0.0], RequestStatus.RUNNING
    trig.on_prefill(req, 0.0)
    trig.on_handoff(req, 0.0)
    assert trig.assess(0.9)["prefill"] is False and trig.assess(0.9)["decode"] is False
    assert trig.samples("decode", 0.1) == [], "a bound of 0.09 s is within 0.1 s: its outcome is open"
    assert trig.assess(1.1)["decode"] is True and trig.latency("decode") == pytest.approx(0.11)


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("changes, slo, message", [
    (dict(rebalance_trigger="slo"), {}, "deployment.rebalance_trigger='slo' with deployment.rebalance=False"),
    (dict(rebalance=True, rebalance_trigger="slo"), {"ttft": 1.0},
     "deployment.rebalance_trigger='slo' with slo.ttft=1.0, slo.tpot=0.0"),
    (dict(rebalance=True, rebalance_trigger="latency"), {}, "deployment.rebalance_trigger='latency'"),
    (dict(rebalance=True, rebalance_slo_quantile=0.0), {}, "deployment.rebalance_slo_quantile=0.0"),
])
def test_trigger_keys_are_refused_at_start_up_in_one_line(changes, slo, message):
    from pdjax.config.serving import serve_config_from_dict
    config = {"backend": "sim", "model": {"checkpoint": "tiny-mha"}, "slo": slo,
              "workload": {"kind": "synthetic", "prompt_len": {"kind": "fixed", "value": 8},
                           "output_len": {"kind": "fixed", "value": 4}, "num_requests": 2, "vocab_size": 256},
              "deployment": {"kind": "disaggregated", "prefill": {"num_instances": 2}, **changes}}
    with pytest.raises(ValueError) as e:
        serve_config_from_dict(config)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_pool_built_directly_refuses_the_slo_trigger_without_slos():
    dep = DeploymentConfig(kind="disaggregated", rebalance=True, rebalance_trigger="slo")
    for slo in (None, SLOConfig(tpot=0.1)):
        with pytest.raises(ValueError, match="deployment.rebalance_trigger='slo' with slo.ttft=0.0") as e:
            rebalancing_pool(dep, [], [], slo)
        assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------ the simulator
def _opt13b_16to1(trigger: str, prefill: int, decode: int, per_gpu_rate: float):
    """OPT-13B on A100s, a stationary 16:1 prompt:output mix (the regime map's rebalancing row that thrashed, 200
    requests), TP1 instances with 16 slots, TTFT 0.25 s / TPOT 0.1 s at 90%: (flips, SLO attainment)."""
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.sim import placement as pl, regime as rg
    from pdjax.sim.run import simulate_config
    grid = rg.RegimeGrid(model="opt-13b", hardware="a100-80gb-sxm", gpu_budget=4, workloads=("16:1",),
                         slo_scales=(1.0,), links=("nvlink",), num_requests=200, total_tokens=1024,
                         max_model_len=2048, max_pp=1, max_num_seqs=16, colocated=("sarathi",), rebalance=True,
                         rebalance_trigger=trigger)
    prob = grid.problem("disaggregated", "16:1", 1.0, "nvlink")
    (p,) = [p for p in rg.disaggregated_candidates(grid, "nvlink")
            if p.rebalance and (p.num_prefill, p.num_decode) == (prefill, decode)]
    cfg = pl.serve_config(prob, p, per_gpu_rate * p.num_gpus)
    assert ("slo" in cfg) == (trigger in ("slo", "slo_predicted"))
    result, _ = simulate_config(serve_config_from_dict(cfg), hardware=prob.node.spec())
    assert result.mixed_pool.get("trigger", "load") == trigger
    return result.mixed_pool["flips"], pl.slo_rule_passes(result.requests, prob.ttft_s, prob.tpot_s)[1]


def test_no_thrash_on_a_stationary_mix_where_the_load_rule_thrashes():
    """2P1D at 2.875 req/s per GPU: the load rule flips an instance to decode when the one decode instance's slots
    fill (TPOT is fine), back, and again; the SLO trigger keeps 2P1D. From 2P2D, prompt-bound here, the SLO trigger
    moves a decode instance to prefill once and never back."""
    load_flips, load_share = _opt13b_16to1("load", 2, 1, 2.875)
    slo_flips, slo_share = _opt13b_16to1("slo", 2, 1, 2.875)
    assert len(load_flips) >= 2 and {(f["src"], f["dst"]) for f in load_flips} == {("prefill", "decode"),
                                                                                      ("decode", "prefill")}
    assert slo_flips == [] and slo_share >= 0.9 > load_share
    flips, _ = _opt13b_16to1("slo", 2, 2, 2.875)
    assert [(f["src"], f["dst"]) for f in flips] == [("decode", "prefill")]
    assert flips[0]["reason"].startswith("prefill over")


# ------------------------------------------------------------------------------------------------ engine == simulator
def tick_step_time(out) -> float:
    return TICK * (4 + out.total_tokens // 8)


@pytest.mark.parametrize("trigger", ["slo", "slo_predicted"])
def test_engine_decisions_equal_the_simulator_s(monkeypatch, trigger):
    """2P2D with the SLO trigger, observed and predicting (TPOT SLO half a decode step): every request arrives at 0 with
    one prompt length, each prefill instance prefills its share in one step and hands all off at once; then only the
    decode instances run (equal batches, equal step times), their TPOT goes over for the window, and an idle prefill
    instance flips to decode. DisaggregatedEngine (fake runners, fake clock, KV that lands at once) and
    simulate_disaggregated with the same pool factory make the same flips, per-step schedules and request records."""
    pytest.importorskip("jax")
    from test_simulator import FakeClock, FakeRunner, _LandedKV, snapshot
    from pdjax.serving import cluster
    from pdjax.serving.disagg import DisaggregatedEngine, Instance
    monkeypatch.setattr(cluster, "scatter_kv_pages", lambda caches, pages, staged: caches)
    dep = DeploymentConfig(kind="disaggregated", router="round_robin", rebalance=True, rebalance_trigger=trigger,
                           rebalance_window_s=16 * TICK, rebalance_flip_s=8 * TICK)
    slo = SLOConfig(ttft=1.0, tpot=2 * TICK)
    base = SchedulerConfig(policy="sarathi", token_budget=4096, max_num_seqs=8, max_model_len=512, page_size=16,
                           num_pages=64)
    cfg = {role: instance_scheduler_config(base, InstanceGroupConfig(), role) for role in ("prefill", "decode")}
    make = overload_scheduler_maker(dep)
    names = ("prefill0", "prefill1", "decode0", "decode1")

    def reqs():
        return [Request(f"r{i}", [i % 7 + 1] * 40, SamplingParams(max_tokens=30), 0.0) for i in range(8)]
    engine_log = {n: [] for n in names}
    clock = FakeClock()
    runners = {n: FakeRunner(clock, tick_step_time, lambda out, t, n=n: engine_log[n].append(snapshot(out, t)))
               for n in names}
    for runner in runners.values():
        runner.kv_stages = runner.kv_stage_meshes = None
    inst = {n: Instance(n, n[:-1], runners[n], make(n[:-1], cfg[n[:-1]])) for n in names}
    engine = DisaggregatedEngine(
        [inst["prefill0"], inst["prefill1"]], [inst["decode0"], inst["decode1"]], router="round_robin",
        clock=clock.clock, sleep=clock.sleep, pool_factory=overload_pool_factory(dep, slo),
        transfer=lambda src, pages, dst, num_tokens, wait=False: _LandedKV(num_tokens))
    engine_result = engine.run(reqs())

    sim_log = {n: [] for n in names}
    groups = {role: [DisaggSimInstance(f"{role}{i}", role, make(role, cfg[role]), tick_step_time) for i in range(2)]
              for role in ("prefill", "decode")}
    sim_result = simulate_disaggregated(
        reqs(), groups["prefill"], groups["decode"], lambda s, d, n: 0.0, router="round_robin",
        pool_factory=overload_pool_factory(dep, slo),
        on_schedule=lambda i, out, t: sim_log[i.name].append(snapshot(out, t)))
    flips = sim_result.mixed_pool["flips"]
    assert [(f["instance"], f["src"], f["dst"]) for f in flips] == [("prefill0", "prefill", "decode")]
    assert flips[0]["reason"].startswith("decode over")
    # decided once TPOT is certainly over (slo) / predicted over after two decode steps (slo_predicted)
    assert flips[0]["drain_start"] == {"slo": 100 * TICK, "slo_predicted": 48 * TICK}[trigger]
    assert engine.pool.summary()["flips"] == flips
    for name in names:
        assert sim_log[name] == engine_log[name], f"{name}'s schedule differs"
    assert [r.__dict__ for r in sim_result.requests] == [r.__dict__ for r in engine_result.requests]


# ------------------------------------------------------------------------------------------------ placement / regime
def test_regime_rebalance_variants_flip_on_each_point_s_slos_and_equal_a_direct_search():
    """A regime grid with rebalance_trigger='slo': the variants' serve configs carry the trigger, the attainment
    target as its quantile and the point's SLOs as the slo block; the cached map (its variants simulated per SLO
    point, not shared) equals placement.search at every point."""
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.sim import placement as pl, regime as rg
    grid = rg.RegimeGrid(model="opt-13b", hardware="a100-80gb-sxm", gpu_budget=3, workloads=("16:1",),
                         slo_scales=(0.4, 1.0), links=("nvlink",), num_requests=24, total_tokens=384,
                         max_model_len=1024, max_probes=8, rel_tol=0.25, max_num_seqs=64, max_pp=1,
                         colocated=("sarathi",), rebalance=True, rebalance_window_s=0.0, rebalance_trigger="slo")
    result = rg.run_grid(grid, workers=1)
    for row, (w, s, k) in zip(result["rows"], grid.points):
        pairs = rg.point_problems(grid, w, s, k)["disaggregated"]
        problem = pairs[0][0]
        variant = next(p for _, p in pairs if p.rebalance)
        cfg = pl.serve_config(problem, variant, 1.0)
        assert cfg["slo"] == {"ttft": problem.ttft_s, "tpot": problem.tpot_s} == {"ttft": 0.25 * s, "tpot": 0.1 * s}
        dep = serve_config_from_dict(cfg).deployment
        assert (dep.rebalance_trigger, dep.rebalance_slo_quantile) == ("slo", grid.attainment)
        direct = pl.search(problem, placements=[p for _, p in pairs])
        rebal = next(r for r in direct["ranking"] if r.get("rebalance"))
        assert row["best_rebalance_disaggregated"] == rebal["placement"]
        assert row["rebalance_disagg_per_gpu_rps"] == pytest.approx(rebal["per_gpu_goodput_rps"], abs=1e-4)
    load = dataclasses.replace(grid, rebalance_trigger="load")
    assert "slo" not in pl.serve_config(load.problem("disaggregated", "16:1", 1.0, "nvlink"), variant, 1.0)
    # the variants' runs depend on the point's SLOs (1P2D at 8 req/s flips at the tight one only), so their
    # simulations are not shared across points: one task per (variant, point); fixed designs share theirs
    from pdjax.sim.run import simulate_config
    flips = {}
    for s in grid.slo_scales:
        problem, v = next((q, p) for q, p in rg.point_problems(grid, "16:1", s, "nvlink")["disaggregated"]
                          if p.rebalance and (p.num_prefill, p.num_decode) == (1, 2))
        run, _ = simulate_config(serve_config_from_dict(pl.serve_config(problem, v, 8.0)), hardware=problem.node.spec())
        flips[s] = run.mixed_pool["num_flips"]
    assert flips == {0.4: 1, 1.0: 0}
    tasks = [t for t in rg._tasks(grid, rg.sarathi_budgets(grid)) if t.link is not None]
    assert all(len(t.problems) == (1 if t.placement.rebalance else 2) for t in tasks)
    assert sorted(t.problems[0][0] for t in tasks if t.placement.rebalance) == [0.4, 0.4, 1.0, 1.0]


@pytest.mark.slow      # two run_real calls on CPU devices: ~20 s
def test_real_engine_flips_on_its_slos_without_changing_tokens(tmp_path):
    """run_real on a tiny model, 2P2D: with a TTFT SLO no CPU prefill meets, the SLO trigger moves a decode instance
    to prefill (recorded in results.json with the trigger's keys) and every request's greedy tokens are the plain
    run's."""
    pytest.importorskip("jax")
    import json
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.serving.run import run_real

    def run(name: str, deployment: dict) -> tuple:
        config = {
            "model": {"checkpoint": "tiny-mha", "attention_impl": "reference"},
            "engine": {"mode": "offline", "warmup": False, "progress": False, "token_buckets": [64],
                       "seq_buckets": [8], "page_buckets": [8]},
            "scheduler": {"token_budget": 64, "max_num_seqs": 8, "max_model_len": 64, "page_size": 8,
                          "num_pages": 48},
            "workload": {"kind": "synthetic", "prompt_len": {"kind": "uniform", "low": 8, "high": 30},
                         "output_len": {"kind": "fixed", "value": 4}, "num_requests": 6, "vocab_size": 256},
            "slo": {"ttft": 1e-6, "tpot": 10.0},
            "deployment": {"kind": "disaggregated", "prefill": {"num_instances": 2},
                           "decode": {"num_instances": 2}, **deployment}}
        summary = run_real(serve_config_from_dict(config), config, str(tmp_path / name))
        return summary, json.loads((tmp_path / name / "outputs.json").read_text())
    plain, plain_tokens = run("plain", {})
    flipping, tokens = run("slo", {"rebalance": True, "rebalance_trigger": "slo", "rebalance_window_s": 0.0})
    pool = flipping["engine"]["mixed_pool"]
    assert pool["trigger"] == "slo" and pool["ttft_s"] == 1e-6 and pool["quantile"] == 0.9
    assert pool["num_flips"] >= 1 and pool["flips"][0]["src"] == "decode", pool["flips"]
    assert tokens == plain_tokens and flipping["num_completed"] == plain["num_completed"] == 6
