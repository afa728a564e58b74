"""Step time of one SchedulerOutput for the simulator, including the real engine's shape padding; sim profiles.

Why padding matters: the pdjax engine pads every step to (T, S, P) buckets (tokens, sequences, pages per
sequence; powers of two by default, see pdjax.runtime.batch.Buckets) so it compiles a bounded number of times.
On the CPU engine the plain-jnp reference attention then attends every padded query token over every padded
page of its sequence's table, so a step costs what its *bucket* costs, not what its tokens cost. Two modes:

- `dense_attention=True` (the jnp reference path, CPU): the step is costed as the cost model's composition of
  T_pad one-token queries each reading P_pad·page_size keys (`decodes=((T_pad, P_pad·page_size − 1),)`), which
  is exactly the work of the reference kernel (every token gathers and scores its own K/V block), and linear
  layers on T_pad tokens. The fitted efficiencies absorb the rest.
- `dense_attention=False` (Pallas kernels, GPU/TPU): attention does the real work; only the linear layers see
  the token padding, costed as T_pad − T extra one-token decodes at context 0.
- In both padded modes the per-sequence host cost (`cost_model.per_seq_host_s`) counts the real sequences (the composition's stand-in sequences
  are padded work): time = iteration_time(padded composition) + per_seq_host_s · (S − composition seqs).
- No padding (None): the real composition (GPU profiles fitted on operator data, e.g. profiles/a100.json).

Buckets are derived from the serve config with `engine_buckets`, the rule of pdjax.serving.build.default_buckets
(tests check the two agree).

A *sim profile* is a machine-profile JSON (pdjax.sim.calibration schema) with two optional extra keys that
`load_profile` ignores: "hardware_spec" (the HardwareSpec the efficiencies are relative to, frozen at calibration
time: `host_cpu()` re-measures a noisy machine, so the simulator must use the numbers the fit saw) and
"padding" ({"dense_attention": bool}: cost steps at the engine's bucket shapes).

Pipeline parallelism (pp > 1): `make_step_time` returns a `PipelineStepTime`, whose `stage_times(out)` gives the
seconds of each stage (its layers only, `cost_model.stage_times`) and of each activation send; the simulator
runs the stages as resources with up to pp batches in flight, so bubbles come out of the schedule (the old
whole-iteration `num_microbatches` formula is not used here any more). Calling it gives one batch's latency
alone through the pipeline (sum of stages and sends). pp == 1 keeps the plain function and its exact numbers.

Speed: `compact_composition` groups decodes into at most two (count, context) groups with the exact same context
sum, which gives the same cost-model time as the per-request composition (the model aggregates decodes by their
mean context) at a fraction of the Python work.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Callable, Optional, Sequence, Tuple

from pdjax.config.buckets import Buckets
from pdjax.config.model_specs import ModelSpec
from pdjax.sim.calibration import MachineProfile, load_profile
from pdjax.sim import cost_model as cm
from pdjax.sim.cost_model import BatchComposition, CostParams, _plan
from pdjax.sim.hardware import HardwareSpec


@dataclasses.dataclass(frozen=True)
class EnginePadding:
    buckets: Buckets
    page_size: int
    dense_attention: bool = True


# --------------------------------------------------------------------------------------------------- compositions
def compact_composition(out) -> BatchComposition:
    """The cost-model composition of a SchedulerOutput with decodes folded into <= 2 groups of equal context sum
    (same `iteration_time` as BatchComposition.from_scheduler_output when pp == 1)."""
    prefills = []
    count = total = 0
    for is_prefill, start, new in zip(out.is_prefill, out.num_computed_tokens, out.num_new_tokens):
        if is_prefill or new != 1:
            prefills.append((new, start))
        else:
            count += 1
            total += start
    decodes = ()
    if count:
        q, r = divmod(total, count)
        decodes = ((count - r, q), (r, q + 1)) if r else ((count, q),)
    return BatchComposition(tuple(prefills), decodes)


def padded_shape(out, padding: EnginePadding) -> Tuple[int, int, int]:
    """(T_pad, S_pad, P_pad) the engine pads `out` to."""
    ps = padding.page_size
    max_pages = 1
    for start, new in zip(out.num_computed_tokens, out.num_new_tokens):
        pages = -(-(start + new) // ps)
        if pages > max_pages:
            max_pages = pages
    return padding.buckets.pick(sum(out.num_new_tokens), len(out.num_new_tokens), max_pages)


def padded_composition(out, padding: EnginePadding) -> BatchComposition:
    """The work the padded engine step does, as a cost-model composition (see the module docstring)."""
    t_pad, _, p_pad = padded_shape(out, padding)
    if padding.dense_attention:
        return BatchComposition((), ((t_pad, p_pad * padding.page_size - 1),))
    batch = compact_composition(out)
    extra = t_pad - batch.num_tokens
    if extra > 0:
        batch = BatchComposition(batch.prefills, batch.decodes + ((extra, 0),))
    return batch


class CachedIterationTime:
    """`iteration_time(batch, ...).total` for pp == 1, bit-identical, faster: the token/sequence-count terms
    (linear layers, element-wise kernels, TP communication) are computed once per (tokens, seqs) by the cost
    model's own `_stage_components` and cached; only attention, which depends on every chunk and context, is
    evaluated per batch, with the cost model's op functions in `_stage_components`' order (tests check the
    equality on random batches)."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec, tp: int, params: CostParams):
        self.model, self.hw, self.tp, self.params = model, hw, tp, params
        self.plan = _plan(model, hw, tp, 1)
        self._count_terms: dict = {}
        self._launch: dict = {}

    def __call__(self, batch: BatchComposition) -> float:
        tokens, seqs = batch.num_tokens, batch.num_seqs
        p = self.params
        overhead = cm.host_time(p, seqs, self.tp)
        if tokens == 0:
            return overhead
        terms = self._count_terms.get((tokens, seqs))
        if terms is None:
            lin, ew, _, com, _, _ = cm._stage_components(batch, self.plan, p, self.tp)
            terms = self._count_terms[(tokens, seqs)] = (lin, ew, com)
        lin, ew, com = terms
        device = lin + ew + self._attention(batch) + com + 0.0
        if p.launch_overhead_s > 0:
            kinds = (bool(batch.prefills), bool(batch.decodes))
            launch = self._launch.get(kinds)
            if launch is None:
                launch = self._launch[kinds] = p.launch_overhead_s * 1 * cm.kernels_per_iteration(
                    self.plan.shapes, self.plan.layers_per_stage, self.tp, *kinds)
            if launch > device:
                device = launch
        return device + overhead

    def _attention(self, batch: BatchComposition) -> float:
        plan, p = self.plan, self.params
        s = plan.shapes
        peak, bw = plan.peak, plan.bandwidth
        attention = 0.0
        for chunk, context in batch.prefills:
            c, mem = cm.prefill_attention_terms(chunk, context, s.heads, s.kv_heads, s.head_dim, s.dtype_bytes, peak,
                                                bw, p)
            attention += c + mem
        if batch.decodes:
            count = sum(n for n, _ in batch.decodes)
            mean_context = sum(n * c for n, c in batch.decodes) / count
            c, mem, items = cm.decode_attention_terms(count, mean_context, s.heads, s.kv_heads, s.head_dim,
                                                      s.dtype_bytes, peak, bw, p)
            attention += (c if c > mem else mem) + items
        if batch.prefills:
            attention += p.attn_prefill_fixed_s
        if batch.decodes:
            attention += p.attn_decode_fixed_s
        return attention * plan.layers_per_stage


