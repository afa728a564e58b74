"""Splitwise's mixed pool (pdjax.scheduler.mixed): a mixed machine takes the prefill or decode phase only when that
pool is overloaded (configured thresholds), runs exactly that phase's protocol, and returns to the pool when idle.
Pure routing tests, the simulator on hand-built loads, the deployment block and the splitwise config (no JAX), and
the real engine on fake CPU devices (tiny-mha): every request gets the colocated run's tokens, no page leaks."""
from __future__ import annotations

import pathlib

import pytest

from pdjax.config.deployment import (DeploymentConfig, InstanceGroupConfig, deployment_from_dict,
                                     instance_scheduler_config)
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.scheduler import Request
from pdjax.scheduler.instances import Instance, check_instance, make_role_scheduler
from pdjax.scheduler.mixed import MixedPool, MixedScheduler, decode_load, phase_intervals
from pdjax.sim.disagg import DisaggSimInstance, simulate_disaggregated

ROOT = pathlib.Path(__file__).resolve().parents[1]
TICK = 1.0 / 1024
BASE = SchedulerConfig(policy="sarathi", token_budget=128, max_num_seqs=16, max_model_len=512, page_size=16,
                       num_pages=256)


def _sched(role, base=BASE, **group):
    return make_role_scheduler(role, instance_scheduler_config(base, InstanceGroupConfig(**group), role))


def _req(rid, n_prompt, max_tokens=8, t=0.0):
    return Request(rid, [1 + (i % 90) for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens), t)


# --------------------------------------------------------------------------------------------------- config
def test_mixed_group_config_and_validation():
    dep = deployment_from_dict({"kind": "disaggregated", "mixed": {"num_instances": 2, "tp": 2},
                                "mixed_prefill_queue_tokens": 4096, "mixed_decode_load": 0.9})
    assert dep.roles == ("prefill", "decode", "mixed") and dep.has_mixed_pool
    assert dep.instance_names("mixed") == ["mixed0", "mixed1"]
    assert dep.device_assignment(6) == {"prefill0": (0,), "decode0": (1,), "mixed0": (2, 3), "mixed1": (4, 5)}
    plain = deployment_from_dict({"kind": "disaggregated"})
    assert plain.roles == ("prefill", "decode") and plain.mixed.num_instances == 0 and not plain.has_mixed_pool
    assert deployment_from_dict({"kind": "disaggregated", "mixed": {"tp": 2}}).roles == ("prefill", "decode")
    cfg = instance_scheduler_config(SchedulerConfig(policy="sarathi"), InstanceGroupConfig(token_budget=1024),
                                    "mixed")
    assert (cfg.policy, cfg.token_budget) == ("sarathi", 1024)
    for block, match in (
            ({"mixed": {"num_instances": 1}}, "deployment.mixed.num_instances=1 with deployment.kind='colocated'"),
            ({"kind": "disaggregated", "mixed_prefill_queue_tokens": 0}, "mixed_prefill_queue_tokens=0, expected"),
            ({"kind": "disaggregated", "mixed_decode_load": 0.0}, r"mixed_decode_load=0.0, expected a fraction"),
            ({"kind": "disaggregated", "mixed_decode_load": 1.5}, r"mixed_decode_load=1.5, expected a fraction"),
            ({"kind": "disaggregated", "mixed": {"num_instances": -1}}, "deployment.mixed.num_instances=-1"),
            ({"kind": "disaggregated", "decode": {"num_instances": 0}}, "deployment.decode.num_instances=0"),
            ({"mixed": {"chips": 1}}, "unknown config key.*deployment.mixed.chips")):
        with pytest.raises(ValueError, match=match):
            deployment_from_dict(block)


def test_mixed_role_needs_a_mixed_scheduler():
    check_instance("mixed0", "mixed", _sched("mixed"))
    with pytest.raises(ValueError, match="needs a 'mixed' scheduler"):
        Instance("mixed0", "mixed", _sched("prefill"))
    with pytest.raises(ValueError, match="cannot run a 'mixed' scheduler"):
        Instance("decode0", "decode", _sched("mixed"))


