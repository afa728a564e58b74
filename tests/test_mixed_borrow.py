"""Splitwise's borrowing mixed pool (deployment.mixed_pool='borrow', pdjax.scheduler.mixed.BorrowingPool): prefill
and decode machines move into the mixed pool when the other phase is overloaded, run mixed batches there under
their own names and return to their pool when idle, so P prompt + T token machines stay P + T machines. Config,
the machine's scheduler, the routing on hand-built loads, and the simulator (no JAX); the real engine's run is in
tests/test_mixed_pool.py (it shares that file's colocated reference run)."""
from __future__ import annotations

import pathlib

import pytest

from pdjax.config.deployment import InstanceGroupConfig, deployment_from_dict, instance_scheduler_config
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.scheduler import Request
from pdjax.scheduler.instances import Instance, make_role_scheduler
from pdjax.scheduler.mixed import (BorrowingPool, BorrowingScheduler, make_borrowing_scheduler, make_pool,
                                   pool_intervals)
from pdjax.sim.disagg import DisaggSimInstance, simulate_disaggregated

ROOT = pathlib.Path(__file__).resolve().parents[1]
TICK = 1.0 / 1024
BASE = SchedulerConfig(policy="sarathi", token_budget=128, max_num_seqs=16, max_model_len=512, page_size=16,
                       num_pages=256)


def _cfg(role, base=BASE, **group):
    return instance_scheduler_config(base, InstanceGroupConfig(**group), role)


def _req(rid, n_prompt, max_tokens=8, t=0.0):
    return Request(rid, [1 + (i % 90) for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens), t)


# --------------------------------------------------------------------------------------------------- config
def test_borrow_config_and_invalid_combinations():
    dep = deployment_from_dict({"kind": "disaggregated", "mixed_pool": "borrow", "prefill": {"num_instances": 2}})
    assert dep.borrows and not dep.has_mixed_pool and dep.roles == ("prefill", "decode")
    assert dep.num_devices == 3                                   # P + T machines, no extra group
    plain = deployment_from_dict({"kind": "disaggregated"})
    assert plain.mixed_pool == "dedicated" and not plain.borrows
    for block, match in (
            ({"kind": "disaggregated", "mixed_pool": "borrow", "mixed": {"num_instances": 1}},
             r"deployment.mixed_pool='borrow' with deployment.mixed.num_instances=1: .*expected "
             r"deployment.mixed.num_instances=0"),
            ({"mixed_pool": "borrow"}, r"deployment.mixed_pool='borrow' with deployment.kind='colocated'.*expected "
                                       r"kind='disaggregated'"),
            ({"kind": "disaggregated", "mixed_pool": "borrowed"},
             r"deployment.mixed_pool='borrowed', expected one of \('dedicated', 'borrow'\)")):
        with pytest.raises(ValueError, match=match):
            deployment_from_dict(block)
    with pytest.raises(ValueError, match="mixed_pool='lend', expected one of"):
        make_pool("lend", "round_robin", [], [])


# --------------------------------------------------------------------------------------------------- the machine
def _handed_off(rid, n_prompt, max_tokens=8):
    """A request as a prefill machine hands it off (first token sampled, prompt computed)."""
    s = make_role_scheduler("prefill", _cfg("prefill"))
    req = _req(rid, n_prompt, max_tokens)
    s.add_request(req)
    while not req.output_token_ids:
        out = s.schedule(0.0)
        s.update(out, [7] * len(out.req_ids), 0.0)
    assert req.finish_reason == "handoff"
    return req


