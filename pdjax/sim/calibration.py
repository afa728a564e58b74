"""Calibration (numpy only): fit `CostParams` to measured times, and assemble the machine profiles
(pdjax.sim.profile.Profile) the simulator costs steps with.

Method: least squares on log(predicted) − log(measured) (relative errors, so a 10 µs kernel counts as much as a
10 ms one), Levenberg–Marquardt in numpy over transformed parameters (log for positive factors, logit for
`attn_causal_skip`), Jacobian by finite differences, and a weak prior pulling each parameter toward its initial
value so parameters the data cannot see stay put. `gemm_token_tile` is discrete: each candidate tile is fitted
and the best kept.

Data sources, all through the same machinery:
(a) Operator profiles (../shared/data/profiling, see its SOURCES.md; `python -m experiments.fit_profile`):
    `fit_vidur_a100(profiling_dir)`: Vidur's A100 operator times (per-layer GEMMs and element-wise ops of
    Llama-2-7B and Llama-3-8B at TP 1/2/4/8, attention prefill/decode, NCCL all-reduce), every operator predicted
    by the op-level functions `iteration_time` uses; `fit_operator_profile(hardware, ...)`: the a100 / h100
    profile JSON (the A100 fit or the H100 GEMM and element-wise fit on held-in token counts, the all-reduce terms
    per link kind on both network files, host priors); module section "(a)".
(b) Whole iterations of the real engine: `fit_cost_params(measurements, model, hw, tp, pp)` on cost-model
    compositions, `fit_padded_engine` on the engine's padded steps, and `engine_profile` (what
    `python -m experiments.calibrate` writes): the padded fit, the step-context terms, the raw measurements and
    the step noise in one Profile. The measurements come from pdjax.runtime.probe (grid, step context) and the
    engine-loop probe (pdjax.experiment.calibrate); this module only fits them.
(c) `fit_step_context(switch_deltas, idle_deltas)`: the step-context terms (shape switch, idle wake) from their
    own direct measurements (pdjax.runtime.probe.profile_step_context), not from the grid; `fit_step_noise`: the
    StepNoise quantiles of measured / predicted step seconds.
"""
from __future__ import annotations

import csv
import dataclasses
import math
import pathlib
import statistics
from typing import Any, Callable, Dict, Iterable, Optional, Sequence

import numpy as np

from pdjax.config.model_specs import ModelSpec, get_model_spec
from pdjax.sim import cost_model as cm
from pdjax.sim.cost_model import BatchComposition, CostParams
from pdjax.sim.hardware import HardwareSpec, get_hardware_spec
from pdjax.sim.profile import PROFILES_DIR, Profile, load_profile, save_profile
from pdjax.sim.replay import replay_steps, step_noise_ratios
from pdjax.sim.step_cost import EnginePadding, make_step_time, padded_composition, padded_shape

_FRACTION_PARAMS = ("attn_causal_skip",)

# What a whole-iteration fit (b) adjusts by default: the parameters whole-iteration times can tell apart. Fixed
# per-kernel costs (kernel_fixed_s, attn_*_fixed_s) are the same for every batch of a model, i.e. collinear with
# iteration_overhead_s, and the element-wise efficiencies are per-token like the GEMMs' activation bytes, so
# those stay at their initial values (pass `initial=` an operator-level profile to set them).
ITERATION_FIT_PARAMS = ("gemm_flops_efficiency", "gemm_bandwidth_efficiency", "attn_flops_efficiency",
                        "attn_bandwidth_efficiency", "iteration_overhead_s", "per_seq_overhead_s")


# --------------------------------------------------------------------------------------------------- solver
def _to_free(name: str, value: float) -> float:
    if name in _FRACTION_PARAMS:
        v = min(max(value, 1e-4), 1 - 1e-4)
        return math.log(v / (1 - v))
    return math.log(max(value, 1e-12))


def _from_free(name: str, z: float) -> float:
    if name in _FRACTION_PARAMS:
        return 1.0 / (1.0 + math.exp(-z))
    return math.exp(z)


def relative_errors(predicted, measured) -> np.ndarray:
    predicted, measured = np.asarray(predicted, float), np.asarray(measured, float)
    return np.abs(predicted - measured) / measured


def error_summary(predicted, measured) -> dict[str, float]:
    err = relative_errors(predicted, measured)
    return {"median_rel_error": float(np.median(err)), "p90_rel_error": float(np.percentile(err, 90)),
            "num_measurements": int(err.size)}


def fit_log_least_squares(predict: Callable[[CostParams], np.ndarray], measured, initial: CostParams,
                          names: Sequence[str], prior_weight: float = 1e-2, iterations: int = 60,
                          weights=None) -> CostParams:
    """Levenberg–Marquardt on r = sqrt(w)·(log predict(params) − log measured), plus prior rows
    prior_weight·(z − z0) over the transformed parameters z."""
    measured = np.asarray(measured, float)
    if measured.ndim != 1 or measured.size == 0 or np.any(measured <= 0):
        raise ValueError("fit: measured times must be a non-empty 1-D array of positive seconds")
    sqrt_w = np.ones_like(measured) if weights is None else np.sqrt(np.asarray(weights, float))
    log_measured = np.log(measured)
    names = list(names)
    known = {f.name for f in dataclasses.fields(CostParams)} - {"gemm_token_tile"}
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"fit: cannot fit {bad}; fittable CostParams fields: {sorted(known)}")
    # A parameter starting at exactly 0 would sit at log(1e-12), too far for the solver to climb: seed it at
    # 1 µs (every fittable zero-default is a time).
    initial = initial.replace(**{n: 1e-6 for n in names if getattr(initial, n) == 0})
    z0 = np.array([_to_free(n, getattr(initial, n)) for n in names])

    def params_of(z):
        return initial.replace(**{n: _from_free(n, float(v)) for n, v in zip(names, z)})

    def residuals(z):
        pred = np.asarray(predict(params_of(z)), float)
        r = sqrt_w * (np.log(np.maximum(pred, 1e-15)) - log_measured)
        return np.concatenate([r, prior_weight * (z - z0)])

    z = z0.copy()
    r = residuals(z)
    cost = float(r @ r)
    damping = 1e-2
    for _ in range(iterations):
        jac = np.empty((r.size, z.size))
        for j in range(z.size):
            step = np.zeros_like(z)
            step[j] = 1e-4
            jac[:, j] = (residuals(z + step) - r) / 1e-4
        jtj, jtr = jac.T @ jac, jac.T @ r
        improved = False
        for _ in range(10):
            delta = np.linalg.solve(jtj + damping * np.diag(np.diag(jtj) + 1e-9), -jtr)
            trial = residuals(z + delta)
            trial_cost = float(trial @ trial)
            if trial_cost < cost:
                z, r, cost = z + delta, trial, trial_cost
                damping = max(damping / 3, 1e-7)
                improved = True
                break
            damping *= 4
        if not improved or float(np.max(np.abs(delta))) < 1e-6:
            break
    return params_of(z)


