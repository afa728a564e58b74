"""StagePipeline: one simulated instance's batches in flight on its pipeline stages, no JAX.

An instance whose model is split into pp stages keeps up to pp batches in flight (pdjax.scheduler.BatchQueue; the
engines' loop: dispatch while the queue is not full and the scheduler returns a non-empty batch, collect the
oldest when full or when nothing else can be scheduled, apply results in dispatch order). On a virtual clock each
stage is a resource:

    batch k occupies stage s from max(its end on stage s-1 + the activation send between the two stages'
    devices, the end of batch k-1 on stage s) for its stage time; stage 0 starts at max(dispatch time, stage 0
    free). It leaves the last stage at its end time.

Bubbles thus come out of the schedule: a stage idles while the batch it needs is still upstream, and unequal
batches leave short ones waiting behind long ones. With one stage (stages=(t,), sends=()) a batch dispatched at
t0 on a free stage ends at t0 + t exactly (bit-identical to the plain `now + step_time(out)`).

Accounting (`stats()`): per stage its busy seconds; `active_s`, the seconds with at least one batch in flight
(dispatch of the first to collection of the last of each busy period); the bubble fraction = idle stage time /
total stage time over the active seconds (1 - sum(busy) / (pp x active_s)); the mean number of batches in flight
(sum over batches of collect - dispatch, over active_s). `pipeline_summary` sums instances: SimResult.pipeline.

`StageTimer`: how long a batch takes on each stage, shared by both simulators' instances: `step_time(out)` (one
stage) or `stage_times(out)` (pp stages; the step-time source's own `stage_times` when its `pp` > 1,
pdjax.sim.step_cost.PipelineStepTime), called with a `StepContext` when the source `takes_context` (its previous
batch and its device's idle gap: costs such as a shape switch or an idle wake). The source is a
pdjax.sim.step_time.StepTime (`as_step_time`: a plain function is one stage without context); an explicit
`stage_times=` function is a plain `(out) -> (stages, sends)` one.

Users: the colocated simulator (pdjax.sim.simulator: one StagePipeline per SimInstance, `SimInstance.pipeline`;
its step context's idle gap is dispatch time minus `device_free`) and pdjax.sim.disagg (each prefill / decode /
mixed instance). Both build SimResult.pipeline with `pipeline_summary`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

from pdjax.scheduler.batch_queue import BatchQueue
from pdjax.sim.step_time import as_step_time


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What came before a step on its instance, for step-time functions that cost it (`takes_context`, e.g.
    pdjax.sim.step_cost.make_step_time; cost_model.context_time): `previous`, the SchedulerOutput the instance
    dispatched before this one (None for its first step), whose padded shape tells a shape switch; `idle_s`,
    seconds the instance's device sat idle right before this step (0 when it runs straight on; for the first
    step, the time since the simulation began)."""
    previous: Optional[object]
    idle_s: float


class StageTimer:
    """(per-stage seconds, per-boundary send seconds) of a batch on one instance; see the module docstring."""

    def __init__(self, step_time: Optional[Callable] = None, stage_times: Optional[Callable] = None):
        source = self.step_time = as_step_time(step_time) if step_time is not None else None
        self.pp = source.pp if source is not None else 1
        explicit = stage_times is not None         # a plain (out) -> (stages, sends) function: no context
        if not explicit and self.pp > 1:
            stage_times = source.stage_times
        self.stage_times = stage_times
        self.explicit = explicit
        self.takes_context = bool(source is not None and not explicit and source.takes_context)
        self.last_out = None           # the batch dispatched last (the next step's StepContext.previous)

    @property
    def decode_only_exact(self) -> bool:
        """One stage, and the source's `decode_fn` is exact for decode-only steps: the decode runs
        (pdjax.sim.simulator) cost whole runs by it. Read when a simulation starts (a hook may have swapped the
        source, pdjax.sim.provision.cap_instances)."""
        return self.stage_times is None and bool(self.step_time.decode_only_exact)

    @property
    def decode_stages_exact(self) -> bool:
        """The source's `decode_stages_fn` gives the (stages, sends) of every decode-only step, one stage or
        several (no explicit `stage_times=` function): the decode runs of an instance with pipeline stages or
        batches in flight (pdjax.sim.simulator) cost their steps by it. Read when a simulation starts."""
        return not self.explicit and self.step_time is not None and bool(self.step_time.decode_only_exact)

    def context(self, out, device_free: float, t: float) -> Optional[StepContext]:
        """The StepContext of `out` dispatched at t on a device free from `device_free` (None when the step-time
        function takes none); records `out` as the next step's previous one."""
        if not self.takes_context:
            return None
        ctx = StepContext(self.last_out, t - device_free if t > device_free else 0.0)
        self.last_out = out
        return ctx

    def __call__(self, out, device_free: float, t: float) -> Tuple[Sequence[float], Sequence[float]]:
        args = (out,) if not self.takes_context else (out, self.context(out, device_free, t))
        if self.stage_times is None:
            return (self.step_time(*args),), ()
        return self.stage_times(*args)