def test_borrowing_scheduler_is_its_role_at_home_and_mixes_in_the_mixed_pool():
    s = make_borrowing_scheduler("decode", _cfg("decode"))
    assert isinstance(s, BorrowingScheduler) and s.name == "decode_only" and s.pool == "decode" and s.is_idle
    Instance("decode0", "decode", s)                               # the role check of both backends holds
    with pytest.raises(RuntimeError, match="decode-pool machine"):
        s.add_request(_req("x", 10))
    a = _handed_off("a", 20, max_tokens=4)
    assert s.add_handoff(a, 0.0)
    s.mark_kv_arrived("a")
    out = s.schedule(0.0)
    assert out.kv_handoff_req_ids == ["a"] and (out.num_prefill_tokens, out.num_decode_tokens) == (0, 1)
    s.update(out, [3], 0.1)
    s.pool = "mixed"                                               # borrowed (BorrowingPool._move) while busy
    with pytest.raises(RuntimeError, match="keep_local.*'prefill' pool: only a mixed-pool machine"):
        make_borrowing_scheduler("prefill", _cfg("prefill")).keep_local("a", 0.0)
    b = _req("b", 40, max_tokens=3)
    assert s.add_request(b)
    out = s.schedule(0.2)                                          # a mixed batch: a's decode + b's whole prompt
    assert out.req_ids == ["a", "b"] and (out.num_decode_tokens, out.num_prefill_tokens) == (1, 40)
    finished = s.update(out, [4, 9], 0.3)
    assert finished == [b] and b.finish_reason == "handoff" and s.num_held == 1 and a.status.name == "RUNNING"
    assert not s.is_idle
    used = s.block_manager.num_used_pages
    assert s.keep_local("b", 0.3) is b                             # its token machine is this one: no transfer
    assert s.num_held == 0 and s.block_manager.num_used_pages == used and b.finish_reason is None
    out = s.schedule(0.4)
    assert out.req_ids == ["a", "b"] and out.num_decode_tokens == 2 and out.num_computed_tokens[1] == 40
    s.update(out, [5, 5], 0.4)
    now = 0.5
    while s.has_unfinished():
        out = s.schedule(now)
        s.update(out, [5] * len(out.req_ids), now)
        now += 0.1
    assert a.finish_reason == b.finish_reason == "length"
    assert len(a.output_token_ids) == 4 and len(b.output_token_ids) == 3
    assert s.is_idle and s.block_manager.num_free_pages == s.config.num_pages


# --------------------------------------------------------------------------------------------------- routing
class _Inst:
    def __init__(self, name, role, sched):
        self.name, self.role, self.scheduler = name, role, sched


def _machines(num_prefill=1, num_decode=1, **decode_group):
    p = [_Inst(f"prefill{i}", "prefill", make_borrowing_scheduler("prefill", _cfg("prefill")))
         for i in range(num_prefill)]
    d = [_Inst(f"decode{i}", "decode", make_borrowing_scheduler("decode", _cfg("decode", **decode_group)))
         for i in range(num_decode)]
    return p, d


def test_overloaded_prompt_pool_borrows_a_token_machine_then_runs_a_request_whole():
    (p,), (d,) = _machines()
    pool = BorrowingPool("least_loaded", [p], [d], prefill_queue_tokens=100)
    p.scheduler.add_request(_req("a", 60))
    assert pool.pick_prefill(_req("b", 40), 0.1) is p               # 60 + 40 = 100: not above
    assert pool.moves == []
    b = _req("b", 41)
    assert pool.pick_prefill(b, 0.2) is d                           # 60 + 41 > 100: decode0 is borrowed
    assert (d.scheduler.pool, p.scheduler.pool) == ("mixed", "prefill")
    d.scheduler.add_request(b)
    c = _req("c", 50)
    assert pool.pick_prefill(c, 0.3) is d                           # the mixed pool's 41 + 50 fits
    d.scheduler.add_request(c)
    # Both overloaded (60 + 50, 91 + 50) and no token machine left to borrow: the machine with the fewest pending
    # tokens (prefill0: 60 + 1 live) moves into the mixed pool and runs the request whole.
    e = _req("e", 50)
    assert pool.pick_prefill(e, 0.4) is p and p.scheduler.pool == "mixed"
    p.scheduler.add_request(e)
    assert pool.pick_decode(_handed_off("e", 50), 0.5, src=p) is p   # kept on its prompt machine
    assert pool.num_kept == 1
    for rid in ("b", "c"):
        d.scheduler.abort(rid, 0.6)
    assert pool.return_idle(0.7) == [d] and d.scheduler.pool == "decode" and p.scheduler.pool == "mixed"
    assert [(m.time, m.instance, m.src, m.dst, m.reason) for m in pool.moves] == [
        (0.2, "decode0", "decode", "mixed", "prefill"), (0.4, "prefill0", "prefill", "mixed", "whole"),
        (0.7, "decode0", "mixed", "decode", "idle")]
    assert pool.summary(end=1.0)["mixed_s"] == {"prefill0": pytest.approx(0.6), "decode0": pytest.approx(0.5)}


