"""Overload handling (issue 30 items 4-5): early rejection (pdjax.scheduler.admission) and online XpYd rebalancing
(pdjax.scheduler.rebalance): the predictor and the flip rule by hand, the deployment keys' refusals, the simulator
with each feature on, and the real engine's schedule == the simulator's with early rejection (fake runners)."""
from __future__ import annotations

import csv
import dataclasses
import random
from types import SimpleNamespace

import pytest

from pdjax.config.deployment import DeploymentConfig, InstanceGroupConfig, instance_scheduler_config
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.metrics import IterationRecord
from pdjax.scheduler import Request, make_scheduler
from pdjax.scheduler.admission import Admission, StepRates, admission_report
from pdjax.scheduler.mixed import make_borrowing_scheduler
from pdjax.scheduler.overload import overload_pool_factory, overload_scheduler_maker
from pdjax.scheduler.rebalance import RebalancingPool
from pdjax.sim.disagg import DisaggSimInstance, simulate_disaggregated

TICK = 1.0 / 1024


def tick_step_time(out) -> float:
    """Whole ticks (exact float sums): fixed + per token."""
    return TICK * (4 + out.total_tokens // 8)


# ------------------------------------------------------------------------------------------------ the predictor
def _req(tokens: int, outputs: int, max_tokens: int, computed: int = 0):
    return SimpleNamespace(all_token_ids=[0] * tokens, output_token_ids=[0] * outputs, max_tokens=max_tokens,
                           num_computed_tokens=computed, prompt_token_ids=[0] * (tokens - outputs),
                           request_id=f"q{tokens}")


def _inst(name: str, *, running=(), waiting=(), num_pages=100, max_num_seqs=10):
    sched = SimpleNamespace(running=list(running), waiting=list(waiting), swapped=[], _kv_pending={}, _kv_ready=[],
                            block_manager=SimpleNamespace(page_size=16, num_pages=num_pages),
                            config=SimpleNamespace(max_num_seqs=max_num_seqs))
    return SimpleNamespace(name=name, scheduler=sched)


def test_step_rates_learn_prefill_and_decode_steps_only():
    records = []
    rates = StepRates(alpha=0.5)
    rates.bind(records)
    records += [IterationRecord(0, 0.0, 1.0, num_prefill_tokens=100), IterationRecord(1, 1.0, 1.5, 50, 3),
                IterationRecord(2, 0.0, 0.2, num_decode_tokens=4)]
    rates.update()
    assert (rates.prefill_s_per_token, rates.decode_step_s) == (0.01, 0.2)   # the mixed step is skipped
    records.append(IterationRecord(3, 2.0, 2.4, num_decode_tokens=4))
    rates.update()
    assert rates.decode_step_s == pytest.approx(0.3)


def test_predicted_load_by_hand():
    """Page size 16, one decode instance (100 pages, 10 slots) running a 31-token request with 10 steps left, one
    prefill instance with a 50-token prompt queued; the new request has 15 prompt tokens."""
    decode = [_inst("decode0", running=[_req(31, 1, 11)])]
    prefill = [_inst("prefill0", waiting=[_req(50, 0, 100)])]
    new = _req(15, 0, 5)
    adm = Admission("predicted_load", threshold=0.25, rates=StepRates(0.01, 0.1))
    # now: the new request (1 page) + the decoding one (2 pages); 2 of 10 slots
    assert adm.load(new, 0.0, prefill, decode, predicted=False) == pytest.approx(0.2)
    # horizon (50 + 15) x 0.01 = 0.65 s: the decoder took 6 steps (37 tokens, 3 pages) and is still there; the queued
    # prompt reached decode at 0.5 s and took 1 step (52 tokens, 4 pages): 8 pages, 3 slots
    assert adm.load(new, 0.0, prefill, decode, predicted=True) == pytest.approx(0.3)
    reason = adm.admit_arrival(new, 0.0, prefill, decode)
    assert reason.startswith("early rejection (predicted_load): decode load 0.300")
    assert Admission("current_load", threshold=0.25).admit_arrival(new, 0.0, prefill, decode) is None
    # 0.05 s a step: the decoder is done by the horizon (13 steps > 10 left); 2 slots
    fast = Admission("predicted_load", rates=StepRates(0.01, 0.05))
    assert fast.load(new, 0.0, prefill, decode, predicted=True) == pytest.approx(0.2)


def test_admission_report_counts_before_and_after_prefill():
    rec = SimpleNamespace
    records = [rec(finish_reason="rejected", first_scheduled_time=None, completed=False, num_prompt_tokens=7),
               rec(finish_reason="rejected", first_scheduled_time=0.1, completed=False, num_prompt_tokens=30),
               rec(finish_reason="aborted", first_scheduled_time=0.2, completed=False, num_prompt_tokens=5),
               rec(finish_reason="length", first_scheduled_time=0.0, completed=True, num_prompt_tokens=9)]
    its = [IterationRecord(i, 0, 1, 0, n, n, "decode0") for i, n in enumerate((2, 4))]
    report = admission_report(records, its + [IterationRecord(9, 0, 1, 5, 0, 50, "prefill0")], ["decode0"])
    assert report["rejected_before_prefill"] == 1 and report["prefill_wasted"] == 2
    assert report["wasted_prefill_tokens"] == 35
    assert report["decode_batch"] == {"mean": 3.0, "std": 1.0, "cv": pytest.approx(1 / 3)}


# ------------------------------------------------------------------------------------------------ the flip rule
def _pool(**kw):
    cfg = SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=8, max_model_len=512, page_size=16,
                          num_pages=64)
    insts = [SimpleNamespace(name=f"{role}{i}", scheduler=make_borrowing_scheduler(role, cfg))
             for role in ("prefill", "decode") for i in range(2)]
    return RebalancingPool("least_loaded", insts[:2], insts[2:], **kw), insts