def test_mixed_scheduler_phases():
    s = _sched("mixed")
    assert isinstance(s, MixedScheduler) and s.phase is None and s.is_idle
    with pytest.raises(RuntimeError, match="phase None"):
        s.add_request(_req("a", 10))
    assert s.take_phase("prefill") and s.handoff_after_prefill
    assert s.add_request(_req("a", 10))
    with pytest.raises(RuntimeError, match="only when idle"):
        s.take_phase("decode")
    out = s.schedule(0.0)
    (done,) = s.update(out, [5], 1.0)
    assert done.finish_reason == "handoff" and s.num_held == 1 and not s.is_idle
    assert not s.return_if_idle()          # pages held for the transfer
    s.release("a")
    assert s.return_if_idle() and s.phase is None
    assert s.take_phase("decode") and not s.handoff_after_prefill
    assert s.add_handoff(done, 1.0)        # the same protocol as decode_only
    s.mark_kv_arrived("a")
    out = s.schedule(2.0)
    assert out.kv_handoff_req_ids == ["a"] and out.num_decode_tokens == 1


# --------------------------------------------------------------------------------------------------- routing
class _Inst:
    def __init__(self, name, role, sched):
        self.name, self.role, self.scheduler = name, role, sched


def _pool(prefill_queue_tokens=100, decode_load_threshold=1.0, num_mixed=1, decode_group=None):
    p = _Inst("prefill0", "prefill", _sched("prefill"))
    d = _Inst("decode0", "decode", _sched("decode", **(decode_group or {})))
    m = [_Inst(f"mixed{i}", "mixed", _sched("mixed")) for i in range(num_mixed)]
    return MixedPool("least_loaded", [p], [d], m, prefill_queue_tokens=prefill_queue_tokens,
                     decode_load=decode_load_threshold), p, d, m


def test_prefill_switch_exactly_above_the_threshold_and_return_when_idle():
    pool, p, _, (m,) = _pool(prefill_queue_tokens=100)
    assert pool.pick_prefill(_req("a", 60), 0.0) is p          # an empty queue is never overloaded
    p.scheduler.add_request(_req("a", 60))
    assert pool.pick_prefill(_req("b", 40), 0.1) is p          # 60 + 40 = 100: at the threshold, not above
    assert pool.switches == [] and m.scheduler.phase is None
    assert pool.pick_prefill(_req("b", 41), 0.2) is m          # 60 + 41 > 100: the mixed machine takes prefill
    assert m.scheduler.phase == "prefill"
    m.scheduler.add_request(_req("b", 41))
    assert pool.pick_prefill(_req("c", 50), 0.3) is m          # pool still overloaded, mixed0 not (41 + 50)
    m.scheduler.add_request(_req("c", 50))
    # Everything overloaded (prefill0 60 + 50, mixed0 91 + 50) and no idle mixed machine: the least loaded queues it.
    assert pool.pick_prefill(_req("d", 50), 0.4) is p
    for rid in ("b", "c"):
        m.scheduler.abort(rid, 0.5)                            # mixed0 has nothing left: idle
    assert pool.return_idle(0.6) == [m] and m.scheduler.phase is None
    assert [(s.time, s.instance, s.phase) for s in pool.switches] == [(0.2, "mixed0", "prefill"),
                                                                       (0.6, "mixed0", None)]


def _handed_off(rid, n_prompt):
    """A request as a prefill instance hands it off (first token sampled, prompt computed)."""
    s = _sched("prefill")
    req = _req(rid, n_prompt)
    s.add_request(req)
    while not req.output_token_ids:
        out = s.schedule(0.0)
        s.update(out, [7] * len(out.req_ids), 0.0)
    assert req.finish_reason == "handoff"
    return req


def test_decode_switch_exactly_above_the_load_threshold():
    # decode0: 16 sequences, 256 pages; a 40-token handed-off request needs 3 pages (41 tokens at page 16).
    pool, _, d, (m,) = _pool(decode_load_threshold=0.25)
    for i in range(3):
        req = _handed_off(f"r{i}", 40)
        assert pool.pick_decode(req, 0.0) is d                 # seqs (i + 1) / 16 <= 0.25
        d.scheduler.add_handoff(req, 0.0)
    req = _handed_off("r3", 40)
    assert decode_load(d, req) == 4 / 16 and pool.pick_decode(req, 0.1) is d   # 0.25: not above
    d.scheduler.add_handoff(req, 0.1)
    req = _handed_off("r4", 40)
    assert decode_load(d, req) == 5 / 16 and pool.pick_decode(req, 0.2) is m   # above: mixed0 takes decode
    assert m.scheduler.phase == "decode" and m.scheduler.add_handoff(req, 0.2)
    assert pool.switch_counts() == {"mixed0": {"prefill": 0, "decode": 1, "returned": 0}}