def test_overloaded_token_pool_borrows_a_prompt_machine_and_keeps_kv_where_it_is():
    # decode0 at 0.25 of its 16 sequence slots is full for a threshold of 0.25.
    p, (d,) = _machines(num_prefill=2)
    pool = BorrowingPool("least_loaded", p, [d], decode_load=0.25)
    for i in range(4):
        req = _handed_off(f"r{i}", 40)
        assert pool.pick_decode(req, 0.0, src=p[0]) is d
        d.scheduler.add_handoff(req, 0.0)
    p[0].scheduler.add_request(_req("busy", 200))                   # prefill0 holds pages: prefill1 is lighter
    p[0].scheduler.update(p[0].scheduler.schedule(0.0), [-1], 0.0)
    req = _handed_off("r4", 40)
    assert pool.pick_decode(req, 0.1, src=p[0]) is p[1]             # (4 + 1) / 16 > 0.25: borrow prefill1
    assert pool.moves[-1].instance == "prefill1" and pool.moves[-1].reason == "decode"
    assert p[1].scheduler.add_handoff(req, 0.1)                     # a prompt machine takes tokens in the mixed pool
    with pytest.raises(RuntimeError, match="prefill-pool machine"):
        p[0].scheduler.add_handoff(_handed_off("r5", 40), 0.1)
    # A request that prefill1 itself prefilled (now in the mixed pool) goes nowhere: the lightest mixed machine is
    # its own, whose pages already hold it.
    s = p[1].scheduler
    own = _req("own", 30)
    s.add_request(own)
    while not own.output_token_ids:
        out = s.schedule(0.2)
        s.update(out, [8] * len(out.req_ids), 0.2)
    assert own.finish_reason == "handoff" and s.num_held == 1
    assert pool.pick_decode(own, 0.3, src=p[1]) is p[1]
    s.keep_local("own", 0.3)
    assert s.num_held == 0 and own in s.running


