"""Discrete-event simulator: the real scheduler objects on a virtual clock advanced by a step-time function.

Every instance owns an unmodified pdjax scheduler (built by `make_scheduler` from the same SchedulerConfig the
real engine uses). An iteration's duration is `step_time(SchedulerOutput)` (normally the calibrated cost model,
see pdjax.sim.step_cost); its sampled tokens are a placeholder id (requests run to max_tokens, as a benchmark run
with ignore_eos does). Requests are routed to an instance on arrival by a global router. Outputs are the same
RequestRecord/IterationRecord lists the real engine produces, so every report, plot and sweep serves both backends.

One event loop (`Simulation`) serves colocated replicas and disaggregated deployments (pdjax.sim.disagg builds it
with transfers and the mixed pool), as the engine's ClusterEngine drives both; `SimInstance` is the one simulated
instance (pdjax.scheduler.instances.Instance, in any role). Each instance replays the loop of
`pdjax.serving.engine.ColocatedEngine` exactly, so that fed the same clock and
arrivals both produce the same SchedulerOutputs (tests/test_simulator.py checks this), with the engine's batch
queue (`pdjax.scheduler.BatchQueue`, up to `max_in_flight` batches dispatched and not yet applied):
    top:  no unfinished request -> wait for the next arrival, admit every arrival <= now, back to top
          if fewer than max_in_flight batches are in flight:
            start = now; admit every arrival <= start; out = schedule(start)
            non-empty -> admit every arrival <= start (the engine does this while the device runs);
                         dispatch out onto the stages (below); if the queue is still not full, back to top
            empty, nothing in flight -> admit arrivals <= now; if none were waiting, wait for the next arrival
                         and admit; back to top
          wait for the oldest batch to end: now = max(now, its end); update(out, sampled, now); back to top
With max_in_flight == 1 and one stage this is: now = start + step_time(out); update.

Pipeline stages. An instance with pp stages (a step-time function with `.pp` > 1 and `.stage_times(out)`, see
pdjax.sim.step_cost.PipelineStepTime, or `stage_times=` given) keeps up to pp batches in flight by default. Each
stage is a resource: batch k occupies stage s from max(its end on stage s-1 + the activation send between the
two stages' devices, the end of batch k-1 on stage s) for its stage time; stage 0 starts at max(dispatch time,
stage 0 free). Bubbles thus come out of the schedule: a stage idles while the batch it needs is still upstream,
and unequal batches leave the short ones waiting behind long ones. The queue, the stage resources and their
accounting are pdjax.sim.pipeline.StagePipeline (`SimInstance.pipeline`, shared with pdjax.sim.disagg).
`SimResult.pipeline` (pdjax.sim.pipeline.pipeline_summary) reports, per instance, each stage's busy seconds and
the bubble fraction = idle stage time / total stage time over the time the instance had a batch in flight
(1 - sum(busy) / (pp x that time)), and the mean number of batches in flight.

With `async_scheduling=True` the instance replays the engine's asynchronous loop instead (vLLM V1-style: while
step k runs on the device, the host updates the scheduler for step k with placeholder tokens, admits, schedules
step k+1 and dispatches it behind step k; it then blocks until step k completes and stamps its tokens with that
time). The device runs steps back to back, so step k+1 is scheduled when step k starts.

Event order at one time t: every completion at t (update), then every arrival at t (routed to an instance's
inbox), then each instance that is ready runs the loop above. Ties between instances go by instance index.

Step context. A step-time function with `takes_context` (pdjax.sim.step_cost.make_step_time's) is called as
step_time(out, StepContext(previous, idle_s)): the batch this instance dispatched before `out` (None for its
first) and how long its device (stage 0) sat idle before `out` could start (dispatch time minus the time the
device became free, 0 when the step runs straight on). The simulator derives both from its own schedule; the
engine mirrors nothing. The cost of a shape switch or an idle wake is the step-time function's business
(cost_model.context_time): with those parameters at 0 the times, hence the schedules, are exactly those of a
context-free step time. Plain functions (one argument) are called as before.

Speed and memory: the loop is a heap of completion times merged with the sorted arrival list; everything per
iteration is the scheduler's own work plus one step-time call (see pdjax.sim.step_cost for the fast cost path),
and no routing bookkeeping unless the router asks for it (`observe_step`). Decode runs (`Simulation.decode_run`,
pdjax.scheduler.runs): where the next steps of an instance are certain (every running request decodes a token or
takes its prefill chunk, nobody is admitted, preempted or finishes before the last of them) and nothing else in
the simulation can come between them, they are applied in bulk, with the same scheduler state, step times,
pipeline accounting and records as one by one (tests/test_decode_runs.py; `decode_runs=False` turns them off).
They need the synchronous loop, a step-time function exact for such steps from their counts (`decode_only_exact`:
pdjax.sim.step_cost's sources without padding, step context or noise), the placeholder tokens, and no
on_schedule / observe_step. An instance with pipeline stages or batches in flight takes runs of decoders only that
admit nobody, one batch at a time through its stages (`plan_stage_clock`: the schedule() after each dispatch finds
every running request in flight and returns nothing). One colocated instance with two batches in flight of
different requests (two groups taking turns: new prompts' chunks beside the decoders, or two groups of decoders)
takes pair runs (`Simulation.pair_run`, pdjax.scheduler.pair_runs.PairRun): the half-steps (collect the oldest
batch, schedule its group again), through prompts completing, requests finishing and (sarathi) arrivals admitted as
schedule() admits them, up to a schedule the run cannot take (a preemption, an empty batch ...) or PAIR_RUN_LENGTH
half-steps, applied in bulk, the last batch left in flight as its SchedulerOutput. A decode_only instance's run
also takes the step that admits handed-off requests whose KV landed (DecodeOnlyScheduler._run_kv_admissions); the
one decode instance of a disaggregated deployment takes its runs past the other instances' steps and the arrivals
(`PendingRun`: applied
when its last step ends, cut at the step that would admit a KV landing once the transfer starts; its records wait
for their place in completion order: same end, the earlier dispatch first). Several colocated replicas
(one stage each) take their runs past the other replicas' steps and past the arrivals routed elsewhere
(`LazyRun`, `Simulation.replica_run`): a run is applied as time passes, caught up at each arrival before the
router reads the replicas (the steps ended applied, the one running across the arrival scheduled: the state the
event loop would have then), and cut at the step running across an arrival routed to it. A replica is caught
up for the router only when its pending steps change what that router reads of it (`catch_up_read`,
pdjax.config.registry.RouterInfo.stale_ok): round robin reads nothing; least_loaded, prefix_affinity and kv_centric
read loads, queued prompt tokens and free pages that the simulator offsets by the pending steps' tokens and pages
(InstanceRouter.unapplied), and a prefix hit that decode steps leave alone unless the request's first page is
cached there or could be registered; so only the replica it picks is caught up, unless prefix caching may change
a hit. Their records are put in completion order at the end (`replica_order`).
Requests may be given as PendingRequests (pdjax.sim.build does): each becomes its scheduler Request when it
arrives, and every request that finishes for good is turned into its RequestRecord at once and dropped
(`SimRequests`), so a run holds the token lists of its live requests only, not of all of them
(experiments/bench_sim.py measures both). The cyclic garbage collector is paused while simulate runs (`gc_paused`:
the run makes no cycles, and the collector's passes over its records cost about a fifth of the time).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import heapq
import itertools
import math
import operator
import time
from bisect import bisect_left, bisect_right
from collections import deque
from functools import partial
from itertools import accumulate, islice, repeat
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from pdjax.metrics import IterationRecord, RequestRecord, request_record
from pdjax.scheduler.base import PLACEHOLDER_TOKEN
from pdjax.scheduler.instances import Instance, TransferRecord
from pdjax.scheduler.routing import InstanceRouter
from pdjax.scheduler.pair_runs import pair_run
from pdjax.sim.pipeline import StagePipeline, StageTimer, StepContext, pipeline_summary  # also re-exported
from pdjax.sim.pipeline import clock_stages



_END_TIME = operator.attrgetter("end_time")


@dataclasses.dataclass
class SimResult:
    requests: List[RequestRecord]
    iterations: List[IterationRecord]
    duration_s: float            # simulated seconds until the last event
    wall_s: float                # real seconds the simulation took
    num_iterations: int
    # Pipeline stages and batches in flight (module docstring): {"bubble_fraction", "stage_busy_s",
    # "active_s", "mean_batches_in_flight", "instances": {name: the same per instance, with pp, max_in_flight}}
    pipeline: Optional[dict] = None

    @property
    def iterations_per_s(self) -> float:
        """Simulated iterations per wall-clock second (the simulator's speed)."""
        return self.num_iterations / self.wall_s if self.wall_s > 0 else float("inf")


class SimInstance(Instance):
    """One simulated instance (pdjax.scheduler.instances.Instance, the engine's and the simulator's one instance
    type, in any role: a colocated replica, or a disaggregated deployment's prefill, decode or mixed-pool
    instance): a scheduler, a step-time function (SchedulerOutput -> seconds) and its inbox of routed, not yet
    admitted requests. role None: the scheduler's own (pdjax.scheduler.instances.role_of).

    Pipeline stages (module docstring): `stage_times(out) -> (per-stage seconds, per-boundary send seconds)`,
    taken from `step_time.stage_times` when the step-time function has `.pp` > 1 (pdjax.sim.step_cost.PipelineStepTime);
    None: one stage of step_time(out). max_in_flight: batches in flight at most (default: step_time's pp, else 1;
    give it with an explicit `stage_times`). `pipeline` (pdjax.sim.pipeline.StagePipeline) holds the batch queue
    and the stage resources."""

    def __init__(self, name: str, scheduler, step_time: Optional[Callable[[object], float]] = None, *,
                 role: Optional[str] = None, stage_times: Optional[Callable] = None,
                 max_in_flight: Optional[int] = None):
        if step_time is None and stage_times is None:
            raise ValueError(f"SimInstance {name!r}: give step_time or stage_times")
        super().__init__(name, role, scheduler)
        self.step_time = step_time
        self.timer = StageTimer(step_time, stage_times)
        self.pipeline = StagePipeline(self.timer.pp if max_in_flight is None else max_in_flight)
        self.inbox: deque = deque()    # routed requests in arrival order, admitted at the engine's admit points
        self.in_flight = None          # (SchedulerOutput, start time[, end]) of the step being "executed"
        self.dispatched = None         # async: (out, start, end) queued on the device, its update still due
        self.device_free = 0.0         # async: when the device finishes its queued work
        self.waits_for_arrival = False  # async: the host sleeps until this instance's next arrival

    @property
    def max_in_flight(self) -> int:
        return self.pipeline.max_in_flight

    @property
    def busy(self) -> bool:
        """The host is blocked collecting a batch (sync: the oldest in-flight batch)."""
        return self.in_flight is not None

    @property
    def takes_context(self) -> bool:
        return self.timer.takes_context

    def context(self, out, device_free: float, t: float) -> Optional[StepContext]:
        """The StepContext of `out` dispatched at host time t on a device free from `device_free` (see StageTimer)."""
        return self.timer.context(out, device_free, t)

    def stage_seconds(self, out, t: float) -> Tuple[Sequence[float], Sequence[float]]:
        """(per-stage seconds, per-boundary send seconds) of batch `out` dispatched at t (pdjax.sim.pipeline
        StageTimer: with its StepContext when the step-time function takes one)."""
        return self.timer(out, self.pipeline.device_free, t)

    def run_stages(self, out, t: float) -> float:
        """Dispatch batch `out` at t (the pipeline's queue must not be full) onto the stages; returns when it leaves
        the last stage. The step context's idle gap is measured from when stage 0 became free."""
        stages, sends = self.timer(out, self.pipeline.device_free, t)
        return self.pipeline.dispatch(out, t, stages, sends)


class PendingRequest:
    """A request that has not arrived: its sort keys (request_id, arrival_time, exactly the Request's) and
    `make() -> Request`, called when it arrives (pdjax.sim.build.build_pending_requests). With these, and every
    finished request turned into its RequestRecord at once (`SimRequests`), a long run holds the token lists of the
    live requests only."""
    __slots__ = ("request_id", "arrival_time", "make")

    def __init__(self, request_id: str, arrival_time: float, make: Callable[[], object]):
        self.request_id, self.arrival_time, self.make = request_id, arrival_time, make


class SimRequests:
    """The requests of one simulation in (arrival_time, request_id) order and their RequestRecords: a request is
    made when it arrives (`arrived`: a PendingRequest becomes its Request), recorded when it finishes for good
    (`finished`: the record is taken and the request dropped, here and from its scheduler's `finished` list,
    which the simulator consumes as the engine's output loop does), and every request still held is recorded at
    the end (`records`: rejected ones, which finish inside add_request, and any left unfinished)."""

    def __init__(self, requests: Sequence):
        self.pending = sorted(requests, key=lambda r: (r.arrival_time, r.request_id))
        self._records: List[Optional[RequestRecord]] = [None] * len(self.pending)
        self._slot: dict = {}           # id(Request) -> its index, while it is live

    def made(self, i: int):
        """Request i, made if it has not arrived yet (the same object `arrived(i)` returns later)."""
        req = self.pending[i]
        if req.__class__ is PendingRequest:
            req = self.pending[i] = req.make()
        return req

    def arrived(self, i: int):
        req = self.pending[i]
        if req.__class__ is PendingRequest:
            req = self.pending[i] = req.make()
        self._slot[id(req)] = i
        return req

    def finished(self, reqs: Sequence, scheduler) -> None:
        for req in reqs:
            i = self._slot.pop(id(req), None)
            if i is not None:
                self._records[i] = request_record(req, float_times=True)     # (times from the clock)
                self.pending[i] = None
        scheduler.finished.clear()

    def records(self) -> List[RequestRecord]:
        out = self._records
        for i, rec in enumerate(out):
            if rec is None:
                req = self.pending[i]
                out[i] = request_record(req.make() if req.__class__ is PendingRequest else req)
        return out


def placeholder_sample(out) -> List[int]:
    """The simulator's sampled ids: PLACEHOLDER_TOKEN where do_sample is True, else -1."""
    do_sample = out.do_sample
    if False not in do_sample:
        return [PLACEHOLDER_TOKEN] * len(do_sample)
    return [PLACEHOLDER_TOKEN if s else -1 for s in do_sample]


def plan_decode_clock(run, decode: Callable[[int], float], start: float, limit: float, *, ends_before: bool):
    """The steps of decode run `run` (decoders only: DecodeRun.plan_decode_steps) from `start`, step j taking
    decode(its decoders' context sum) seconds: (starts, ends, seconds, the end of the last step, or `start` when
    none). ends_before: the steps ending before `limit`; else the steps starting before it (the last may end
    after). The clock runs in blocks, each step's end its start plus its seconds (accumulate adds left to right,
    as `start + d` step by step); step times >= 0 keep the starts sorted, so the first step past the limit is
    found by bisection (a negative one: the block is scanned in order)."""
    return clock_steps(decode, run.count, run.total, run.plan_decode_steps(), start, limit, ends_before=ends_before)


def clock_steps(decode: Callable[[int], float], count: int, total: int, left: int, start: float, limit: float, *,
                ends_before: bool):
    """plan_decode_clock's clock of `left` steps of `count` decoders whose contexts sum to `total` at the first."""
    starts, ends, seconds = [], [], []
    # First block: about the steps until the limit at the first step's time (steps only grow longer)
    first = decode(total) if left else 0.0
    gap = limit - start
    block = left if gap == float("inf") or first <= 0 else max(1, int(gap / first) + 2)
    while left:
        m = block if block < left else left
        ds = list(map(decode, range(total, total + m * count, count)))
        clock = list(accumulate(ds, initial=start))     # clock[j]: start of block step j, clock[m]: end
        if min(ds) < 0:      # a negative step time: the clock is not sorted, scan it in order
            ok = 0
            while ok < m and (clock[ok + 1] < limit if ends_before else clock[ok] < limit):
                ok += 1
        elif ends_before:
            ok = bisect_left(clock, limit, 1, m + 1) - 1  # steps ending before the limit
        else:
            ok = bisect_left(clock, limit, 0, m)          # steps starting before the limit
        if ok:
            starts += clock[:ok]
            ends += clock[1:ok + 1]
            seconds += ds[:ok]
            start = clock[ok]
            total += ok * count
        if ok < m:
            break
        left -= m
        block = 16
    return starts, ends, seconds, start


def plan_run(run, step_time, start: float, limit: float, *, ends_before: bool):
    """The steps of decode run `run` from `start` as plan_decode_clock plans a decoders-only one, with the
    step-time source's `decode_fn` (and `composition` for steps with prefill chunks, DecodeRun.next_step):
    (starts, ends, seconds, per step its prefill chunks or None for a decoders-only run, the end of the last
    step or `start`). ends_before: the steps ending before `limit`; else the steps starting before it."""
    count, total = run.count, run.total
    decode = step_time.decode_fn(count)
    if not run.prefills and not run.admits_first:
        starts, ends, seconds, end = plan_decode_clock(run, decode, start, limit, ends_before=ends_before)
        return starts, ends, seconds, None, end
    composition = step_time.composition
    starts, ends, seconds, chunk_lists = [], [], [], []
    while ends_before or start < limit:
        chunks = run.next_step()
        if chunks is None:
            break
        d = composition(count, total, chunks) if chunks else decode(total)
        end = start + d
        if ends_before and not end < limit:
            break
        starts.append(start)
        ends.append(end)
        seconds.append(d)
        chunk_lists.append(chunks)
        start = end
        total += count
    return starts, ends, seconds, chunk_lists, start


def plan_stage_clock(run, stage_fn: Callable, start: float, limit: float, *, ends_before: bool):
    """The steps of decode run `run` (decoders only) on a pipelined instance from `start`, one batch at a time:
    step j's (stages, sends) = stage_fn(its decoders' context sum), its end the stages' chain as
    StagePipeline.run_stages adds it on free stages (stage s starts when the batch arrives from stage s - 1), the
    next step dispatched at that end. (starts, ends, per-step stage seconds, per-stage free times after the last
    step, the end of the last step or `start`). ends_before / limit as plan_decode_clock; a negative stage or
    send time ends the plan (the loop would not start the next step at that end)."""
    count, total = run.count, run.total
    left = run.plan_decode_steps()
    starts, ends, stage_list, free = [], [], [], None
    while left and (ends_before or start < limit):
        stages, sends = stage_fn(total)
        if min(stages) < 0 or (sends and min(sends) < 0):
            break
        ready = start
        ready_at = []
        for s, seconds in enumerate(stages):
            if s:
                ready = ready + sends[s - 1]
            ready = ready + seconds
            ready_at.append(ready)
        if ends_before and not ready < limit:
            break
        starts.append(start)
        ends.append(ready)
        stage_list.append(stages)
        free = ready_at
        start = ready
        total += count
        left -= 1
    return starts, ends, stage_list, free, start


# Half-steps a pair run plans at most: its requests' records wait for its end (memory), and a longer run saves
# nothing measurable (one ordinary half-step and one reading of the running list per run).
PAIR_RUN_LENGTH = 1024


def plan_pair_clock(run, stage_fn: Callable, stage_free: Sequence[float], t: float, first_end: float,
                    limit: float, pages: int, max_collects: int, arrive: Optional[Callable] = None):
    """The half-steps of pair run `run` (pdjax.scheduler.pair_runs.PairRun) from host time t, the batch in flight
    ending at first_end, its stages free from `stage_free`: batch h of group h % 2 dispatched at times[h] with
    stage_fn(its decodes)(their context sum, its chunks) -> (stages, sends) (the source's composition_stages_fn),
    chained on the stages as StagePipeline.run_stages; at h >= 1 the host first collects the oldest batch at
    times[h] = max(its end, times[h - 1]) (run.collect: the pages its finishes free). It ends (H = the
    half-steps) at the first h whose collect comes at or after `limit` (the next arrival) unless the run admits
    (`run.queue`: arrive(at, queue) appends the requests arrived by `at` and returns the next arrival time, None at
    one the run cannot take), or whose collect ends the run (`run.stops`), or whose schedule cannot be planned
    (PairRun.schedule_next, with `pages` free pages), takes a negative stage time or passes max_collects.
    (times[0 .. H], ends, stages, stage free times after batch H - 1, H)."""
    times, ends, stage_list = [t], [], []
    free = list(stage_free)
    fns: dict = {}
    collect, schedule_next = run.collect, run.schedule_next
    at = t
    h = 0
    while True:
        if h:
            prev = first_end if h == 1 else ends[h - 2]
            if prev > at:
                at = prev
            times.append(at)
            pages += collect(h)
            if run.stops:
                run.ends_completing = True
                break
            if not at < limit:
                limit = arrive(at, run.queue) if arrive is not None and run.queue is not None else None
                if limit is None:
                    break
        if h + 1 > max_collects:
            break
        planned = schedule_next(h % 2, pages)
        if planned is None:
            break
        grow, chunks, count, total = planned
        fn = fns.get(count)
        if fn is None:
            fn = fns[count] = stage_fn(count)
        stages, sends = fn(total, chunks)
        if min(stages) < 0 or (sends and min(sends) < 0):
            break
        pages -= grow
        ends.append(clock_stages(stages, sends, times[h], free))
        stage_list.append(stages)
        h += 1
    return times, ends, stage_list, free, h


def apply_run(run, pipeline, requests: SimRequests, starts: Sequence[float], ends: Sequence[float],
              seconds: Sequence[float]) -> None:
    """Apply the first len(starts) planned steps of decode run `run` (pdjax.scheduler.runs.DecodeRun): its
    scheduler's state, the records of the requests it finished, the one-stage pipeline's accounting."""
    finished = run.apply(starts, ends)
    if finished:
        requests.finished(finished, run.sched)
    pipeline.run_serial(starts, ends, seconds)


class RunStep:
    """The in-flight step of an instance whose decode run ended with a step across the next event
    (Simulation.decode_run): applied already; its completion event only records it and wakes the instance."""
    __slots__ = ("record",)

    def __init__(self, record: IterationRecord):
        self.record = record


def _never_stale_ok(inst, req, prefill_tokens: int) -> bool:
    return False


class LazyRun:
    """A replica's decode run applied as time passes (Simulation.replica_run): planned steps starts/ends/seconds/
    chunk_lists (per step its prefill chunks; None: a decoders-only run); steps before `applied` applied, step
    `applied` scheduled too (its schedule() side: DecodeRun.schedule_step) when `scheduled`. `end`: the end of its
    last step, when its completion event comes."""
    __slots__ = ("run", "starts", "ends", "seconds", "chunk_lists", "applied", "scheduled", "end")

    def __init__(self, run, starts: List[float], ends: List[float], seconds: List[float], chunk_lists):
        self.run, self.starts, self.ends, self.seconds, self.chunk_lists = run, starts, ends, seconds, chunk_lists
        self.applied, self.scheduled, self.end = 0, False, ends[-1]

    def steps_at(self, t: float) -> Tuple[int, int]:
        """(its planned steps ended by t, its planned steps started before t)."""
        j = bisect_right(self.ends, t)
        return j, (j + 1 if j < len(self.starts) and self.starts[j] < t else j)


class PendingRun:
    """The decode run of a disaggregated deployment's one decode instance (Simulation.pass_idx) planned from
    starts[0] but applied only when its last step ends (Simulation.start_pending_run): other instances' steps,
    arrivals and handoffs go on meanwhile (they touch only its KV queues); a KV landing at L (known when its
    transfer starts) drops the planned steps starting at or after L (truncate_pending). Its iteration records are
    made when their place in completion order is known (Simulation.flush_deferred: the first `emitted` are out;
    the rest wait in Simulation.deferred once it is applied), step numbers from `step`. seq: its completion's heap
    key. left: steps of the run not clocked yet (clocked up to a horizon: the next other instance's step end;
    finish_pending clocks more unless a KV landing came meanwhile)."""
    __slots__ = ("run", "starts", "ends", "seconds", "chunk_lists", "step", "emitted", "seq", "left")

    def __init__(self, run, starts: List[float], ends: List[float], seconds: List[float],
                 chunk_lists: Optional[list], step: int, seq: int):
        self.run, self.starts, self.ends, self.seconds, self.seq = run, starts, ends, seconds, seq
        self.chunk_lists, self.step, self.emitted, self.left = chunk_lists, step, 0, 0


class Simulation:
    """The state of one simulation, colocated or disaggregated, and its steps: the one event loop of both
    deployment kinds (as the engine's pdjax.serving.cluster.ClusterEngine drives both). `colocated` /
    `disaggregated` build it; `run` runs it. At each event time t:
      finish_steps(t)    every step ending at t: (sync) collect the oldest batch in flight and update its
                         scheduler, record the iteration; finished prefills of a disaggregated deployment are
                         handed off (handoff: decode router -> add_handoff -> start_transfer on the link)
      land_transfer(t)   the next KV arrival at t: mark_kv_arrived on the decode side, release on the prefill side
                         (the two repeat until nothing more is due at t: a zero-time transfer can land at once)
      return_idle(t)     the mixed pool's idle instances return to it (pdjax.sim.disagg; no-op without one)
      route_arrivals(t)  every arrival at t: the router picks an instance; colocated: the request joins its inbox
                         (admitted at the engine loop's admit points); disaggregated: add_request at once
      start_steps(t)     every woken instance not blocked collecting runs its engine loop (run_loop: the batch
                         queue, with decode runs in bulk; run_async: the asynchronous loop) until it blocks
    A colocated deployment has no transfers and no mixed pool; its iteration records count steps over the whole
    run and name instances only when there are several; a disaggregated one counts steps per instance. Ties in the
    completion heap go by instance index (colocated) or by insertion order (disaggregated). A router with an
    `observe_step(instance, out)` method (a test-only router of pdjax.scheduler.routing that keeps its own load
    figures) is told every completed step; no other per-step routing work is done."""

    def __init__(self, requests, instances: Sequence[SimInstance], route: Callable, *, direct: bool, sample,
                 on_schedule, max_iterations: int, decode_runs: Sequence[bool], async_scheduling: bool = False,
                 observe_step: Optional[Callable] = None, pool=None):
        self.instances = list(instances)
        self.route, self.direct, self.pool = route, direct, pool
        self.observe_step = observe_step
        self.async_scheduling = async_scheduling
        self.sample, self.on_schedule, self.max_iterations = sample, on_schedule, max_iterations
        self.requests = SimRequests(requests)
        self.pending = self.requests.pending      # in arrival order; entries before next_arrival have arrived
        self.next_arrival = 0
        self.iterations: List[IterationRecord] = []
        self.completions: list = []       # heap of (end time, tie key, instance index)
        self.seq = None if pool is None else itertools.count()    # tie key: index (colocated), insertion order
        multi = pool is not None or len(self.instances) > 1
        self.names = [inst.name if multi else "" for inst in self.instances]
        self.global_steps = pool is None  # colocated: iteration steps count over the run, else per instance
        self.single = pool is None and len(self.instances) == 1   # decode runs up to the next arrival
        # several colocated replicas: each one's decode runs go up to the next arrival (only the router reads
        # another instance's state), their records out of completion order until `run` sorts them (replica_order)
        # (not with a host KV tier shared by replicas: its LRU order follows their evictions in time order)
        tiers = [id(inst.scheduler.block_manager.host_tier) for inst in self.instances
                 if getattr(inst.scheduler.block_manager, "host_tier", None) is not None]
        self.replicas = (pool is None and len(self.instances) > 1 and len(set(self.names)) == len(self.names)
                         and len(set(tiers)) == len(tiers))
        # (replica, request, prompt tokens of its unapplied steps) -> the router may read it (RouterInfo.stale_ok),
        # given their tokens and pages in unapplied; default never. router_reads: False if it reads none (round robin)
        self.stale_ok, self.unapplied, self.router_reads = _never_stale_ok, {}, True
        self.lazy_cut: Dict[Tuple[float, int], int] = {}   # (end, replica): completions of LazyRuns cut since
        self.waking = [False] * len(self.instances)     # ready to run its loop at the current time
        self.index_of = {id(inst): i for i, inst in enumerate(self.instances)}
        self.decode_runs = list(decode_runs)
        # per instance: its decode runs may end with a step across the next event (Simulation.decode_run)
        self.cross = [False] * len(self.instances)
        # per instance: schedule() calls per step of its decode runs on stages (0: one stage, one batch in flight)
        self.run_schedules = [0 if inst.max_in_flight == 1 and inst.timer.stage_times is None
                              else 2 if inst.max_in_flight > 1 else 1 for inst in self.instances]
        # per instance: pair runs (Simulation.pair_run: one colocated instance, two batches in flight)
        self.pair_runs = [self.single and self.run_schedules[i] == 2 and inst.max_in_flight == 2
                          for i, inst in enumerate(self.instances)]
        self.pair_after = [0.0] * len(self.instances)    # pair_run: no run is tried before this time
        self.pair_again = False
        self.run_again = True             # decode_run: the run it applied may be followed by another at once
        # decode_run: per instance, no run is tried while the next event is closer than this: the seconds of its
        # last run's last step, or of the first step of the last run that could not take one (steps of one
        # instance change slowly; a run not tried is only slower, never different)
        self.short_gap = [0.0] * len(self.instances)
        # disaggregated: KV transfers (pdjax.sim.disagg sets transfer_time, kv_bytes_of, serialize_transfers)
        self.transfers: List[TransferRecord] = []
        self.kv_arrivals: list = []        # heap of (end time, seq, TransferRecord, src index, dst index)
        self.link_free: Dict[Tuple[int, int], float] = {}
        self.transfer_time = self.kv_bytes_of = None
        self.serialize_transfers = True
        # disaggregated, one decode instance (pdjax.sim.disagg sets it): its decode runs are PendingRuns, their
        # records wait in `deferred` (in step order) until completion order places them; `stale`: the heap keys
        # of the completions of PendingRuns shortened since
        self.pass_idx = -1
        self.pending_run: Optional[PendingRun] = None
        self.deferred: deque = deque()
        self.stale: set = set()

    @classmethod
    def colocated(cls, requests, instances, router, async_scheduling, sample, on_schedule, max_iterations,
                  decode_runs: bool = True) -> "Simulation":
        """Replicas, each request routed by router(request, instances) into an inbox. Decode runs (decode_run):
        nobody watches single steps (no on_schedule, no observing router), the tokens are the placeholder, the
        synchronous loop; per instance one stage, one batch in flight and a step time exact for decode-only steps
        from their counts."""
        instances = list(instances)
        observe_step = getattr(router, "observe_step", None)
        plain = (decode_runs and not async_scheduling and on_schedule is None and observe_step is None
                 and sample is placeholder_sample)
        state = cls(requests, instances, lambda req, t: router(req, instances), direct=False, sample=sample,
                    on_schedule=on_schedule, max_iterations=max_iterations,
                    decode_runs=[plain and decode_run_ready(inst) for inst in instances],
                    async_scheduling=async_scheduling, observe_step=observe_step)
        if isinstance(router, InstanceRouter):
            state.stale_ok, state.unapplied = router.stale_ok, router.unapplied
            state.router_reads = router.reads_instances
        return state

    # ------------------------------------------------------------------------------------------- events
    def next_event_time(self) -> float:
        inf = float("inf")
        t_arrival = self.pending[self.next_arrival].arrival_time if self.next_arrival < len(self.pending) else inf
        t_done = self.completions[0][0] if self.completions else inf
        if self.kv_arrivals and self.kv_arrivals[0][0] < t_done:
            t_done = self.kv_arrivals[0][0]
        return t_arrival if t_arrival < t_done else t_done

    def step_or_transfer_due(self, t: float) -> bool:
        return bool(self.completions and self.completions[0][0] <= t
                    or self.kv_arrivals and self.kv_arrivals[0][0] <= t)

    def run(self) -> float:
        """The event loop until no event is left; returns the last event time (check_done has checked it)."""
        now, inf = 0.0, float("inf")
        pool = self.pool if self.pool is not None and self.pool.active else None
        transfers = self.pool is not None
        finish_steps, route_arrivals, start_steps = self.finish_steps, self.route_arrivals, self.start_steps
        with gc_paused():
            while True:
                t = self.next_event_time()
                if t == inf:
                    break
                now = t
                if transfers:
                    while self.step_or_transfer_due(now):
                        finish_steps(now)
                        self.land_transfer(now)
                    if pool is not None:
                        pool.return_idle(now)
                else:
                    finish_steps(now)
                route_arrivals(now)
                start_steps(now)
        self.iterations += self.deferred
        self.deferred.clear()
        if self.replicas:         # runs recorded steps ahead of the other replicas' events
            self.replica_order()
        self.check_done(now)
        return now

    def replica_order(self) -> None:
        """Several colocated replicas whose runs recorded their steps when applied, ahead of the other instances'
        events: the records in completion order, as the event loop appends them one by one (the completion heap's
        (end time, instance index)), and numbered in that order. Each instance's records are in its own step order
        (its steps end one after another), so a stable sort by end time, then by instance index among equal end
        times, is that order."""
        its = self.iterations
        its.sort(key=_END_TIME)
        ends = list(map(_END_TIME, its))
        if any(map(operator.eq, ends, islice(ends, 1, None))):   # ties: each group of them by instance index
            rank = {name: i for i, name in enumerate(self.names)}
            i, n = 0, len(its)
            while i < n:
                j = i + 1
                while j < n and ends[j] == ends[i]:
                    j += 1
                if j - i > 1:
                    its[i:j] = sorted(its[i:j], key=lambda r: rank[r.instance])
                i = j
        any(map(setattr, its, repeat("step"), range(len(its))))

    def push_completion(self, end: float, idx: int) -> None:
        heapq.heappush(self.completions, (end, idx if self.seq is None else next(self.seq), idx))

    def finish_steps(self, t: float) -> None:
        """Every step ending at t: (sync) collect the oldest batch in flight and update the scheduler with it (the
        async loop updated it at dispatch), record the iteration, wake the instance, hand off or record the
        requests it finished."""
        completions, its, stale, deferred = self.completions, self.iterations, self.stale, self.deferred
        lazy_cut = self.lazy_cut
        while completions and completions[0][0] <= t:
            end, seq, idx = heapq.heappop(completions)
            if stale and seq in stale:       # a PendingRun's completion before it was shortened
                stale.discard(seq)
                continue
            inst = self.instances[idx]
            if inst.in_flight.__class__ is PendingRun:
                self.finish_pending(idx)
                continue
            if lazy_cut and (end, idx) in lazy_cut:     # the completion a LazyRun had before it was cut short
                lazy_cut[end, idx] -= 1
                if not lazy_cut[end, idx]:
                    del lazy_cut[end, idx]
                continue
            if inst.in_flight.__class__ is LazyRun:
                self.finish_lazy(idx, t)
                continue
            if inst.in_flight.__class__ is RunStep:   # a decode run's last step, applied already: its record
                if deferred or self.pending_run is not None:
                    self.flush_deferred(t, inst.in_flight.record.start_time, idx)
                its.append(inst.in_flight.record)
                inst.in_flight = None
                self.waking[idx] = True
                continue
            out, start = inst.in_flight[0], inst.in_flight[1]
            inst.in_flight = None
            finished = None
            if not self.async_scheduling:
                inst.pipeline.collect(t)      # the oldest batch in flight (= inst.in_flight), in dispatch order
                finished = inst.scheduler.update(out, self.sample(out), t)
            if self.observe_step is not None:
                self.observe_step(inst, out)
            if deferred or self.pending_run is not None:
                self.flush_deferred(t, start, idx)
            its.append(IterationRecord(
                step=len(its) if self.global_steps else inst.num_steps, start_time=start, end_time=t,
                num_prefill_tokens=out.num_prefill_tokens, num_decode_tokens=out.num_decode_tokens,
                num_seqs=len(out.req_ids), instance=self.names[idx]))
            inst.num_steps += 1
            self.waking[idx] = True
            if len(its) > self.max_iterations:
                raise RuntimeError(f"simulation exceeded max_iterations={self.max_iterations}")
            if finished:
                self.finished(idx, finished, t)

    def finish_lazy(self, idx: int, t: float) -> None:
        """Replica idx's LazyRun ends at t: its steps not applied yet, their records, the requests it finished."""
        inst = self.instances[idx]
        lazy, inst.in_flight = inst.in_flight, None
        finished = self.advance_lazy(idx, lazy, len(lazy.starts))
        self.waking[idx] = True
        if finished:
            self.finished(idx, finished, t)

    def advance_lazy(self, idx: int, lazy: LazyRun, j: int) -> list:
        """Apply LazyRun `lazy`'s steps before j (its scheduler state, records, stage accounting); returns the
        requests they finished."""
        a = lazy.applied
        if j <= a:
            return []
        starts, ends, seconds, chunk_lists = lazy.starts[a:j], lazy.ends[a:j], lazy.seconds[a:j], lazy.chunk_lists
        finished = lazy.run.apply_range(a, starts, ends, scheduled=lazy.scheduled)
        lazy.applied, lazy.scheduled = j, False
        self.instances[idx].pipeline.run_serial(starts, ends, seconds)
        self.record_run(idx, lazy.run.count, starts, ends, None if chunk_lists is None else chunk_lists[a:j])
        return finished

    def catch_up(self, idx: int, t: float) -> None:
        """Replica idx's LazyRun as the event loop would have it at t, before routing the arrivals at t: the steps
        ending by t applied, the one running across t scheduled."""
        lazy = self.instances[idx].in_flight
        j, started = lazy.steps_at(t)
        if self.advance_lazy(idx, lazy, j):
            raise RuntimeError(f"replica {self.names[idx]!r}: a run finished a request before its last step")
        if started > j and not lazy.scheduled:
            lazy.run.schedule_step(j, lazy.starts[j])
            lazy.scheduled = True

    def catch_up_read(self, req, t: float) -> None:
        """Catch up every replica whose LazyRun changes what the router reads of it to route `req` at t, but the
        tokens and pages of its steps that catch_up would apply or schedule (given the router in `unapplied`)."""
        stale_ok, unapplied = self.stale_ok, self.unapplied
        for idx, inst in enumerate(self.instances):
            lazy = inst.in_flight
            if lazy.__class__ is not LazyRun:
                continue
            j, started = lazy.steps_at(t)
            if j == len(lazy.ends):     # its last step (a finish, a prompt done) ended at t: applied first
                self.catch_up(idx, t)
                continue
            tokens = 0
            if lazy.chunk_lists is not None:
                for chunks in lazy.chunk_lists[lazy.applied:j]:
                    for n, _ in chunks:
                        tokens += n
            if not stale_ok(inst, req, tokens):
                self.catch_up(idx, t)
            else:     # (pages: counted only if the router reads them)
                pages = partial(lazy.run.pages_granted, lazy.applied + lazy.scheduled, started)
                unapplied[id(inst)] = (tokens, pages, tokens + lazy.run.count * (j - lazy.applied))

    def cut_lazy(self, idx: int, t: float) -> None:
        """An arrival at t was routed to replica idx: its LazyRun ends with the step running across t (then the
        loop admits it), or now when none is. The steps it keeps stay unapplied (nothing reads the replica before
        their end but the router, through stale_ok) unless it ends now."""
        inst = self.instances[idx]
        lazy = inst.in_flight
        _, n = lazy.steps_at(t)
        if n == len(lazy.starts):
            return
        self.lazy_cut[lazy.end, idx] = self.lazy_cut.get((lazy.end, idx), 0) + 1
        del lazy.starts[n:], lazy.ends[n:], lazy.seconds[n:]
        if lazy.chunk_lists is not None:
            del lazy.chunk_lists[n:]
        if n:
            lazy.end = lazy.ends[-1]
            self.push_completion(lazy.end, idx)
            return
        inst.in_flight = None     # nothing in flight (nor applied: no step ended by t): its loop runs at t

    def finished(self, idx: int, finished: Sequence, t: float) -> None:
        """Requests instance `idx`'s step finished at t: a 'handoff' (a prefill_only scheduler's) is handed off
        (disaggregated) or its pages freed (colocated: no decode side simulated); the others are recorded."""
        sched = self.instances[idx].scheduler
        done = []
        for req in finished:
            if req.finish_reason != "handoff":
                done.append(req)
            elif self.pool is not None:
                self.handoff(idx, req, t)
            else:
                sched.release(req.request_id)
                done.append(req)
        self.requests.finished(done, sched)    # handed-off ones finish on the decode side

    # ------------------------------------------------------------------------------------------- transfers
    def handoff(self, src_idx: int, req, t: float) -> None:
        """A finished prefill: the decode router (MixedPool / BorrowingPool.pick_decode) picks its instance; the
        prefilling machine itself (borrowing mixed pool) keeps it (keep_local, no transfer); a rejection releases
        it on the prefill side at once, else its KV transfer starts."""
        src = self.instances[src_idx]
        dst = self.pool.pick_decode(req, t, src)
        if dst is None:            # rejected after its prefill (pdjax.scheduler.overload.AdmittingPool)
            src.scheduler.release(req.request_id)
            self.waking[src_idx] = True
            return
        if dst is src:
            src.scheduler.keep_local(req.request_id, t)
            self.waking[src_idx] = True
            return
        if not dst.scheduler.add_handoff(req, t):
            src.scheduler.release(req.request_id)
            self.waking[src_idx] = True
            return
        self.start_transfer(src_idx, self.index_of[id(dst)], req, t)

    def start_transfer(self, src_idx: int, dst_idx: int, req, t: float) -> None:
        """Queue req's KV on the (src, dst) link (FIFO when serialized) and schedule its arrival."""
        src, dst = self.instances[src_idx], self.instances[dst_idx]
        # Partial transfer (DecodeOnlyScheduler.reuse_prefix): the leading pages dst holds already stay put.
        tokens = req.num_computed_tokens - req.num_kv_local_pages * dst.scheduler.config.page_size
        link = (src_idx, dst_idx)
        start = max(t, self.link_free.get(link, t)) if self.serialize_transfers else t
        end = start + self.transfer_time(src, dst, tokens)
        self.link_free[link] = end
        kv = self.kv_bytes_of(tokens)
        record = TransferRecord(request_id=req.request_id, src=src.name, dst=dst.name, num_tokens=tokens,
                                kv_bytes=kv, ready_time=t, start_time=start, end_time=end, moved_bytes=kv)
        self.transfers.append(record)
        heapq.heappush(self.kv_arrivals, (end, next(self.seq), record, src_idx, dst_idx))
        if dst_idx == self.pass_idx and dst.in_flight.__class__ is PendingRun:
            self.truncate_pending(dst_idx, end)

    # ------------------------------------------------------------------------------------------- pending runs
    def start_pending_run(self, idx: int, t: float) -> Optional[float]:
        """Plan instance `idx`'s (Simulation.pass_idx) decode run from t: every step up to the run's first finish
        that starts before the next known KV landing, its PendingRun in flight until the last one ends (applied
        then: finish_pending); returns that end, None when there is no run. What happens meanwhile touches only
        its KV queues (add_handoff); a landing stops the run before the step that would admit it."""
        inst = self.instances[idx]
        run = inst.scheduler.decode_run(self.max_iterations - len(self.iterations) - len(self.deferred))
        if run is None:
            return None
        limit = self.kv_arrivals[0][0] if self.kv_arrivals else float("inf")
        left = 0
        if run.prefills:
            starts, ends, seconds, chunk_lists, end = plan_run(run, inst.timer.step_time, t, limit,
                                                               ends_before=False)
        else:     # clocked up to the next step end of another instance (its handoffs may land soon after)
            horizon = self.completions[0][0] if self.completions else limit
            left = run.plan_decode_steps()
            starts, ends, seconds, end = clock_steps(inst.timer.step_time.decode_fn(run.count), run.count,
                                                     run.total, left, t, min(horizon, limit), ends_before=False)
            chunk_lists, left = None, (left - len(starts) if horizon < limit else 0)
        if not starts:
            return None
        seq = next(self.seq)
        pend = inst.in_flight = self.pending_run = PendingRun(run, starts, ends, seconds, chunk_lists,
                                                              inst.num_steps, seq)
        pend.left = left
        heapq.heappush(self.completions, (end, seq, idx))
        return end

    def extend_pending(self, idx: int, pend: PendingRun) -> bool:
        """Clock more steps of PendingRun `pend` (no KV landing came since it was clocked) from its last end, up
        to the next step end of another instance and the next known landing; False when none is left to clock."""
        limit = self.kv_arrivals[0][0] if self.kv_arrivals else float("inf")
        horizon = self.completions[0][0] if self.completions else limit
        run, k = pend.run, len(pend.starts)
        starts, ends, seconds, end = clock_steps(self.instances[idx].timer.step_time.decode_fn(run.count),
                                                 run.count, run.total + k * run.count, pend.left, pend.ends[-1],
                                                 min(horizon, limit), ends_before=False)
        if not starts:
            return False
        pend.left = pend.left - len(starts) if horizon < limit else 0
        pend.starts += starts
        pend.ends += ends
        pend.seconds += seconds
        pend.seq = next(self.seq)
        heapq.heappush(self.completions, (end, pend.seq, idx))
        return True

    def truncate_pending(self, idx: int, landing: float) -> None:
        """A KV transfer to instance `idx` lands at `landing`: its PendingRun keeps the steps starting before
        then (the step that starts at or after it would admit the request; any step whose record is out started
        before now <= landing), its completion moves earlier."""
        pend = self.instances[idx].in_flight
        starts = pend.starts
        if landing <= pend.ends[-1]:
            pend.left = 0        # the step after the last one would see it
        k = next((j for j, s in enumerate(starts) if s >= landing), None)
        if k is None:
            return
        if k == 0:
            raise RuntimeError(f"pending decode run of {self.names[idx]!r} from {starts[0]} cut by a KV landing at "
                               f"{landing}: nothing may land before the run's first step")
        del starts[k:], pend.ends[k:], pend.seconds[k:]
        if pend.chunk_lists is not None:
            del pend.chunk_lists[k:]
        self.stale.add(pend.seq)
        pend.seq = next(self.seq)
        heapq.heappush(self.completions, (pend.ends[-1], pend.seq, idx))

    def finish_pending(self, idx: int) -> None:
        """Instance `idx`'s PendingRun ended: apply its steps (scheduler, finished requests' records, stage
        accounting) and wake the instance; its iteration records not out yet wait in `deferred` (flush_deferred)."""
        inst = self.instances[idx]
        pend = inst.in_flight
        if pend.left and self.extend_pending(idx, pend):
            return
        inst.in_flight = self.pending_run = None
        a = pend.emitted
        self.deferred += self.run_records(idx, pend.run.count, pend.starts[a:], pend.ends[a:],
                                          None if pend.chunk_lists is None else pend.chunk_lists[a:], pend.step + a)
        apply_run(pend.run, inst.pipeline, self.requests, pend.starts, pend.ends, pend.seconds)
        inst.num_steps += len(pend.starts)
        self.waking[idx] = True

    def flush_deferred(self, t: float, start: float, idx: int) -> None:
        """Before the record of instance idx's step [start, t]: the deferred records that complete before it: an
        earlier end, or the same end and an earlier dispatch (the completion heap's insertion order; at one
        dispatch time instances dispatch in index order): those of applied runs (`deferred`), then the steps of the
        PendingRun in flight."""
        deferred, its, k = self.deferred, self.iterations, self.pass_idx
        while deferred:
            r = deferred[0]
            end = r.end_time
            if end < t or (end == t and (r.start_time < start or (r.start_time == start and k < idx))):
                its.append(deferred.popleft())
            else:
                return
        pend = self.pending_run
        if pend is None:
            return
        starts, ends, a = pend.starts, pend.ends, pend.emitted
        j, n = a, len(starts)
        while j < n and (ends[j] < t or (ends[j] == t and (starts[j] < start or (starts[j] == start and k < idx)))):
            j += 1
        if j > a:
            its += self.run_records(k, pend.run.count, starts[a:j], ends[a:j],
                                    None if pend.chunk_lists is None else pend.chunk_lists[a:j], pend.step + a)
            pend.emitted = j

    def land_transfer(self, t: float) -> None:
        """The next KV arrival due at t: the decode side may admit it, the prefill side frees its pages."""
        if not (self.kv_arrivals and self.kv_arrivals[0][0] <= t):
            return
        _, _, record, src_idx, dst_idx = heapq.heappop(self.kv_arrivals)
        self.instances[dst_idx].scheduler.mark_kv_arrived(record.request_id)
        self.instances[src_idx].scheduler.release(record.request_id)
        self.waking[src_idx] = self.waking[dst_idx] = True

    # ------------------------------------------------------------------------------------------- arrivals
    def route_arrivals(self, t: float) -> None:
        """Every arrival at t: route(request, t) picks its instance; colocated, it waits in that inbox until the
        instance's loop admits it; disaggregated, add_request at once (a rejection finishes it there)."""
        pending, direct = self.pending, self.direct
        replicas = self.replicas
        while self.next_arrival < len(pending) and pending[self.next_arrival].arrival_time <= t:
            req = self.requests.arrived(self.next_arrival)
            self.next_arrival += 1
            if replicas and self.router_reads:
                self.catch_up_read(req, t)
            inst = self.route(req, t)
            if self.unapplied:
                self.unapplied.clear()
            if inst is None:       # rejected at its arrival (pdjax.scheduler.overload.AdmittingPool)
                continue
            if replicas and inst.in_flight.__class__ is LazyRun:
                self.cut_lazy(self.index_of[id(inst)], t)
            if direct:
                inst.scheduler.add_request(req)
            else:
                inst.inbox.append(req)
            self.waking[self.index_of[id(inst)]] = True

    def start_steps(self, t: float) -> None:
        for idx, inst in enumerate(self.instances):
            if not self.waking[idx]:
                continue
            self.waking[idx] = False
            if self.async_scheduling:
                # After a collect with nothing dispatched, the engine waits for an arrival (admitting any that came
                # during the step) instead of scheduling again at once.
                if not inst.busy and (not inst.waits_for_arrival or (inst.inbox and
                                                                     inst.inbox[0].arrival_time <= t)):
                    inst.waits_for_arrival = False
                    self.run_async(idx, t)
            elif not inst.busy:
                self.run_loop(idx, t)

    # ------------------------------------------------------------------------------------------- engine loops
    @staticmethod
    def admit(inst: SimInstance, t: float) -> int:
        """Move every request of inst's inbox that arrived by t into its scheduler; returns how many."""
        box = inst.inbox
        n = 0
        add = inst.scheduler.add_request
        while box and box[0].arrival_time <= t:
            add(box.popleft())
            n += 1
        return n

    def run_loop(self, idx: int, t: float) -> None:
        """The engine's batch-queue loop of instance `idx` at time t, until the host blocks collecting the oldest
        batch in flight or has to wait for an arrival (a disaggregated instance's inbox stays empty: its requests
        and handoffs reach the scheduler at their own time)."""
        inst = self.instances[idx]
        sched, pipe, admit, on_schedule = inst.scheduler, inst.pipeline, self.admit, self.on_schedule
        runs = self.decode_runs[idx]
        pairs = runs and self.pair_runs[idx]
        while True:
            if not sched.has_unfinished():
                if not admit(inst, t):
                    if not pipe:
                        return                 # idle: woken by its next arrival
                    break
                continue
            if not pipe.full:
                admit(inst, t)
                if runs and not pipe:
                    end = self.decode_run(idx, t)
                    if end is not None:
                        if inst.in_flight is not None:
                            return            # the run's last step ends after the next event: blocked until then
                        t = end
                        runs = self.run_again     # a run cut short by the next event is not tried again at once
                        continue
                elif pairs and len(pipe) == 1:
                    end = self.pair_run(idx, t)
                    pairs = False             # the group collected last is scheduled one by one next,
                    if end is not None:
                        t = end
                        pairs = self.pair_again   # unless the run ended with a prompt's completion
                        continue
                out = sched.schedule(t)
                if not out.is_empty:
                    admit(inst, t)
                    if on_schedule is not None:
                        on_schedule(inst, out, t)
                    inst.run_stages(out, t)
                    if not pipe.full:
                        continue
                elif not pipe:
                    if not admit(inst, t):
                        return                 # blocked: woken by its next arrival
                    continue
            break
        out, start, end = pipe.peek()      # the host blocks collecting the oldest batch
        inst.in_flight = (out, start)
        self.push_completion(end if end > t else t, idx)

    def decode_run(self, idx: int, t: float) -> Optional[float]:
        """Run instance `idx`'s next steps at once while they are a decode run (pdjax.scheduler.runs: every running
        request decodes one token or takes its prefill chunk, no preemption, no admission; requests finish and
        prompts complete only in the run's last step) that the rest of the simulation cannot interleave with: the
        steps this loop would run one by one, with the same scheduler state (DecodeRun.apply), step times (the
        step-time function's `decode_fn` / `composition`), pipeline accounting (StagePipeline.run_serial) and
        iteration records, without building their SchedulerOutputs. Returns the end of the last step, the loop
        goes on from there as after that step's completion event; None when no step qualifies.

        Which steps: with one colocated instance, every step scheduled before the next arrival (the last one may
        end after it: the arrival is routed at that end, before the loop goes on, as the event loop would: it
        only joins the inbox while the step runs); else only steps that end before any other event (an arrival,
        another instance's completion, a KV landing), and none while an instance after this one still has to
        run its loop at t; an instance marked `cross` (a disaggregated decode instance whose state nothing reads
        before its step ends: pdjax.sim.disagg) also takes the step across the next event, applied at once and
        recorded at its end (RunStep: the instance is blocked until then, as collecting that step)."""
        if idx == self.pass_idx:
            return self.start_pending_run(idx, t)
        limit = self.run_limit(idx, t)
        if limit is None:
            return None
        inst = self.instances[idx]
        run = inst.scheduler.decode_run(self.max_iterations - len(self.iterations))
        if run is None:
            return None
        if self.replicas and not self.run_schedules[idx]:
            return self.replica_run(idx, run, t, limit)
        single = self.single
        applied = self.apply_decode_run(inst, run, t, limit, ends_before=not (single or self.cross[idx]),
                                        schedules=self.run_schedules[idx])
        if applied is None:
            if not single:
                self.short_gap[idx] = run.count and inst.timer.step_time.decode_fn(run.count)(run.total)
            return None
        starts, ends, chunk_lists, end = applied
        self.record_run(idx, run.count, starts, ends, chunk_lists)
        if not single:
            self.short_gap[idx] = ends[-1] - starts[-1]
            if not end < limit:    # cross: the last step ends at or after the next event
                inst.in_flight = RunStep(self.iterations.pop())
                self.push_completion(end, idx)
                return end
        # Another run may follow at once after one that ended with a request finishing (or, one colocated
        # instance, at an arrival); one cut short by the next event would stop at the same step again.
        self.run_again = single or len(starts) == run.limit
        if single and not end < limit:
            self.route_arrivals(end)     # arrived while the run's last step ran
            self.waking[idx] = False
        return end

    def replica_run(self, idx: int, run, t: float, limit: float) -> Optional[float]:
        """decode_run of replica `idx` (one of several colocated; one stage, one batch in flight): the steps of
        `run` that start before `limit` (the next arrival) are applied at once if they all end before it; else
        the run is planned on, up to the arrival after the next as many as there are replicas, and left in
        flight as a LazyRun, applied as time passes: at each arrival, before the router reads the replicas
        (catch_up), and cut at the step running across an arrival routed to it (cut_lazy); its completion event
        applies the rest. So a replica's state is exact whenever something reads it."""
        inst = self.instances[idx]
        pending, i = self.pending, self.next_arrival + len(self.instances) - 1
        horizon = pending[i].arrival_time if i < len(pending) else float("inf")
        starts, ends, seconds, chunk_lists, end = plan_run(run, inst.timer.step_time, t, horizon, ends_before=False)
        if not starts:
            return None
        if end < limit:
            apply_run(run, inst.pipeline, self.requests, starts, ends, seconds)
            self.record_run(idx, run.count, starts, ends, chunk_lists)
            self.run_again = True     # it ended on its own (a finish, a prompt completed ...): another may follow
            return end
        inst.in_flight = LazyRun(run, starts, ends, seconds, chunk_lists)
        self.push_completion(end, idx)
        return end

    def pair_run(self, idx: int, t: float) -> Optional[float]:
        """Run instance `idx`'s next half-steps at once while they are a pair run (pdjax.scheduler.pair_runs.PairRun:
        two groups of running requests taking turns through the stages, one batch in flight at t; one colocated
        instance), as far as plan_pair_clock takes it (the arrivals fed to a run that admits, pair_arrivals): the
        scheduler state, stage accounting and records of one schedule() / update() at a time, the last batch left in
        flight as its SchedulerOutput; the arrivals up to the last collect routed, those up to the last schedule
        added to the scheduler's queue (as the loop's admit does) before the run's admissions are applied. Returns
        the time of the last collect (the loop goes on from there, scheduling the group collected then); None when
        fewer than 3 half-steps qualify."""
        if t < self.pair_after[idx]:
            return None
        inst = self.instances[idx]
        pipe = inst.pipeline
        out, first_start, first_end = pipe.peek()
        sched = inst.scheduler
        run = pair_run(sched, out, admit=not inst.inbox)
        if run is None:
            self.pair_after[idx] = math.nextafter(t, math.inf)    # not at once again
            return None
        pending = self.pending
        limit = pending[self.next_arrival].arrival_time if self.next_arrival < len(pending) else float("inf")
        bm = inst.scheduler.block_manager
        step_time = inst.timer.step_time
        times, ends, stages, free, H = plan_pair_clock(
            run, step_time.composition_stages_fn, pipe.stage_free, t, first_end, limit,
            len(bm._free) + len(bm._free_cached), min(self.max_iterations - len(self.iterations), PAIR_RUN_LENGTH),
            self.pair_arrivals(sched))
        if H < 3:
            # what cut it short (a finish, a prompt's end, an arrival) is still ahead until the last half-step
            # planned: no run is tried before then (one not tried is only slower, never different)
            self.pair_after[idx] = times[-1] if times[-1] > t else math.nextafter(t, math.inf)
            return None
        self.route_arrivals(times[H])     # arrived while the host waited on the stages
        if run.admitted:
            self.admit(inst, times[H - 1])    # the arrivals the loop adds to the queue before the run's schedules
        run.apply(times, H)
        if run.finished:
            self.requests.finished(run.finished, inst.scheduler)
        pipe.run_pair(times, ends, stages, free, run.in_flight_output(H))
        its, name, counts, tokens, chunks = self.iterations, self.names[idx], run.batch_counts, run.batch_tokens, \
            run.chunks
        step = len(its) if self.global_steps else inst.num_steps
        inst.num_steps += H
        its.append(IterationRecord(step, first_start, times[1], out.num_prefill_tokens, out.num_decode_tokens,
                                   len(out.req_ids), name))
        its += [IterationRecord(step + h - 1, times[h - 2], times[h], tokens[h - 2], counts[h - 2],
                                counts[h - 2] + len(chunks[h - 2]), name) for h in range(2, H + 1)]
        self.waking[idx] = False
        self.pair_again = run.ends_completing   # the group collected last may go on in a pair run at once
        return times[H]

    def pair_arrivals(self, sched) -> Callable:
        """plan_pair_clock's `arrive(at, queue)` for a pair run of `sched` (the one colocated instance's, its inbox
        empty): the requests arriving by `at` after those given before, made (SimRequests.made) but not routed,
        appended to `queue`; returns the next arrival time, or None at a request add_request would reject."""
        pending, requests = self.pending, self.requests
        cursor = [self.next_arrival]
        ids: set = set()

        def arrive(at: float, queue: list) -> Optional[float]:
            i = cursor[0]
            while i < len(pending) and pending[i].arrival_time <= at:
                req = requests.made(i)
                if req.request_id in ids or sched._validate_request(req) is not None:
                    return None
                ids.add(req.request_id)
                queue.append(req)
                i += 1
            cursor[0] = i
            return pending[i].arrival_time if i < len(pending) else float("inf")
        return arrive

    def run_limit(self, idx: int, t: float) -> Optional[float]:
        """The time instance `idx`'s decode run at t plans up to (decode_run): the next arrival (one colocated
        instance) or the next event; None when no run is to be tried (an instance after it still has to run its
        loop at t, or the next event is closer than its last step: skipping a run is only slower, never
        different)."""
        if self.single:
            pending = self.pending
            return pending[self.next_arrival].arrival_time if self.next_arrival < len(pending) else float("inf")
        if self.replicas:
            pending = self.pending
            limit = pending[self.next_arrival].arrival_time if self.next_arrival < len(pending) else float("inf")
            return None if self.run_schedules[idx] and limit - t < self.short_gap[idx] else limit
        waking = self.waking
        if idx + 1 < len(waking) and any(waking[j] and not self.instances[j].busy
                                         for j in range(idx + 1, len(waking))):
            return None
        if self.cross[idx]:
            return self.cross_limit(idx)
        limit = self.next_event_time()
        if limit - t < self.short_gap[idx]:
            return None
        return limit

    def cross_limit(self, idx: int) -> float:
        """The next event that can touch cross instance `idx` (a disaggregated decode instance whose state nothing
        reads between its steps, pdjax.sim.disagg): the next step end or KV landing; an arrival too unless every
        other instance is blocked on a step (then an arrival only joins a scheduler's queue, and no step it could
        start, hence no handoff or landing, comes before the next step end)."""
        inst_busy = [inst.in_flight is not None for j, inst in enumerate(self.instances) if j != idx]
        if False in inst_busy:
            return self.next_event_time()
        inf = float("inf")
        t_done = self.completions[0][0] if self.completions else inf
        if self.kv_arrivals and self.kv_arrivals[0][0] < t_done:
            t_done = self.kv_arrivals[0][0]
        return t_done

    def apply_decode_run(self, inst: SimInstance, run, t: float, limit: float, *, ends_before: bool,
                         schedules: int):
        """Plan decode run `run` of `inst` from t up to `limit` (ends_before: the steps ending before it, else
        the steps starting before it) and apply its steps: scheduler state, finished requests' records, stage
        accounting. (starts, ends, per-step prefill chunks or None, the last step's end); None when no step
        qualifies. schedules: 0 for one stage with one batch in flight (plan_run), else the schedule() calls per
        step of a run of decoders on stages (plan_stage_clock, DecodeRun.apply)."""
        if not schedules:
            starts, ends, seconds, chunk_lists, end = plan_run(run, inst.timer.step_time, t, limit,
                                                               ends_before=ends_before)
            if not starts:
                return None
            apply_run(run, inst.pipeline, self.requests, starts, ends, seconds)
            return starts, ends, chunk_lists, end
        if not run.decoders_only:        # pipeline stages or batches in flight: decoders only, nobody admitted
            return None
        starts, ends, stages, free, end = plan_stage_clock(run, inst.timer.step_time.decode_stages_fn(run.count),
                                                           t, limit, ends_before=ends_before)
        if not starts:
            return None
        finished = run.apply(starts, ends, schedules)
        if finished:
            self.requests.finished(finished, run.sched)
        inst.pipeline.run_serial_stages(starts, ends, stages, free)
        return starts, ends, None, end

    def record_run(self, idx: int, count: int, starts: Sequence[float], ends: Sequence[float],
                   chunk_lists: Optional[list]) -> None:
        """The iteration records of a decode run's steps on instance `idx` (count running requests; chunk_lists:
        per step its prefill chunks, None for a decode-only run)."""
        inst, its = self.instances[idx], self.iterations
        step = len(its) if self.global_steps else inst.num_steps
        inst.num_steps += len(starts)
        its += self.run_records(idx, count, starts, ends, chunk_lists, step)

    def run_records(self, idx: int, count: int, starts: Sequence[float], ends: Sequence[float],
                    chunk_lists: Optional[list], step: int) -> list:
        """record_run's records, the first numbered `step`."""
        name, k = self.names[idx], len(starts)
        if chunk_lists is None:
            return list(map(IterationRecord, range(step, step + k), starts, ends, repeat(0, k), repeat(count, k),
                            repeat(count, k), repeat(name, k)))
        records = []
        for s, e, chunks in zip(starts, ends, chunk_lists):
            if chunks:
                records.append(IterationRecord(step, s, e, sum(n for n, _ in chunks), count, count + len(chunks),
                                               name))
            else:
                records.append(IterationRecord(step, s, e, 0, count, count, name))
            step += 1
        return records

    def run_async(self, idx: int, t: float) -> None:
        """The engine's async loop of instance `idx` from host time t, until the host blocks on a step or waits.

        `dispatched`: the step on (or queued for) the device whose update is still due; the host updates the
        scheduler for it with placeholders at once (`update_async`, as the engine), admits, schedules the next
        step and dispatches it behind it on the device, then blocks until the earlier step completes. The
        step's ids and end time are known here already, so they are resolved (`resolve_async`) right away."""
        inst = self.instances[idx]
        sched = inst.scheduler
        while True:
            prev = inst.dispatched
            inst.dispatched = None
            if prev is not None:
                pending = sched.update_async(prev[0], t)
                sched.resolve_async(pending, self.sample(prev[0]), prev[2])
                finished = pending.finished
                if finished:
                    self.requests.finished(finished, sched)
            self.admit(inst, t)
            new = None
            if sched.has_unfinished():
                out = sched.schedule(t)
                if not out.is_empty:
                    if self.on_schedule is not None:
                        self.on_schedule(inst, out, t)
                    start = inst.device_free if inst.device_free > t else t
                    if inst.takes_context:
                        end = start + inst.step_time(out, inst.context(out, inst.device_free, t))
                    else:
                        end = start + inst.step_time(out)
                    inst.device_free = end
                    new = (out, start, end)
            if prev is not None:
                inst.in_flight = prev              # the host blocks collecting prev
                inst.dispatched = new
                inst.waits_for_arrival = new is None
                self.push_completion(prev[2], idx)
                return
            if new is None:
                inst.waits_for_arrival = True      # idle or blocked: woken by its next arrival
                return
            inst.dispatched = new

    # ------------------------------------------------------------------------------------------- end
    def check_done(self, t: float) -> None:
        if self.pool is not None:
            stuck = {i.name: (i.scheduler.num_waiting, i.scheduler.num_running)
                     for i in self.instances if i.scheduler.has_unfinished()}
            if stuck:
                raise RuntimeError(f"disaggregated simulation cannot make progress at t={t}: (waiting, running) "
                                   f"per instance {stuck}, no arrival or KV transfer left (a request larger than a "
                                   "decode instance's KV pages?)")
            return
        stuck = [i.name for i in self.instances if i.scheduler.has_unfinished() or i.inbox or i.dispatched]
        if stuck:
            raise RuntimeError(f"simulation cannot make progress at t={t}: instances {stuck} have unfinished "
                               "requests but schedule nothing and no arrivals are left")

    def result(self, wall_start: float) -> SimResult:
        iterations = self.iterations
        return SimResult(requests=self.requests.records(), iterations=iterations,
                         duration_s=max(map(_END_TIME, iterations), default=0.0),
                         wall_s=time.perf_counter() - wall_start, num_iterations=len(iterations),
                         pipeline=None if self.async_scheduling else pipeline_summary(
                             (inst.name or f"instance{i}", inst.pipeline) for i, inst in enumerate(self.instances)))


def decode_run_ready(inst: SimInstance) -> bool:
    """Instance `inst` can take decode runs (Simulation.decode_run): a step-time source exact for decode-only
    steps from their counts (one stage: its `decode_fn`; pipeline stages or batches in flight: its
    `decode_stages_fn`)."""
    return inst.timer.decode_stages_exact


def check_async_instances(instances: Sequence[SimInstance]) -> None:
    """The engine refuses asynchronous scheduling with pipeline stages or batches in flight: so does simulate."""
    piped = [i.name for i in instances if i.max_in_flight > 1 or i.timer.stage_times is not None]
    if piped:
        raise ValueError(f"simulate: async_scheduling with pipeline stages / batches in flight on instances "
                         f"{piped}: the engine refuses that combination (pdjax.serving.engine); use one or the "
                         "other")


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off while the block runs, as it was after (also on an error): a
    simulation keeps hundreds of thousands of objects alive (records, token times) and makes no reference
    cycles, so the collector's repeated passes over them are pure cost (about a fifth of chat10k's time).
    Reference counting still frees everything as usual. On the way out the objects made meanwhile go straight to
    the oldest generation (gc.freeze / unfreeze, unless the process froze objects itself): enabled again, the
    collector would pass over all of them (still counted young) at the next allocation, a tenth of a second per
    700,000 objects, only to move the survivors (the records) up a generation."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        promote = gc.get_freeze_count() == 0
        if promote:
            gc.freeze()
        gc.enable()
        if promote:
            gc.unfreeze()