def test_decode_load_counts_pages_of_queued_requests():
    pool, _, d, _ = _pool(decode_group={"num_pages": 40})
    req = _handed_off("a", 40)       # 41 tokens: 3 pages of 16
    assert decode_load(d, req) == 3 / 40                                  # > 1 / 16 sequence slots
    d.scheduler.add_handoff(req, 0.0)                                      # queued: its pages count
    assert decode_load(d) == 3 / 40
    assert decode_load(d, _handed_off("b", 300)) == (3 + 19) / 40        # 301 tokens: 19 pages


def test_without_mixed_instances_the_pool_is_the_two_routers():
    p = [_Inst(f"prefill{i}", "prefill", _sched("prefill")) for i in range(2)]
    d = [_Inst(f"decode{i}", "decode", _sched("decode")) for i in range(2)]
    pool = MixedPool("round_robin", p, d, [], prefill_queue_tokens=1)
    assert [pool.pick_prefill(_req("a", 10), 0.0) for _ in range(3)] == [p[0], p[1], p[0]]
    assert [pool.pick_decode(_req("a", 10), 0.0) for _ in range(3)] == [d[0], d[1], d[0]]


# --------------------------------------------------------------------------------------------------- simulator
def step_time(out) -> float:
    return TICK * (3 + out.total_tokens // 8)


def transfer_time(src, dst, num_tokens):
    return TICK * (1 + 2 * -(-num_tokens // 16))


def _sim(reqs, q, load, num_mixed=1):
    def inst(role, i):
        return DisaggSimInstance(f"{role}{i}", role, _sched(role), step_time)
    p, d = [inst("prefill", 0)], [inst("decode", 0)]
    m = [inst("mixed", i) for i in range(num_mixed)]
    log = []

    def on_schedule(instance, out, now):
        for x in p + d + m:
            x.scheduler.check_invariants()
        log.append((instance.name, getattr(instance.scheduler, "phase", instance.role), now, out))
    result = simulate_disaggregated(reqs, p, d, transfer_time, mixed=m, mixed_prefill_queue_tokens=q,
                                    mixed_decode_load=load, on_schedule=on_schedule)
    return result, p + d + m, log


def _burst(n=12, prompt=100, out=20):
    return [_req(f"r{i:02d}", prompt, out, i * TICK) for i in range(n)]


def _check_run(result, instances, reqs, log):
    assert all(r.completed and r.finish_reason == "length" for r in result.requests)
    assert {r.request_id: r.num_output_tokens for r in result.requests} == {r.request_id: r.max_tokens for r in reqs}
    assert sorted(t.request_id for t in result.transfers) == sorted(r.request_id for r in reqs)
    for inst in instances:                          # no page leaks, every mixed machine back in the pool
        s = inst.scheduler
        assert s.num_held == 0 and not s.has_unfinished()
        assert s.block_manager.num_free_pages == s.config.num_pages
        assert getattr(s, "phase", None) is None
    for name, phase, _, out in log:                 # a machine in a phase runs that phase's work only
        if phase in ("prefill", "decode"):
            assert out.num_decode_tokens == 0 if phase == "prefill" else out.num_prefill_tokens == 0, name


def test_sim_below_the_thresholds_the_mixed_machine_never_switches():
    reqs = _burst()
    result, instances, log = _sim(reqs, q=100_000, load=1.0)
    _check_run(result, instances, reqs, log)
    assert result.mixed_pool["switches"] == [] and not [x for x in log if x[0] == "mixed0"]
    assert {t.src for t in result.transfers} == {"prefill0"} and {t.dst for t in result.transfers} == {"decode0"}


def test_sim_prefill_overload_mixed_prefills_hands_off_and_returns():
    reqs = _burst()
    result, instances, log = _sim(reqs, q=300, load=1.0)
    _check_run(result, instances, reqs, log)
    switches = [tuple(s) for s in result.mixed_pool["switches"]]
    assert [s[2] for s in switches][:2] == ["prefill", None] and all(s[2] != "decode" for s in switches)
    # It prefilled some requests and handed them off to the decode pool (KV transfer from mixed0).
    assert any(t.src == "mixed0" and t.dst == "decode0" for t in result.transfers)
    # Every step of mixed0 fell inside a prefill phase of the log; it returned once its last KV had left.
    from pdjax.scheduler.mixed import Switch
    spans = phase_intervals([Switch(*s) for s in switches], "mixed0", float("inf"))
    for name, phase, now, _ in log:
        if name == "mixed0":
            assert any(a <= now < b and ph == phase == "prefill" for a, b, ph in spans)
    last_src = max(t.end_time for t in result.transfers if t.src == "mixed0")
    assert switches[-1][2] is None and switches[-1][0] == last_src


def test_sim_decode_overload_mixed_decodes_and_returns():
    reqs = _burst()
    result, instances, log = _sim(reqs, q=100_000, load=0.1)   # > 1 live sequence of 16 is overloaded
    _check_run(result, instances, reqs, log)
    phases = [s[2] for s in result.mixed_pool["switches"]]
    assert "decode" in phases and "prefill" not in phases and phases[-1] is None
    assert any(t.src == "prefill0" and t.dst == "mixed0" for t in result.transfers)
    assert all(ph == "decode" for name, ph, _, _ in log if name == "mixed0")


def test_sim_is_deterministic_and_both_phases_with_two_mixed_machines():
    runs = [_sim(_burst(16), q=1000, load=0.1, num_mixed=2)[0] for _ in range(2)]
    assert runs[0].mixed_pool == runs[1].mixed_pool
    assert [r.token_times for r in runs[0].requests] == [r.token_times for r in runs[1].requests]
    phases = {s[2] for s in runs[0].mixed_pool["switches"]}
    assert {"prefill", "decode", None} <= phases


# --------------------------------------------------------------------------------------------------- splitwise config
@pytest.mark.parametrize("arg", ["aa-code-dedicated", "hh-conv-dedicated"])
def test_splitwise_config_simulates(arg, shared_data):
    from pdjax.config.files import config_file
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.experiment.run import to_plain_dict
    from pdjax.sim.run import engine_info, simulate_config
    config = to_plain_dict(config_file(str(ROOT / "README.md"), "configs/sim/splitwise.py", arg))
    config["workload"]["num_requests"] = 120
    cfg = serve_config_from_dict(config)
    assert cfg.deployment.roles == ("prefill", "decode", "mixed") and cfg.deployment.mixed_pool == "dedicated"
    result, setup = simulate_config(cfg)
    assert len(result.requests) == 120 and all(r.completed for r in result.requests)
    assert set(setup.groups) == {"prefill", "decode", "mixed"} and setup.groups["mixed"].tp == 8
    info = engine_info(result, setup, cfg)
    assert set(info["instances"]) == {"prefill0", "prefill1", "decode0", "mixed0"}
    assert "mixed_pool" in info and info["mixed_pool"]["prefill_queue_tokens"] == 8192


def test_bad_splitwise_arg():
    from pdjax.config.files import config_file
    for arg in ("ah-code", "aa-code-lent", "aa-code-borrow-x", "aa"):   # ha is Splitwise-HA
        with pytest.raises(ValueError, match=f"splitwise: ARG='{arg}'"):
            config_file(str(ROOT / "README.md"), "configs/sim/splitwise.py", arg)


# --------------------------------------------------------------------------------------------------- real engine
PAGE, MAX_LEN, BUDGET = 8, 64, 32
PROMPT_LENS = (20, 33, 12, 40, 17, 25)
MAX_TOKENS = (5, 3, 6, 4, 2, 5)


@pytest.fixture(scope="module")
def engine_parts():
    import numpy as np

    from pdjax.config.model_specs import get_model_spec
    from pdjax.models.llama import init_params
    spec = get_model_spec("tiny-mha")
    params = init_params(spec, seed=0)
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, spec.vocab_size, n)] for n in PROMPT_LENS]
    return spec, params, prompts