# --------------------------------------------------------------------------------------------------- simulator
def step_time(out) -> float:
    return TICK * (3 + out.total_tokens // 8)


def transfer_time(src, dst, num_tokens):
    return TICK * (1 + 2 * -(-num_tokens // 16))


def _sim(reqs, q=8192, load=1.0, num_prefill=1, num_decode=1, mode="borrow", router="least_loaded"):
    make = make_borrowing_scheduler if mode == "borrow" else make_role_scheduler
    p = [DisaggSimInstance(f"prefill{i}", "prefill", make("prefill", _cfg("prefill")), step_time)
         for i in range(num_prefill)]
    d = [DisaggSimInstance(f"decode{i}", "decode", make("decode", _cfg("decode")), step_time)
         for i in range(num_decode)]
    log = []

    def on_schedule(inst, out, now):
        for x in p + d:
            x.scheduler.check_invariants()
        log.append((inst.name, getattr(inst.scheduler, "pool", inst.role), now, out.num_prefill_tokens,
                    out.num_decode_tokens))
    result = simulate_disaggregated(reqs, p, d, transfer_time, router=router, mixed_prefill_queue_tokens=q,
                                    mixed_decode_load=load, mixed_pool=mode, on_schedule=on_schedule)
    return result, p + d, log


def _burst(n=12, prompt=100, out=20, gap=TICK):
    return [_req(f"r{i:02d}", prompt, out, i * gap) for i in range(n)]


def _check_served(result, machines, reqs):
    assert {r.request_id: r.num_output_tokens for r in result.requests} == {r.request_id: r.max_tokens for r in reqs}
    assert all(r.completed and r.finish_reason == "length" for r in result.requests)
    for m in machines:                              # no page leaks, every machine back in its own pool
        s = m.scheduler
        assert s.num_held == 0 and not s.has_unfinished() and s.block_manager.num_free_pages == s.config.num_pages
        assert s.pool == s.home


@pytest.mark.parametrize("num_prefill,num_decode,router", [(1, 1, "least_loaded"), (2, 2, "round_robin"),
                                                           (2, 1, "least_loaded")])
def test_sim_without_overload_borrowing_is_the_plain_deployment(num_prefill, num_decode, router):
    reqs = _burst(16, gap=4 * TICK)
    plain, _, plain_log = _sim(_burst(16, gap=4 * TICK), num_prefill=num_prefill, num_decode=num_decode,
                               mode="dedicated", router=router)
    borrow, machines, log = _sim(reqs, q=100_000, load=1.0, num_prefill=num_prefill, num_decode=num_decode,
                                 router=router)
    _check_served(borrow, machines, reqs)
    assert borrow.mixed_pool["moves"] == [] and borrow.mixed_pool["num_kept_local"] == 0
    assert plain.mixed_pool is None
    assert borrow.requests == plain.requests and borrow.iterations == plain.iterations
    assert borrow.transfers == plain.transfers
    assert [x[:1] + x[2:] for x in log] == [x[:1] + x[2:] for x in plain_log]


def _stints(result, name):
    end = max(it.end_time for it in result.iterations)
    return pool_intervals(result.mixed_pool["moves"], name, end)


@pytest.mark.parametrize("num_prefill,num_decode,q,load,first_move", [
    (2, 1, 300, 1.0, ("decode0", "decode", "mixed", "prefill")),    # the overloaded prompt pool borrows decode0
    (2, 1, 300, 0.3, ("decode0", "decode", "mixed", "prefill")),
    (2, 1, 1000, 0.2, ("prefill1", "prefill", "mixed", "decode")),  # the full token pool borrows an idle prompt machine
    (1, 2, 300, 1.0, ("decode0", "decode", "mixed", "prefill"))])   # decode0's prompts hand their KV to decode1
def test_sim_borrowing_stays_within_p_plus_t_machines_and_returns_when_idle(num_prefill, num_decode, q, load,
                                                                           first_move):
    # 16 at once; with 2 token machines, 4 at once (the 4th overloads prefill0: decode0 prefills it and hands its
    # KV to decode1, so it is idle only once that landed) and then 8 spaced out.
    reqs = _burst(16) if num_decode == 1 else _burst(4, gap=0.0) + [
        _req(f"s{i}", 100, 20, 0.5 + i * 0.25) for i in range(8)]
    result, machines, log = _sim(reqs, q=q, load=load, num_prefill=num_prefill, num_decode=num_decode)
    _check_served(result, machines, reqs)
    names = {m.name for m in machines}
    assert len(names) == num_prefill + num_decode                          # P + T machines, no more
    assert {it.instance for it in result.iterations} <= names
    assert {t.src for t in result.transfers} | {t.dst for t in result.transfers} <= names
    mp = result.mixed_pool
    assert mp["machines"] == {"prefill": [f"prefill{i}" for i in range(num_prefill)],
                              "decode": [f"decode{i}" for i in range(num_decode)]}
    # Each request's KV moved once or stayed on its prompt machine.
    assert len(result.transfers) + mp["num_kept_local"] == len(reqs)
    assert len({t.request_id for t in result.transfers}) == len(result.transfers)
    assert tuple(mp["moves"][0][1:]) == first_move
    mixed_batch = False
    for name, pool, now, n_prefill, n_decode in log:
        # The log's pool at every step is the move log's pool at that time; at home a machine runs its phase only.
        (here,) = [p for a, b, p in _stints(result, name) if a <= now < b] or [machines_home(name)]
        assert pool == here, (name, now)
        if pool == "prefill":
            assert n_decode == 0
        elif pool == "decode":
            assert n_prefill == 0
        else:
            mixed_batch = mixed_batch or (n_prefill > 0 and n_decode > 0)
    if num_decode == 1:       # the mixed pool ran prompts and tokens in one batch (decode0 took both)
        assert mixed_batch
    for m in machines:
        stints = _stints(result, m.name)
        for (a, b, pool), nxt in zip(stints, stints[1:] + [None]):
            if pool != "mixed" or nxt is None:
                continue
            # It came home at the first moment it held nothing: its last step in the stint, or the landing of the
            # last KV it sent (its pages were held until then); none of its steps spans the move.
            work = [it.end_time for it in result.iterations if it.instance == m.name and it.start_time < b]
            work += [t.end_time for t in result.transfers if t.src == m.name and t.ready_time <= b]
            assert b == max(work), (m.name, a, b)
            assert not any(it.start_time < b < it.end_time for it in result.iterations if it.instance == m.name)
        if stints:
            assert stints[-1][2] == m.scheduler.home


def machines_home(name):
    return "prefill" if name.startswith("prefill") else "decode"


def test_sim_prompt_machines_take_tokens_when_the_token_pool_is_full():
    reqs = _burst(16)
    result, machines, _ = _sim(reqs, q=100_000, load=0.2, num_prefill=2, num_decode=1)
    _check_served(result, machines, reqs)
    reasons = {(m[1], m[4]) for m in result.mixed_pool["moves"]}
    assert ("prefill0", "decode") in reasons or ("prefill1", "decode") in reasons
    assert not any(name == "decode0" and why == "prefill" for name, why in reasons)
    # KV between two prompt machines (one borrowed for tokens), or kept where it was prefilled.
    assert any(t.dst.startswith("prefill") for t in result.transfers) or result.mixed_pool["num_kept_local"] > 0


def test_sim_borrowing_is_deterministic():
    runs = [_sim(_burst(16), q=300, load=0.3, num_prefill=2)[0] for _ in range(2)]
    assert runs[0].mixed_pool == runs[1].mixed_pool and runs[0].mixed_pool["moves"]
    assert [r.token_times for r in runs[0].requests] == [r.token_times for r in runs[1].requests]


def test_sim_refuses_mixed_instances_with_borrowing():
    from pdjax.scheduler.mixed import MixedScheduler
    p = [DisaggSimInstance("prefill0", "prefill", make_borrowing_scheduler("prefill", _cfg("prefill")), step_time)]
    d = [DisaggSimInstance("decode0", "decode", make_borrowing_scheduler("decode", _cfg("decode")), step_time)]
    m = [DisaggSimInstance("mixed0", "mixed", MixedScheduler(_cfg("mixed")), step_time)]
    with pytest.raises(ValueError, match="mixed_pool='borrow' with mixed instances \\['mixed0'\\]"):
        simulate_disaggregated(_burst(2), p, d, transfer_time, mixed=m, mixed_pool="borrow")
    plain = [DisaggSimInstance("prefill0", "prefill", make_role_scheduler("prefill", _cfg("prefill")), step_time)]
    with pytest.raises(ValueError, match="needs a BorrowingScheduler"):
        simulate_disaggregated(_burst(2), plain, d, transfer_time, mixed_pool="borrow")


# --------------------------------------------------------------------------------------------------- splitwise
def _splitwise(arg, n):
    from pdjax.config.files import config_file
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.experiment.run import to_plain_dict
    from pdjax.sim.run import engine_info, simulate_config
    config = to_plain_dict(config_file(str(ROOT / "README.md"), "configs/sim/splitwise.py", arg))
    config["workload"]["num_requests"] = n
    cfg = serve_config_from_dict(config)
    result, setup = simulate_config(cfg)
    return cfg, result, engine_info(result, setup, cfg)


@pytest.mark.parametrize("arg", ["aa-code", "hh-conv"])
def test_splitwise_preset_borrows_within_three_machines(arg, shared_data):
    cfg, result, info = _splitwise(arg, 150)
    assert cfg.deployment.mixed_pool == "borrow" and cfg.deployment.roles == ("prefill", "decode")
    assert set(info["instances"]) == {"prefill0", "prefill1", "decode0"}
    assert {it.instance for it in result.iterations} <= set(info["instances"])
    assert all(r.completed for r in result.requests) and len(result.requests) == 150
    mp = info["mixed_pool"]
    assert mp["mode"] == "borrow" and mp["prefill_queue_tokens"] == 8192 and mp["decode_load"] == 1.0
    assert len(result.transfers) + mp["num_kept_local"] == 150
    for counts in mp["move_counts"].values():         # every borrowed machine came back
        assert counts["borrowed"] == counts["returned"]


def test_splitwise_dedicated_and_off_variants(shared_data):
    from pdjax.config.files import config_file
    dedicated = config_file(str(ROOT / "README.md"), "configs/sim/splitwise.py", "aa-code-dedicated")
    off = config_file(str(ROOT / "README.md"), "configs/sim/splitwise.py", "aa-code-off")
    assert (dedicated.deployment.mixed_pool, dedicated.deployment.mixed.num_instances) == ("dedicated", 1)
    assert (off.deployment.mixed_pool, off.deployment.mixed.num_instances) == ("dedicated", 0)
    # hh-conv's first 150 requests never overload a pool: borrowing is exactly the plain 2 + 1 machines.
    _, borrow, info = _splitwise("hh-conv", 150)
    _, plain, _ = _splitwise("hh-conv-off", 150)
    assert info["mixed_pool"]["moves"] == []
    assert borrow.requests == plain.requests and borrow.iterations == plain.iterations