def test_flip_after_the_window_drain_and_cost():
    pool, (p0, p1, d0, d1) = _pool(prefill_queue_tokens=100, decode_load=0.5, window_s=1.0, flip_s=0.5)
    for i, inst in enumerate((p0, p1)):
        inst.scheduler.add_request(Request(f"r{i}", [1] * 300, SamplingParams(max_tokens=4), 0.0))
    assert pool.return_idle(0.0) == [] and pool.return_idle(0.9) == [] and not pool.flips
    assert pool.return_idle(1.0) == []            # decided: decode0 (least loaded) drains, is idle, costs 0.5 s
    assert pool.state["decode0"] == "flipping" and pool.members("decode") == [d1]
    assert pool.return_idle(1.4) == [] and pool.return_idle(1.6) == [d0]
    (flip,) = pool.flips
    assert dataclasses.astuple(flip)[:6] == (1.0, 1.0, 1.6, "decode0", "decode", "prefill")
    assert "prefill over" in flip.reason
    assert pool.members("prefill") == [p0, p1, d0] and pool.pick_prefill(None, 1.6) is d0
    d0.scheduler.add_request(Request("r9", [1] * 8, SamplingParams(max_tokens=2), 1.6))    # takes prompts now
    assert pool.return_idle(5.0) == [] and len(pool.flips) == 1, "the decode side keeps one instance"
    assert pool.summary()["roles"] == {"prefill0": "prefill", "prefill1": "prefill", "decode0": "prefill",
                                       "decode1": "decode"}


def test_no_flip_while_both_sides_are_over_or_the_donor_is_busy():
    pool, (p0, p1, d0, d1) = _pool(prefill_queue_tokens=100, decode_load=0.5, window_s=0.0)
    for i, inst in enumerate((p0, p1)):
        inst.scheduler.add_request(Request(f"r{i}", [1] * 300, SamplingParams(max_tokens=4), 0.0))
    pool.decode_load = 1e-9
    for inst in (d0, d1):   # a live sequence on each decode instance: load 1/8 > threshold
        inst.scheduler.running.append(Request(f"x{inst.name}", [1] * 4, SamplingParams(max_tokens=4), 0.0))
    assert pool.return_idle(3.0) == [] and not pool.flips and pool._pending is None
    pool.decode_load = 0.5                          # decode side fine now: decode0 drains but is busy
    assert pool.return_idle(4.0) == [] and pool.state["decode0"] == "draining"
    d0.scheduler.running.clear()
    assert pool.return_idle(4.5) == [d0] and pool.flips[0].drained == 4.5


