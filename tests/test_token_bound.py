"""The workload's prompt-id bound (WorkloadRequest.token_bound) that lets add_request skip scanning the prompt,
and the simulator's garbage-collector pause: both speed-ups only, so the bound must hold for every prompt the
generator makes and add_request's verdicts must be those of the full scan."""
import dataclasses
import gc

import pytest

from pdjax.config import SamplingParams, SchedulerConfig
from pdjax.scheduler import Request, make_scheduler
from pdjax.scheduler.request import request_from_workload
from pdjax.sim.simulator import gc_paused
from pdjax.workload import make_workload

BASE = dict(preset="chat", num_requests=20, fit_to_model=True, max_model_len=512, vocab_size=300)


@pytest.mark.parametrize("extra", [
    {}, {"vocab_size": 7}, {"allowed_token_ids": (3, 250, 17)}, {"prompt_source": "text", "vocab_size": 256},
    {"num_turns": 3, "shared_prefix_len": 5}, {"shared_prefix_len": 9, "allowed_token_ids": (1, 2)},
])
def test_the_bound_holds_for_every_generated_prompt(extra):
    reqs = make_workload({**BASE, **extra}, seed=5)
    for r in reqs:
        lo, hi = r.token_bound
        assert lo <= min(r.prompt_token_ids) and max(r.prompt_token_ids) <= hi, (r.request_id, r.token_bound)
    if "allowed_token_ids" in extra:
        assert reqs[0].token_bound == (min(extra["allowed_token_ids"]), max(extra["allowed_token_ids"]))


def test_a_request_made_or_replaced_by_hand_carries_no_bound():
    r = make_workload(BASE, seed=1)[0]
    assert dataclasses.replace(r, prompt_token_ids=[-1, 5]).token_bound is None
    assert request_from_workload(r).token_bound == r.token_bound
    assert Request("x", [1], SamplingParams(), 0.0).token_bound is None


@pytest.mark.parametrize("bound", [None, (0, 31999), (-8, 10), (0, 99), (0, 999), (0, 1999)])
def test_add_request_gives_the_full_scans_verdict_whatever_the_bound_allows(bound):
    """A bound that admits a bad id falls back to the scan: the same rejection, naming the exact id."""
    cases = {"neg": [4, -3, 9, -7], "big": [5, 1200, 3], "ok": [0, 5, 999]}
    expected = {"neg": "negative token id -7 in the prompt",
                "big": "token id 1200 in the prompt is outside the vocabulary [0, 1000)", "ok": None}
    s = make_scheduler(SchedulerConfig(policy="orca", token_budget=64, max_model_len=64, num_pages=64,
                                       vocab_size=1000))
    for rid, ids in cases.items():
        r = Request(rid, ids, SamplingParams(), 0.0)
        if bound is not None and bound[0] <= min(ids) and max(ids) <= bound[1]:    # only true bounds
            r.token_bound = bound
        assert s.add_request(r) == (expected[rid] is None)
        assert (r.reject_reason or None) == expected[rid]


def test_gc_paused_restores_the_collector():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError):
        with gc_paused():
            raise KeyError("x")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()        # left off as it was
    finally:
        gc.enable()


def test_gc_paused_promotes_the_run_objects_and_leaves_nothing_frozen():
    """On the way out the objects made meanwhile go to the oldest generation (no young-generation pass over them
    at the next allocation), nothing stays frozen, and a caller's own frozen objects stay frozen."""
    with gc_paused():
        made = [[i] for i in range(1000)]
    assert gc.get_freeze_count() == 0
    assert gc.get_count()[0] < 1000                 # the young generation does not hold them
    assert any(obj is made for obj in gc.get_objects(generation=2))
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gc_paused():
            more = [[i] for i in range(10)]
        assert gc.get_freeze_count() == frozen and more
    finally:
        gc.unfreeze()
