"""Serving stacks defined by published per-step fits: a step's time as one engine measured it (no JAX).

The `pdjax` stack is the cost model itself (hardware roofline x fitted efficiencies + host terms,
pdjax.sim.cost_model). A *step-fit stack* instead reproduces another engine's measured step times: DistServe's
simulator (simdistserve) carries such fits for DistServe's own engine and for the vLLM it compared against
(OPT-13B TP 1/2/4 and OPT-66B TP 2/3/4/8 on A100-80GB; ../shared/data/profiling/distserve/, see its SOURCES.md).
A fit is valid only for the (model, hardware, tp) it was measured on: `StepFitStack.fit_for` refuses any
other with the combinations it holds. Each shipped stack is registered by name (pdjax.sim.step_time.register_stack:
a StepFitStack is a pdjax.sim.step_time.Stack, its FittedStepTime a StepTime).

Step time of one pipeline stage (seconds), for prefill chunks (n_i new tokens at offset o_i) and decodes
(context c_j including the new token), with the file's coefficients in milliseconds:
- prefill-only step (the fit's own regime, o_i = 0): a + b·Σn_i + c·Σn_i²
- decode-only step of B requests: a + b·Σc_j + c·B, the small- or large-batch fit by B against the threshold
- a mixed step (chunked prefill; extrapolated, the fits hold no mixed step): the prefill fit over the chunks
  plus the decode fit's per-context and per-request terms (b·Σc_j + c·B, without its intercept: one step has
  one floor); a chunk at offset o attends to o + n keys, so its quadratic term is c·(n² + 2·n·o), which is
  c·n² for a whole prompt and keeps the term proportional to attention work for a chunk.
- pp stages: the step's time / pp per stage (simdistserve's convention).
- the engine's own per-step overhead outside the fits (simdistserve's worker overhead: 2 ms + 1e-4 ms per
  context token of the batch, on the first stage), as explicit parameters `step_floor_s` and
  `per_context_token_s`; both are printed with every run (`describe`).
"""
from __future__ import annotations

import csv
import dataclasses
import functools
import json
import os
from typing import Dict, Iterable, Mapping, Sequence, Tuple

import numpy as np

from pdjax.config.files import REPO_ROOT
from pdjax.config.registry import STACKS
from pdjax.metrics.report import atomic_open
from pdjax.sim.step_time import GroupTiming, Stack, StepTimeBase, register_stack

SHARED_PROFILING_DIR = os.path.normpath(os.path.join(REPO_ROOT, os.pardir, "shared", "data", "profiling"))


@dataclasses.dataclass(frozen=True)
class StepFit:
    """One (model, hardware, tp)'s fit, coefficients in milliseconds (module docstring)."""
    prefill: Tuple[float, float, float]
    decode_small: Tuple[float, float, float]
    decode_large: Tuple[float, float, float]
    large_batch_threshold: int

    def prefill_ms(self, chunks: Sequence[Tuple[int, int]]) -> float:
        """The prefill fit over (new tokens, offset) chunks; 0 for none."""
        if not chunks:
            return 0.0
        a, b, c = self.prefill
        return a + b * sum(n for n, _ in chunks) + c * sum(n * n + 2 * n * o for n, o in chunks)

    def decode_ms(self, contexts: Sequence[int], intercept: bool = True) -> float:
        """The decode fit over the decodes' context lengths (new token included); 0 for none."""
        if not contexts:
            return 0.0
        batch = len(contexts)
        a, b, c = self.decode_small if batch < self.large_batch_threshold else self.decode_large
        return (a if intercept else 0.0) + b * sum(contexts) + c * batch

    def step_ms(self, chunks: Sequence[Tuple[int, int]], contexts: Sequence[int]) -> float:
        """One whole step (all stages), before pp and the stack's overhead terms."""
        if not chunks:
            return self.decode_ms(contexts)
        return self.prefill_ms(chunks) + self.decode_ms(contexts, intercept=False)