# ------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("changes, message", [
    (dict(admission="predicted_load"), "deployment.admission='predicted_load' with deployment.kind='colocated'"),
    (dict(kind="disaggregated", rebalance=True, mixed_pool="borrow"), "with a mixed pool"),
    (dict(kind="disaggregated", rebalance=True, prefill=InstanceGroupConfig(tp=2)),
     "deployment.prefill.tp=2 != deployment.decode.tp=1"),
])
def test_overload_keys_are_refused_where_they_do_not_apply(changes, message):
    with pytest.raises(ValueError, match=None) as e:
        DeploymentConfig(**changes)
    assert message in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------------ the simulator
def _requests(n: int, seed: int, *, prompt=(16, 200), out=(20, 60), gap_ticks=4):
    rng = random.Random(seed)
    reqs, t = [], 0
    for i in range(n):
        t += rng.randint(0, gap_ticks)
        reqs.append(Request(f"r{i:03d}", [rng.randrange(100) for _ in range(rng.randint(*prompt))],
                            SamplingParams(max_tokens=rng.randint(*out)), t * TICK))
    return reqs


def _simulate(dep: DeploymentConfig, reqs, *, prefill=1, decode=1, base=None, transfer_s=2 * TICK,
              on_schedule=None):
    base = base or SchedulerConfig(policy="sarathi", token_budget=256, max_num_seqs=8, max_model_len=512,
                                   page_size=16, num_pages=256)
    make = overload_scheduler_maker(dep)
    cfg = {role: instance_scheduler_config(base, InstanceGroupConfig(), role) for role in ("prefill", "decode")}
    groups = {role: [DisaggSimInstance(f"{role}{i}", role, make(role, cfg[role]), tick_step_time) for i in range(n)]
              for role, n in (("prefill", prefill), ("decode", decode))}
    return simulate_disaggregated(reqs, groups["prefill"], groups["decode"], lambda s, d, n: transfer_s,
                                  router=dep.router, pool_factory=overload_pool_factory(dep), on_schedule=on_schedule)


def test_simulated_early_rejection_sheds_load_before_prefill():
    reqs = lambda: _requests(120, seed=3, gap_ticks=2)     # noqa: E731
    plain = _simulate(DeploymentConfig(kind="disaggregated"), reqs())
    early = _simulate(DeploymentConfig(kind="disaggregated", admission="predicted_load", admission_threshold=0.9),
                      reqs())
    assert all(r.completed for r in plain.requests)
    rejected = [r for r in early.requests if r.finish_reason == "rejected"]
    assert rejected and all(r.first_scheduled_time is None and r.reject_reason.startswith(
        "early rejection (predicted_load)") for r in rejected)
    assert all(r.completed for r in early.requests if r.finish_reason != "rejected")
    summary = early.mixed_pool["admission"]
    assert summary["arrivals_rejected"] == len(rejected) and summary["decode_step_s"] > 0
    # what shedding buys: the served requests wait less for their first token
    wait = lambda res: max(r.first_token_time - r.arrival_time for r in res.requests if r.completed)   # noqa: E731
    assert wait(early) < wait(plain)


def test_simulated_late_rejection_wastes_prefill_and_frees_it():
    dep = DeploymentConfig(kind="disaggregated", admission_handoff_load=0.5)
    res = _simulate(dep, _requests(60, seed=4, gap_ticks=1))
    report = admission_report(res.requests, res.iterations, ["decode0"])
    late = [r for r in res.requests if r.finish_reason == "rejected"]
    assert late and report["prefill_wasted"] == len(late) and report["rejected_before_prefill"] == 0
    assert all(r.reject_reason.startswith("after prefill: decode instance decode0 load") and len(r.token_times) == 1
               for r in late)
    assert report["wasted_prefill_tokens"] == sum(r.num_prompt_tokens for r in late)