def _serve_cfg(q, load, num_mixed):
    from pdjax.config.serving import serve_config_from_dict
    return serve_config_from_dict({
        "model": {"checkpoint": "tiny-mha", "attention_impl": "reference"}, "workload": {"preset": "chat"},
        "engine": {"token_buckets": [BUDGET], "seq_buckets": [8], "page_buckets": [MAX_LEN // PAGE]},
        "scheduler": {"token_budget": BUDGET, "max_num_seqs": 8, "max_model_len": MAX_LEN, "page_size": PAGE,
                      "num_pages": 48, "watermark": 0.0},
        "deployment": {"kind": "disaggregated", "mixed": {"num_instances": num_mixed},
                       "mixed_prefill_queue_tokens": q, "mixed_decode_load": load}})


def _requests(prompts):
    return [Request(f"r{i}", p, SamplingParams(max_tokens=m), 0.0)      # a burst at t=0
            for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS))]


@pytest.fixture(scope="module")
def colocated_tokens(engine_parts):
    from pdjax.serving.build import build_engine
    spec, params, prompts = engine_parts
    cfg = _serve_cfg(8192, 1.0, 0)
    import dataclasses
    cfg = dataclasses.replace(cfg, deployment=DeploymentConfig())
    result = build_engine(cfg, params=params, spec=spec).run(_requests(prompts))
    return {rid: [int(t) for t in toks] for rid, toks in result.output_tokens.items()}