def _starts(initial: CostParams, names: Sequence[str]) -> list[CostParams]:
    """Initial points for a multi-start fit. A roofline's max() has flat directions: while every measurement
    sits on the FLOPs side, the bandwidth factor gets no gradient. Starting with the FLOPs-type and the
    bandwidth-type factors pushed apart both ways puts each side in play at least once."""
    def scaled(flops_factor, bandwidth_factor):
        changes = {}
        for n in names:
            if n.endswith("flops_efficiency"):
                changes[n] = getattr(initial, n) * flops_factor
            elif n.endswith("bandwidth_efficiency"):
                changes[n] = getattr(initial, n) * bandwidth_factor
        return initial.replace(**changes)
    return [initial, scaled(3.0, 0.3), scaled(0.3, 3.0)]


def _fit_multistart_tiles(predict: Callable[[CostParams], np.ndarray], measured, initial: CostParams,
                          names: Sequence[str], tiles: Sequence[int]):
    """`fit_log_least_squares` from each of `_starts` per token tile in `tiles`; (params, relative errors) of the
    lowest mean log1p(relative error)^2."""
    best = None
    for tile in tiles:
        for start in _starts(initial.replace(gemm_token_tile=int(tile)), names):
            params = fit_log_least_squares(predict, measured, start, names)
            err = relative_errors(predict(params), measured)
            score = float(np.mean(np.log1p(err) ** 2))
            if best is None or score < best[0]:
                best = (score, params, err)
    return best[1], best[2]


def _fit_weighted_tiles(predict: Callable[[CostParams], np.ndarray], measured, initial: CostParams,
                        names: Sequence[str], tiles: Sequence[int], weights, iterations: int = 60) -> CostParams:
    """`fit_log_least_squares` once per token tile in `tiles` (weighted rows); the params of the lowest weighted
    sum of log1p(relative error)^2."""
    best = None
    for tile in tiles:
        params = fit_log_least_squares(predict, measured, initial.replace(gemm_token_tile=int(tile)), names,
                                       weights=weights, iterations=iterations)
        score = float(np.sum(weights * np.log1p(relative_errors(predict(params), measured)) ** 2))
        if best is None or score < best[0]:
            best = (score, params)
    return best[1]


# --------------------------------------------------------------------------------------------------- (b) iterations
@dataclasses.dataclass(frozen=True)
class FitResult:
    params: CostParams
    median_rel_error: float
    p90_rel_error: float
    num_measurements: int
    fitted: tuple[str, ...]


def fit_cost_params(measurements: Iterable[tuple[BatchComposition, float]], model: ModelSpec, hw: HardwareSpec,
                    tp: int = 1, pp: int = 1, initial: Optional[CostParams] = None,
                    fit_names: Sequence[str] = ITERATION_FIT_PARAMS,
                    tiles: Sequence[int] = (1, 8, 16, 32, 64, 128)) -> FitResult:
    """Fit CostParams to measured whole-iteration seconds of batches run on `tp`·`pp` devices of `hw`.

    Each tile in `tiles` is tried (a CPU engine has no tensor-core tiles; GPUs use 64-128) and the best kept.
    """
    measurements = list(measurements)
    if not measurements:
        raise ValueError("fit_cost_params: no measurements")
    for batch, seconds in measurements:
        if not isinstance(batch, BatchComposition) or not seconds > 0:
            raise ValueError(f"fit_cost_params: bad measurement ({batch!r}, {seconds!r}); expected "
                             f"(BatchComposition, positive seconds)")
    batches = [b for b, _ in measurements]
    measured = np.array([s for _, s in measurements], float)
    initial = CostParams() if initial is None else initial

    def predict(p):
        return np.array(cm.iteration_times(batches, model, hw, tp, pp, p))

    params, err = _fit_multistart_tiles(predict, measured, initial, fit_names, tiles)
    return FitResult(params=params, median_rel_error=float(np.median(err)),
                     p90_rel_error=float(np.percentile(err, 90)), num_measurements=len(measured),
                     fitted=tuple(fit_names) + ("gemm_token_tile",))


def fit_padded_engine(outputs: Sequence[Any], seconds: Sequence[float], model: ModelSpec, hw: HardwareSpec,
                      padding: EnginePadding, fit_names: Sequence[str], initial: Optional[CostParams] = None,
                      tiles: Sequence[int] = (1,)):
    """Fit CostParams to whole-step seconds of the padded engine running `outputs` (SchedulerOutputs), with
    exactly the step time `make_step_time(..., padding=padding)` predicts; returns (params, relative errors).
    Multi-start Levenberg-Marquardt (`_starts`) per token tile in `tiles`."""
    batches = [padded_composition(out, padding) for out in outputs]
    extra_seqs = np.array([len(out.num_new_tokens) - b.num_seqs for out, b in zip(outputs, batches)], float)
    measured = np.asarray(seconds, float)
    initial = CostParams() if initial is None else initial

    def predict(p: CostParams):
        return np.array(cm.iteration_times(batches, model, hw, 1, 1, p)) + p.per_seq_overhead_s * extra_seqs

    return _fit_multistart_tiles(predict, measured, initial, fit_names, tiles)


def fit_engine_profile(measured, model: ModelSpec, hw: HardwareSpec, padding: EnginePadding, *, source: str,
                       command: str):
    """Fit CostParams to [(kind, SchedulerOutput, seconds)] measured on the padded engine on `hw` (kind:
    'prefill' | 'decode' | 'mixed'); returns (Profile, report) with the fit errors overall and per kind."""
    # attn_seq_head_s too: in the dense (padded reference) composition it is a per-token attention cost
    # (softmax bookkeeping, masks, index math per query) that the byte and FLOP terms do not capture.
    names = ITERATION_FIT_PARAMS + ("attn_seq_head_s",)
    if not padding.dense_attention and hw.kind == "cpu":
        # Blocked XLA attention: each pass is a fori_loop of its own with a fixed cost per call (the chunk pass
        # runs only when a batch holds a prefill chunk, the decode pass when it holds decodes); prefill-only,
        # decode-only and mixed batches tell the two apart from the per-iteration overhead.
        names = names + ("attn_prefill_fixed_s", "attn_decode_fixed_s")
    # No tensor-core tiles on a CPU (the token axis is already padded to its bucket); GPUs round up to 64-128.
    tiles = (1, 16) if padding.dense_attention or hw.kind == "cpu" else (1, 16, 64, 128)
    params, err = fit_padded_engine([out for _, out, _ in measured], [s for _, _, s in measured], model, hw,
                                    padding, names, tiles=tiles)
    groups = {}
    for kind in sorted({k for k, _, _ in measured}):
        e = np.array([x for x, (k, _, _) in zip(err, measured) if k == kind])
        groups[kind] = {"median_rel_error": float(np.median(e)), "p90_rel_error": float(np.percentile(e, 90)),
                        "num_measurements": int(e.size)}
    report = {"median_rel_error": float(np.median(err)), "p90_rel_error": float(np.percentile(err, 90)),
              "num_measurements": len(measured), "groups": groups}
    profile = Profile(hardware=hw.name, params=params, fitted=tuple(names) + ("gemm_token_tile",), fit=report,
                      source=source, command=command)
    return profile, report