def test_simulated_rebalancing_flips_a_prefill_instance_to_decode():
    """2P2D under a decode-heavy mix (short prompts, long outputs, few slots): the prefill side idles while the
    decode side is full, so a prefill instance drains and serves decode."""
    dep = DeploymentConfig(kind="disaggregated", router="least_loaded", rebalance=True, rebalance_decode_load=0.7,
                           rebalance_window_s=8 * TICK, rebalance_flip_s=16 * TICK)
    reqs = lambda: _requests(80, seed=5, prompt=(8, 40), out=(100, 200), gap_ticks=3)   # noqa: E731
    fixed = _simulate(DeploymentConfig(kind="disaggregated", router="least_loaded"), reqs(), prefill=2, decode=2)
    res = _simulate(dep, reqs(), prefill=2, decode=2)
    flips = res.mixed_pool["flips"]
    assert flips and flips[0]["src"] == "prefill" and flips[0]["dst"] == "decode"
    assert flips[0]["served"] >= flips[0]["drained"] + 16 * TICK
    flipped = flips[0]["instance"]
    decoded_after = [it for it in res.iterations if it.instance == flipped and it.start_time >= flips[0]["served"]
                     and it.num_decode_tokens]
    assert decoded_after, "the flipped instance decodes"
    assert all(r.completed for r in res.requests)
    assert res.duration_s < fixed.duration_s


# ------------------------------------------------------------------------------------------------ engine == simulator
def test_engine_schedule_equals_simulator_with_early_and_late_rejection(monkeypatch):
    """DisaggregatedEngine (fake runners, fake clock, KV that lands at once) and simulate_disaggregated with the same
    pool factory make the same per-step schedules, rejections (at arrival and after prefill) and records. Every
    request arrives at 0 and one prefill step hands all off (the engine's lock-step rounds are not the simulator's:
    tests/test_simulator.py)."""
    pytest.importorskip("jax")
    from test_simulator import FakeClock, FakeRunner, _LandedKV, snapshot
    from pdjax.serving import cluster
    from pdjax.serving.disagg import DisaggregatedEngine, Instance
    monkeypatch.setattr(cluster, "scatter_kv_pages", lambda caches, pages, staged: caches)
    dep = DeploymentConfig(kind="disaggregated", admission="predicted_load", admission_threshold=0.6,
                           admission_handoff_load=0.4, admission_prefill_tokens_per_s=8192.0,
                           admission_decode_step_s=0.005)
    base = SchedulerConfig(policy="sarathi", token_budget=4096, max_num_seqs=8, max_model_len=512, page_size=16,
                           num_pages=64)
    cfg = {role: instance_scheduler_config(base, InstanceGroupConfig(), role) for role in ("prefill", "decode")}

    def reqs():
        return _requests(30, seed=6, prompt=(16, 120), out=(5, 30), gap_ticks=0)
    engine_log = {"prefill0": [], "decode0": []}
    clock = FakeClock()
    runners = {name: FakeRunner(clock, tick_step_time, lambda out, t, n=name: engine_log[n].append(snapshot(out, t)))
               for name in engine_log}
    for runner in runners.values():
        runner.kv_stages = runner.kv_stage_meshes = None
    engine = DisaggregatedEngine(
        [Instance("prefill0", "prefill", runners["prefill0"], make_scheduler(cfg["prefill"]))],
        [Instance("decode0", "decode", runners["decode0"], make_scheduler(cfg["decode"]))],
        clock=clock.clock, sleep=clock.sleep, pool_factory=overload_pool_factory(dep),
        transfer=lambda src, pages, dst, num_tokens, wait=False: _LandedKV(num_tokens))
    engine_result = engine.run(reqs())

    sim_log = {"prefill0": [], "decode0": []}
    sim_result = _simulate(dep, reqs(), base=base, transfer_s=0.0,
                           on_schedule=lambda inst, out, t: sim_log[inst.name].append(snapshot(out, t)))
    reasons = [r.reject_reason.split(":")[0] for r in sim_result.requests if r.finish_reason == "rejected"]
    assert "early rejection (predicted_load)" in reasons and "after prefill" in reasons, "both kinds happen"
    assert len(engine_log["prefill0"]) == 1 and len(engine_log["decode0"]) > 10
    for name in engine_log:
        assert sim_log[name] == engine_log[name], f"{name}'s schedule differs"
    assert [r.__dict__ for r in sim_result.requests] == [r.__dict__ for r in engine_result.requests]