@dataclasses.dataclass(frozen=True)
class StepFitStack:
    """A serving stack given by per-step fits on one hardware, keyed by (pdjax model name, tp)."""
    name: str
    hardware: str
    fits: Mapping[Tuple[str, int], StepFit]
    step_floor_s: float = 0.0
    per_context_token_s: float = 0.0
    source: str = ""

    def fit_for(self, model: str, hardware: str, tp: int) -> StepFit:
        """The fit of (model, hardware, tp); a clear error naming what the stack holds otherwise."""
        fit = self.fits.get((model, tp))
        if fit is None or hardware != self.hardware:
            held = ", ".join(f"{m} tp={t}" for m, t in sorted(self.fits))
            raise ValueError(f"stack {self.name!r} has no step fit for model={model!r} tp={tp} on "
                             f"hardware={hardware!r}: it was fitted on {self.hardware!r} for {held} "
                             "(a step-fit stack does not extrapolate to other models, TP degrees or hardware)")
        return fit

    def check(self, model: str, hardware: str, tp: int) -> None:
        """ValueError unless the stack holds a fit for (model, hardware, tp) (pdjax.sim.step_time.Stack)."""
        self.fit_for(model, hardware, tp)

    def step_time(self, group: GroupTiming) -> "FittedStepTime":
        """The step time of a group's instances: its fit, no step noise (the fits are the measurement)."""
        return FittedStepTime(self, self.fit_for(group.model.name, group.gpu, group.tp), group.pp)

    def stage_time_s(self, fit: StepFit, chunks: Sequence[Tuple[int, int]], contexts: Sequence[int],
                     pp: int = 1, first_stage: bool = True) -> float:
        """Seconds one pipeline stage spends on the step: the fit / pp, plus the overhead on the first stage."""
        seconds = fit.step_ms(chunks, contexts) / 1e3 / pp
        if first_stage and (chunks or contexts):
            context_tokens = sum(o + n for n, o in chunks) + sum(contexts)
            seconds += self.step_floor_s + self.per_context_token_s * context_tokens
        return seconds

    def describe(self) -> Dict[str, object]:
        """The stack's parameters, as printed with a run and recorded in its results."""
        return {"stack": self.name, "kind": "step_fit", "hardware": self.hardware, "source": self.source,
                "step_floor_s": self.step_floor_s, "per_context_token_s": self.per_context_token_s,
                "fitted": sorted(f"{m}/tp{t}" for m, t in self.fits)}


# DistServe's files name models by their HF ids.
_DISTSERVE_MODELS = {"facebook/opt-13b": "opt-13b", "facebook/opt-66b": "opt-66b", "facebook/opt-175b": "opt-175b"}


def _triple(values, where: str) -> Tuple[float, float, float]:
    if not isinstance(values, (list, tuple)) or len(values) != 3:
        raise ValueError(f"{where}={values!r}, expected three coefficients [a, b, c]")
    return tuple(float(v) for v in values)


def _read_json(path: str, what: str):
    """The JSON at `path`; ValueError naming `what` and the file when it cannot be read or parsed."""
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"{what} {path!r}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path!r} is not valid JSON: {e}") from None


def load_distserve_fits(path: str) -> Dict[Tuple[str, int], StepFit]:
    """The step fits of one simdistserve profile file (`profiler-*.json`): {(pdjax model, tp): StepFit}."""
    data = _read_json(path, "step-fit file")
    fits = {}
    for hf_name, by_tp in data.items():
        model = _DISTSERVE_MODELS.get(hf_name)
        if model is None:
            raise ValueError(f"step-fit file {path!r}: model {hf_name!r}, expected one of {sorted(_DISTSERVE_MODELS)}")
        for tp, entry in by_tp.items():
            fits[(model, int(tp))] = _fit_entry(entry, f"{path}: {hf_name} tp={tp}")
    return fits


def _fit_entry(p: Mapping, where: str) -> StepFit:
    """A StepFit from one (model, tp) entry of DistServe's files (the stack file's format too)."""
    return StepFit(prefill=_triple(p["prefill"], f"{where} prefill"),
                   decode_small=_triple(p["decoding_smallbs"], f"{where} decoding_smallbs"),
                   decode_large=_triple(p["decoding_largebs"], f"{where} decoding_largebs"),
                   large_batch_threshold=int(p["decoding_large_small_bs_threshold"]))


# simdistserve's worker overhead per step (its add_ray_overhead): 2 ms + 1e-4 ms per context token.
_SIMDISTSERVE_OVERHEAD = dict(step_floor_s=2e-3, per_context_token_s=1e-7)

STEP_FIT_STACKS = {
    "distserve": ("distserve/profiler-a100-80g.distserve.json", "DistServe's engine (simdistserve fits)"),
    "distserve-vllm": ("distserve/profiler-a100-80g.vllm.json",
                       "the vLLM DistServe compared against (simdistserve fits)"),
}


