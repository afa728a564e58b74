"""The engine bridge: the real engine's loop on its own thread, each HTTP request an asyncio queue of its events.

    event loop (HTTP)                              engine thread (pdjax.serving.run.run_real(..., online=bridge))
    submit(prompt, sampling, loop) -> _Live  --->  OnlineSource inbox -> admitted at the loop's admission point
    await live.queue.get()                   <---  on_token(rid, tok, t): loop.call_soon_threadsafe(put_nowait)
    abort(rid) / stop(rid, kept)             --->  OnlineSource abort: scheduler.abort frees the pages
    shutdown(): close the source, abort the rest; the engine thread writes the run's result files and ends

Token events are posted to the event loop in one batch per step, at the engine's next admission point (right
after it dispatched the next step, so delivery overlaps the device), not one wake-up per token.
Events on a request's queue (tuples): ('token', token_id, finish_reason or None) per output token, the last one
carrying the finish reason; ('finish', reason, None) for an end without a token (aborted); ('error', message,
None) for a request the engine rejected or an engine failure. Finish reasons are the engine's ('length', 'stop',
'aborted', 'rejected'); a request ended by a stop string is recorded in the run as 'stop' at its last kept token
(OnlineSource.abort keep_tokens).

All engine state is touched on the engine thread only; the HTTP side only reads plain counters (`num_live`) and
the schedulers' queue lengths (metrics).
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
from typing import Dict, List, Optional, Sequence

from pdjax.config.sampling import SamplingParams
from pdjax.scheduler import Request
from pdjax.serving.api.metrics import ServerMetrics
from pdjax.serving.online import OnlineSource, SourceClosed


class Busy(Exception):
    """The server holds server.max_queued_requests requests already (HTTP 429)."""


class Unavailable(Exception):
    """The engine is not ready, shutting down, or failed (HTTP 503)."""


@dataclasses.dataclass(eq=False)
class _Live:
    req: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    instance: str = ""
    token_times: List[float] = dataclasses.field(default_factory=list)
    done: bool = False
    skip_special_tokens: bool = True     # the request's text leaves special tokens out (vLLM's field)

    def push(self, event: tuple) -> None:
        _post(self.loop, [(self.queue, event)])


def _deliver(items) -> None:
    for queue, event in items:
        queue.put_nowait(event)


def _post(loop, items) -> None:
    """Hand events to their queues on `loop` (one wake-up of the event loop for all of them)."""
    try:
        loop.call_soon_threadsafe(_deliver, items)
    except RuntimeError:   # the event loop is closed (server gone): nobody is listening
        pass


def _final(req: Request) -> Optional[str]:
    """The request's finish reason once it is over for the client (a prefill handoff is not), else None."""
    reason = req.finish_reason
    return None if reason is None or reason == "handoff" else reason