def simulate(requests: Sequence, instances: Sequence[SimInstance], router=None, *,
             async_scheduling: bool = False,
             sample: Callable = placeholder_sample, on_schedule: Optional[Callable] = None,
             max_iterations: int = 50_000_000, decode_runs: bool = True) -> SimResult:
    """Run `requests` (scheduler Requests, arrival_time in seconds) through `instances` until all finish.

    router(req, instances) -> instance (default round robin: pdjax.scheduler.routing.InstanceRouter).
    async_scheduling: replay the engine's asynchronous loop (module docstring) instead of the synchronous one.
    sample(out) -> sampled ids (one per scheduled request, -1 where do_sample is False). on_schedule(instance,
    out, now) is called after every non-empty schedule() (tests use it to record the outputs). Raises
    RuntimeError when an instance has unfinished requests, schedules nothing and no arrival is left, or after
    `max_iterations` iterations. decode_runs=False runs every step through schedule() and update() (the same
    results, slower: Simulation.decode_run).
    """
    if not instances:
        raise ValueError("simulate: no instances")
    if async_scheduling:
        check_async_instances(instances)
    wall_start = time.perf_counter()
    if router is None:
        router = InstanceRouter("round_robin", instances, role="colocated")
    state = Simulation.colocated(requests, instances, router, async_scheduling, sample, on_schedule, max_iterations,
                                 decode_runs)
    state.run()
    return state.result(wall_start)