def load_stack(name: str, profiling_dir: str = SHARED_PROFILING_DIR) -> StepFitStack:
    """A shipped step-fit stack by name, read from the shared profiling data (`profiling_dir`), or a stack file
    (a path ending in .json, as `save_stack` writes and `fit_step_stack` fits)."""
    if name.endswith(".json"):
        return load_stack_file(name)
    if name not in STEP_FIT_STACKS:
        raise ValueError(f"stack={name!r}, expected one of {STACKS} or a stack file (.json; 'pdjax' is the cost "
                         "model itself)")
    rel, what = STEP_FIT_STACKS[name]
    path = os.path.join(profiling_dir, rel)
    return StepFitStack(name=name, hardware="a100-80gb-sxm", fits=load_distserve_fits(path),
                        source=f"{what}: {rel}", **_SIMDISTSERVE_OVERHEAD)


class FittedStepTime(StepTimeBase):
    """The simulator's step time (`(SchedulerOutput) -> seconds`) of one instance on a step-fit stack: a
    prefill chunk is a scheduled prompt part (`is_prefill`: n new tokens at offset num_computed_tokens), a
    decode one token whose context is num_computed_tokens + 1. pp > 1: `stage_times` gives every stage the
    fit / pp (the overhead on stage 0, no separate send time: the fits include it), as simdistserve divides."""

    def __init__(self, stack: StepFitStack, fit: StepFit, pp: int = 1, noise=None):
        self.stack, self.fit, self.pp, self.noise = stack, fit, pp, noise

    @staticmethod
    def batch(out) -> Tuple[list, list]:
        """(prefill chunks [(n, offset)], decode contexts) of a SchedulerOutput."""
        chunks, contexts = [], []
        for c, n, pre in zip(out.num_computed_tokens, out.num_new_tokens, out.is_prefill):
            if pre:
                chunks.append((n, c))
            else:
                contexts.append(c + n)
        return chunks, contexts

    def stage_times(self, out, ctx=None) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
        chunks, contexts = self.batch(out)
        first = self.stack.stage_time_s(self.fit, chunks, contexts, self.pp, first_stage=True)
        rest = self.stack.stage_time_s(self.fit, chunks, contexts, self.pp, first_stage=False)
        stages = (first,) + (rest,) * (self.pp - 1)
        if self.noise is not None:
            f = self.noise()
            stages = tuple(f * t for t in stages)
        return stages, (0.0,) * (self.pp - 1)

    def __call__(self, out, ctx=None) -> float:
        return sum(self.stage_times(out)[0])


for _name in STEP_FIT_STACKS:
    register_stack(_name, functools.partial(load_stack, _name))


def get_stack(name: str) -> Stack:
    """The stack `name` (its registered factory's, pdjax.sim.step_time.register_stack), or the stack file `name`
    (*.json, `load_stack_file`)."""
    if name.endswith(".json"):
        return load_stack_file(name)
    if name not in STACKS or STACKS[name].factory is None:
        raise ValueError(f"stack={name!r}, expected one of {STACKS} or a stack file (.json; 'pdjax' is the cost "
                         "model itself)")
    return STACKS[name].factory()


# ------------------------------------------------------------------------------------------ stack files, fitting
def save_stack(stack: StepFitStack, path: str) -> None:
    """Write `stack` as a stack file (JSON, coefficients in ms as DistServe's files; written atomically)."""
    fits: Dict[str, Dict[str, dict]] = {}
    for (model, tp), fit in sorted(stack.fits.items()):
        fits.setdefault(model, {})[str(tp)] = {"prefill": list(fit.prefill), "decoding_smallbs": list(fit.decode_small),
                                               "decoding_largebs": list(fit.decode_large),
                                               "decoding_large_small_bs_threshold": fit.large_batch_threshold}
    data = {"name": stack.name, "hardware": stack.hardware, "source": stack.source,
            "step_floor_s": stack.step_floor_s, "per_context_token_s": stack.per_context_token_s, "fits": fits}
    with atomic_open(path, "w") as f:
        json.dump(data, f, indent=1)


