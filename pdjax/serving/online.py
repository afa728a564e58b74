"""Online request source: requests and aborts submitted from other threads while an engine runs (no JAX).

An API server (pdjax.serving.api) runs the engine loop on its own thread and hands it work through an
`OnlineSource`: `submit(req)` and `abort(request_id)` are thread-safe and only queue a command; the engine applies
the commands on its own thread at the points where it admits arrivals (`engine.run([], source=source)`, which
takes its ArrivalQueue from `source.arrivals(add, abort)`), so the scheduler is only ever touched by the engine
thread, between steps. An abort therefore frees its pages at the engine's next admission point (at most one step
after the call). The run ends once the source is `close`d and every request it admitted has finished.

Arrival times: a request's arrival is stamped on the engine clock as the moment it was submitted (the engine's
now at admission minus the time it waited in the inbox), so TTFT includes the wait for the loop.

`OnlineSource(on_admit=..., on_poll=..., has_output=...)`: callbacks run on the engine thread: on_admit(req,
accepted) after each admission (accepted False: the scheduler rejected it, it is finished), on_poll() at every
admission point and before the loop blocks for an arrival (a front end posts its buffered tokens there and
notices the requests that finished without a token: aborted, rejected at a handoff); has_output() -> True makes
the next admission point due at once (next_time -inf), so a loop that waits for a KV transfer to land polls.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Dict, List, Optional

from pdjax.serving.engine import ArrivalQueue


class SourceClosed(RuntimeError):
    """submit() after close(): the engine is shutting down."""


class WarmupCancelled(Exception):
    """The source was closed before warm-up finished (SIGTERM while starting): nothing was served."""


class OnlineSource:
    """Thread-safe inbox of requests and aborts for one engine run (module docstring)."""

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter,
                 on_admit: Optional[Callable[[object, bool], None]] = None,
                 on_poll: Optional[Callable[[], None]] = None, has_output: Optional[Callable[[], bool]] = None):
        self.clock = clock
        self.on_admit, self.on_poll, self.has_output = on_admit, on_poll, has_output
        self._cond = threading.Condition()
        self._inbox: collections.deque = collections.deque()
        self._closed = False

    # ---- any thread
    def submit(self, req) -> None:
        """Queue `req` (a pdjax.scheduler.Request; its arrival_time is set at admission); SourceClosed if closed."""
        with self._cond:
            if self._closed:
                raise SourceClosed("the engine is shutting down and takes no new requests")
            self._inbox.append(("add", req, self.clock()))
            self._cond.notify_all()

    def abort(self, request_id: str, *, keep_tokens: Optional[int] = None, reason: str = "aborted") -> None:
        """Queue an abort of `request_id` (a no-op for one that already finished). keep_tokens: a front end ended
        the request itself after that many output tokens (a stop string): its outputs beyond them are dropped and
        it is recorded as finished with `reason` at its last kept token instead of 'aborted'."""
        with self._cond:
            self._inbox.append(("abort", request_id, (keep_tokens, reason)))
            self._cond.notify_all()

    def close(self) -> None:
        """No more submissions; aborts still go through. The engine's run ends when everything finished."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def arrivals(self, add: Callable[[object], bool], abort: Callable[[str, float], bool]) -> "OnlineArrivals":
        """The engine's ArrivalQueue over this source: add(req) -> accepted (the engine's admission), abort(id,
        now) -> found (the engine's abort)."""
        return OnlineArrivals(self, add, abort)

    # ---- engine thread
    def _take(self) -> List[tuple]:
        with self._cond:
            commands = list(self._inbox)
            self._inbox.clear()
        return commands

    def _wait(self, timeout: float) -> None:
        with self._cond:
            if not self._inbox and not self._closed:
                self._cond.wait(timeout)


class OnlineArrivals(ArrivalQueue):
    """ArrivalQueue whose arrivals come from an OnlineSource (pending: every request admitted so far, in order).
    exhausted once the source is closed and its inbox is empty; next_time is -inf while commands wait (admit
    now) and +inf otherwise (a loop that polls until the next arrival keeps polling)."""

    POLL_S = 0.05   # longest blocking wait before re-checking (a close() or command also wakes it at once)

    def __init__(self, source: OnlineSource, add: Callable[[object], bool], abort: Callable[[str, float], bool]):
        super().__init__([], add)
        self.source = source
        self.abort = abort
        self.by_id: Dict[str, object] = {}

    @property
    def exhausted(self) -> bool:
        return self.source._closed and not self.source._inbox

    @property
    def next_time(self) -> float:
        src = self.source
        due = src._inbox or (src.has_output is not None and src.has_output())
        return float("-inf") if due else float("inf")

    def admit(self, t: float) -> int:
        rejected = 0
        src = self.source
        for kind, item, extra in src._take():
            if kind == "add":
                req = item
                req.arrival_time = max(0.0, min(t, t - (src.clock() - extra)))   # when it was submitted
                ok = bool(self.add(req))
                rejected += not ok
                self.pending.append(req)
                self.by_id[req.request_id] = req
                self.next = len(self.pending)
                if src.on_admit is not None:
                    src.on_admit(req, ok)
            else:
                self._abort(item, t, *extra)
        if src.on_poll is not None:
            src.on_poll()
        return rejected

    def _abort(self, request_id: str, t: float, keep_tokens: Optional[int], reason: str) -> None:
        self.abort(request_id, t)
        req = self.by_id.get(request_id)
        if keep_tokens is None or req is None or req.finish_reason in ("rejected", None):
            return
        keep = max(0, min(keep_tokens, len(req.output_token_ids)))
        del req.output_token_ids[keep:]
        del req.token_times[keep:]
        del req.all_token_ids[len(req.prompt_token_ids) + keep:]
        req.finish_reason = reason
        if req.token_times:
            req.finish_time = req.token_times[-1]

    def wait(self, now: Callable[[], float], sleep: Callable[[float], None]) -> int:
        """Block until a command arrives (or the source closes), then admit."""
        src = self.source
        had_output = src.has_output is not None and src.has_output()
        if src.on_poll is not None:
            src.on_poll()               # deliver what the last step produced before sleeping
        if not had_output:              # (a loop that came for the output only goes back to its own waiting)
            src._wait(self.POLL_S)
        return self.admit(now())
