"""Fit a machine profile (pdjax/sim/profiles/<hardware>.json) from operator measurements and print the fit errors
per regime as JSON.

python -m experiments.fit_profile --hardware=h100 [--profiling_dir=../shared/data/profiling] [--out=PATH]
python -m experiments.fit_profile --hardware=a100          (what experiments.fit_a100 runs)
python -m experiments.fit_profile --hardware=h100 --evaluate_only   (errors of the shipped profiles, no writes)

What is fitted on what (the data: ../shared/data/profiling, see its SOURCES.md):
- a100: GEMMs, element-wise ops (Llama-2-7B, Llama-3-8B, TP 1/2/4/8), attention prefill/decode subsets and the
  generic all-reduce terms (pairwise-NVLink PCIe box) exactly as before (`calibration.fit_vidur_a100`, unchanged).
- h100: GEMMs and element-wise ops of Llama-2-7B (TP 1/2/4/8) on one H100 SXM: the GEMM factors (FLOPs and
  bandwidth efficiency, occupancy, tile, kernel fixed cost) and the element-wise efficiencies. Token counts are
  split 3:1 into fit and held-out rows (every 4th distinct token count is held out, `HOLDOUT_EVERY`); the shipped
  profile is fitted on the fit rows only and its held-out error is reported. No H100 attention or network rows
  exist: attention factors are carried over from the A100 fit (fractions of the H100's own peaks) and the
  all-reduce terms from the A100 NVSwitch DGX (same NCCL protocol; bandwidth efficiency of the H100's NVLink4).
- both: the all-reduce terms per link kind (`cost_model.allreduce_time`: fixed + (n-1)·step + bytes term) on both
  network files: the pairwise box gives 'pair' (2 GPUs on a bridge) and 'pcie' (4 GPUs), the DGX file gives
  'switch' (groups inside the 8-GPU NVSwitch node) and 'network' (groups spanning nodes, d GPUs per node
  -> d NICs in parallel). Rows are weighted so each octave of message size weighs the same (small all-reduces
  are what TP decode steps do).
- host floor and per-sequence terms (`iteration_overhead_s`, `per_seq_overhead_s`, `tp_sync_s`,
  `tp_sync_per_seq_s`, `launch_overhead_s`): the profiling data has no whole-step rows (only per-layer operators),
  so these are priors, documented in HOST_PRIORS with their source.

Regimes: each GEMM row's arithmetic intensity (FLOPs / bytes moved) against the hardware's ridge point
(peak FLOP/s / HBM bandwidth): memory-bound below ridge/2, compute-bound above 2·ridge, transition between.
Layer rows (4 GEMMs + element-wise ops of one layer) take the regime of their token count's QKV GEMM.
Output JSON: {"hardware", "profile", "before": {...}, "after": {...}} with, per table, per TP, per regime,
{"median_rel_error", "p90_rel_error", "num_measurements"}; "before" is the profile shipped before this fit
(a100: the previous a100.json; h100: the A100 profile on H100 peaks, what the simulator used until now).
"""
from __future__ import annotations

import csv
import dataclasses
import json
import pathlib
from typing import Any, Dict, Optional, Sequence

import numpy as np
from absl import flags

from pdjax.experiment import cli

FLAGS = flags.FLAGS
_REPO = pathlib.Path(__file__).resolve().parents[1]


def define_flags() -> None:
    """The flags, defined only by the entry points (tests import this module's functions next to other CLIs')."""
    flags.DEFINE_string("hardware", "h100", "Profile to fit: 'a100' or 'h100'.")
    flags.DEFINE_string("profiling_dir", str(_REPO.parent / "shared" / "data" / "profiling"),
                        "Directory with a100/, h100/ and network/ CSVs (see its SOURCES.md).")
    flags.DEFINE_string("out", "", "Profile JSON to write (default pdjax/sim/profiles/<hardware>.json).")
    flags.DEFINE_bool("evaluate_only", False, "Only print the errors of the shipped profile (and the 'before' one).")


HOLDOUT_EVERY = 4
NETWORK_FILES = {"pairwise": "a100_pairwise_nvlink_all_reduce.csv", "dgx": "a100_dgx_all_reduce.csv"}
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
HARDWARE = {"a100": ("a100-80gb-sxm", "a100"), "h100": ("h100-sxm", "h100")}   # name -> (spec, profiling subdir)
MODELS = {"a100": ("llama-2-7b", "llama-3-8b"), "h100": ("llama-2-7b",)}


