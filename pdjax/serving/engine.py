"""Colocated serving engine: one model runner and one scheduler on one device group.

Each iteration: admit the requests that have arrived, `schedule(now)`, run the jitted step, `update` the
requests with the sampled ids, stamp every output token with the time its id reached the host. The engine never
decides who runs (that is the scheduler's job) and never builds device arrays (that is the runner's job).

Modes: online (requests join at their arrival time on the wall clock; the engine sleeps when nothing is
runnable) and offline (everything arrives at t=0).

Batches in flight (`max_in_flight`, pipeline parallelism: pass `runner.pp` for a PipelineRunner): the engine keeps
up to max_in_flight dispatched, uncollected batches in a `pdjax.scheduler.BatchQueue` (vLLM V1's batch queue), so
stage s of the pipeline runs batch k+1 while stage s+1 runs batch k:

    while fewer than max_in_flight batches are in flight and schedule(now) is non-empty: dispatch it, queue it
    then (queue full, or nothing more can be scheduled): collect the oldest, update the scheduler, stamp its tokens

The scheduler builds each batch from requests not in flight (a request is in at most one in-flight batch, never
a preemption victim) and results are applied in dispatch order (pdjax.scheduler.base). An IterationRecord keeps
its batch's start (when it was scheduled) and end (when its ids reached the host and it was applied), so with
max_in_flight > 1 the records of consecutive iterations overlap in time. max_in_flight=1 is the plain loop.

Async scheduling (`async_scheduling=True`, as vLLM V1's async scheduler): while step k runs on the device, the
host already updates the scheduler with placeholder tokens for step k, schedules step k+1 and builds and
dispatches its batch; the decode inputs of step k+1 that are step k's samples are filled in on the device from
step k's output (they never round-trip through the host). After step k's ids reach the host the placeholders
are patched and the tokens stamped. The device never waits for host scheduling, at the price of one constraint:
finishing must be decidable without the token value (no stop tokens; requests run to max_tokens, as in
benchmarks with ignore_eos). `host_overlap_s` reports the host time spent while a step was in flight.
Async scheduling and max_in_flight > 1 are refused together: async scheduling overlaps the host with the device
by applying a batch speculatively the moment it is dispatched and feeding its samples to the very next batch on
the device, which chains every request's consecutive batches (the next one cannot start its first stage before
the previous one left the last), i.e. exactly the dependency a pipeline must avoid; the batch queue already
overlaps host scheduling with the device (the host schedules batch k+1 while batch k runs). Use one or the other.

Compiles: with `compile_counter` (pdjax.runtime.compiles.count) every IterationRecord carries the number of XLA
compiles JAX reported since the previous record, so a latency that includes a compile is never mistaken for a
step; `fail_on_compile=True` raises at the first one instead.

Non-finite logits: a runner returns NONFINITE_LOGITS (pdjax.scheduler.output) instead of a token id for a
sequence whose logits hold a NaN or an inf (pdjax.runtime.step). The engine never emits a token for it: it aborts
that request (finish_reason 'aborted', reject_reason naming the step), logs one warning line naming the request
and the step, and serves the others on (`fail_nonfinite`; with async scheduling the placeholder token it had
already applied is taken back). Broken weights therefore show as aborted requests, never as token 0.

Logprobs: after each collected step, the requests that asked (SamplingParams.logprobs) get their token's entry in
`Request.output_logprobs` (pdjax.serving.logprobs.StepLogprobs), before `on_token` reports the token.

Multi-controller runs (`coordinator`, pdjax.serving.distributed): every clock reading of the loop goes through
`coordinator.now(...)` (process 0's time, so every process schedules and admits identically) and every
SchedulerOutput through `coordinator.digest(...)`; the default single-process Coordinator returns the local
values unchanged and digests nothing unless asked, so the loop is exactly the plain one.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, List, Optional, Sequence, Tuple

from pdjax.errors import UserError
from pdjax.metrics import IterationRecord, RequestRecord, request_record
from pdjax.scheduler import BatchQueue, Request
from pdjax.scheduler.output import NONFINITE_LOGITS, NOT_SAMPLED
from pdjax.serving.distributed import Coordinator
from pdjax.serving.logprobs import StepLogprobs

TokenCallback = Callable[[str, int, float], None]   # (request_id, token_id, time_s)


@dataclasses.dataclass
class EngineResult:
    requests: List[RequestRecord]
    iterations: List[IterationRecord]
    output_tokens: dict                 # request_id -> list of generated token ids
    duration_s: float
    host_overlap_s: float               # host work done while a step was in flight


def nonfinite_reason(where: str) -> str:
    """The reject_reason of a request failed for non-finite logits at `where` ('step 12', 'decode0 step 3')."""
    return f"non-finite logits (NaN or inf) at {where}: no token could be sampled"


def fail_nonfinite(scheduler, out, sampled, now: float, where: str
                   ) -> Tuple[Sequence[int], List[Request], List[int]]:
    """Abort each request of `out` whose sampled id is NONFINITE_LOGITS (module docstring), one warning line each;
    returns (sampled with those rows set to NOT_SAMPLED, for scheduler.update; the aborted requests; the device
    pages they held, for `scrub_pages`). Shared by the colocated and the multi-instance engine. `where`: the step,
    as the log line and reject_reason name it."""
    if NONFINITE_LOGITS not in sampled:
        return sampled, [], []
    sampled = list(sampled)
    aborted, pages = [], []
    for j, tok in enumerate(sampled):
        if tok != NONFINITE_LOGITS:
            continue
        sampled[j] = NOT_SAMPLED
        rid = out.req_ids[j]
        logging.warning("request %r: %s; request aborted (the other requests continue)", rid, nonfinite_reason(where))
        live = scheduler.get_request(rid)
        held = list(live.page_table) if live is not None else []
        req = scheduler.abort(rid, now)
        if req is not None:
            req.reject_reason = nonfinite_reason(where)
            aborted.append(req)
            pages += held
    return sampled, aborted, pages


def scrub_pages(runner, scheduler, pages: Sequence[int], compiles: "CompileTracker") -> None:
    """Zero the device pages an aborted non-finite request left free (`runner.zero_pages`: NaN left in a page's
    unwritten slots would poison the next request given it) and drop them from the prefix cache; pages still
    shared with a live request (a cached prefix) are left alone. Call after the iteration is recorded: a first
    zeroing may compile its copy (unless warm-up precompiled the swap copies), which belongs to no iteration."""
    bm = scheduler.block_manager
    free = [p for p in dict.fromkeys(pages) if bm.ref_count[p] == 0]
    zero = getattr(runner, "zero_pages", None)
    if not free or zero is None:
        return
    bm.uncache(free)
    zero(free)
    compiles.reset()


class CompileDuringRunError(UserError, RuntimeError):
    """A step compiled after warm-up with engine.fail_on_compile=True: the run stops as asked, in one line (a
    UserError for the entry points; a RuntimeError, as it was before)."""


class CompileTracker:
    """Compiles since the last call, from `counter` (pdjax.runtime.compiles.count; None: never any). Shared by
    the colocated and the disaggregated engine; `fail=True` raises at the first compile instead."""

    def __init__(self, counter: Optional[Callable[[], int]] = None, fail: bool = False):
        self.counter, self.fail = counter, fail
        self.reset()

    def reset(self) -> None:
        self._seen = self.counter() if self.counter is not None else 0

    def new(self, where: str) -> int:
        if self.counter is None:
            return 0
        seen, self._seen = self._seen, self.counter()
        if self._seen > seen and self.fail:
            raise CompileDuringRunError(f"{self._seen - seen} XLA compile(s) during {where} after warm-up "
                               "(engine.fail_on_compile=True): a shape, sharding or function was not precompiled")
        return self._seen - seen


class ArrivalQueue:
    """Requests not yet handed to a scheduler, in arrival order (times relative to the run's start).

    add(req) -> bool hands a request over (False: rejected at the door); `admit(t)` adds every request that has
    arrived by t and returns how many were rejected; `wait(now, sleep)` sleeps until the next arrival and admits it.
    Shared by the colocated and the disaggregated engine."""

    def __init__(self, requests: Sequence[Request], add: Callable[[Request], bool]):
        self.pending = sorted(requests, key=lambda r: (r.arrival_time, r.request_id))
        self.next = 0
        self.add = add

    @property
    def exhausted(self) -> bool:
        return self.next >= len(self.pending)

    @property
    def next_time(self) -> float:
        return self.pending[self.next].arrival_time

    def admit(self, t: float) -> int:
        rejected = 0
        while self.next < len(self.pending) and self.pending[self.next].arrival_time <= t:
            rejected += not self.add(self.pending[self.next])
            self.next += 1
        return rejected

    def wait(self, now: Callable[[], float], sleep: Callable[[float], None]) -> int:
        """Sleep until the next arrival, then admit; returns the rejections."""
        target = self.next_time
        left = target - now()  # read the clock once: a second read may have passed the arrival
        if left > 0:
            sleep(left)
        # max(): a clock that rounds may read a hair before the arrival it slept for.
        return self.admit(max(now(), target))


class ColocatedEngine:
    """Drives `scheduler` and `runner` (pdjax.runtime.ModelRunner / PipelineRunner, or anything with
    dispatch/collect). max_in_flight: batches dispatched and not yet collected at most (module docstring; the
    runner's pp for a PipelineRunner); raises ValueError for max_in_flight < 1 or > 1 with async scheduling."""

    def __init__(self, runner, scheduler, *, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep, on_token: Optional[TokenCallback] = None,
                 async_scheduling: bool = False, compile_counter: Optional[Callable[[], int]] = None,
                 fail_on_compile: bool = False, max_in_flight: int = 1, coordinator=None):
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight!r}, expected a positive int (the runner's pp stages)")
        if async_scheduling and max_in_flight > 1:
            raise ValueError(f"async_scheduling=True with max_in_flight={max_in_flight}: async scheduling feeds each "
                             "batch's samples to the next batch on the device, which serializes a pipeline; use "
                             "max_in_flight > 1 (batches in flight) or async scheduling, not both")
        self.max_in_flight = max_in_flight
        self.runner = runner
        self.compiles = CompileTracker(compile_counter, fail_on_compile)
        self.scheduler = scheduler
        self.clock = clock
        self.sleep = sleep
        self.on_token = on_token
        self.async_scheduling = async_scheduling
        if coordinator is None:
            coordinator = Coordinator()
        self.coordinator = coordinator

    def check_requests(self, requests: Sequence[Request]) -> None:
        """Raise UserError when this engine cannot serve `requests` (async scheduling with stop tokens or a
        hand-off policy); run() checks it, and a run checks it before warm-up compiles anything."""
        if self.async_scheduling:
            with_stops = [r.request_id for r in requests if r.sampling.stop_token_ids]
            if with_stops or getattr(self.scheduler, "handoff_after_prefill", False):
                raise UserError(
                    f"async scheduling needs requests that finish at max_tokens (no stop tokens; requests "
                    f"{with_stops[:3]} have some) on a colocated policy; use async_scheduling=False")

    def run(self, requests: Sequence[Request], *, progress: Optional[Callable[[int], None]] = None,
            source=None) -> EngineResult:
        """Serve `requests` (scheduler Requests with arrival times relative to the start) until all finish.
        source: an online request source (pdjax.serving.online.OnlineSource) whose requests and aborts join
        while the loop runs, at its admission points; the run then ends once it is closed and all finished."""
        self.check_requests(requests)
        self._t0 = self.clock()
        self._iterations: List[IterationRecord] = []
        self._overlap = 0.0
        self._progress = progress
        self.compiles.reset()
        arrivals = (ArrivalQueue(requests, self.scheduler.add_request) if source is None
                    else source.arrivals(self.scheduler.add_request, self.abort))
        arrivals.admit(self._now())
        loop = self._run_async if self.async_scheduling else self._run_sync
        loop(arrivals)
        all_reqs = arrivals.pending
        return EngineResult(
            requests=[request_record(r) for r in all_reqs], iterations=self._iterations,
            output_tokens={r.request_id: list(r.output_token_ids) for r in all_reqs},
            duration_s=self._now(), host_overlap_s=self._overlap)

    def abort(self, request_id: str, now: float) -> bool:
        """Finish `request_id` as 'aborted' and free its pages at once (the scheduler's abort); False if it is
        not live. Call it from the loop's thread between steps (an online source's admission points)."""
        return self.scheduler.abort(request_id, now) is not None

    # ---------------------------------------------------------------------------------------------------------
    def _now(self) -> float:
        return self.coordinator.now(self.clock() - self._t0)

    def _wait_for_arrival(self, arrivals: ArrivalQueue) -> None:
        """Sleep until the next arrival and admit it; raise if there is none (the run could never progress)."""
        sched = self.scheduler
        if arrivals.exhausted:
            raise RuntimeError(
                f"scheduler returned an empty batch with {sched.num_waiting} waiting and {sched.num_running} "
                "running requests and no arrivals left: it cannot make progress")
        arrivals.wait(self._now, self.sleep)

    def _record(self, out, sampled, start: float, end: float, finished) -> None:
        self._iterations.append(IterationRecord(
            step=len(self._iterations), start_time=start, end_time=end,
            num_prefill_tokens=out.num_prefill_tokens, num_decode_tokens=out.num_decode_tokens,
            num_seqs=out.num_seqs, num_compiles=self.compiles.new(f"iteration {len(self._iterations)}")))
        if self.on_token is not None:
            for rid, tok in zip(out.req_ids, sampled):
                if tok >= 0:
                    self.on_token(rid, int(tok), end)
        if finished and self._progress is not None:
            self._progress(len(finished))

    def _run_sync(self, arrivals: ArrivalQueue) -> None:
        """The batch-queue loop (module docstring); with max_in_flight == 1: schedule, run, update."""
        sched = self.scheduler
        queue = BatchQueue(self.max_in_flight)
        while True:
            if not sched.has_unfinished():       # (in-flight requests are unfinished: the queue is empty here)
                if arrivals.exhausted:
                    return
                self._wait_for_arrival(arrivals)
                continue
            if not queue.full:
                start = self._now()
                arrivals.admit(start)    # a request that arrived during the last step joins this one
                out = sched.schedule(start)
                self.coordinator.digest("replica0", out)
                if not out.is_empty:
                    queue.push(out, (self.runner.dispatch(out), start))
                    host_start = self._now()
                    arrivals.admit(host_start)               # overlapped with the device step
                    self._overlap += self._now() - host_start
                    if not queue.full:
                        continue                             # fill the pipeline
                else:
                    self._copies_only(out)
                    if not queue:
                        if sched.has_unfinished():   # (else an abort at admission ended the last request)
                            self._wait_for_arrival(arrivals)
                        continue
            out, (handle, start) = queue.pop()               # the oldest batch: wait for it, apply it
            sampled = self.coordinator.collect(self.runner, handle)
            end = self._now()
            sampled, aborted, pages = fail_nonfinite(sched, out, sampled, end, f"step {len(self._iterations)}")
            step_lp = StepLogprobs.read(self.coordinator, self.runner, handle, out)
            finished = sched.update(out, sampled, end)
            if step_lp is not None:
                step_lp.attach(sampled)
            self._record(out, sampled, start, end, finished + aborted)
            if pages:
                scrub_pages(self.runner, sched, pages, self.compiles)

    def _copies_only(self, out) -> None:
        """An empty batch that still carries swap copies (a request swapped itself out while every other one was
        in flight) goes to the runner for its copies: a later batch swaps those pages back in."""
        if out.swap_out or out.swap_in:
            self.runner.collect(self.runner.dispatch(out))

    def _take_back_nonfinite(self, pending, sampled, now: float) -> Tuple[List[Request], List[int]]:
        """Async scheduling: each placeholder of `pending` whose sampled id is NONFINITE_LOGITS is dropped (the
        last token its request holds: its next step is not applied yet) and taken out of `pending`, and the
        request aborted (or marked aborted when the placeholder already finished it), one warning line each.
        Returns (those requests, the device pages they held, for `scrub_pages`)."""
        if NONFINITE_LOGITS not in sampled:
            return [], []
        where = f"step {len(self._iterations)}"
        failed, pages, kept = [], [], []
        for slot in pending.slots:
            i, req, n_out, n_all = slot
            if int(sampled[i]) != NONFINITE_LOGITS:
                kept.append(slot)
                continue
            logging.warning("request %r: %s; request aborted (the other requests continue)", req.request_id,
                            nonfinite_reason(where))
            pages += req.page_table
            del req.output_token_ids[n_out:], req.all_token_ids[n_all:], req.token_times[n_out:]
            if n_out == 0:
                req.first_token_time = None
            if self.scheduler.abort(req.request_id, now) is None:     # finished on the placeholder already
                req.finish_reason, req.finish_time = "aborted", now
            req.reject_reason = nonfinite_reason(where)
            failed.append(req)
        pending.slots[:] = kept
        return failed, pages

    def _run_async(self, arrivals: ArrivalQueue) -> None:
        sched = self.scheduler
        in_flight = None    # (out, handle, start) of the dispatched, uncollected step
        while True:
            host_start = self._now()
            pending = sched.update_async(in_flight[0], host_start) if in_flight is not None else None
            arrivals.admit(host_start)
            out = sched.schedule(host_start) if sched.has_unfinished() else None
            if out is not None:
                self.coordinator.digest("replica0", out)
            handle = None
            if out is not None and not out.is_empty:
                prev = (in_flight[0], in_flight[1]) if in_flight is not None else None
                handle = self.runner.dispatch(out, prev=prev)
            elif out is not None:
                self._copies_only(out)
            if in_flight is not None:
                self._overlap += self._now() - host_start
                out_prev, handle_prev, start_prev = in_flight
                sampled = self.coordinator.collect(self.runner, handle_prev)
                end = self._now()
                failed, pages = self._take_back_nonfinite(pending, sampled, end)
                sched.resolve_async(pending, sampled, end)
                step_lp = StepLogprobs.read(self.coordinator, self.runner, handle_prev, out_prev)
                if step_lp is not None:
                    step_lp.attach_pending(pending, sampled)
                self._record(out_prev, sampled, start_prev, end,
                             pending.finished + [r for r in failed if r not in pending.finished])
                if pages:   # (the step in flight wrote these pages before the zeros land: they follow it)
                    scrub_pages(self.runner, sched, pages, self.compiles)
                in_flight = None
            if handle is not None:
                start = self._iterations[-1].end_time if self._iterations else host_start
                in_flight = (out, handle, max(start, host_start))
                continue
            if not sched.has_unfinished():
                if arrivals.exhausted:
                    return
                self._wait_for_arrival(arrivals)
            elif out is not None and out.is_empty:
                self._wait_for_arrival(arrivals)
