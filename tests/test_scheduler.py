"""Scheduler library: config validation, request lifecycle, rejection/abort, prefix caching,
disaggregation protocol, and the no-JAX layering rule."""
import enum
import random
import subprocess
import sys

import pytest

from pdjax.config import SamplingParams, SchedulerConfig
from pdjax.scheduler import Request, RequestStatus, make_scheduler
from pdjax.scheduler.fake_runner import drive, fake_sample, fake_token


def req(rid, n_prompt, max_tokens=4, t=0.0, base=1, **kw):
    return Request(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens, **kw), t)


def step(s, now=0.0):
    out = s.schedule(now)
    return out, s.update(out, fake_sample(out), now)


# ---------------------------------------------------------------- config validation
@pytest.mark.parametrize("kw, match", [
    (dict(policy="nope"), "policy='nope'"),
    (dict(token_budget=0), "token_budget=0"),
    (dict(max_num_seqs=-1), "max_num_seqs=-1"),
    (dict(page_size=0), "page_size=0"),
    (dict(num_pages=-1), "num_pages=-1"),
    (dict(max_model_len=1.5), "max_model_len=1.5"),
    (dict(policy="orca", token_budget=512, max_model_len=1024), "token_budget=512 < max_model_len=1024"),
    (dict(policy="sarathi", enable_chunking=False, token_budget=512, max_model_len=1024), "enable_chunking=False"),
    (dict(policy="sarathi", token_budget=64, max_num_seqs=128), "token_budget=64 < max_num_seqs=128"),
    (dict(num_pages=100, max_model_len=2048, page_size=16), "cannot hold one max-length request"),
    (dict(preemption_mode="swap"), "num_host_pages >= 1"),
    (dict(preemption_mode="drop"), "preemption_mode='drop'"),
    (dict(ordering="lifo"), "ordering='lifo'"),
    (dict(watermark=1.0), "watermark=1.0"),
    (dict(watermark=True), "watermark=True"),
    (dict(scheduler_reserve_full_isl=1), "scheduler_reserve_full_isl=1, expected a bool"),
    (dict(policy="sarathi", scheduler_reserve_full_isl=False), "read by policy 'vllm_v1' only"),
    (dict(tile_size=4096), "tile_size=4096"),
    (dict(policy="sarathi", max_num_partial_prefills=2), "enforced by policy 'vllm_v1' only"),
    (dict(policy="vllm_v1", max_long_partial_prefills=1), "needs long_prefill_token_threshold"),
    (dict(policy="vllm_v1", long_prefill_token_threshold=64, max_num_partial_prefills=1,
          max_long_partial_prefills=2), "max_long_partial_prefills=2 > max_num_partial_prefills=1"),
    (dict(min_prefill_tokens=2048), "min_prefill_tokens=2048"),
    (dict(policy="vllm_v0", decode_batches=2, token_budget=2048), "decode_batches=2 is read by the Sarathi-based"),
    (dict(policy="orca", token_budget=4096, tile_size=64), "tile_size=64 needs chunking"),
    (dict(dynamic_chunking=True, tile_size=128, dynamic_chunk_min_tokens=64), "dynamic_chunk_min_tokens=64"),
])
def test_bad_config_raises_naming_the_value(kw, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        SchedulerConfig(**kw)


def test_num_pages_zero_is_for_the_engine_to_resolve():
    """scheduler.num_pages = 0 is valid config (the real engine sizes the cache from device memory) but no scheduler
    runs on it: the engine resolves it first, and a scheduler given 0 pages refuses."""
    config = SchedulerConfig(num_pages=0)
    with pytest.raises(ValueError, match="num_pages=0"):
        make_scheduler(config)


def test_valid_configs_for_every_policy():
    for policy in ("vllm_v0", "orca", "decode_first"):
        assert not SchedulerConfig(policy=policy, token_budget=2048).chunking
    for policy in ("sarathi", "chunked_only", "chunked_prefill_first", "vllm_v1", "prefill_only", "decode_only"):
        cfg = SchedulerConfig(policy=policy, token_budget=256)
        assert cfg.chunking and make_scheduler(cfg).name == policy


def test_request_status_is_an_int_enum_printed_by_name():
    assert issubclass(RequestStatus, enum.IntEnum)
    r = req("a", 4, max_tokens=1)
    assert r.status is RequestStatus.WAITING and f"{r.status}" == "waiting" and "status=waiting" in repr(r)
    finished = [st for st in RequestStatus if st >= RequestStatus.FINISHED]
    assert finished == [RequestStatus.FINISHED, RequestStatus.REJECTED]
    for st in RequestStatus:
        r.status = st
        assert r.is_finished == (st in finished)


# ---------------------------------------------------------------- lifecycle, rejection, abort
def test_lifecycle_timestamps_and_finish_reasons():
    s = make_scheduler(SchedulerConfig(policy="sarathi", token_budget=8, max_num_seqs=4, max_model_len=64,
                                       page_size=4, num_pages=64))
    a = req("a", 10, max_tokens=3, t=0.5)
    assert s.add_request(a) and a.status == RequestStatus.WAITING and s.num_waiting == 1
    out, fin = step(s, 1.0)
    assert out.num_new_tokens == [8] and out.do_sample == [False] and not fin
    assert a.status == RequestStatus.RUNNING and a.num_computed_tokens == 8 and a.first_scheduled_time == 1.0
    out, _ = step(s, 2.0)
    assert a.first_token_time == 2.0 and a.num_output_tokens == 1 and a.num_computed_tokens == 10
    assert out.req_ids == ["a"] and a.first_scheduled_time == 1.0
    step(s, 3.0)
    out, fin = step(s, 4.0)
    assert fin == [a] and a.finish_reason == "length" and a.finish_time == 4.0 and out.req_ids == ["a"]
    assert a.token_times == [2.0, 3.0, 4.0] and a.sched_step == out.step
    assert a.all_token_ids == a.prompt_token_ids + a.output_token_ids
    assert not s.has_unfinished() and s.finished == [a]
    # stop token
    stop = fake_token("b", 5)
    b = req("b", 5, max_tokens=10, stop_token_ids=(stop,))
    s.add_request(b)
    _, fin = step(s)
    assert fin == [b] and b.finish_reason == "stop" and b.output_token_ids == [stop]
    # max_model_len caps the output
    c = req("c", 62, max_tokens=100)
    s.add_request(c)
    while s.has_unfinished():
        step(s)
    assert c.finish_reason == "length" and c.num_tokens == 64


def test_bad_requests_are_rejected_with_a_reason_and_others_go_on():
    s = make_scheduler(SchedulerConfig(policy="orca", token_budget=64, max_model_len=64, num_pages=64))
    good = req("good", 5)
    bad = [Request("empty", [], SamplingParams(), 0.0), req("long", 65), Request("neg", [1, -2], SamplingParams(), 0.0)]
    assert s.add_request(good)
    for r in bad:
        assert not s.add_request(r)
        assert r.status == RequestStatus.REJECTED and r.finish_reason == "rejected" and r.reject_reason
    dup = req("good", 3)
    assert not s.add_request(dup) and "duplicate" in dup.reject_reason
    assert "empty" in bad[0].reject_reason and "max_model_len=64" in bad[1].reject_reason
    while s.has_unfinished():
        step(s)
    assert good.finish_reason == "length" and len(s.finished) == 5


def test_abort_anywhere_frees_everything():
    cfg = SchedulerConfig(policy="sarathi", token_budget=16, max_num_seqs=8, max_model_len=64, page_size=4,
                          num_pages=20, watermark=0.0, preemption_mode="swap", num_host_pages=32)
    s = make_scheduler(cfg)
    rs = [req(f"r{i}", 12, max_tokens=30, t=i * 0.01) for i in range(5)]
    for r in rs:
        s.add_request(r)
    seen = set()
    for _ in range(40):
        out = s.schedule(0.0)
        seen |= {r.status for r in rs}
        if RequestStatus.SWAPPED in seen and any(r.status == RequestStatus.RUNNING for r in rs):
            break
        s.update(out, fake_sample(out), 0.0)
    assert RequestStatus.SWAPPED in seen
    # abort between schedule() and update(): update skips it
    running = next(r for r in rs if r.status == RequestStatus.RUNNING and r.request_id in out.req_ids)
    assert s.abort(running.request_id, 1.0) is running
    s.update(out, fake_sample(out), 1.0)
    assert running.finish_reason == "aborted" and running.finish_time == 1.0
    s.check_invariants()
    for r in rs:
        if not r.is_finished:
            s.abort(r.request_id, 2.0)
            s.check_invariants()
    assert s.abort("unknown", 3.0) is None
    assert not s.has_unfinished() and all(r.finish_reason == "aborted" for r in rs)
    assert s.block_manager.num_free_pages == 20 and s.block_manager.num_free_host_pages == 32


# ---------------------------------------------------------------- prefix caching
def cache_cfg(**kw):
    base = dict(policy="sarathi", token_budget=20, max_num_seqs=4, max_model_len=256, page_size=8, num_pages=64,
                enable_prefix_caching=True)
    base.update(kw)
    return SchedulerConfig(**base)


def test_second_request_computes_only_the_uncached_suffix():
    s = make_scheduler(cache_cfg(token_budget=256))
    shared = list(range(1, 101))
    a = Request("a", shared, SamplingParams(max_tokens=2), 0.0)
    s.add_request(a)
    while s.has_unfinished():
        step(s)
    b = Request("b", shared[:70] + [500, 501, 502], SamplingParams(max_tokens=2), 0.0)
    s.add_request(b)
    out, _ = step(s)
    assert out.num_computed_tokens == [64] and out.num_new_tokens == [73 - 64]   # 8 full pages cached
    assert b.num_cached_tokens == 64 and out.token_ids[0] == b.prompt_token_ids[64:]
    while s.has_unfinished():
        step(s)
    # a fully cached prompt still computes its last token (to sample from it)
    c = Request("c", shared[:96], SamplingParams(max_tokens=1), 0.0)
    s.add_request(c)
    out, _ = step(s)
    assert out.num_computed_tokens == [88] and out.num_new_tokens == [8]
    while s.has_unfinished():
        step(s)
    s.check_invariants()
    assert s.block_manager.num_free_pages == 64


def test_partially_computed_pages_are_not_shared():
    s = make_scheduler(cache_cfg())
    shared = list(range(1, 65))
    s.add_request(Request("a", shared, SamplingParams(max_tokens=3), 0.0))
    step(s)                                   # a: 20 tokens computed (2 full pages, 1 half page)
    s.add_request(Request("b", shared, SamplingParams(max_tokens=3), 0.0))
    for _ in range(2):                        # a's chunks take the whole budget: b waits
        out, _ = step(s)
        assert out.req_ids == ["a"]
    out = s.schedule(0.0)                     # a: 60 computed, 7 full pages; its 8th page is half written
    assert out.req_ids == ["a", "b"]
    assert out.num_computed_tokens == [60, 56] and out.num_new_tokens == [4, 8]
    a_pages, b_pages = out.page_tables
    assert b_pages[:7] == a_pages[:7] and b_pages[7] != a_pages[7]
    s.check_invariants()


@pytest.mark.parametrize("policy", ["sarathi", "vllm_v1", "orca"])
def test_disabling_the_cache_changes_no_token(policy):
    def run(caching):
        chunk = policy != "orca"
        cfg = SchedulerConfig(policy=policy, token_budget=32 if chunk else 128, max_num_seqs=4, max_model_len=128,
                              page_size=4, num_pages=48, watermark=0.0, enable_prefix_caching=caching)
        rng = random.Random(3)
        prefix = [rng.randrange(20) for _ in range(64)]
        reqs = [(i * 0.02, Request(f"r{i}", prefix[:rng.randint(30, 64)] + [rng.randrange(20) for _ in range(8)],
                                   SamplingParams(max_tokens=12), i * 0.02)) for i in range(10)]
        fed = {}

        def record(out, now):
            for rid, c, toks in zip(out.req_ids, out.num_computed_tokens, out.token_ids):
                for j, t in enumerate(toks):
                    fed.setdefault(rid, {})[c + j] = t
        s = make_scheduler(cfg)
        drive(s, reqs, on_step=record)
        return {r.request_id: r.output_token_ids for _, r in reqs}, fed, s
    out_on, fed_on, s_on = run(True)
    out_off, fed_off, _ = run(False)
    assert out_on == out_off
    assert s_on.block_manager.num_cache_hit_pages > 0
    for rid, pos_tok in fed_on.items():
        for p, t in pos_tok.items():
            assert fed_off[rid][p] == t       # same token at the same position, only fewer of them


# ---------------------------------------------------------------- disaggregation
def test_prefill_decode_handoff_protocol_with_backpressure():
    pcfg = SchedulerConfig(policy="prefill_only", token_budget=32, max_num_seqs=8, max_model_len=64, page_size=4,
                           num_pages=64)
    dcfg = SchedulerConfig(policy="decode_only", token_budget=8, max_num_seqs=2, max_model_len=64, page_size=4,
                           num_pages=32, watermark=0.0)
    P, D = make_scheduler(pcfg), make_scheduler(dcfg)
    reqs = [req(f"h{i}", 10 + i, max_tokens=6) for i in range(4)] + [req("one", 5, max_tokens=1)]
    for r in reqs:
        P.add_request(r)
    handed = []
    while P.has_unfinished():
        out, fin = step(P)
        assert out.num_decode_tokens == 0
        handed += [r for r in fin if r.finish_reason == "handoff"]
    assert reqs[-1].finish_reason == "length" and reqs[-1] not in handed    # first token ended it: no handoff
    assert [r.request_id for r in handed] == ["h0", "h1", "h2", "h3"]
    held = sum(len(P.held_page_table(r.request_id)) for r in handed)
    assert P.num_held == 4 and P.block_manager.num_free_pages == 64 - held
    P.check_invariants()
    with pytest.raises(TypeError):
        D.add_request(req("x", 3))
    for r in handed:
        assert r.num_output_tokens == 1 and r.num_computed_tokens == r.num_prompt_tokens
        assert D.add_handoff(r, 0.0) and r.status == RequestStatus.WAITING_FOR_KV and r.finish_reason is None
    assert D.schedule(0.0).is_empty                      # no KV has arrived yet
    for r in handed:
        D.mark_kv_arrived(r.request_id)
        P.release(r.request_id)
    assert P.num_held == 0 and P.block_manager.num_free_pages == 64
    with pytest.raises(KeyError):
        D.mark_kv_arrived("h0")
    out = D.schedule(0.0)
    assert out.req_ids == ["h0", "h1"] and out.kv_handoff_req_ids == ["h0", "h1"]   # max_num_seqs=2: backpressure
    assert out.is_prefill == [False, False] and out.num_computed_tokens == [10, 11]
    assert [list(t) for t in out.token_ids] == [[handed[0].output_token_ids[0]], [handed[1].output_token_ids[0]]]
    D.update(out, fake_sample(out), 0.0)
    while D.has_unfinished():
        out, _ = step(D)
        assert out.num_prefill_tokens == 0
    D.check_invariants()
    for r in handed:
        assert r.finish_reason == "length" and r.num_output_tokens == 6
        assert r.output_token_ids == [fake_token(r.request_id, r.num_prompt_tokens + j) for j in range(6)]
    assert D.block_manager.num_free_pages == 32


def test_decode_only_rejects_what_it_cannot_take():
    D = make_scheduler(SchedulerConfig(policy="decode_only", token_budget=8, max_num_seqs=2, max_model_len=16,
                                       page_size=4, num_pages=8))
    fresh = req("fresh", 4)
    assert not D.add_handoff(fresh, 0.0) and "not a handed-off request" in fresh.reject_reason
    P = make_scheduler(SchedulerConfig(policy="prefill_only", token_budget=64, max_num_seqs=2, max_model_len=64,
                                       page_size=4, num_pages=32))
    big = req("big", 20, max_tokens=4)
    P.add_request(big)
    step(P)
    assert big.finish_reason == "handoff"
    assert not D.add_handoff(big, 0.0) and "max_model_len=16" in big.reject_reason
    P.abort("big", 0.0)                               # the transfer is off: drop the held pages
    assert P.block_manager.num_free_pages == 32


# ---------------------------------------------------------------- layering
def test_scheduler_and_config_import_no_jax():
    code = ("import sys, pdjax.config, pdjax.scheduler, pdjax.scheduler.fake_runner; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')); "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# ---------------------------------------------------------------- async scheduling (update_async / resolve_async)
def _serve_fake(async_, abort_at=None):
    """Serve five requests, one step per time unit (step i scheduled at i, ending at i + 1). Async: the step is
    updated with placeholders half a unit before its end and resolved at its end, as the engine's async loop."""
    s = make_scheduler(SchedulerConfig(policy="sarathi", token_budget=16, max_num_seqs=8, num_pages=64,
                                       page_size=4, max_model_len=64))
    reqs = [req(f"r{i}", 5 + 3 * i, max_tokens=3 + i) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    prev, i = None, 0
    while prev is not None or s.has_unfinished():
        if prev is not None:
            if async_:
                pending = s.update_async(prev, i - 0.5)
                assert all(r.output_token_ids[k] == 0 for _, r, k, _ in pending.slots)   # placeholders
                s.resolve_async(pending, fake_sample(prev), i)
            else:
                s.update(prev, fake_sample(prev), i)
        prev = s.schedule(i) if s.has_unfinished() else None
        if prev is not None and abort_at == i:
            s.abort("r1", i)    # in flight: update skips it, resolve must not touch it
        prev = prev if prev is not None and not prev.is_empty else None
        i += 1
    s.check_invariants()
    return [(r.request_id, r.output_token_ids, r.all_token_ids, r.token_times, r.first_token_time, r.finish_time,
             r.finish_reason) for r in reqs]


def test_async_update_then_resolve_equals_the_sync_update():
    sync, async_ = _serve_fake(False), _serve_fake(True)
    assert sync == async_
    assert all(reason == "length" for *_, reason in sync)


def test_resolve_leaves_a_request_aborted_in_flight_alone():
    sync, async_ = _serve_fake(False, abort_at=3), _serve_fake(True, abort_at=3)
    assert sync == async_
    aborted = dict((r[0], r) for r in async_)["r1"]
    assert aborted[-1] == "aborted" and len(aborted[1]) == len(aborted[3])