# --------------------------------------------------------------------------------------------------- data
def load_mlp(profiling_dir, subdir: str, models: Sequence[str]) -> Dict[str, Dict[str, np.ndarray]]:
    """Per-layer operator rows of `<subdir>/<model>_mlp.csv`: {"gemm": ..., "elementwise": ..., "layer": ...}
    column arrays (seconds), with the TP-sharded shapes of the cost model (pdjax.sim.calibration.load_mlp_rows)."""
    from pdjax.sim.calibration import load_mlp_rows  # noqa: PLC0415

    arrays = lambda rows: {k: np.array([r[k] for r in rows]) for k in rows[0]}  # noqa: E731
    return dict(zip(("gemm", "elementwise", "layer"), map(arrays, load_mlp_rows(profiling_dir, subdir, models))))


def load_allreduce(profiling_dir) -> Dict[str, np.ndarray]:
    """All-reduce rows of both network files: bytes, group, per_node (GPUs of the group on one node), kind
    ('pair' | 'pcie' | 'switch' | 'network'), box ('pairwise' | 'dgx'), seconds."""
    rows = []
    for box, name in NETWORK_FILES.items():
        with open(pathlib.Path(profiling_dir) / "network" / name) as f:
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
    return {k: np.array([r[k] for r in rows]) for k in rows[0]}


def network_spec(box: str):
    """The HardwareSpec of a network file's machine (links only matter)."""
    from pdjax.sim.hardware import get_hardware_spec  # noqa: PLC0415
    return get_hardware_spec("a100-80gb-pcie" if box == "pairwise" else "a100-80gb-sxm")


def holdout_mask(tokens) -> np.ndarray:
    """True for held-out rows: every HOLDOUT_EVERY-th distinct token count (counting from the 2nd)."""
    values = np.unique(tokens)
    held = set(values[1::HOLDOUT_EVERY].tolist())
    return np.array([t in held for t in np.asarray(tokens).tolist()])


# --------------------------------------------------------------------------------------------------- predictions
def predict_gemm(g, params, hw) -> np.ndarray:
    from pdjax.sim import cost_model as cm  # noqa: PLC0415
    return cm.gemm_time(g["tokens"], g["k"], g["m"], 2, hw.peak_flops_fp16, hw.hbm_bandwidth, hw.compute_units,
                        params, maximum=np.maximum, minimum=np.minimum)


def predict_elementwise(e, params, hw) -> np.ndarray:
    from pdjax.sim import cost_model as cm  # noqa: PLC0415
    out = np.empty(e["tokens"].shape)
    for kind in np.unique(e["kind"]):
        sel = e["kind"] == kind
        out[sel] = cm.elementwise_time(e["tokens"][sel], e["bytes_per_token"][sel], str(kind), hw.hbm_bandwidth,
                                       params)
    return out


def predict_layer(data, params, hw) -> np.ndarray:
    """Per mlp.csv row: its 4 GEMMs + 5 per-layer element-wise ops (the embedding excluded), from the rows'
    own predictions (rows are stored 4 GEMMs / 6 element-wise ops per layer row, in order)."""
    g = predict_gemm(data["gemm"], params, hw).reshape(-1, 4).sum(axis=1)
    e = predict_elementwise(data["elementwise"], params, hw).reshape(-1, 6)
    return g + e[:, 1:].sum(axis=1)


def predict_allreduce(ar, params, generic: bool = False) -> np.ndarray:
    """All-reduce seconds with the per-kind terms (generic=True: the generic alpha-beta ring, as before)."""
    from pdjax.sim import cost_model as cm  # noqa: PLC0415
    out = np.empty(ar["bytes"].shape, float)
    keys = sorted(set(zip(ar["box"].tolist(), ar["group"].tolist(), ar["per_node"].tolist(), ar["kind"].tolist())))
    for box, group, per_node, kind in keys:
        sel = (ar["box"] == box) & (ar["group"] == group) & (ar["per_node"] == per_node)
        spec = network_spec(box)
        if kind == "network":
            bw, hop = spec.inter_node_bandwidth, spec.inter_node_latency
        else:
            bw, hop = spec.group_link(group)
        out[sel] = cm.allreduce_time(ar["bytes"][sel].astype(float), group, bw, hop, params,
                                     None if generic else kind, per_node if kind == "network" else 1)
    return out


