"""The engines' online hooks without a model (fake runners, the wall clock): requests submitted from another thread
join a running loop, an abort frees the request's pages at the loop's next admission point (colocated engine,
replicas, a disaggregated request whose KV is still moving), a front end's stop keeps exactly the tokens it
delivered, and closing the source ends the run with every request in its records."""
import threading
import time

import pytest

from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.scheduler import Request, make_scheduler
from pdjax.scheduler.fake_runner import fake_sample
from pdjax.serving.cluster import ClusterEngine, Instance
from pdjax.serving.engine import ColocatedEngine
from pdjax.serving.online import OnlineSource, SourceClosed

CFG = dict(token_budget=64, max_num_seqs=8, max_model_len=512, page_size=16, num_pages=128)


class FakeRunner:
    """Sleeps `step_s` per step (so a long request stays live for a while), samples fake tokens."""
    kv_stages = kv_stage_meshes = ()

    def __init__(self, step_s=0.002):
        self.step_s = step_s
        self.batches = []

    def dispatch(self, out, prev=None):
        self.batches.append(list(out.req_ids))
        time.sleep(self.step_s)
        return fake_sample(out, vocab_size=97)

    def collect(self, handle):
        return handle


def _req(rid, max_tokens, prompt_len=20):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), 0.0)


def _serve(engine, source):
    box = {}
    thread = threading.Thread(target=lambda: box.update(result=engine.run([], source=source)))
    thread.start()
    return thread, box


def _wait(cond, timeout=20.0):
    deadline = time.time() + timeout
    while not cond():
        if time.time() >= deadline:       # a hang guard, not a speed check
            pytest.fail("timed out")
        time.sleep(0.001)


def test_colocated_engine_serves_submissions_and_aborts_free_pages_at_once():
    tokens = {}
    engine = ColocatedEngine(FakeRunner(), make_scheduler(SchedulerConfig(policy="sarathi", **CFG)),
                             on_token=lambda rid, tok, t: tokens.setdefault(rid, []).append(tok))
    sched = engine.scheduler
    source = OnlineSource()
    thread, box = _serve(engine, source)
    long, short = _req("long", 400), _req("short", 5)
    source.submit(long)
    source.submit(short)
    _wait(lambda: len(tokens.get("long", ())) >= 3)
    source.abort("long")
    _wait(lambda: long.finish_reason is not None)
    assert long.finish_reason == "aborted" and long.page_table == []
    n_batches = len(engine.runner.batches)
    _wait(lambda: short.finish_reason is not None)
    source.submit(late := _req("late", 4))     # a request after the others finished wakes the idle loop
    _wait(lambda: late.finish_reason is not None)
    source.close()
    thread.join(10)
    assert not thread.is_alive()
    assert all("long" not in b for b in engine.runner.batches[n_batches:])   # never scheduled after the abort
    assert sched.block_manager.num_used_pages == 0 and not sched.has_unfinished()
    sched.check_invariants()
    records = {r.request_id: r for r in box["result"].requests}
    assert set(records) == {"long", "short", "late"}
    assert records["long"].finish_reason == "aborted" and records["long"].num_output_tokens < 400
    assert (records["short"].finish_reason, records["short"].num_output_tokens) == ("length", 5)
    assert box["result"].output_tokens["short"] == tokens["short"]
    try:
        source.submit(_req("after", 2))
        raise AssertionError("submit after close must fail")
    except SourceClosed:
        pass


def test_stop_keeps_the_delivered_tokens_and_records_a_stop():
    engine = ColocatedEngine(FakeRunner(), make_scheduler(SchedulerConfig(policy="sarathi", **CFG)))
    source = OnlineSource()
    thread, box = _serve(engine, source)
    req = _req("s", 300)
    source.submit(req)
    _wait(lambda: len(req.output_token_ids) >= 6)
    source.abort("s", keep_tokens=4, reason="stop")
    _wait(lambda: req.finish_reason is not None)
    source.close()
    thread.join(10)
    (rec,) = box["result"].requests
    assert (rec.finish_reason, rec.num_output_tokens, len(rec.token_times)) == ("stop", 4, 4)
    assert rec.finish_time == rec.token_times[-1]
    assert req.all_token_ids == req.prompt_token_ids + req.output_token_ids
    rec.validate()
    assert engine.scheduler.block_manager.num_used_pages == 0


