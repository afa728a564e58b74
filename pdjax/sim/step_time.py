"""The step-cost seam of the simulator (no JAX): what a step-time source must offer (`StepTime`), and the serving
stacks that make one per instance group (`register_stack`).

A step-time source is called once per simulated step, `step_time(out)` or, when it `takes_context`,
`step_time(out, StepContext)` (pdjax.sim.pipeline), and returns the step's seconds. The simulator loops
(pdjax.sim.simulator, pdjax.sim.disagg, pdjax.sim.pipeline.StageTimer, pdjax.sim.replay) read exactly the members
of the `StepTime` protocol and nothing else:

    pp                 pipeline stages: pp > 1 means `stage_times(out[, ctx]) -> (per-stage s, per-boundary send s)`
                       is what the stage resources take, and the instance keeps up to pp batches in flight
    takes_context      pass a StepContext (previous batch, idle gap) as the second argument
    decode_only_exact  `decode_fn(count)(total_context)` is the time of every decode-only step of `count` decodes
                       (and `composition(count, total_context, chunks)` of a step with prefill chunks): the decode
                       runs (pdjax.scheduler.runs) cost their steps by them instead of calling the source per step
    stage_times, decode_fn, composition   as above; only read when pp > 1 / decode_only_exact
    decode_stages_fn   `decode_stages_fn(count)(total_context)`: `stage_times` of such a decode-only step (one stage:
                       decode_fn's seconds); read when decode_only_exact, for the decode runs of an instance with
                       pipeline stages or batches in flight
    composition_stages, composition_stages_fn   `composition_stages(count, total_context, chunks)` ==
                       `composition_stages_fn(count)(total_context, chunks)`: the stages of a step with prefill
                       chunks (decode_stages_fn's without); read when decode_only_exact, for the pair runs

`StepTimeBase` gives every member its default (one stage, no context, no decode runs), so a new source is a
subclass with `__call__` and whatever it overrides. A plain function `(out) -> seconds` (tests, quick studies) is
taken as is: `as_step_time` wraps it in `PlainStepTime`, the one place that tells the two apart.

A serving stack (`deployment.<group>.stack`, DESIGN.md §3 "What a step costs") makes the step-time source of a
group's instances: `register_stack(name, factory)` adds its name to the stack table (pdjax.config.registry.STACKS,
which the config's `stack` keys are checked against) and its factory, `() -> Stack`. The shipped ones: 'pdjax'
(the cost model, pdjax.sim.step_cost.CostModelStack), 'vllm-eager' (the cost model under an eager engine's host
floor, pdjax.sim.eager) and the step-fit stacks (pdjax.sim.stack: 'distserve', 'distserve-vllm');
pdjax.sim.stack.get_stack gives a stack by name or reads a stack file (`*.json`).
pdjax.sim.build checks at import that every row of the table has its factory.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence, Tuple, runtime_checkable

from pdjax.config.registry import STACKS, StackInfo


# --------------------------------------------------------------------------------------------------- step time
@runtime_checkable
class StepTime(Protocol):
    """What the simulator loops call on a step-time source (module docstring)."""
    pp: int
    takes_context: bool
    decode_only_exact: bool

    def __call__(self, out, ctx=None) -> float: ...

    def stage_times(self, out, ctx=None) -> Tuple[Sequence[float], Sequence[float]]: ...

    def decode_fn(self, count: int) -> Callable[[int], float]: ...

    def composition(self, count: int, total_context: int, chunks: Sequence[Tuple[int, int]]) -> float: ...

    def decode_stages_fn(self, count: int) -> Callable[[int], Tuple[Sequence[float], Sequence[float]]]: ...

    def composition_stages(self, count: int, total_context: int,
                           chunks: Sequence[Tuple[int, int]]) -> Tuple[Sequence[float], Sequence[float]]: ...

    def composition_stages_fn(self, count: int) -> Callable[[int, Sequence[Tuple[int, int]]],
                                                            Tuple[Sequence[float], Sequence[float]]]: ...


class StepTimeBase:
    """Every StepTime member at its default: one stage, called without a context, no decode runs. Subclasses
    define `__call__` and override what they offer."""
    pp = 1
    takes_context = False
    decode_only_exact = False

    def __call__(self, out, ctx=None) -> float:
        raise NotImplementedError

    def stage_times(self, out, ctx=None) -> Tuple[Sequence[float], Sequence[float]]:
        """One stage: the whole step."""
        return (self(out) if ctx is None else self(out, ctx),), ()

    def decode_fn(self, count: int) -> Callable[[int], float]:
        raise NotImplementedError(f"{type(self).__name__}.decode_fn: only read when decode_only_exact is True")

    def composition(self, count: int, total_context: int, chunks: Sequence[Tuple[int, int]]) -> float:
        raise NotImplementedError(f"{type(self).__name__}.composition: only read when decode_only_exact is True")

    def decode_stages_fn(self, count: int) -> Callable[[int], Tuple[Sequence[float], Sequence[float]]]:
        """One stage: total_context -> ((decode_fn(count)(total_context),), ()). A source with pp > 1 that is
        decode_only_exact gives its own (its stages)."""
        if self.pp != 1:
            raise NotImplementedError(f"{type(self).__name__}.decode_stages_fn: a source with pp={self.pp} gives its "
                                      "own stage times")
        decode = self.decode_fn(count)
        return lambda total_context: ((decode(total_context),), ())

    def composition_stages(self, count: int, total_context: int,
                           chunks: Sequence[Tuple[int, int]]) -> Tuple[Sequence[float], Sequence[float]]:
        """One stage: `stage_times` of a step of prefill `chunks` ((tokens, context before them), in batch order)
        after `count` one-token decodes whose contexts sum to total_context: ((composition(...),), ()), or
        decode_stages_fn's without chunks. Read when decode_only_exact, for the pair runs of an instance with
        two batches in flight (pdjax.sim.simulator.Simulation.pair_run)."""
        if self.pp != 1:
            raise NotImplementedError(f"{type(self).__name__}.composition_stages: a source with pp={self.pp} gives "
                                      "its own stage times")
        if not chunks:
            return self.decode_stages_fn(count)(total_context)
        return (self.composition(count, total_context, chunks),), ()

    def composition_stages_fn(self, count: int) -> Callable[[int, Sequence[Tuple[int, int]]],
                                                            Tuple[Sequence[float], Sequence[float]]]:
        """(total_context, chunks) -> composition_stages(count, total_context, chunks)."""
        return lambda total_context, chunks: self.composition_stages(count, total_context, chunks)


class PlainStepTime(StepTimeBase):
    """A plain `(out) -> seconds` function as a StepTime (one stage, no context, no decode runs)."""

    def __init__(self, fn: Callable[[Any], float]):
        self.fn = fn

    def __call__(self, out, ctx=None) -> float:
        return self.fn(out)


def as_step_time(fn) -> StepTime:
    """`fn` itself when it offers every StepTime member (a StepTimeBase subclass does), else `fn` as a plain
    `(out) -> seconds` function (PlainStepTime)."""
    if isinstance(fn, StepTime):
        return fn
    if not callable(fn):
        raise TypeError(f"step time {fn!r}: expected a StepTime or a function (SchedulerOutput) -> seconds")
    return PlainStepTime(fn)


# --------------------------------------------------------------------------------------------------- stacks
@dataclasses.dataclass(frozen=True)
class GroupTiming:
    """What a stack gets to time one instance group: the model and hardware specs, the hardware's registry name
    (`gpu`: the spec's may name a node-type variant), tp / pp, the cost parameters, the engine padding (None: none),
    and the step noise to apply (None: deterministic; a stack may ignore it)."""
    model: Any              # pdjax.config.model_specs.ModelSpec
    hardware: Any           # pdjax.sim.hardware.HardwareSpec
    gpu: str
    tp: int
    pp: int
    params: Any             # pdjax.sim.cost_model.CostParams
    padding: Any = None     # pdjax.sim.step_cost.EnginePadding
    noise: Any = None       # pdjax.sim.step_cost.StepNoise


class Stack(Protocol):
    """A serving stack: `name`; `check(model, hardware, tp)` raises ValueError when it cannot time that group
    (model and hardware by registry name: a step-fit stack times only what it was measured on; build time and the
    placement search ask); `step_time(GroupTiming) -> StepTime`; `describe()`, the dict recorded with a run."""
    name: str

    def check(self, model: str, hardware: str, tp: int) -> None: ...

    def step_time(self, group: GroupTiming) -> StepTime: ...

    def describe(self) -> dict: ...


def register_stack(name: str, factory: Callable[[], Stack], *, replace: bool = False) -> None:
    """Add serving stack `name` (a valid deployment.<group>.stack from now on): `factory() -> Stack`. A built-in
    row (declared in pdjax.config.registry) takes its factory alone."""
    if name in STACKS and STACKS[name].factory is None:
        STACKS[name].factory = factory
    else:
        STACKS.add(name, StackInfo(name, factory), replace=replace)


def check_stacks() -> None:
    """Every row of the stack table has its factory (pdjax.sim.build runs this at import, after importing the
    modules whose shipped stacks register themselves: pdjax.sim.step_cost, pdjax.sim.stack)."""
    STACKS.check_complete("factory", {n: STACKS[n].factory for n in STACKS if STACKS[n].factory is not None},
                          "the registered stack factories")