def load_stack_file(path: str) -> StepFitStack:
    """A stack file (`save_stack`'s format); one-line errors naming the file."""
    data = _read_json(path, "stack file")
    missing = [k for k in ("name", "hardware", "fits") if k not in data]
    if missing:
        raise ValueError(f"stack file {path!r}: missing {missing}, expected name, hardware, fits (save_stack's format)")
    fits = {}
    for model, by_tp in data["fits"].items():
        for tp, entry in by_tp.items():
            fits[(model, int(tp))] = _fit_entry(entry, f"{path}: {model} tp={tp}")
    return StepFitStack(name=str(data["name"]), hardware=str(data["hardware"]), fits=fits,
                        step_floor_s=float(data.get("step_floor_s", 0.0)),
                        per_context_token_s=float(data.get("per_context_token_s", 0.0)),
                        source=str(data.get("source", path)))


def _least_squares(rows: Sequence[Sequence[float]], ms: Sequence[float], what: str) -> Tuple[float, float, float]:
    if len(rows) < 3:
        raise ValueError(f"fit_step_stack: {len(rows)} {what} step(s), expected at least 3 to fit [a, b, c]")
    coef, *_ = np.linalg.lstsq(np.asarray(rows, dtype=np.float64), np.asarray(ms, dtype=np.float64), rcond=None)
    return tuple(float(c) for c in coef)


def read_step_csv(path: str) -> list:
    """Measured steps from a CSV with columns phase (prefill | decode), lengths (space-separated: the prompt
    lengths of a prefill step, the contexts of a decode step, new token included) and seconds."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise ValueError(f"step file {path!r}: {e.strerror or e}") from None
    steps = []
    for i, row in enumerate(rows, start=2):
        try:
            phase, lengths, seconds = row["phase"], [int(x) for x in row["lengths"].split()], float(row["seconds"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise ValueError(f"step file {path!r} line {i}: {row!r}, expected columns phase, lengths, seconds "
                             "(e.g. 'prefill,512 256,0.041')") from None
        if phase not in ("prefill", "decode"):
            raise ValueError(f"step file {path!r} line {i}: phase={phase!r}, expected 'prefill' or 'decode'")
        steps.append({"prefill_lens" if phase == "prefill" else "decode_contexts": lengths, "seconds": seconds})
    return steps


def fit_step_stack(steps: Iterable[Mapping[str, object]], *, name: str, hardware: str, model: str, tp: int,
                   large_batch_threshold: int = 95, step_floor_s: float = 0.0, per_context_token_s: float = 0.0,
                   source: str = "") -> StepFitStack:
    """A stack fitted from measured steps of one (model, hardware, tp), in DistServe's form (module docstring):
    each step a mapping {'prefill_lens': [n_i] or 'decode_contexts': [c_j], 'seconds'} (pure prefill or pure
    decode steps; their measured time minus the overhead terms given here, which stay explicit parameters).
    Least squares on [1, Σn, Σn²] for prefill steps and [1, Σc, B] for decode steps below / at or above the
    threshold; at least 3 steps of each (a regime with too few takes the other decode regime's fit)."""
    prefill_x, prefill_y, small_x, small_y, large_x, large_y = [], [], [], [], [], []
    for i, step in enumerate(steps):
        lens, ctx = list(step.get("prefill_lens") or ()), list(step.get("decode_contexts") or ())
        if bool(lens) == bool(ctx):
            raise ValueError(f"fit_step_stack: step {i} has prefill_lens={lens} and decode_contexts={ctx}, "
                             "expected exactly one of them (pure prefill or pure decode steps)")
        context_tokens = sum(lens) + sum(ctx)
        ms = 1e3 * (float(step["seconds"]) - step_floor_s - per_context_token_s * context_tokens)
        if lens:
            prefill_x.append((1.0, sum(lens), sum(n * n for n in lens)))
            prefill_y.append(ms)
        elif len(ctx) < large_batch_threshold:
            small_x.append((1.0, sum(ctx), len(ctx)))
            small_y.append(ms)
        else:
            large_x.append((1.0, sum(ctx), len(ctx)))
            large_y.append(ms)
    prefill = _least_squares(prefill_x, prefill_y, "prefill")
    if len(small_x) >= 3 and len(large_x) >= 3:
        small, large = _least_squares(small_x, small_y, "decode"), _least_squares(large_x, large_y, "decode")
    else:
        small = large = _least_squares(small_x + large_x, small_y + large_y, "decode")
    fit = StepFit(prefill, small, large, large_batch_threshold)
    return StepFitStack(name=name, hardware=hardware, fits={(model, int(tp)): fit}, step_floor_s=step_floor_s,
                        per_context_token_s=per_context_token_s, source=source or "fitted from measured steps")
