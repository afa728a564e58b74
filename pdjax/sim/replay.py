"""Step replay: the simulator's step time on the batches a real engine ran, next to the time the engine took.

Used twice: experiments.sim_fidelity separates the cost model's error from the divergence of two trajectories,
and the calibration's engine-loop probe (pdjax.experiment.calibrate) measures the step-time noise the simulator samples
(`step_noise_ratios`; pdjax.sim.step_cost.StepNoise). No JAX: batches are SchedulerOutput compositions.

A real iteration i is measured from its start to the next iteration's start when the engine went straight on
(the scheduler, batch building, the device step, collecting and updating: what a simulated step stands for), its
own end otherwise (the run's last step, or one followed by an idle wait longer than `idle_gap_s`). Each step is
costed with the StepContext the simulator would give it: the previous batch, and the engine's wait before it
when that was an idle wait. Classes: 'shape_switch' (padded (T, S, P) differs from the previous step's),
'after_idle' (the engine waited > idle_gap_s before it), 'steady' (neither).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Sequence

import numpy as np

from pdjax.scheduler import SchedulerOutput
from pdjax.sim.simulator import StepContext
from pdjax.sim.step_cost import padded_shape
from pdjax.sim.step_time import as_step_time

IDLE_GAP_S = 1e-3   # an engine wait longer than this before a step is an idle wait, shorter ones its host work


class ScheduleRecorder:
    """Wraps a scheduler's schedule(): keeps each non-empty batch's composition (new tokens, context before them,
    is_prefill per sequence) in dispatch order, i.e. one entry per engine iteration."""

    def __init__(self, scheduler):
        self.batches: List[tuple] = []
        self._schedule = scheduler.schedule
        scheduler.schedule = self

    def __call__(self, now):
        out = self._schedule(now)
        if not out.is_empty:
            self.batches.append((tuple(out.num_new_tokens), tuple(out.num_computed_tokens), tuple(out.is_prefill)))
        return out


def composition_output(batch) -> Any:
    """A SchedulerOutput with a recorded batch's composition (what step-time functions read)."""
    new, ctx, prefill = batch
    out = SchedulerOutput(step=0)
    for i, (n, c, p) in enumerate(zip(new, ctx, prefill)):
        out.req_ids.append(f"r{i}")
        out.num_new_tokens.append(n)
        out.num_computed_tokens.append(c)
        out.is_prefill.append(p)
        out.do_sample.append(True)
    return out


@dataclasses.dataclass
class Replay:
    """Per real iteration (numpy arrays of equal length): measured and predicted seconds, and the classes."""
    measured: Any
    predicted: Any
    shape_switch: Any
    after_idle: Any
    has_prefill: Any

    @property
    def steady(self):
        return ~self.shape_switch & ~self.after_idle

    @property
    def steady_decode(self):
        """Steady decode-only steps: the bulk of the steps that make TBT."""
        return self.steady & ~self.has_prefill


def replay_steps(batches: Sequence[tuple], iterations, step_time: Callable, padding=None,
                 idle_gap_s: float = IDLE_GAP_S) -> Replay:
    """Replay `batches` (ScheduleRecorder's) against the engine's IterationRecords (module docstring).
    step_time: a noise-free simulator step time (pdjax.sim.build.group_step_time(..., noise=False)).
    Raises ValueError when the counts differ or nothing ran."""
    if len(batches) != len(iterations) or not batches:
        raise ValueError(f"{len(batches)} recorded batches for {len(iterations)} iterations: expected the same "
                         "non-zero number (record with ScheduleRecorder on the engine's scheduler)")
    starts = np.array([it.start_time for it in iterations])
    ends = np.array([it.end_time for it in iterations])
    next_start = np.r_[starts[1:], np.inf]
    straight = next_start - ends <= idle_gap_s
    measured = np.where(straight, next_start - starts, ends - starts)
    outs = [composition_output(b) for b in batches]
    gaps = np.r_[starts[0], starts[1:] - ends[:-1]]
    idle = np.r_[True, gaps[1:] > idle_gap_s]
    step_time = as_step_time(step_time)
    if step_time.takes_context:
        predicted = np.array([step_time(o, StepContext(outs[i - 1] if i else None,
                                                       float(gaps[i]) if idle[i] else 0.0))
                              for i, o in enumerate(outs)])
    else:
        predicted = np.array([step_time(o) for o in outs])
    shapes = [padded_shape(o, padding) if padding is not None else None for o in outs]
    switch = np.array([i > 0 and shapes[i] != shapes[i - 1] for i in range(len(outs))])
    prefill = np.array([any(b[2]) for b in batches])
    return Replay(measured, predicted, switch & ~idle, idle, prefill)


def step_noise_ratios(replay: Replay) -> List[float]:
    """measured / predicted of the steady decode-only steps: the step-time noise of the engine loop around the
    cost model (prefill and context steps are left out: their mean error is the cost model's, not noise)."""
    mask = replay.steady_decode
    return [float(m / p) for m, p in zip(replay.measured[mask], replay.predicted[mask]) if p > 0]
