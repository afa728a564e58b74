"""A fake runner and a fake-time driver: exercise a scheduler without a model (tests, benchmarks, examples).

The fake runner "samples" a token that depends only on the request id and the position it is sampled at,
like a seeded sampler, so a request produces the same tokens whatever batches it ran in; this makes
scheduling changes (prefix caching on/off, preemption) checkable on their outputs.
The driver advances a fake clock by a simple linear step cost so that arrival-time behaviour (queueing,
stalls) is reproducible; it is not a calibrated cost model (that is pdjax/sim's job).
"""
from __future__ import annotations

import zlib
from typing import Callable, List, Optional, Sequence, Tuple

from pdjax.scheduler.base import Scheduler
from pdjax.scheduler.output import SchedulerOutput
from pdjax.scheduler.request import Request


def fake_token(request_id: str, position: int, vocab_size: int = 32000) -> int:
    """The token a request samples at `position` (the index it will have in all_token_ids)."""
    return (zlib.crc32(request_id.encode()) * 7919 + position * 104729) % vocab_size


def fake_sample(out: SchedulerOutput, vocab_size: int = 32000) -> List[int]:
    """One sampled token per scheduled request, -1 where do_sample is False."""
    return [fake_token(rid, c + n, vocab_size) if s else -1
            for rid, c, n, s in zip(out.req_ids, out.num_computed_tokens, out.num_new_tokens, out.do_sample)]


def linear_step_time(out: SchedulerOutput, fixed_s: float = 5e-3, per_token_s: float = 5e-5) -> float:
    """A toy iteration time: a fixed cost plus a cost per scheduled token (seconds)."""
    return fixed_s + per_token_s * out.total_tokens


def drive(sched: Scheduler, arrivals: Sequence[Tuple[float, Request]], *,
          step_time: Callable[[SchedulerOutput], float] = linear_step_time,
          before_schedule: Optional[Callable[[float], None]] = None,
          on_step: Optional[Callable[[SchedulerOutput, float], None]] = None,
          vocab_size: int = 32000, max_steps: int = 1_000_000) -> List[SchedulerOutput]:
    """Run `sched` on a fake clock until every request finished; returns every SchedulerOutput.

    arrivals: (arrival_time, request) pairs; a request is added once the clock reaches its time. Handed-off
    requests of a prefill_only scheduler are released at once. before_schedule(now) runs before and
    on_step(out, now) after each schedule() (before update()).
    Raises RuntimeError after `max_steps` iterations (a livelock) or when nothing can ever be scheduled.
    """
    pending = sorted(arrivals, key=lambda a: a[0])
    i = 0
    now = 0.0
    outputs = []
    idle_steps = 0
    for _ in range(max_steps):
        while i < len(pending) and pending[i][0] <= now:
            sched.add_request(pending[i][1])
            i += 1
        if not sched.has_unfinished():
            if i == len(pending):
                return outputs
            now = max(now, pending[i][0])
            continue
        if before_schedule is not None:
            before_schedule(now)
        out = sched.schedule(now)
        if on_step is not None:
            on_step(out, now)
        outputs.append(out)
        if out.is_empty:
            idle_steps += 1
            if idle_steps > 1000:
                raise RuntimeError(f"no progress for 1000 steps at t={now}: {sched.num_running} running, "
                                   f"{sched.num_waiting} waiting")
            now += step_time(out)
            continue
        idle_steps = 0
        now += step_time(out)
        for req in sched.update(out, fake_sample(out, vocab_size), now):
            if req.finish_reason == "handoff":
                sched.release(req.request_id)
    raise RuntimeError(f"not finished after max_steps={max_steps}")
