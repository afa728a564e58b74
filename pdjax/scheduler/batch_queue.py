"""BatchQueue: the batches an instance has dispatched and not yet applied (vLLM V1's batch queue), no JAX.

An instance whose model is split into pp pipeline stages keeps up to pp batches in flight, so stage s works on
batch k+1 while stage s+1 still works on batch k (Sarathi-Serve's pipeline scheduling; vLLM V1's
`max_concurrent_batches` / `step_with_batch_queue`). The engine (pdjax.serving.engine) and the simulator
(pdjax.sim.simulator) drive the same loop with this queue:

    while the queue is not full and schedule(now) returns a non-empty batch: dispatch it, push it
    then (queue full, or nothing more can be scheduled): pop the oldest, wait for it, update(), stamp its tokens

Rules (the scheduler side is in pdjax.scheduler.base):
- A request is in at most one in-flight batch: `Scheduler.schedule` builds the next batch only from requests
  not in flight (their `num_computed_tokens` has not advanced yet), and `push` checks it.
- A request in flight is never a preemption victim (its pages are being written by the device).
- Results are applied in dispatch order: `pop` returns the oldest batch and `Scheduler.update` refuses an
  output older than one it already applied.
With max_in_flight == 1 the loop is the plain schedule -> run -> update loop.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Deque, Iterable, Set, Tuple

from pdjax.scheduler.output import SchedulerOutput


class BatchQueue:
    """Dispatched, not yet applied batches, oldest first, at most `max_in_flight` of them.

    push(out, payload) queues a non-empty SchedulerOutput with anything the caller needs to collect it (a runner
    handle, start/end times); pop() -> (out, payload) returns the oldest; `in_flight_ids` are the request ids of
    every queued batch."""

    def __init__(self, max_in_flight: int = 1):
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight!r}, expected a positive int")
        self.max_in_flight = max_in_flight
        self._q: Deque[Tuple[SchedulerOutput, Any]] = deque()
        self._ids: Set[str] = set()
        self.num_pushed = 0

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    @property
    def full(self) -> bool:
        return len(self._q) >= self.max_in_flight

    @property
    def in_flight_ids(self) -> frozenset:
        return frozenset(self._ids)

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._ids

    def push(self, out: SchedulerOutput, payload: Any = None) -> None:
        """Queue dispatched batch `out`; raises when the queue is full, `out` is empty, or one of its requests is
        already in an in-flight batch (a scheduler bug: its tokens would be computed twice)."""
        if self.full:
            raise RuntimeError(f"BatchQueue.push: {len(self._q)} batches already in flight "
                               f"(max_in_flight={self.max_in_flight})")
        if out.is_empty:
            raise ValueError(f"BatchQueue.push: step {out.step} schedules nothing; only dispatched batches queue")
        twice = self._ids.intersection(out.req_ids)
        if twice:
            raise RuntimeError(f"BatchQueue.push: step {out.step} schedules requests {sorted(twice)[:3]} that are "
                               "already in an in-flight batch")
        self._ids.update(out.req_ids)
        self._q.append((out, payload))
        self.num_pushed += 1

    def peek(self) -> Tuple[SchedulerOutput, Any]:
        """The oldest (out, payload) without removing it."""
        if not self._q:
            raise IndexError("BatchQueue.peek: no batch in flight")
        return self._q[0]

    def pop(self) -> Tuple[SchedulerOutput, Any]:
        """Remove and return the oldest (out, payload): the next batch to collect and apply."""
        if not self._q:
            raise IndexError("BatchQueue.pop: no batch in flight")
        out, payload = self._q.popleft()
        self._ids.difference_update(out.req_ids)
        return out, payload


def mean_in_flight(intervals: Iterable[Tuple[float, float]]) -> Tuple[float, float]:
    """(mean number of batches in flight while at least one is, seconds with at least one in flight) from the
    (dispatch, collect) time of every batch; e.g. iteration records' (start_time, end_time)."""
    spans = sorted((float(a), float(b)) for a, b in intervals)
    if not spans:
        return 0.0, 0.0
    busy = total = 0.0
    cur_a, cur_b = spans[0]
    for a, b in spans:
        total += b - a
        if a > cur_b:
            busy += cur_b - cur_a
            cur_a, cur_b = a, b
        elif b > cur_b:
            cur_b = b
    busy += cur_b - cur_a
    return (total / busy if busy > 0 else float(len(spans) > 0)), busy
