"""Calibration: fit `CostParams` to measured times, and the machine-profile JSON they are stored in.

Method: least squares on log(predicted) − log(measured) (relative errors, so a 10 µs kernel counts as much as a
10 ms one), Levenberg–Marquardt in numpy over transformed parameters (log for positive factors, logit for
`attn_causal_skip`), Jacobian by finite differences, and a weak prior pulling each parameter toward its initial
value so parameters the data cannot see stay put. `gemm_token_tile` is discrete: each candidate tile is fitted
and the best kept. Numpy only.

Two data sources use the same machinery:
(a) `fit_vidur_a100(profiling_dir)`: operator times measured by Vidur on A100 (per-layer GEMMs and element-wise
    ops of Llama-2-7B and Llama-3-8B at TP 1/2/4/8, attention prefill/decode, NCCL all-reduce). Every operator
    is predicted by the same op-level functions `iteration_time` uses.
(b) `fit_cost_params(measurements, model, hw, tp, pp)`: whole-iteration times of the real engine over a grid of
    batch compositions (the lead's `experiments/calibrate.py` profiles the engine and calls this).
(c) `fit_step_context(switch_deltas, idle_deltas)`: the step-context terms (shape switch, idle wake) from their
    own direct measurements (experiments/calibrate.py's `profile_step_context`), not from the grid.

Machine profile JSON (schema "pdjax.machine_profile/v1"):
    {"schema": "pdjax.machine_profile/v1",
     "hardware": "<HardwareSpec name the efficiencies are relative to>",
     "cost_params": {<every CostParams field>},
     "fitted": [<names of the fitted fields; the rest are priors>],
     "fit": {"median_rel_error": float, "p90_rel_error": float, "num_measurements": int, "groups": {...}},
     "source": "<what was measured, model(s), tp/pp, engine/version>",
     "command": "<the command that produced it>"}
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import pathlib
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from pdjax.config.model_specs import ModelSpec, get_model_spec
from pdjax.sim import cost_model as cm
from pdjax.sim.cost_model import BatchComposition, CostParams
from pdjax.sim.hardware import HardwareSpec, get_hardware_spec

SCHEMA = "pdjax.machine_profile/v1"
PROFILES_DIR = pathlib.Path(__file__).resolve().parent / "profiles"
_FRACTION_PARAMS = ("attn_causal_skip",)

# What a whole-iteration fit (b) adjusts by default: the parameters whole-iteration times can tell apart. Fixed
# per-kernel costs (kernel_fixed_s, attn_*_fixed_s) are the same for every batch of a model, i.e. collinear with
# iteration_overhead_s, and the element-wise efficiencies are per-token like the GEMMs' activation bytes, so
# those stay at their initial values (pass `initial=` an operator-level profile to set them).
ITERATION_FIT_PARAMS = ("gemm_flops_efficiency", "gemm_bandwidth_efficiency", "attn_flops_efficiency",
                        "attn_bandwidth_efficiency", "iteration_overhead_s", "per_seq_overhead_s")


# --------------------------------------------------------------------------------------------------- profiles
@dataclasses.dataclass(frozen=True)
class MachineProfile:
    hardware: str
    params: CostParams
    fitted: tuple[str, ...] = ()
    fit: dict = dataclasses.field(default_factory=dict)
    source: str = ""
    command: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "hardware": self.hardware, "cost_params": self.params.to_dict(),
                "fitted": list(self.fitted), "fit": self.fit, "source": self.source, "command": self.command}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MachineProfile":
        if data.get("schema") != SCHEMA:
            raise ValueError(f"machine profile schema={data.get('schema')!r}, expected {SCHEMA!r}")
        for key in ("hardware", "cost_params"):
            if key not in data:
                raise ValueError(f"machine profile lacks {key!r}; keys: {sorted(data)}")
        return cls(hardware=data["hardware"], params=CostParams.from_dict(data["cost_params"]),
                   fitted=tuple(data.get("fitted", ())), fit=data.get("fit", {}), source=data.get("source", ""),
                   command=data.get("command", ""))


def save_profile(path, profile: MachineProfile) -> None:
    pathlib.Path(path).write_text(json.dumps(profile.to_dict(), indent=2, sort_keys=True) + "\n")


def load_profile(path_or_name) -> MachineProfile:
    """A profile from a JSON path, or a shipped one by name ('a100' -> pdjax/sim/profiles/a100.json)."""
    path = pathlib.Path(path_or_name)
    if not path.suffix:
        path = PROFILES_DIR / f"{path_or_name}.json"
    if not path.is_file():
        shipped = sorted(p.stem for p in PROFILES_DIR.glob("*.json"))
        raise ValueError(f"machine profile {str(path_or_name)!r} not found; shipped profiles: {shipped}")
    return MachineProfile.from_dict(json.loads(path.read_text()))


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

    best = None
    for tile in tiles:
        for start in _starts(initial.replace(gemm_token_tile=int(tile)), fit_names):
            params = fit_log_least_squares(predict, measured, start, fit_names)
            err = relative_errors(predict(params), measured)
            score = float(np.mean(np.log1p(err) ** 2))
            if best is None or score < best[0]:
                best = (score, params, err)
    _, params, err = best
    return FitResult(params=params, median_rel_error=float(np.median(err)),
                     p90_rel_error=float(np.percentile(err, 90)), num_measurements=len(measured),
                     fitted=tuple(fit_names) + ("gemm_token_tile",))


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


# --------------------------------------------------------------------------------------------------- (a) Vidur A100
VIDUR_MODELS = {"llama-2-7b": "llama-2-7b", "llama-3-8b": "llama-3-8b"}
_GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
_ELEMENTWISE_OPS = ("emb", "input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add")
A100_FIT_PARAMS = ("gemm_flops_efficiency", "gemm_bandwidth_efficiency", "kernel_fixed_s", "gemm_outputs_per_unit",
                   "gemm_occupancy_exponent",
                   *cm.ELEMENTWISE_EFFICIENCY.values(), "attn_flops_efficiency", "attn_bandwidth_efficiency",
                   "attn_seq_head_s", "attn_prefill_fixed_s", "attn_decode_fixed_s", "comm_bandwidth_efficiency", "comm_fixed_s")
# attn_causal_skip is held at 1 (kernels skip fully masked tiles: FlashAttention-2, FlashInfer, pdjax's Pallas
# kernel). Fitting it lands near 0.13, driven by the Llama-2-7B prefill rows (an older kernel); that quarters the
# prefill-attention error on this data (18% -> 5% median) but makes one long prefill dearer than the same
# prompt in chunks, the opposite of what Sarathi-Serve measured. Pass fit_names=A100_FIT_PARAMS +
# ("attn_causal_skip",) to reproduce that variant.
_VIDUR_ELEMENTWISE_KIND = {"emb": "embedding", "input_layernorm": "norm", "post_attention_layernorm": "norm",
                           "attn_rope": "rope", "mlp_act": "activation", "add": "residual"}


@dataclasses.dataclass
class OperatorData:
    """Column arrays of operator measurements (seconds), grouped by kind; built by `load_vidur_profiles`."""
    gemm: dict = dataclasses.field(default_factory=dict)         # tokens, k, m, seconds, model, op
    elementwise: dict = dataclasses.field(default_factory=dict)  # tokens, bytes_per_token, kind, seconds, op
    layer: dict = dataclasses.field(default_factory=dict)        # model, tp, tokens, seconds (sum of ops)
    prefill: dict = dataclasses.field(default_factory=dict)      # chunk, context, heads, kv_heads, seconds, model
    decode: dict = dataclasses.field(default_factory=dict)       # count, context, heads, kv_heads, seconds, model
    allreduce: dict = dataclasses.field(default_factory=dict)    # bytes, group, seconds
    head_dim: int = 128


def _arrays(rows: list[dict]) -> dict[str, np.ndarray]:
    return {k: np.array([r[k] for r in rows]) for k in rows[0]} if rows else {}


def load_mlp_rows(profiling_dir, subdir: str, models) -> tuple:
    """(gemm, elementwise, layer) row lists of `<profiling_dir>/<subdir>/<model>_mlp.csv` for each model (Vidur's
    per-layer operator profiles), in seconds, with the TP-sharded shapes of the cost model; a layer's time is the
    sum of its operators but the embedding."""
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
    return gemm, elementwise, layer


def load_vidur_profiles(profiling_dir) -> OperatorData:
    """Read ../shared/data/profiling (see its SOURCES.md). Times -> seconds. Note: the all-reduce CSV's `size`
    is already bytes (Vidur's collectives_wrapper writes `size * 2  # bytes` for fp16 buffers)."""
    root = pathlib.Path(profiling_dir)
    prefill, decode, allreduce = [], [], []
    gemm, elementwise, layer = load_mlp_rows(root, "a100", VIDUR_MODELS)
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
    with open(root / "network" / "a100_pairwise_nvlink_all_reduce.csv") as f:
        for row in csv.DictReader(f):
            if row["collective"] == "all_reduce":
                allreduce.append(dict(bytes=int(row["size"]), group=int(row["num_workers"]),
                                      seconds=float(row["time_stats.all_reduce.median"]) * 1e-3))
    return OperatorData(gemm=_arrays(gemm), elementwise=_arrays(elementwise), layer=_arrays(layer),
                        prefill=_arrays(prefill), decode=_arrays(decode), allreduce=_arrays(allreduce))


def predict_operators(data: OperatorData, params: CostParams, hw: HardwareSpec,
                      network_hw: HardwareSpec) -> dict[str, np.ndarray]:
    """Predicted seconds per group of `data`, with the same op-level formulas as `iteration_time`."""
    peak, bw, b, d = hw.peak_flops_fp16, hw.hbm_bandwidth, 2, data.head_dim
    g, e, p, dc, ar = data.gemm, data.elementwise, data.prefill, data.decode, data.allreduce
    out = {
        "gemm": cm.gemm_time(g["tokens"], g["k"], g["m"], b, peak, bw, hw.compute_units, params, maximum=np.maximum,
                             minimum=np.minimum),
        "elementwise": np.empty(e["tokens"].shape),
    }
    for kind in np.unique(e["kind"]):
        sel = e["kind"] == kind
        out["elementwise"][sel] = cm.elementwise_time(e["tokens"][sel], e["bytes_per_token"][sel], str(kind), bw,
                                                      params)
    c, m = cm.prefill_attention_terms(p["chunk"], p["context"], p["heads"], p["kv_heads"], d, b, peak, bw, params)
    out["attention_prefill"] = c + m + params.attn_prefill_fixed_s
    c, m, items = cm.decode_attention_terms(dc["count"], dc["context"], dc["heads"], dc["kv_heads"], d, b, peak, bw,
                                            params)
    out["attention_decode"] = np.maximum(c, m) + items + params.attn_decode_fixed_s
    times = np.empty(ar["bytes"].shape)
    for group in np.unique(ar["group"]):
        sel = ar["group"] == group
        link_bw, hop = network_hw.group_link(int(group))
        times[sel] = cm.allreduce_time(ar["bytes"][sel], int(group), link_bw, hop, params)
    out["allreduce"] = times
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

    best = None
    for tile in tiles:
        params = fit_log_least_squares(predict, measured, initial.replace(gemm_token_tile=int(tile)),
                                       fit_names, weights=weights)
        err = relative_errors(predict(params), measured)
        score = float(np.sum(weights * np.log1p(err) ** 2))
        if best is None or score < best[0]:
            best = (score, params)
    params = best[1]
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