class PipelineStepTime:
    """The step time of a pp-stage instance (module docstring): `stage_times(out) -> (per-stage seconds,
    per-boundary send seconds)` for the simulator's stage resources; calling it returns one batch's latency alone
    through the pipeline. `pp` tells the simulator how many batches it may keep in flight."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec, tp: int, pp: int, params: CostParams,
                 padding: Optional[EnginePadding] = None):
        self.model, self.hw, self.tp, self.pp, self.params, self.padding = model, hw, tp, pp, params, padding
        self._per_seq = cm.per_seq_host_s(params, tp * pp)

    def stage_times(self, out) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
        if self.padding is not None:
            batch = padded_composition(out, self.padding)
            stages, sends = cm.stage_times(batch, self.model, self.hw, self.tp, self.pp, self.params)
            # host per-sequence cost counts the real sequences (see make_step_time); it sits on stage 0
            extra = self._per_seq * (len(out.num_new_tokens) - batch.num_seqs)
            return (stages[0] + extra,) + stages[1:], sends
        return cm.stage_times(compact_composition(out), self.model, self.hw, self.tp, self.pp, self.params)

    def __call__(self, out) -> float:
        stages, sends = self.stage_times(out)
        return sum(stages) + sum(sends)


def make_step_time(model: ModelSpec, hw: HardwareSpec, tp: int = 1, pp: int = 1,
                   params: Optional[CostParams] = None, padding: Optional[EnginePadding] = None
                   ) -> Callable[[Any], float]:
    """A `SchedulerOutput -> seconds` function (the simulator's step_time): the cost model on the output's
    composition, padded as the engine pads it when `padding` is given. pp > 1: a `PipelineStepTime` (per-stage
    times; the simulator pipelines batches, so bubbles come from the simulated stage schedule)."""
    params = CostParams() if params is None else params
    _plan(model, hw, tp, pp)   # validate the layout now, not at the first step
    if pp > 1:
        return PipelineStepTime(model, hw, tp, pp, params, padding)
    cost = CachedIterationTime(model, hw, tp, params)

    per_seq = cm.per_seq_host_s(params, tp * pp)

    def step_time(out) -> float:
        if padding is not None:
            batch = padded_composition(out, padding)
            # The padded composition's "sequences" are stand-ins for padded work; the host's per-sequence
            # cost (batch building, sampling bookkeeping) counts the real ones.
            return cost(batch) + per_seq * (len(out.num_new_tokens) - batch.num_seqs)
        return cost(compact_composition(out))
    return step_time


# --------------------------------------------------------------------------------------------------- profiles
@dataclasses.dataclass(frozen=True)
class SimProfile:
    machine: MachineProfile
    hardware_spec: Optional[HardwareSpec] = None     # frozen spec (host-cpu calibrations)
    padding: Optional[dict] = None                   # {"dense_attention": bool}


def load_sim_profile(path_or_name) -> SimProfile:
    """A machine profile plus the optional "hardware_spec" and "padding" keys (module docstring)."""
    machine = load_profile(path_or_name)
    path = pathlib.Path(path_or_name)
    data = json.loads(path.read_text()) if path.suffix else {}
    spec = data.get("hardware_spec")
    padding = data.get("padding")
    if padding is not None:
        unknown = sorted(set(padding) - {"dense_attention"})
        if unknown:
            raise ValueError(f"profile {str(path_or_name)!r}: unknown padding keys {unknown}; expected "
                             f"'dense_attention'")
    return SimProfile(machine=machine, hardware_spec=HardwareSpec(**spec) if spec else None, padding=padding)


def save_sim_profile(path, machine: MachineProfile, hardware_spec: Optional[HardwareSpec] = None,
                     padding: Optional[dict] = None, extra: Optional[dict] = None) -> None:
    """Write a sim profile JSON; `extra` keys (e.g. the raw "measurements") are stored alongside."""
    data = dict(extra or {})
    data.update(machine.to_dict())
    if hardware_spec is not None:
        data["hardware_spec"] = dataclasses.asdict(hardware_spec)
    if padding is not None:
        data["padding"] = dict(padding)
    pathlib.Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def fit_padded_engine(outputs: Sequence[Any], seconds: Sequence[float], model: ModelSpec, hw: HardwareSpec,
                      padding: EnginePadding, fit_names: Sequence[str], initial: Optional[CostParams] = None,
                      tiles: Sequence[int] = (1,)):
    """Fit CostParams to whole-step seconds of the padded engine running `outputs` (SchedulerOutputs), with
    exactly the step time `make_step_time(..., padding=padding)` predicts; returns (params, relative errors).
    Multi-start Levenberg-Marquardt of pdjax.sim.calibration, one run per token tile in `tiles`."""
    import numpy as np  # noqa: PLC0415
    from pdjax.sim import calibration as cal  # noqa: PLC0415

    batches = [padded_composition(out, padding) for out in outputs]
    extra_seqs = np.array([len(out.num_new_tokens) - b.num_seqs for out, b in zip(outputs, batches)], float)
    measured = np.asarray(seconds, float)
    initial = CostParams() if initial is None else initial

    def predict(p: CostParams):
        return np.array(cm.iteration_times(batches, model, hw, 1, 1, p)) + p.per_seq_overhead_s * extra_seqs

    best = None
    for tile in tiles:
        for start in cal._starts(initial.replace(gemm_token_tile=int(tile)), fit_names):
            params = cal.fit_log_least_squares(predict, measured, start, fit_names)
            err = cal.relative_errors(predict(params), measured)
            score = float(np.mean(np.log1p(err) ** 2))
            if best is None or score < best[0]:
                best = (score, params, err)
    return best[1], best[2]