def arithmetic_intensity(g) -> np.ndarray:
    flops = 2.0 * g["tokens"] * g["k"] * g["m"]
    moved = 2.0 * (g["k"] * g["m"] + g["tokens"] * (g["k"] + g["m"]))
    return flops / moved


def regimes(intensity, ridge: float) -> np.ndarray:
    return np.where(intensity < ridge / 2, "memory", np.where(intensity > 2 * ridge, "compute", "transition"))


# --------------------------------------------------------------------------------------------------- errors
def _summary(pred, meas) -> Dict[str, Any]:
    from pdjax.sim.calibration import error_summary  # noqa: PLC0415
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


def compute_errors(data, params, hw, rows: Optional[np.ndarray] = None) -> Dict[str, Any]:
    """GEMM and layer errors per TP and regime (rows: optional mask over layer rows, e.g. held-out ones)."""
    g, L = data["gemm"], data["layer"]
    ridge = hw.peak_flops_fp16 / hw.hbm_bandwidth
    layer_rows = np.ones(len(L["seconds"]), bool) if rows is None else rows
    gemm_rows = np.repeat(layer_rows, 4)
    regime = regimes(arithmetic_intensity(g), ridge)
    layer_regime = regime.reshape(-1, 4)[:, 0]
    pg, pl = predict_gemm(g, params, hw), predict_layer(data, params, hw)
    pe = predict_elementwise(data["elementwise"], params, hw)
    ew_rows = np.repeat(layer_rows, 6)
    return {"ridge_flops_per_byte": ridge,
            "gemm": regime_table(pg[gemm_rows], g["seconds"][gemm_rows], g["tp"][gemm_rows], regime[gemm_rows]),
            "layer": regime_table(pl[layer_rows], L["seconds"][layer_rows], L["tp"][layer_rows],
                                  layer_regime[layer_rows]),
            "elementwise": _summary(pe[ew_rows], data["elementwise"]["seconds"][ew_rows])}


def allreduce_errors(ar, params, generic: bool = False, small_bytes: int = 1 << 20) -> Dict[str, Any]:
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


# --------------------------------------------------------------------------------------------------- fits
def fit_allreduce(ar, initial):
    """Per link kind: (fixed, step, bandwidth efficiency) by log least squares, octave-weighted in size."""
    from pdjax.sim import calibration as cal  # noqa: PLC0415
    params = initial
    for kind in ("pair", "pcie", "switch", "network"):
        sel = ar["kind"] == kind
        sub = {k: v[sel] for k, v in ar.items()}
        names = [f"comm_{kind}_fixed_s", f"comm_{kind}_step_s", f"comm_{kind}_bandwidth_efficiency"]
        start = params.replace(**{names[0]: 2e-5, names[1]: 2e-6, names[2]: 0.6})
        if kind == "pair":   # a 2-GPU group has no (n-1) lever: one latency term
            names = names[:1] + names[2:]
            start = start.replace(**{f"comm_{kind}_step_s": 0.0})
        weights = cal._octave_weights(sub["bytes"]) * sel.sum()
        params = cal.fit_log_least_squares(lambda p: predict_allreduce(sub, p), sub["seconds"], start, names,
                                           weights=weights, iterations=80)
    return params


def fit_compute(data, hw, initial, rows, tiles: Sequence[int] = (64, 128)):
    """GEMM + element-wise factors on the layer rows `rows` (GEMMs and element-wise groups weigh the same; inside
    each, every octave of token count weighs the same)."""
    from pdjax.sim import calibration as cal  # noqa: PLC0415
    g = {k: v[np.repeat(rows, 4)] for k, v in data["gemm"].items()}
    e = {k: v[np.repeat(rows, 6)] for k, v in data["elementwise"].items()}
    measured = np.concatenate([g["seconds"], e["seconds"]])
    weights = np.concatenate([cal._octave_weights(g["tokens"]), cal._octave_weights(e["tokens"])]) * measured.size / 2

    def predict(p):
        return np.concatenate([predict_gemm(g, p, hw), predict_elementwise(e, p, hw)])

    best = None
    for tile in tiles:
        p = cal.fit_log_least_squares(predict, measured, initial.replace(gemm_token_tile=int(tile)),
                                      COMPUTE_FIT_PARAMS, weights=weights)
        score = float(np.sum(weights * np.log1p(cal.relative_errors(predict(p), measured)) ** 2))
        if best is None or score < best[0]:
            best = (score, p)
    return best[1]


