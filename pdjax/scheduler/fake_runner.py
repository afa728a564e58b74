"""A fake runner and a fake-time driver: exercise a scheduler without a model (tests, benchmarks, examples).

The fake runner "samples" a token that depends only on the request id and the position it is sampled at,
like a seeded sampler, so a request produces the same tokens whatever batches it ran in; this makes
scheduling changes (prefix caching on/off, preemption) checkable on their outputs.
The driver advances a fake clock by a simple linear step cost so that arrival-time behaviour (queueing,
stalls) is reproducible; it is not a calibrated cost model (that is pdjax/sim's job). With `max_in_flight` > 1
it runs the engine's batch-queue loop (pdjax.scheduler.batch_queue): batches are scheduled while fewer than
max_in_flight are in flight and something can be scheduled, run back to back on one fake device, and applied
oldest first.
"""
from __future__ import annotations

import zlib
from typing import Callable, List, Optional, Sequence, Tuple

from pdjax.scheduler.base import Scheduler
from pdjax.scheduler.batch_queue import BatchQueue
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
          on_update: Optional[Callable[[SchedulerOutput, float], None]] = None,
          vocab_size: int = 32000, max_steps: int = 1_000_000, max_in_flight: int = 1) -> List[SchedulerOutput]:
    """Run `sched` on a fake clock until every request finished; returns every SchedulerOutput.

    arrivals: (arrival_time, request) pairs; a request is added once the clock reaches its time. Handed-off
    requests of a prefill_only scheduler are released at once. before_schedule(now) runs before and
    on_step(out, now) after each schedule(); on_update(out, now) after each update().
    max_in_flight: batches dispatched and not yet applied at most (module docstring); a batch dispatched at t
    runs from max(t, the end of the previous batch) for step_time(out).
    Raises RuntimeError after `max_steps` iterations (a livelock) or when nothing can ever be scheduled.
    """
    pending = sorted(arrivals, key=lambda a: a[0])
    queue = BatchQueue(max_in_flight)
    i = 0
    now = 0.0
    device_free = 0.0
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
        if not queue.full:
            if before_schedule is not None:
                before_schedule(now)
            out = sched.schedule(now)
            if on_step is not None:
                on_step(out, now)
            outputs.append(out)
            if out.is_empty:
                if not queue:
                    idle_steps += 1
                    if idle_steps > 1000:
                        raise RuntimeError(f"no progress for 1000 steps at t={now}: {sched.num_running} running, "
                                           f"{sched.num_waiting} waiting")
                    now += step_time(out)
                    continue
            else:
                idle_steps = 0
                end = (now if now > device_free else device_free) + step_time(out)
                device_free = end
                queue.push(out, end)
                if not queue.full:
                    continue
        now = _apply_oldest(sched, queue, now, vocab_size, on_update)
    raise RuntimeError(f"not finished after max_steps={max_steps}")


def _apply_oldest(sched: Scheduler, queue: BatchQueue, now: float, vocab_size: int, on_update) -> float:
    """Wait for the oldest batch in flight and apply it (handed-off requests released at once); the new clock."""
    out, end = queue.pop()
    if end > now:
        now = end
    for req in sched.update(out, fake_sample(out, vocab_size), now):
        if req.finish_reason == "handoff":
            sched.release(req.request_id)
    if on_update is not None:
        on_update(out, now)
    return now