def test_rejected_submission_is_reported_to_the_front_end():
    admitted = []
    engine = ColocatedEngine(FakeRunner(), make_scheduler(SchedulerConfig(policy="sarathi", **CFG)))
    source = OnlineSource(on_admit=lambda req, ok: admitted.append((req.request_id, ok)))
    thread, box = _serve(engine, source)
    source.submit(_req("too_long", 4, prompt_len=600))
    source.submit(_req("fine", 3))
    _wait(lambda: len(admitted) == 2)
    source.close()
    thread.join(10)
    assert admitted == [("too_long", False), ("fine", True)]
    reasons = {r.request_id: r.finish_reason for r in box["result"].requests}
    assert reasons == {"too_long": "rejected", "fine": "length"}


def test_replicas_abort_on_the_instance_holding_the_request():
    scheds = [make_scheduler(SchedulerConfig(policy="sarathi", **CFG)) for _ in range(2)]
    engine = ClusterEngine([Instance(f"replica{i}", "colocated", FakeRunner(), s) for i, s in enumerate(scheds)])
    source = OnlineSource()
    thread, box = _serve(engine, source)
    reqs = [_req(f"r{i}", 400) for i in range(4)]
    for r in reqs:
        source.submit(r)
    _wait(lambda: all(len(r.output_token_ids) >= 2 for r in reqs))
    for r in reqs:
        source.abort(r.request_id)
    _wait(lambda: all(r.finish_reason is not None for r in reqs))
    source.close()
    thread.join(10)
    assert [r.finish_reason for r in box["result"].requests] == ["aborted"] * 4
    assert [s.block_manager.num_used_pages for s in scheds] == [0, 0]


class _SlowStagedKV:
    """A KV transfer that lands only when the test says so."""
    num_tokens = num_pages = kv_bytes = moved_bytes = 0

    def __init__(self, landed):
        self.landed = landed

    def is_ready(self):
        return self.landed.is_set()

    def wait(self):
        self.landed.wait()


def test_disaggregated_abort_while_the_kv_moves_drops_the_transfer_and_frees_both_sides():
    landed = threading.Event()
    prefill = make_scheduler(SchedulerConfig(policy="prefill_only", **CFG))
    decode = make_scheduler(SchedulerConfig(policy="decode_only", **CFG))
    transfers = []

    def transfer(src_stages, pages, dst_meshes, *, num_tokens, wait=False):
        transfers.append(list(pages))
        return _SlowStagedKV(landed)

    engine = ClusterEngine([Instance("prefill0", "prefill", FakeRunner(), prefill),
                            Instance("decode0", "decode", FakeRunner(), decode)], transfer=transfer)
    source = OnlineSource()
    thread, box = _serve(engine, source)
    req = _req("d", 50)
    source.submit(req)
    _wait(lambda: transfers and prefill.num_held == 1)     # first token sampled, KV in flight, pages held
    assert prefill.block_manager.num_used_pages > 0
    source.abort("d")
    _wait(lambda: req.finish_reason == "aborted")
    landed.set()                                            # a landing after the abort changes nothing
    source.close()
    thread.join(10)
    assert not thread.is_alive()
    assert prefill.num_held == 0 and not engine._in_flight and not engine._staged
    assert prefill.block_manager.num_used_pages == 0 == decode.block_manager.num_used_pages
    assert not decode.has_unfinished()
    (rec,) = box["result"].requests
    assert rec.finish_reason == "aborted" and rec.num_output_tokens == 1



@pytest.mark.parametrize("cluster", [False, True])
def test_close_then_abort_of_the_last_live_requests_ends_the_run(cluster):
    """The API's drain deadline (EngineBridge.end_all) closes the source, then aborts every live request: when the
    loop takes those aborts at the admission point before it schedules, the scheduler is left empty with nothing
    to come, and the run must end there (it raised 'cannot make progress')."""
    source = OnlineSource()
    reqs = [_req(f"r{i}", 400) for i in range(3)]

    def on_token(rid, tok, t):       # on the engine thread, after a step: the next admission point takes these
        if rid == "r0" and len(reqs[0].output_token_ids) == 2:
            with source._cond:
                source._closed = True
                source._inbox.extend(("abort", r.request_id, (None, "aborted")) for r in reqs)

    scheds = [make_scheduler(SchedulerConfig(policy="sarathi", **CFG)) for _ in range(2 if cluster else 1)]
    if cluster:
        engine = ClusterEngine([Instance(f"replica{i}", "colocated", FakeRunner(), s)
                                for i, s in enumerate(scheds)], on_token=on_token)
    else:
        engine = ColocatedEngine(FakeRunner(), scheds[0], on_token=on_token)
    for r in reqs:
        source.submit(r)
    thread, box = _serve(engine, source)
    thread.join(20)
    assert not thread.is_alive() and "result" in box
    assert [r.finish_reason for r in box["result"].requests] == ["aborted"] * 3
    assert [s.block_manager.num_used_pages for s in scheds] == [0] * len(scheds)