def clock_stages(stages: Sequence[float], sends: Sequence[float], t: float, free: List[float]) -> float:
    """The stage rule of a batch dispatched at t: stage s starts when its input arrived (stage s-1's end plus the
    send `sends[s-1]`) and stage s is free (`free[s]`, updated in place to the batch's end there); returns when it
    leaves the last stage (seconds)."""
    ready = t
    for s, seconds in enumerate(stages):
        if s:
            ready = ready + sends[s - 1]
        start = ready if ready > free[s] else free[s]
        ready = start + seconds
        free[s] = ready
    return ready


class StagePipeline:
    """Per-stage free times and busy seconds of one instance, and its BatchQueue of dispatched, uncollected
    batches (payload: (dispatch time, end time)). max_in_flight: batches in flight at most (normally pp)."""

    def __init__(self, max_in_flight: int = 1):
        self.queue = BatchQueue(max_in_flight)
        self.stage_free: List[float] = []   # per stage: when it finishes the batches dispatched so far
        self.stage_busy: List[float] = []   # per stage: seconds busy
        self.active_s = 0.0                 # seconds with at least one batch in flight
        self.in_flight_s = 0.0              # sum over batches of their (dispatch, collect) spans
        self._active_since = 0.0

    # ------------------------------------------------------------------------------------------- queue
    @property
    def max_in_flight(self) -> int:
        return self.queue.max_in_flight

    @property
    def full(self) -> bool:
        return self.queue.full

    def __len__(self) -> int:
        return len(self.queue)

    def __bool__(self) -> bool:
        return bool(self.queue)

    @property
    def device_free(self) -> float:
        """When stage 0 finishes the batches dispatched so far (0 before the first): a step context's idle gap
        is dispatch time minus this."""
        return self.stage_free[0] if self.stage_free else 0.0

    def peek(self) -> Tuple[Any, float, float]:
        """(out, dispatch time, end time) of the oldest batch in flight."""
        out, (start, end) = self.queue.peek()
        return out, start, end

    # ------------------------------------------------------------------------------------------- stages
    def run_stages(self, stages: Sequence[float], sends: Sequence[float], t: float) -> float:
        """Occupy the stages with a batch of per-stage seconds `stages` and per-boundary send seconds `sends`
        (len(stages) - 1 of them) dispatched at t; returns when it leaves the last stage. No queue bookkeeping."""
        if not self.stage_free:
            self.stage_free = [0.0] * len(stages)
            self.stage_busy = [0.0] * len(stages)
        elif len(stages) != len(self.stage_free):
            raise ValueError(f"StagePipeline: a batch of {len(stages)} stage times on a {len(self.stage_free)}-stage "
                             "pipeline")
        busy = self.stage_busy
        for s, seconds in enumerate(stages):
            busy[s] += seconds
        return clock_stages(stages, sends, t, self.stage_free)

    def dispatch(self, out, t: float, stages: Sequence[float], sends: Sequence[float] = ()) -> float:
        """Queue batch `out` dispatched at t (BatchQueue.push: the queue must not be full) and run it through the
        stages; returns its end time."""
        if self.queue.full:   # checked before the stages are occupied
            self.queue.push(out)      # raises the queue's error
        end = self.run_stages(stages, sends, t)
        if not self.queue:
            self._active_since = t
        self.queue.push(out, (t, end))
        return end

    def run_serial(self, starts: Sequence[float], ends: Sequence[float], seconds: Sequence[float]) -> None:
        """The accounting of batches run one at a time on a one-stage pipeline with an empty queue: batch j
        dispatched at starts[j] on a free stage, taking seconds[j] and collected at its end ends[j] ==
        starts[j] + seconds[j] (the simulator's decode runs): bit-identical to dispatch() then collect() for
        each, without the SchedulerOutputs."""
        if self.queue or len(self.stage_free) > 1:
            raise ValueError("StagePipeline.run_serial: needs a one-stage pipeline with no batch in flight")
        if not starts:
            return
        if not self.stage_free:
            self.stage_free = [0.0]
            self.stage_busy = [0.0]
        busy, in_flight, active = self.stage_busy[0], self.in_flight_s, self.active_s
        for start, end, d in zip(starts, ends, seconds):
            busy += d
            in_flight += end - start
            active += end - start
        self.stage_busy[0], self.in_flight_s, self.active_s = busy, in_flight, active
        self.stage_free[0] = ends[-1]
        self._active_since = starts[-1]
        self.queue.num_pushed += len(starts)

    def run_serial_stages(self, starts: Sequence[float], ends: Sequence[float], stages: Sequence[Sequence[float]],
                          last_free: Sequence[float]) -> None:
        """run_serial on any number of stages: batch j dispatched at starts[j] with an empty queue, on stages free
        by then, per-stage seconds stages[j], leaving the last stage at ends[j] and collected then (the next one
        dispatched at that end, or later); last_free: when each stage finished the last batch. Bit-identical to
        dispatch() then collect() for each, without the SchedulerOutputs."""
        if self.queue:
            raise ValueError("StagePipeline.run_serial_stages: needs a pipeline with no batch in flight")
        if not starts:
            return
        pp = len(stages[0])
        if not self.stage_free:
            self.stage_free = [0.0] * pp
            self.stage_busy = [0.0] * pp
        elif len(self.stage_free) != pp:
            raise ValueError(f"StagePipeline: a batch of {pp} stage times on a {len(self.stage_free)}-stage pipeline")
        busy = self.stage_busy
        in_flight, active = self.in_flight_s, self.active_s
        for start, end, seconds in zip(starts, ends, stages):
            for s, d in enumerate(seconds):
                busy[s] += d
            in_flight += end - start
            active += end - start
        self.in_flight_s, self.active_s = in_flight, active
        self.stage_free[:] = last_free
        self._active_since = starts[-1]
        self.queue.num_pushed += len(starts)

    def run_pair(self, times: Sequence[float], ends: Sequence[float], stages: Sequence[Sequence[float]],
                 last_free: Sequence[float], last_out) -> None:
        """The accounting of a pair run (pdjax.scheduler.pair_runs.PairRun) of H = len(stages) half-steps with one
        batch in flight at its start: batch h dispatched at times[h] (h < H), taking stages[h] per stage and
        leaving the last stage at ends[h]; the oldest batch collected at times[h] for h = 1 .. H (the batch in
        flight at the start, then batch h - 2); last_free: each stage's free time after batch H - 1, which stays
        in flight as `last_out`. Bit-identical to dispatch() and collect() for each, without the
        SchedulerOutputs."""
        H = len(stages)
        _, (first_start, _) = self.queue.pop()
        busy = self.stage_busy
        for seconds in stages:
            for s, d in enumerate(seconds):
                busy[s] += d
        in_flight = self.in_flight_s + (times[1] - first_start)
        for h in range(2, H + 1):
            in_flight += times[h] - times[h - 2]
        self.in_flight_s = in_flight
        self.stage_free[:] = last_free
        self.queue.push(last_out, (times[H - 1], ends[H - 1]))
        self.queue.num_pushed += H - 1

    def collect(self, t: float) -> Tuple[Any, float, float]:
        """Pop the oldest batch, collected (applied) at t >= its end; returns (out, dispatch time, end time)."""
        out, (start, end) = self.queue.pop()
        self.in_flight_s += t - start
        if not self.queue:
            self.active_s += t - self._active_since
        return out, start, end

    # ------------------------------------------------------------------------------------------- stats
    def stats(self) -> dict:
        """pp, max_in_flight, per-stage busy seconds and fractions, active seconds, bubble fraction, mean batches
        in flight (module docstring; SimResult.pipeline's per-instance entry)."""
        pp = len(self.stage_busy)
        total = pp * self.active_s
        return {"pp": pp, "max_in_flight": self.max_in_flight, "stage_busy_s": list(self.stage_busy),
                "active_s": self.active_s,
                "bubble_fraction": (1.0 - sum(self.stage_busy) / total) if total > 0 else 0.0,
                "stage_busy_fraction": [b / self.active_s if self.active_s > 0 else 0.0 for b in self.stage_busy],
                "mean_batches_in_flight": self.in_flight_s / self.active_s if self.active_s > 0 else 0.0}


def pipeline_summary(pipelines: Iterable[Tuple[str, StagePipeline]]) -> dict:
    """SimResult.pipeline of (name, StagePipeline) pairs: over all instances (stage seconds summed) and per
    instance ("instances": name -> StagePipeline.stats())."""
    pipelines = list(pipelines)
    per = {name: p.stats() for name, p in pipelines}
    busy = sum(sum(p["stage_busy_s"]) for p in per.values())
    total = sum(p["pp"] * p["active_s"] for p in per.values())
    active = sum(p["active_s"] for p in per.values())
    return {"bubble_fraction": (1.0 - busy / total) if total > 0 else 0.0, "stage_busy_s": busy,
            "stage_total_s": total,
            "mean_batches_in_flight": (sum(p.in_flight_s for _, p in pipelines) / active) if active > 0 else 0.0,
            "instances": per}