class EngineBridge:
    """The `online` front end of pdjax.serving.run.run_real (module docstring). max_queued: live requests at most
    (0: no bound)."""

    def __init__(self, *, max_queued: int = 0, metrics: Optional[ServerMetrics] = None):
        self.max_queued = max_queued
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self.source = OnlineSource(on_admit=self._on_admit, on_poll=self._on_poll,
                                   has_output=lambda: bool(self._batch))
        self.ready = threading.Event()
        self.failed: Optional[str] = None
        self.schedulers: Dict[str, object] = {}
        self.max_model_len = 0
        self.vocab_size = 0
        self.async_scheduling = False
        self._live: Dict[str, _Live] = {}
        self._lock = threading.Lock()
        self._batch: List[tuple] = []     # token events of the current step, posted at the next admission point

    # ---- engine thread
    def attach(self, engine) -> None:
        """Called by run_real once the engine is warm: the server may take requests from now on."""
        if hasattr(engine, "instances"):
            pairs = [(inst.name, inst.scheduler, inst.runner) for inst in engine.instances]
        else:
            pairs = [("replica0", engine.scheduler, engine.runner)]
        self.schedulers = {name: sched for name, sched, _ in pairs}
        entry = [s for name, s, _ in pairs if not name.startswith(("decode", "mixed"))]
        self.max_model_len = min(s.config.max_model_len for s in entry)
        self.vocab_size = int(pairs[0][2].spec.vocab_size)
        self.async_scheduling = bool(getattr(engine, "async_scheduling", False))
        self.metrics.attach(self.schedulers)
        self.ready.set()

    def _locate(self, request_id: str) -> str:
        for name, sched in self.schedulers.items():
            if sched.get_request(request_id) is not None:
                return name
        return ""

    def on_token(self, request_id: str, token_id: int, t: float) -> None:
        live = self._live.get(request_id)
        if live is None or live.done:
            return
        req = live.req
        live.instance = self._locate(request_id) or live.instance
        m, inst = self.metrics, live.instance
        if live.token_times:
            m.tbt.labels(inst).observe(t - live.token_times[-1])
        else:
            m.ttft.labels(inst).observe(t - req.arrival_time)
        live.token_times.append(t)
        m.generation_tokens.labels(inst).inc()
        reason = _final(req)
        last = reason is not None and len(live.token_times) >= len(req.output_token_ids)
        self._batch.append((live, ("token", token_id, reason if last else None)))
        if last:
            self._finished(live, reason)

    def _on_admit(self, req: Request, accepted: bool) -> None:
        live = self._live.get(req.request_id)
        if live is None:
            return
        live.instance = self._locate(req.request_id)
        if accepted:
            self.metrics.prompt_tokens.labels(live.instance).inc(len(req.prompt_token_ids))
        else:
            live.push(("error", req.reject_reason or "rejected by the scheduler", None))
            self._finished(live, "rejected")

    def _flush(self) -> None:
        """Post the step's token events: one event-loop wake-up per step, not one per token (the GIL is shared
        with the engine thread)."""
        batch, self._batch = self._batch, []
        by_loop: Dict[asyncio.AbstractEventLoop, list] = {}
        for live, event in batch:
            by_loop.setdefault(live.loop, []).append((live.queue, event))
        for loop, items in by_loop.items():
            _post(loop, items)

    def _on_poll(self) -> None:
        """Post the step's tokens; then the requests over without a token still to deliver: aborted, rejected
        at a handoff."""
        if self._batch:
            self._flush()
        if not self._live:
            return
        with self._lock:
            lives = list(self._live.values())
        for live in lives:
            reason = _final(live.req)
            if reason is None or live.done or len(live.token_times) < len(live.req.output_token_ids):
                continue
            if reason == "rejected":
                live.push(("error", live.req.reject_reason or "rejected by the scheduler", None))
            else:
                live.push(("finish", reason, None))
            self._finished(live, reason)

    def _finished(self, live: _Live, reason: str) -> None:
        live.done = True
        with self._lock:      # once per request, whichever thread ends it first (end_all races the engine)
            if self._live.pop(live.req.request_id, None) is None:
                return
        self.metrics.finished.labels(live.instance, reason).inc()
        if live.token_times and reason in ("length", "stop"):
            self.metrics.e2e.labels(live.instance).observe(live.token_times[-1] - live.req.arrival_time)

    def fail(self, message: str) -> None:
        """The engine thread died: every live request gets an error event, new ones a 503."""
        self.failed = message
        self.source.close()
        with self._lock:
            lives = list(self._live.values())
            self._live.clear()
        for live in lives:
            live.done = True
            live.push(("error", f"engine failed: {message}", None))

    # ---- event loop
    @property
    def num_live(self) -> int:
        return len(self._live)

    def submit(self, prompt_token_ids: Sequence[int], sampling: SamplingParams, loop: asyncio.AbstractEventLoop,
               prefix: str = "cmpl") -> _Live:
        """Hand a request to the engine; Busy at the queue bound, Unavailable before warm-up / after shutdown."""
        if self.failed is not None:
            raise Unavailable(f"the engine failed: {self.failed}")
        if not self.ready.is_set():
            raise Unavailable("the engine is still warming up")
        req = Request(f"{prefix}-{uuid.uuid4().hex}", list(prompt_token_ids), sampling, arrival_time=0.0)
        live = _Live(req, loop, asyncio.Queue())
        with self._lock:
            if self.max_queued and len(self._live) >= self.max_queued:
                raise Busy(f"the server holds {len(self._live)} requests (server.max_queued_requests="
                           f"{self.max_queued}); retry later")
            self._live[req.request_id] = live
        try:
            self.source.submit(req)
        except SourceClosed as e:
            with self._lock:
                self._live.pop(req.request_id, None)
            raise Unavailable(str(e)) from None
        return live

    def abort(self, live: _Live) -> None:
        """The client went away: abort the request in the engine (its pages are freed at the next admission
        point; metrics count it 'aborted')."""
        if not live.done:
            self.source.abort(live.req.request_id)

    def stop(self, live: _Live, num_tokens: int) -> None:
        """The front end ended the request itself after `num_tokens` outputs (a stop string): abort it in the
        engine, recorded as finished by 'stop' at its last kept token."""
        if live.done:
            return
        del live.token_times[num_tokens:]
        self._finished(live, "stop")
        self.source.abort(live.req.request_id, keep_tokens=num_tokens, reason="stop")

    def end_all(self, reason: str = "aborted") -> int:
        """The drain deadline passed: end every live request now, each client's stream with a last event
        ('finish', reason) (the final chunk and [DONE]), and abort them in the engine. Any thread; returns how
        many were ended."""
        self.source.close()
        with self._lock:
            lives = list(self._live.values())
        for live in lives:
            live.push(("finish", reason, None))
            self._finished(live, reason)
            self.source.abort(live.req.request_id)
        return len(lives)

    def shutdown(self) -> None:
        """No new requests; abort every live one (the engine run then ends and writes its result files)."""
        self.source.close()
        with self._lock:
            lives = list(self._live.values())
        for live in lives:
            self.abort(live)