def median_decode_step_s(measured) -> float:
    """The median seconds of the grid's decode-only points ([(kind, SchedulerOutput, seconds)])."""
    decode = [s for kind, _, s in measured if kind == "decode"]
    return statistics.median(decode if decode else [s for _, _, s in measured])


def measurement_records(measured, padding: EnginePadding) -> list:
    """The profile's raw "measurements": per grid point its kind, padded (T, S, P) shape, seconds and
    sequences as [new tokens, context before them, is_prefill]."""
    return [{"kind": kind, "shape": list(padded_shape(out, padding)), "seconds": s,
             "seqs": [[n, c, bool(p)] for n, c, p in zip(out.num_new_tokens, out.num_computed_tokens, out.is_prefill)]}
            for kind, out, s in measured]


def engine_profile(measured, model: ModelSpec, hw: HardwareSpec, padding: EnginePadding, *, source: str,
                   command: str, context: Optional[dict] = None, probe: Sequence = (), probe_requests: int = 0):
    """The Profile of a calibration of the padded engine on `hw`, and what it found.

    measured: [(kind, SchedulerOutput, seconds)] of the grid (`fit_engine_profile`).
    context: `profile_step_context` data (pdjax.runtime.probe); its fitted terms (shape switch, idle wake) go
        into the params, the data into "step_context".
    probe: [(batches, iterations)] of engine-loop probe runs (`probe_requests` requests each); the fitted model
        replays them (pdjax.sim.replay) and the measured / predicted ratios of their steady decode steps become
        "step_noise" (too few steady steps: no noise, and the reason in the returned summary).
    The profile stores the padding and, on a CPU, the HardwareSpec the fit saw. Returns (Profile, {"fit": errors,
    "step_context": fitted terms or None, "step_noise": {"num_steps", "p50", "p90", "p99"} | {"skipped": why}
    | None})."""
    profile, report = fit_engine_profile(measured, model, hw, padding, source=source, command=command)
    context_terms = None
    if context is not None:
        context_terms = fit_step_context_terms(context)
        profile = profile.replace(params=profile.params.replace(**context_terms),
                                  fitted=profile.fitted + STEP_CONTEXT_PARAMS,
                                  source=profile.source + f"; step context: {len(context['switch'])} shape "
                                  f"switches and {len(context['idle'])} idle gaps x {context['rounds']} rounds")
    extra = {"measurements": measurement_records(measured, padding)}
    if context is not None:
        extra["step_context"] = context
    noise = None
    if probe:
        step_time = make_step_time(model, hw, 1, 1, profile.params, padding)   # the fitted model, no noise
        try:
            ratios = [r for batches, iterations in probe
                      for r in step_noise_ratios(replay_steps(batches, iterations, step_time, padding))]
            quantiles = fit_step_noise(ratios)
        except ValueError as e:   # too few steady decode steps: a profile without noise, and the reason
            noise = {"skipped": str(e)}
        else:
            noise = {"num_steps": len(ratios), "p50": quantiles[50], "p90": quantiles[90], "p99": quantiles[99]}
            extra["step_noise"] = {"quantiles": quantiles, "num_steps": len(ratios),
                                   "source": f"engine-loop probe ({len(probe)} run(s) of {probe_requests} "
                                             "requests, steady decode steps, measured / fitted model)"}
    profile = profile.replace(hardware_spec=hw if hw.kind == "cpu" else None, padding=padding.profile_dict(),
                              extra=extra)
    return profile, {"fit": report, "step_context": context_terms, "step_noise": noise}


# --------------------------------------------------------------------------------------------------- step context
STEP_CONTEXT_PARAMS = ("shape_switch_s", "idle_wake_s", "idle_wake_tau_s", "idle_wake_fixed_s")
STEP_NOISE_QUANTILES = 101     # values at probabilities 0, 0.01, ..., 1
MIN_NOISE_STEPS = 100


def fit_step_noise(ratios: Sequence[float], num_quantiles: int = STEP_NOISE_QUANTILES) -> list[float]:
    """The StepNoise quantiles (pdjax.sim.step_cost) of measured / predicted step seconds: the empirical
    distribution at `num_quantiles` evenly spaced probabilities 0..1. Raises ValueError for fewer than
    MIN_NOISE_STEPS ratios (a tail needs samples) or a non-positive one."""
    r = np.asarray(list(ratios), float)
    if r.size < MIN_NOISE_STEPS:
        raise ValueError(f"fit_step_noise: {r.size} step ratios, expected at least {MIN_NOISE_STEPS} (a probe "
                         "that ran too few steady decode steps)")
    if not np.all(r > 0):
        raise ValueError(f"fit_step_noise: ratios must be > 0, got min {float(r.min())!r}")
    return [float(x) for x in np.quantile(r, np.linspace(0.0, 1.0, num_quantiles))]