def _record_schedules(instances, state: str) -> list:
    """Wrap each instance's scheduler.schedule to log (instance name, scheduler.<state> when it scheduled, output)
    of every call; returns the (growing) log."""
    log = []
    for inst in instances:
        def wrap(inst=inst, orig=inst.scheduler.schedule):
            def schedule(now):
                out = orig(now)
                log.append((inst.name, getattr(inst.scheduler, state), out))
                return out
            return schedule
        inst.scheduler.schedule = wrap()
    return log


def _run_real(engine_parts, q, load, num_mixed):
    from pdjax.serving.build import build_engine
    spec, params, prompts = engine_parts
    engine = build_engine(_serve_cfg(q, load, num_mixed), params=params, spec=spec)
    phases = _record_schedules(engine.mixed, "phase")   # (instance, phase at schedule, output) of every mixed step
    result = engine.run(_requests(prompts))
    return engine, result, phases


def _check_real(engine, result, phases, colocated_tokens):
    assert {rid: [int(t) for t in toks] for rid, toks in result.output_tokens.items()} == colocated_tokens
    assert all(r.finish_reason == "length" for r in result.requests)
    assert not engine._staged
    for inst in engine.instances:                 # no page leaks on any machine
        s = inst.scheduler
        assert s.num_held == 0 and not s.has_unfinished()
        assert s.block_manager.num_free_pages == s.config.num_pages
    for inst in engine.mixed:
        assert inst.scheduler.phase is None       # every mixed machine back in the pool
    for name, phase, out in phases:
        if out.req_ids:
            assert phase in ("prefill", "decode"), f"{name} ran a step while idle"
            assert (out.num_decode_tokens if phase == "prefill" else out.num_prefill_tokens) == 0


def test_real_engine_below_the_thresholds_never_switches(engine_parts, colocated_tokens):
    engine, result, phases = _run_real(engine_parts, q=8192, load=1.0, num_mixed=1)
    _check_real(engine, result, phases, colocated_tokens)
    assert engine.pool.switches == [] and not [p for p in phases if p[2].req_ids]
    assert {it.instance for it in result.iterations} == {"prefill0", "decode0"}


def test_real_engine_above_the_thresholds_switches_and_returns(engine_parts, colocated_tokens):
    # The burst at t=0 (prompts 20, 33, 12, 40, 17, 25) overloads a 90-token prefill queue at the fourth arrival
    # (65 + 40 > 90): mixed0 takes the prefill phase (r3, then r5: 65 + 25 > 90 on prefill0, 40 + 25 on mixed0);
    # more than one live sequence of 8 (0.2) overloads the decode instance: an idle mixed machine takes decode.
    engine, result, phases = _run_real(engine_parts, q=90, load=0.2, num_mixed=2)
    _check_real(engine, result, phases, colocated_tokens)
    log = [(s.instance, s.phase) for s in engine.pool.switches]
    assert log[0] == ("mixed0", "prefill") and ("mixed1", "prefill") not in log
    assert any(ph == "decode" for _, ph in log)
    prefilled_on_mixed0 = {rid for name, ph, out in phases if name == "mixed0" and ph == "prefill"
                           for rid in out.req_ids}
    assert prefilled_on_mixed0 == {"r3", "r5"}
    for name in ("mixed0", "mixed1"):
        mine = [ph for n, ph in log if n == name]
        assert mine[-1] is None and all(a != b for a, b in zip(mine, mine[1:]))   # alternates, ends back in pool
    ran = {it.instance for it in result.iterations}
    assert {"mixed0", "mixed1"} <= ran
    assert any(t.src.startswith("mixed") for t in result.transfers)     # a mixed prefill handed off (KV moved)
    assert any(t.dst.startswith("mixed") for t in result.transfers)     # a mixed decode received KV