# ------------------------------------------------------------------------------------------------ the real engine
def _run_real(tmp_path, name: str, deployment: dict, num_requests: int = 6):
    import json
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.serving.run import run_real
    config = {
        "model": {"checkpoint": "tiny-mha", "attention_impl": "reference"},
        "engine": {"mode": "offline", "warmup": False, "progress": False, "token_buckets": [64],
                   "seq_buckets": [8], "page_buckets": [8]},
        "scheduler": {"token_budget": 64, "max_num_seqs": 8, "max_model_len": 64, "page_size": 8, "num_pages": 48},
        "workload": {"kind": "synthetic", "prompt_len": {"kind": "uniform", "low": 8, "high": 30},
                     "output_len": {"kind": "fixed", "value": 4}, "num_requests": num_requests, "vocab_size": 256},
        "deployment": {"kind": "disaggregated", **deployment}}
    workdir = tmp_path / name
    summary = run_real(serve_config_from_dict(config), config, str(workdir))
    return summary, json.loads((workdir / "outputs.json").read_text())


@pytest.mark.slow      # three run_real calls on 4 CPU devices: ~30 s
def test_real_engine_rejects_with_a_reason_and_rebalances_without_changing_tokens(tmp_path):
    """run_real on a tiny model (CPU devices): early and late rejection finish the rejected requests with their
    reason and leave the others' greedy tokens as the plain run's; rebalancing flips an instance (2P2D, every
    prefill queue over 1 token) and every request's tokens are the plain run's."""
    pytest.importorskip("jax")
    two = {"prefill": {"num_instances": 2}, "decode": {"num_instances": 2}}
    plain, plain_tokens = _run_real(tmp_path, "plain", two)
    assert plain["num_completed"] == 6
    rejecting, tokens = _run_real(tmp_path, "reject", {
        **two, "admission": "predicted_load", "admission_threshold": 0.2, "admission_handoff_load": 0.2,
        "admission_prefill_tokens_per_s": 1000.0, "admission_decode_step_s": 0.01})
    report = rejecting["engine"]["overload"]
    assert report["rejected_before_prefill"] >= 1 and report["prefill_wasted"] >= 1, report
    served = {rid: ids for rid, ids in tokens.items() if len(ids) == 4}
    assert served and all(plain_tokens[rid] == ids for rid, ids in served.items())
    assert rejecting["engine"]["mixed_pool"]["admission"]["arrivals_checked"] == 6
    with open(tmp_path / "reject" / "requests.csv") as f:
        rows = list(csv.DictReader(f))
    reasons = {row["reject_reason"].split(":")[0] for row in rows if row["finish_reason"] == "rejected"}
    assert reasons == {"early rejection (predicted_load)", "after prefill"}
    flipping, tokens = _run_real(tmp_path, "rebalance", {**two, "rebalance": True,
                                                        "rebalance_prefill_queue_tokens": 1, "rebalance_window_s": 0.0})
    assert flipping["engine"]["mixed_pool"]["num_flips"] >= 1
    assert tokens == plain_tokens and flipping["num_completed"] == 6


def test_provisioning_searches_rebalancing_as_a_design():
    from pdjax.config.serving import serve_config_from_dict
    from test_provision import small_problem
    from pdjax.sim import provision as pv
    problem = small_problem(designs=("Splitwise-AA", "Splitwise-HA"), mixed=("off", "rebalance"))
    assert [s.name for s in problem.systems] == ["Splitwise-AA", "Splitwise-AA +rebalance", "Splitwise-HA"]
    cfg = pv.serve_config(problem, pv.Cluster(problem.systems[1], 2, 2), 5.0)
    assert cfg["deployment"]["rebalance"] is True and serve_config_from_dict(cfg).deployment.rebalance
    probe = pv.probe(problem, pv.Cluster(problem.systems[1], 2, 2), 5.0)
    assert probe.row()["mixed"] == "rebalance"