def fit_step_context(switch_deltas: Sequence[float], idle_deltas: Sequence[tuple[float, float]],
                     taus: Optional[Sequence[float]] = None) -> dict[str, float]:
    """The step-context terms of CostParams (cost_model.context_time) from direct measurements on the engine:

    switch_deltas: seconds a step took right after a step of another padded shape minus the same step right
        after itself (one per (previous, next) pair, each already a median over rounds);
        shape_switch_s = their median, floored at 0.
    idle_deltas: (idle gap seconds, seconds the step took after sleeping that long minus the same step back to
        back), for one or several compositions per gap; the median per gap (robust to a composition whose own
        noise swamps the effect: a 10 ms step on a loaded machine) is fitted by least squares to
        idle_wake_fixed_s + idle_wake_s · min(1, gap / idle_wake_tau_s), both amplitudes >= 0, tau the best of
        `taus` (default 0.5 ms .. 200 ms, log-spaced).
    Returns {name: value} for STEP_CONTEXT_PARAMS (zeros where there is no data)."""
    out = {name: 0.0 for name in STEP_CONTEXT_PARAMS}
    if len(switch_deltas):
        out["shape_switch_s"] = max(0.0, float(np.median(np.asarray(switch_deltas, float))))
    if len(idle_deltas):
        if any(g <= 0 for g, _ in idle_deltas):
            raise ValueError("fit_step_context: idle gaps must be > 0 seconds")
        per_gap: dict = {}
        for g, d in idle_deltas:
            per_gap.setdefault(float(g), []).append(float(d))
        gaps = np.array(sorted(per_gap), float)
        deltas = np.array([np.median(per_gap[g]) for g in sorted(per_gap)], float)
        taus = np.geomspace(5e-4, 0.2, 41) if taus is None else np.asarray(taus, float)
        best = None
        for tau in taus:
            ramp = np.minimum(1.0, gaps / tau)
            for cols in ((0, 1), (1,), (0,)):         # non-negative least squares over the two amplitudes
                a = np.stack([np.ones_like(gaps), ramp], axis=1)[:, cols]
                coef, *_ = np.linalg.lstsq(a, deltas, rcond=None)
                if np.any(coef < 0):
                    continue
                sse = float(np.sum((a @ coef - deltas) ** 2))
                full = dict(zip(cols, coef))
                if best is None or sse < best[0] - 1e-18:
                    best = (sse, float(full.get(0, 0.0)), float(full.get(1, 0.0)), float(tau))
        if best is not None:
            _, fixed, wake, tau = best
            out.update(idle_wake_fixed_s=fixed, idle_wake_s=wake, idle_wake_tau_s=tau if wake > 0 else 0.0)
    return out


def fit_step_context_terms(context: dict) -> Dict[str, float]:
    """CostParams step-context values from `profile_step_context` data (pdjax.runtime.probe) via
    `fit_step_context`."""
    return fit_step_context([e["delta_s"] for e in context["switch"]],
                            [(e["gap_s"], e["delta_s"]) for e in context["idle"]])


def merge_step_context(first: dict, second: dict) -> dict:
    """The mean of two `profile_step_context` results of the same compositions (bracketing a real run)."""
    out = {"rounds": first["rounds"] + second["rounds"]}
    for key, value in (("switch", "delta_s"), ("idle", "delta_s"), ("steady", "seconds")):
        out[key] = [{**a, value: 0.5 * (a[value] + b[value])} for a, b in zip(first[key], second[key])]
    return out


# --------------------------------------------------------------------------------------------------- (a) operator data
VIDUR_MODELS = {"llama-2-7b": "llama-2-7b", "llama-3-8b": "llama-3-8b"}
_GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
_ELEMENTWISE_OPS = ("emb", "input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add")
A100_FIT_PARAMS = ("gemm_flops_efficiency", "gemm_bandwidth_efficiency", "kernel_fixed_s", "gemm_outputs_per_unit",
                   "gemm_occupancy_exponent",
                   *cm.ELEMENTWISE_EFFICIENCY.values(), "attn_flops_efficiency", "attn_bandwidth_efficiency",
                   "attn_seq_head_s", "attn_prefill_fixed_s", "attn_decode_fixed_s", "comm_bandwidth_efficiency",
                   "comm_fixed_s")
# attn_causal_skip is held at 1 (kernels skip fully masked tiles: FlashAttention-2, FlashInfer, pdjax's Pallas
# kernel). Fitting it lands near 0.13, driven by the Llama-2-7B prefill rows (an older kernel); that quarters the
# prefill-attention error on this data (18% -> 5% median) but makes one long prefill dearer than the same
# prompt in chunks, the opposite of what Sarathi-Serve measured. Pass fit_names=A100_FIT_PARAMS +
# ("attn_causal_skip",) to reproduce that variant.
_VIDUR_ELEMENTWISE_KIND = {"emb": "embedding", "input_layernorm": "norm", "post_attention_layernorm": "norm",
                           "attn_rope": "rope", "mlp_act": "activation", "add": "residual"}
# The network files and the machine each was measured on (its links are what the all-reduce rows see).
NETWORK_FILES = {"pairwise": "a100_pairwise_nvlink_all_reduce.csv", "dgx": "a100_dgx_all_reduce.csv"}
NETWORK_HARDWARE = {"pairwise": "a100-80gb-pcie", "dgx": "a100-80gb-sxm"}


@dataclasses.dataclass
class OperatorData:
    """Column arrays of operator measurements (seconds), grouped by kind; built by `load_mlp` and
    `load_vidur_profiles`."""
    gemm: dict = dataclasses.field(default_factory=dict)         # tokens, k, m, seconds, model, op, tp
    elementwise: dict = dataclasses.field(default_factory=dict)  # tokens, bytes_per_token, kind, seconds, op, tp, model
    layer: dict = dataclasses.field(default_factory=dict)        # model, tp, tokens, seconds (sum of ops)
    prefill: dict = dataclasses.field(default_factory=dict)      # chunk, context, heads, kv_heads, seconds, model
    decode: dict = dataclasses.field(default_factory=dict)       # count, context, heads, kv_heads, seconds, model
    allreduce: dict = dataclasses.field(default_factory=dict)    # bytes, group, per_node, kind, box, seconds
    head_dim: int = 128


def _arrays(rows: list[dict]) -> dict[str, np.ndarray]:
    return {k: np.array([r[k] for r in rows]) for k in rows[0]} if rows else {}