def _before_params(hardware: str):
    """The params the simulator used for `hardware` before this fit (the shipped a100.json as committed: the
    pre-fit values are recorded in its 'fit.before' key once refitted)."""
    from pdjax.sim.calibration import load_profile  # noqa: PLC0415
    from pdjax.sim.cost_model import CostParams  # noqa: PLC0415
    profile = load_profile("a100")
    before = profile.fit.get("before_cost_params")
    return CostParams.from_dict(before) if before else profile.params


def run(hardware: str, profiling_dir: str, out: str = "", evaluate_only: bool = False) -> Dict[str, Any]:
    from pdjax.sim import calibration as cal  # noqa: PLC0415
    from pdjax.sim.hardware import get_hardware_spec  # noqa: PLC0415

    if hardware not in HARDWARE:
        raise ValueError(f"--hardware={hardware!r}, expected one of {sorted(HARDWARE)}")
    if not pathlib.Path(profiling_dir).is_dir():
        raise ValueError(f"--profiling_dir={profiling_dir!r} is not a directory")
    spec_name, subdir = HARDWARE[hardware]
    hw = get_hardware_spec(spec_name)
    data = load_mlp(profiling_dir, subdir, MODELS[hardware])
    ar = load_allreduce(profiling_dir)
    held = holdout_mask(data["layer"]["tokens"])
    before = _before_params(hardware)
    out_path = pathlib.Path(out) if out else cal.PROFILES_DIR / f"{hardware}.json"
    report: Dict[str, Any] = {"hardware": spec_name, "profile": str(out_path)}

    def errors(params, generic_comm):
        res = {"compute": compute_errors(data, params, hw),
               "allreduce": allreduce_errors(ar, params, generic=generic_comm)}
        if hardware == "h100":
            res["compute_heldout"] = compute_errors(data, params, hw, rows=held)
        return res

    report["before"] = errors(before, True)
    if evaluate_only:
        report["after"] = errors(cal.load_profile(out_path).params, False)
        return report

    if hardware == "a100":
        compute_params, a100_report = cal.fit_vidur_a100(profiling_dir)
        fitted = tuple(cal.A100_FIT_PARAMS) + ("gemm_token_tile",)
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
    params = fit_allreduce(ar, compute_params.replace(**HOST_PRIORS))
    comm_fitted = tuple(f.name for f in dataclasses.fields(params)
                        if f.name.startswith("comm_") and f.name.count("_") >= 3 and getattr(params, f.name) > 0)
    fit_block["allreduce_per_kind"] = {k: v["all"] for k, v in allreduce_errors(ar, params).items()}
    fit_block["host_priors"] = ("iteration_overhead_s, per_seq_overhead_s, tp_sync_s, tp_sync_per_seq_s, "
                                "launch_overhead_s: priors (no whole-step rows); see experiments/fit_profile.py "
                                "HOST_PRIORS")
    if hardware == "a100":
        fit_block["before_cost_params"] = before.to_dict()
    profile = cal.MachineProfile(hardware=spec_name, params=params, fitted=fitted + comm_fitted, fit=fit_block,
                                 source=source, command=f"python -m experiments.fit_profile --hardware={hardware}")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    cal.save_profile(out_path, profile)
    report["after"] = errors(params, False)
    report["cost_params"] = params.to_dict()
    return report


def medians(report: Dict[str, Any]) -> Dict[str, Any]:
    """The compact view: median relative error per table / TP / regime (before -> after)."""
    def squeeze(block):
        if isinstance(block, dict) and "median_rel_error" in block:
            return round(block["median_rel_error"], 4)
        if isinstance(block, dict) and "num_measurements" in block:
            return None
        if isinstance(block, dict):
            return {k: squeeze(v) for k, v in block.items() if k != "ridge_flops_per_byte"}
        return block
    return {k: squeeze(report[k]) for k in ("before", "after") if k in report}


def main(argv):
    del argv
    try:
        report = run(FLAGS.hardware, FLAGS.profiling_dir, FLAGS.out, FLAGS.evaluate_only)
    except ValueError as e:
        raise cli.UserError(str(e)) from None
    print(json.dumps({"hardware": report["hardware"], "profile": report["profile"], "median_rel_error": medians(report),
                      "full": {k: report[k] for k in ("before", "after")}}, indent=1))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