# ------------------------------------------------------------------------------------------ real engine, borrowing
def _borrow_cfg(q, load):
    from pdjax.config.serving import serve_config_from_dict
    return serve_config_from_dict({
        "model": {"checkpoint": "tiny-mha", "attention_impl": "reference"}, "workload": {"preset": "chat"},
        "engine": {"token_buckets": [BUDGET], "seq_buckets": [8], "page_buckets": [MAX_LEN // PAGE]},
        "scheduler": {"token_budget": BUDGET, "max_num_seqs": 8, "max_model_len": MAX_LEN, "page_size": PAGE,
                      "num_pages": 48, "watermark": 0.0},
        "deployment": {"kind": "disaggregated", "mixed_pool": "borrow", "mixed_prefill_queue_tokens": q,
                       "mixed_decode_load": load}})


def _sim_moves_of(cfg, prompts):
    """The simulator's move log for the same machines (scheduler configs of cfg) and the same burst."""
    from pdjax.scheduler.mixed import make_borrowing_scheduler
    dep = cfg.deployment
    group = [DisaggSimInstance(name, role, make_borrowing_scheduler(
                 role, instance_scheduler_config(cfg.scheduler, dep.group(role), role)), step_time)
             for role in dep.roles for name in dep.instance_names(role)]
    result = simulate_disaggregated(_requests(prompts), [i for i in group if i.role == "prefill"],
                                    [i for i in group if i.role == "decode"], transfer_time, router=dep.router,
                                    mixed_prefill_queue_tokens=dep.mixed_prefill_queue_tokens,
                                    mixed_decode_load=dep.mixed_decode_load, mixed_pool="borrow")
    return result.mixed_pool["moves"]


@pytest.mark.parametrize("load", [1.0, 0.2])
def test_real_engine_borrowing_keeps_tokens_and_pages(engine_parts, colocated_tokens, load):
    # The burst at t=0 (prompts 20, 33, 12, 40, 17, 25) overloads prefill0's 90-token queue at the fourth arrival
    # (65 + 40 > 90): the token machine decode0 is borrowed and prefills r3 and r5 (mixed batches with the decodes
    # it takes). load=0.2 (more than one live sequence of 8 is full): the token side then borrows prefill0 too, and
    # requests stay on the machine that prefilled them.
    from pdjax.serving.build import build_engine
    spec, params, prompts = engine_parts
    cfg = _borrow_cfg(90, load)
    engine = build_engine(cfg, params=params, spec=spec)
    assert [i.name for i in engine.instances] == ["prefill0", "decode0"] and not engine.mixed
    batches = _record_schedules(engine.instances, "pool")   # (machine, pool at schedule, output) of every step
    result = engine.run(_requests(prompts))
    assert {rid: [int(t) for t in toks] for rid, toks in result.output_tokens.items()} == colocated_tokens
    assert all(r.finish_reason == "length" for r in result.requests) and not engine._staged
    for inst in engine.instances:                 # no page leaks; every machine back in its own pool
        s = inst.scheduler
        assert s.num_held == 0 and not s.has_unfinished() and s.pool == s.home
        assert s.block_manager.num_free_pages == s.config.num_pages
    assert {it.instance for it in result.iterations} <= {"prefill0", "decode0"}      # 1 + 1 machines, no more
    moves = [(m.instance, m.src, m.dst, m.reason) for m in engine.pool.moves]
    assert moves[0] == ("decode0", "decode", "mixed", "prefill")
    assert ("decode0", "mixed", "decode", "idle") in moves
    if load < 1.0:
        assert ("prefill0", "prefill", "mixed", "decode") in moves
    prefilled_on_decode0 = {rid for name, pool, out in batches if name == "decode0" and pool == "mixed"
                            for rid, pre in zip(out.req_ids, out.is_prefill) if pre}
    assert prefilled_on_decode0 == {"r3", "r5"}
    assert any(out.num_prefill_tokens and out.num_decode_tokens for _, pool, out in batches if pool == "mixed")
    for name, pool, out in batches:               # at home a machine runs its own phase only
        if pool == "prefill":
            assert out.num_decode_tokens == 0, name
        elif pool == "decode":
            assert out.num_prefill_tokens == 0, name
    assert len(result.transfers) + engine.pool.num_kept == len(prompts)
    assert engine.pool.num_kept > 0                # r3 / r5 at least keep their KV on decode0
    # The burst is routed before any step on both backends: the same arrival-side moves (the only arrivals).
    sim_moves = [tuple(m[1:]) for m in _sim_moves_of(cfg, prompts) if m[4] in ("prefill", "whole")]
    assert sim_moves == [mv for mv in moves if mv[3] in ("prefill", "whole")] == [moves[0]]