def load_mlp(profiling_dir, subdir: str, models) -> OperatorData:
    """The gemm, elementwise and layer rows of `<profiling_dir>/<subdir>/<model>_mlp.csv` for each model (Vidur's
    per-layer operator profiles), in seconds, with the TP-sharded shapes of the cost model; a layer's time is the
    sum of its operators but the embedding. Rows are stored 4 GEMMs and 6 element-wise ops per layer row, in order."""
    gemm, elementwise, layer = [], [], []
    for model_name in models:
        spec = get_model_spec(model_name)
        with open(pathlib.Path(profiling_dir) / subdir / f"{model_name}_mlp.csv") as f:
            for row in csv.DictReader(f):
                tp = int(row["num_tensor_parallel_workers"])
                tokens = int(row["num_tokens"])
                shapes = cm.sharded_shapes(spec, tp)
                total = 0.0
                for op, (k, m) in zip(_GEMM_OPS, shapes.gemms):
                    sec = float(row[f"time_stats.{op}.median"]) * 1e-3
                    total += sec
                    gemm.append(dict(tokens=tokens, k=k, m=m, seconds=sec, model=model_name, op=op, tp=tp))
                h, b, d = shapes.hidden, shapes.dtype_bytes, shapes.head_dim
                per_token = {"emb": 2 * h * b, "input_layernorm": 2 * h * b, "post_attention_layernorm": 2 * h * b,
                             "attn_rope": 2 * (shapes.heads + shapes.kv_heads) * d * b,
                             "mlp_act": 3 * shapes.gemms[2][1] // 2 * b, "add": 3 * h * b}
                for op in _ELEMENTWISE_OPS:
                    sec = float(row[f"time_stats.{op}.median"]) * 1e-3
                    total += sec if op != "emb" else 0.0
                    elementwise.append(dict(tokens=tokens, bytes_per_token=per_token[op], seconds=sec, op=op,
                                            kind=_VIDUR_ELEMENTWISE_KIND[op], tp=tp, model=model_name))
                layer.append(dict(model=model_name, tp=tp, tokens=tokens, seconds=total))
    return OperatorData(gemm=_arrays(gemm), elementwise=_arrays(elementwise), layer=_arrays(layer))


def load_allreduce(profiling_dir, boxes: Sequence[str] = tuple(NETWORK_FILES)) -> Dict[str, np.ndarray]:
    """All-reduce rows of the network files of `boxes` (NETWORK_FILES): bytes (the CSV's `size` is already bytes:
    Vidur's collectives_wrapper writes `size * 2  # bytes` for fp16 buffers), group, per_node (GPUs of the group on
    one node), kind ('pair' | 'pcie' | 'switch' | 'network'), box, seconds."""
    rows = []
    for box in boxes:
        with open(pathlib.Path(profiling_dir) / "network" / NETWORK_FILES[box]) as f:
            for row in csv.DictReader(f):
                if row["collective"] != "all_reduce":
                    continue
                group, per_node = int(row["num_workers"]), int(row["devices_per_node"])
                if group > per_node:
                    kind = "network"
                elif box == "pairwise":
                    kind = "pair" if group <= 2 else "pcie"
                else:
                    kind = "switch"
                rows.append(dict(bytes=int(row["size"]), group=group, per_node=min(per_node, group), kind=kind,
                                 box=box, seconds=float(row["time_stats.all_reduce.median"]) * 1e-3))
    return _arrays(rows)


def load_vidur_profiles(profiling_dir) -> OperatorData:
    """Read ../shared/data/profiling (see its SOURCES.md): A100 per-layer operators of VIDUR_MODELS, attention
    prefill/decode subsets, the pairwise box's all-reduces. Times -> seconds."""
    root = pathlib.Path(profiling_dir)
    prefill, decode = [], []
    data = load_mlp(root, "a100", VIDUR_MODELS)
    for model_name in VIDUR_MODELS:
        spec = get_model_spec(model_name)
        with open(root / "a100" / f"{model_name}_attention_subset.csv") as f:
            for row in csv.DictReader(f):
                tp = int(row["num_tensor_parallel_workers"])
                shapes = cm.sharded_shapes(spec, tp)
                common = dict(heads=shapes.heads, kv_heads=shapes.kv_heads, model=model_name)
                if row["is_prefill"] == "True":
                    prefill.append(dict(chunk=int(row["prefill_chunk_size"]), context=int(row["kv_cache_size"]),
                                        seconds=float(row["attn_prefill_median_ms"]) * 1e-3, **common))
                else:
                    decode.append(dict(count=int(row["batch_size"]), context=int(row["kv_cache_size"]),
                                       seconds=float(row["attn_decode_median_ms"]) * 1e-3, **common))
    return dataclasses.replace(data, prefill=_arrays(prefill), decode=_arrays(decode),
                               allreduce=load_allreduce(root, ("pairwise",)))


# --------------------------------------------------------------------------------------------------- (a) predictions
def predict_gemm(g, params: CostParams, hw: HardwareSpec) -> np.ndarray:
    """Seconds of each GEMM row (tokens x k @ k x m, fp16)."""
    return cm.gemm_time(g["tokens"], g["k"], g["m"], 2, hw.peak_flops_fp16, hw.hbm_bandwidth, hw.compute_units,
                        params, maximum=np.maximum, minimum=np.minimum)


def predict_elementwise(e, params: CostParams, hw: HardwareSpec) -> np.ndarray:
    """Seconds of each element-wise row, with its kind's bandwidth efficiency."""
    out = np.empty(e["tokens"].shape)
    for kind in np.unique(e["kind"]):
        sel = e["kind"] == kind
        out[sel] = cm.elementwise_time(e["tokens"][sel], e["bytes_per_token"][sel], str(kind), hw.hbm_bandwidth,
                                       params)
    return out


def predict_allreduce(ar, params: CostParams, generic: bool = False,
                      network_specs: Optional[Dict[str, HardwareSpec]] = None) -> np.ndarray:
    """All-reduce seconds of each row (`load_allreduce`) on its box's links (network_specs: box -> HardwareSpec,
    default the NETWORK_HARDWARE specs), with the per-link-kind terms, or the generic alpha-beta ring
    (generic=True)."""
    out = np.empty(ar["bytes"].shape, float)
    keys = sorted(set(zip(ar["box"].tolist(), ar["group"].tolist(), ar["per_node"].tolist(), ar["kind"].tolist())))
    for box, group, per_node, kind in keys:
        sel = (ar["box"] == box) & (ar["group"] == group) & (ar["per_node"] == per_node)
        spec = (network_specs or {}).get(box) or get_hardware_spec(NETWORK_HARDWARE[box])
        if kind == "network":
            bw, hop = spec.inter_node_bandwidth, spec.inter_node_latency
        else:
            bw, hop = spec.group_link(group)
        out[sel] = cm.allreduce_time(ar["bytes"][sel].astype(float), group, bw, hop, params,
                                     None if generic else kind, per_node if kind == "network" else 1)
    return out


def predict_operators(data: OperatorData, params: CostParams, hw: HardwareSpec,
                      network_hw: HardwareSpec) -> dict[str, np.ndarray]:
    """Predicted seconds per group of `data`, with the same op-level formulas as `iteration_time` (all-reduces:
    the generic ring on `network_hw`'s links)."""
    peak, bw, b, d = hw.peak_flops_fp16, hw.hbm_bandwidth, 2, data.head_dim
    p, dc = data.prefill, data.decode
    out = {"gemm": predict_gemm(data.gemm, params, hw),
           "elementwise": predict_elementwise(data.elementwise, params, hw)}
    c, m = cm.prefill_attention_terms(p["chunk"], p["context"], p["heads"], p["kv_heads"], d, b, peak, bw, params)
    out["attention_prefill"] = c + m + params.attn_prefill_fixed_s
    c, m, items = cm.decode_attention_terms(dc["count"], dc["context"], dc["heads"], dc["kv_heads"], d, b, peak, bw,
                                            params)
    out["attention_decode"] = np.maximum(c, m) + items + params.attn_decode_fixed_s
    out["allreduce"] = predict_allreduce(data.allreduce, params, generic=True,
                                         network_specs={"pairwise": network_hw, "dgx": network_hw})
    return out


def predict_layers(data: OperatorData, params: CostParams, hw: HardwareSpec) -> np.ndarray:
    """Predicted per-layer non-attention time (4 GEMMs + norms, RoPE, activation, add) for each mlp.csv row."""
    L = data.layer
    out = np.empty(L["tokens"].shape)
    for model_name in np.unique(L["model"]):
        spec = get_model_spec(str(model_name))
        for tp in np.unique(L["tp"][L["model"] == model_name]):
            sel = (L["model"] == model_name) & (L["tp"] == tp)
            s = cm.sharded_shapes(spec, int(tp))
            tokens = L["tokens"][sel]
            total = sum(cm.gemm_time(tokens, k, m, 2, hw.peak_flops_fp16, hw.hbm_bandwidth, hw.compute_units, params,
                                     np.maximum, np.minimum) for k, m in s.gemms)
            total = total + sum(cm.elementwise_time(tokens, nbytes, kind, hw.hbm_bandwidth, params)
                                for kind, nbytes in s.layer_elementwise)
            out[sel] = total
    return out


def _octave_weights(tokens) -> np.ndarray:
    """Weights summing to 1 with each power-of-two bucket of `tokens` summing to the same share."""
    bucket = np.floor(np.log2(np.asarray(tokens, float))).astype(int)
    _, inverse, counts = np.unique(bucket, return_inverse=True, return_counts=True)
    w = 1.0 / counts[inverse]
    return w / w.sum()


# --------------------------------------------------------------------------------------------------- (a) A100 fit
def fit_vidur_a100(profiling_dir, hardware: str = "a100-80gb-sxm", network_hardware: str = "a100-80gb-pcie",
                   initial: Optional[CostParams] = None, tiles: Sequence[int] = (64, 128),
                   fit_names: Sequence[str] = A100_FIT_PARAMS) -> tuple[CostParams, dict[str, Any]]:
    """Fit the A100 efficiency factors to Vidur's operator profiles. Returns (params, report) where the report
    has median/p90 relative error overall (every operator measurement), per group, and per layer."""
    data = load_vidur_profiles(profiling_dir)
    hw, net = get_hardware_spec(hardware), get_hardware_spec(network_hardware)
    initial = CostParams() if initial is None else initial
    groups = ("gemm", "elementwise", "attention_prefill", "attention_decode", "allreduce")
    measured = np.concatenate([data.gemm["seconds"], data.elementwise["seconds"], data.prefill["seconds"],
                               data.decode["seconds"], data.allreduce["seconds"]])
    sizes = [data.gemm["seconds"].size, data.elementwise["seconds"].size, data.prefill["seconds"].size,
             data.decode["seconds"].size, data.allreduce["seconds"].size]
    # Each group weighs the same in total, so 11k GEMM rows do not drown 250 decode-attention rows; inside the
    # GEMM and element-wise groups each octave of token count weighs the same, so the decode regime (1-64
    # tokens, a few rows) counts as much as the hundreds of rows at 256-4096 tokens.
    weights = np.concatenate([_octave_weights(data.gemm["tokens"]), _octave_weights(data.elementwise["tokens"]),
                              *[np.full(n, 1.0 / n) for n in sizes[2:]]]) * sum(sizes) / len(sizes)

    def predict(params):
        out = predict_operators(data, params, hw, net)
        return np.concatenate([out[k] for k in groups])

    params = _fit_weighted_tiles(predict, measured, initial, fit_names, tiles, weights)
    out = predict_operators(data, params, hw, net)
    report = {"overall": error_summary(predict(params), measured), "groups": {}}
    for key, m in zip(groups, [data.gemm, data.elementwise, data.prefill, data.decode, data.allreduce]):
        report["groups"][key] = error_summary(out[key], m["seconds"])
    for model_name in VIDUR_MODELS:
        for key, m in (("attention_prefill", data.prefill), ("attention_decode", data.decode)):
            sel = m["model"] == model_name
            report["groups"][f"{key}[{model_name}]"] = error_summary(out[key][sel], m["seconds"][sel])
    report["groups"]["layer_total"] = error_summary(predict_layers(data, params, hw), data.layer["seconds"])
    report["hardware"] = hardware
    report["network_hardware"] = network_hardware
    return params, report


# --------------------------------------------------------------------------------------------------- (a) profiles
# What `fit_operator_profile` fits on what (`python -m experiments.fit_profile`; the data: ../shared/data/profiling):
# - a100: `fit_vidur_a100` (GEMMs, element-wise ops, attention subsets, the generic all-reduce terms).
# - h100: GEMMs and element-wise ops of Llama-2-7B (TP 1/2/4/8) on one H100 SXM: COMPUTE_FIT_PARAMS. Token
#   counts are split 3:1 into fit and held-out rows (every HOLDOUT_EVERY-th distinct token count is held out);
#   the profile is fitted on the fit rows only and its held-out error reported. No H100 attention or network rows
#   exist: attention factors are carried over from the A100 fit (fractions of the H100's own peaks) and the
#   all-reduce terms from the A100 boxes (same NCCL protocol; bandwidth efficiency of the H100's NVLink4).
# - both: the all-reduce terms per link kind (`cost_model.allreduce_time`: fixed + (n-1)·step + bytes term) on
#   both network files: the pairwise box gives 'pair' (2 GPUs on a bridge) and 'pcie' (4 GPUs), the DGX file
#   'switch' (groups inside the 8-GPU NVSwitch node) and 'network' (groups spanning nodes, d GPUs per node -> d
#   NICs in parallel), rows weighted so each octave of message size weighs the same (small all-reduces are what
#   TP decode steps do); the host terms are HOST_PRIORS (the profiling data has no whole-step rows).
# Regimes: each GEMM row's arithmetic intensity (FLOPs / bytes moved) against the hardware's ridge point (peak
# FLOP/s / HBM bandwidth): memory-bound below ridge/2, compute-bound above 2·ridge, transition between. Layer rows
# take the regime of their token count's QKV GEMM.
HOLDOUT_EVERY = 4
COMPUTE_FIT_PARAMS = ("gemm_flops_efficiency", "gemm_bandwidth_efficiency", "kernel_fixed_s", "gemm_outputs_per_unit",
                      "gemm_occupancy_exponent", "norm_bandwidth_efficiency", "rope_bandwidth_efficiency",
                      "activation_bandwidth_efficiency", "residual_bandwidth_efficiency",
                      "embedding_bandwidth_efficiency")
# Host-side terms (no whole-step rows in the profiling data). Source: microsoft/vidur's cpu_overheads.csv (A100,
# the Sarathi-Serve/vLLM-v0 engine with Ray workers; schedule + sampler + prepare-inputs + process-outputs + Ray
# comm medians, decode batches of 8..64): Llama-2-7B TP1 ~1.3 ms + 0.11 ms/sequence; TP2/TP4 (7B and 70B)
# ~3.9-4.1 ms + 0.17-0.22 ms/sequence, i.e. ~2.7 ms + ~0.09 ms/sequence more with several workers. The launch
# floor takes the CUDA kernel-launch latency (~4 µs per kernel issued eagerly). The same host is assumed with H100s.
HOST_PRIORS = {"iteration_overhead_s": 1.3e-3, "per_seq_overhead_s": 1.1e-4, "tp_sync_s": 2.7e-3,
               "tp_sync_per_seq_s": 9e-5, "launch_overhead_s": 4e-6}
OPERATOR_HARDWARE = {"a100": ("a100-80gb-sxm", "a100"), "h100": ("h100-sxm", "h100")}   # -> (spec, profiling subdir)
OPERATOR_MODELS = {"a100": ("llama-2-7b", "llama-3-8b"), "h100": ("llama-2-7b",)}


def holdout_mask(tokens) -> np.ndarray:
    """True for held-out rows: every HOLDOUT_EVERY-th distinct token count (counting from the 2nd)."""
    values = np.unique(tokens)
    held = set(values[1::HOLDOUT_EVERY].tolist())
    return np.array([t in held for t in np.asarray(tokens).tolist()])


def arithmetic_intensity(g) -> np.ndarray:
    flops = 2.0 * g["tokens"] * g["k"] * g["m"]
    moved = 2.0 * (g["k"] * g["m"] + g["tokens"] * (g["k"] + g["m"]))
    return flops / moved


def regimes(intensity, ridge: float) -> np.ndarray:
    return np.where(intensity < ridge / 2, "memory", np.where(intensity > 2 * ridge, "compute", "transition"))


def _summary(pred, meas) -> Dict[str, Any]:
    return error_summary(pred, meas) if len(meas) else {"num_measurements": 0}


def regime_table(pred, meas, tp, regime) -> Dict[str, Any]:
    """{tp: {regime: summary, 'all': summary}, 'all': {regime: summary, 'all': summary}}."""
    out: Dict[str, Any] = {}
    for t in [*sorted(set(tp.tolist())), "all"]:
        sel_t = np.ones(len(meas), bool) if t == "all" else tp == t
        row = {}
        for r in ("memory", "transition", "compute", "all"):
            sel = sel_t & (np.ones(len(meas), bool) if r == "all" else regime == r)
            row[r] = _summary(pred[sel], meas[sel])
        out[str(t)] = row
    return out


def compute_errors(data: OperatorData, params: CostParams, hw: HardwareSpec,
                   rows: Optional[np.ndarray] = None) -> Dict[str, Any]:
    """GEMM and layer errors per TP and regime (rows: optional mask over layer rows, e.g. held-out ones)."""
    g, L = data.gemm, data.layer
    ridge = hw.peak_flops_fp16 / hw.hbm_bandwidth
    layer_rows = np.ones(len(L["seconds"]), bool) if rows is None else rows
    gemm_rows = np.repeat(layer_rows, 4)
    regime = regimes(arithmetic_intensity(g), ridge)
    layer_regime = regime.reshape(-1, 4)[:, 0]
    pg, pl = predict_gemm(g, params, hw), predict_layers(data, params, hw)
    pe = predict_elementwise(data.elementwise, params, hw)
    ew_rows = np.repeat(layer_rows, 6)
    return {"ridge_flops_per_byte": ridge,
            "gemm": regime_table(pg[gemm_rows], g["seconds"][gemm_rows], g["tp"][gemm_rows], regime[gemm_rows]),
            "layer": regime_table(pl[layer_rows], L["seconds"][layer_rows], L["tp"][layer_rows],
                                  layer_regime[layer_rows]),
            "elementwise": _summary(pe[ew_rows], data.elementwise["seconds"][ew_rows])}


def allreduce_errors(ar, params: CostParams, generic: bool = False, small_bytes: int = 1 << 20) -> Dict[str, Any]:
    """Per (box, group, GPUs per node): all sizes and sizes < small_bytes (1 MiB)."""
    pred = predict_allreduce(ar, params, generic)
    out = {}
    keys = sorted(set(zip(ar["box"].tolist(), ar["group"].tolist(), ar["per_node"].tolist(), ar["kind"].tolist())))
    for box, group, per_node, kind in keys:
        sel = (ar["box"] == box) & (ar["group"] == group) & (ar["per_node"] == per_node)
        small = sel & (ar["bytes"] < small_bytes)
        out[f"{box}/n{group}/per_node{per_node}/{kind}"] = {
            "all": _summary(pred[sel], ar["seconds"][sel]), "small": _summary(pred[small], ar["seconds"][small])}
    for box in np.unique(ar["box"]).tolist():
        sel = ar["box"] == box
        small = sel & (ar["bytes"] < small_bytes)
        out[f"{box}/all"] = {"all": _summary(pred[sel], ar["seconds"][sel]),
                             "small": _summary(pred[small], ar["seconds"][small])}
    return out


def fit_allreduce(ar, initial: CostParams) -> CostParams:
    """Per link kind: (fixed, step, bandwidth efficiency) by log least squares, octave-weighted in size."""
    params = initial
    for kind in ("pair", "pcie", "switch", "network"):
        sel = ar["kind"] == kind
        sub = {k: v[sel] for k, v in ar.items()}
        names = [f"comm_{kind}_fixed_s", f"comm_{kind}_step_s", f"comm_{kind}_bandwidth_efficiency"]
        start = params.replace(**{names[0]: 2e-5, names[1]: 2e-6, names[2]: 0.6})
        if kind == "pair":   # a 2-GPU group has no (n-1) lever: one latency term
            names = names[:1] + names[2:]
            start = start.replace(**{f"comm_{kind}_step_s": 0.0})
        weights = _octave_weights(sub["bytes"]) * sel.sum()
        params = fit_log_least_squares(lambda p, sub=sub: predict_allreduce(sub, p), sub["seconds"], start, names,
                                       weights=weights, iterations=80)
    return params


def fit_compute(data: OperatorData, hw: HardwareSpec, initial: CostParams, rows,
                tiles: Sequence[int] = (64, 128)) -> CostParams:
    """GEMM + element-wise factors on the layer rows `rows` (GEMMs and element-wise groups weigh the same; inside
    each, every octave of token count weighs the same)."""
    g = {k: v[np.repeat(rows, 4)] for k, v in data.gemm.items()}
    e = {k: v[np.repeat(rows, 6)] for k, v in data.elementwise.items()}
    measured = np.concatenate([g["seconds"], e["seconds"]])
    weights = np.concatenate([_octave_weights(g["tokens"]), _octave_weights(e["tokens"])]) * measured.size / 2

    def predict(p):
        return np.concatenate([predict_gemm(g, p, hw), predict_elementwise(e, p, hw)])

    return _fit_weighted_tiles(predict, measured, initial, COMPUTE_FIT_PARAMS, tiles, weights)


def before_params() -> CostParams:
    """The params the simulator used before an operator fit: the shipped a100.json as committed (its pre-fit
    values, recorded in 'fit.before_cost_params' once refitted)."""
    profile = load_profile("a100")
    before = profile.fit.get("before_cost_params")
    return CostParams.from_dict(before) if before else profile.params


def _fit_compute_for(hardware: str, profiling_dir, data, hw, before, held):
    """(compute CostParams, fitted names, the profile's fit block, its source text) of `fit_operator_profile`'s
    compute part: the vidur A100 fit, or the H100 fit on 3/4 of the token counts (`held`: the rest)."""
    if hardware == "a100":
        compute_params, a100_report = fit_vidur_a100(profiling_dir)
        fitted = tuple(A100_FIT_PARAMS) + ("gemm_token_tile",)
        fit_block = {**a100_report["overall"], "groups": a100_report["groups"], "network_hardware": "a100-80gb-pcie"}
        source = ("microsoft/vidur@7d47513 A100 operator profiles: Llama-2-7B and Llama-3-8B per-layer GEMMs and "
                  "element-wise ops (TP 1/2/4/8), attention prefill/decode subsets (TP1), NCCL all-reduce on 4x A100 "
                  "80GB PCIe with pairwise NVLink (generic terms) and per link kind on it and on an 8x A100 DGX "
                  "(NVSwitch, and groups across DGX nodes).")
    else:
        start = before.replace(**{n: getattr(before, n) for n in COMPUTE_FIT_PARAMS})
        compute_params = fit_compute(data, hw, start, ~held)
        fitted = COMPUTE_FIT_PARAMS + ("gemm_token_tile",)
        fit_block = {"groups": {"gemm": compute_errors(data, compute_params, hw, ~held)["gemm"]["all"]["all"],
                                "heldout_gemm": compute_errors(data, compute_params, hw, held)["gemm"]["all"]["all"],
                                "heldout_layer": compute_errors(data, compute_params, hw, held)["layer"]["all"]["all"]},
                     "holdout": f"every {HOLDOUT_EVERY}th distinct num_tokens (from the 2nd), all TPs"}
        fit_block.update(fit_block["groups"]["heldout_layer"])
        source = ("microsoft/vidur@7d47513 H100 operator profiles: Llama-2-7B per-layer GEMMs and element-wise ops "
                  "(TP 1/2/4/8), fitted on 3/4 of the token counts. Attention factors carried over from the A100 "
                  "fit; all-reduce terms per link kind fitted on the A100 network files (pairwise box and "
                  "NVSwitch DGX), applied to the H100's own link rates.")
    return compute_params, fitted, fit_block, source


def fit_operator_profile(hardware: str, profiling_dir, out: str = "", evaluate_only: bool = False) -> Dict[str, Any]:
    """Fit the `hardware` ('a100' | 'h100') profile on the operator data in `profiling_dir` and write it to `out`
    (default pdjax/sim/profiles/<hardware>.json); evaluate_only: only the errors of the profile at `out`.
    Returns {"hardware", "profile", "before", "after"[, "cost_params"]}: per table, per TP, per regime,
    {"median_rel_error", "p90_rel_error", "num_measurements"}; "before" is the profile shipped before this fit
    (a100: the previous a100.json; h100: the A100 profile on H100 peaks). Raises ValueError for a bad argument."""
    if hardware not in OPERATOR_HARDWARE:
        raise ValueError(f"--hardware={hardware!r}, expected one of {sorted(OPERATOR_HARDWARE)}")
    if not pathlib.Path(profiling_dir).is_dir():
        raise ValueError(f"--profiling_dir={str(profiling_dir)!r} is not a directory")
    spec_name, subdir = OPERATOR_HARDWARE[hardware]
    hw = get_hardware_spec(spec_name)
    data = load_mlp(profiling_dir, subdir, OPERATOR_MODELS[hardware])
    ar = load_allreduce(profiling_dir)
    held = holdout_mask(data.layer["tokens"])
    before = before_params()
    out_path = pathlib.Path(out) if out else PROFILES_DIR / f"{hardware}.json"
    report: Dict[str, Any] = {"hardware": spec_name, "profile": str(out_path)}

    def errors(params, generic_comm):
        res = {"compute": compute_errors(data, params, hw),
               "allreduce": allreduce_errors(ar, params, generic=generic_comm)}
        if hardware == "h100":
            res["compute_heldout"] = compute_errors(data, params, hw, rows=held)
        return res

    report["before"] = errors(before, True)
    if evaluate_only:
        report["after"] = errors(load_profile(out_path).params, False)
        return report

    compute_params, fitted, fit_block, source = _fit_compute_for(hardware, profiling_dir, data, hw, before, held)
    params = fit_allreduce(ar, compute_params.replace(**HOST_PRIORS))
    comm_fitted = tuple(f.name for f in dataclasses.fields(params)
                        if f.name.startswith("comm_") and f.name.count("_") >= 3 and getattr(params, f.name) > 0)
    fit_block["allreduce_per_kind"] = {k: v["all"] for k, v in allreduce_errors(ar, params).items()}
    # (the text is kept as shipped profiles have it; HOST_PRIORS is above, in this module, since the fit moved)
    fit_block["host_priors"] = ("iteration_overhead_s, per_seq_overhead_s, tp_sync_s, tp_sync_per_seq_s, "
                                "launch_overhead_s: priors (no whole-step rows); see experiments/fit_profile.py "
                                "HOST_PRIORS")
    if hardware == "a100":
        fit_block["before_cost_params"] = before.to_dict()
    profile = Profile(hardware=spec_name, params=params, fitted=fitted + comm_fitted, fit=fit_block, source=source,
                      command=f"python -m experiments.fit_profile --hardware={hardware}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    save_profile(out_path, profile)
    report["after"] = errors(params, False)
    report["cost_params"] = params.to_dict()
    return report


def operator_fit_summary(report: Dict[str, Any]) -> Dict[str, Any]:
    """What `python -m experiments.fit_profile` prints: the median relative error per table / TP / regime
    (before -> after), then the full report's "before" and "after"."""
    def squeeze(block):
        if isinstance(block, dict) and "median_rel_error" in block:
            return round(block["median_rel_error"], 4)
        if isinstance(block, dict) and "num_measurements" in block:
            return None
        if isinstance(block, dict):
            return {k: squeeze(v) for k, v in block.items() if k != "ridge_flops_per_byte"}
        return block
    medians = {k: squeeze(report[k]) for k in ("before", "after") if k in report}
    return {"hardware": report["hardware"], "profile": report["profile"], "median_rel_error": medians,
            "full": {k: report[k] for k in ("before", "after")}}
