"""Overload experiments of issue 30 (item 6), in simulation: early rejection vs none vs the current-load rule at
overload, and online XpYd rebalancing vs fixed XpYd vs Splitwise's borrowing pool on a trace whose prompt:output mix
shifts. Logic for experiments/overload.py (no JAX).

Setup (both): Llama-2-70B (`llama-2-70b-16k`), one TP8 instance per DGX-A100 machine (A100-80GB SXM), KV over
InfiniBand between machines: configs/sim/splitwise.py's layout, with the Azure LLM inference traces 2023 (shared
data/traces) replayed with their own lengths and (scaled) arrival times; SLOs TTFT 2 s, TBT (max gap) 0.2 s.
- `early_rejection`: the conversation trace (prompt median 1020, output median 129; or Mooncake's conversation
  trace, `trace='mooncake'`), arrivals x`time_scale` (0.25: 4x its own load), 3 prompt + 1 token machines;
  variants 'none' (backpressure only: every request is served however late), 'late' (Mooncake's baseline:
  reject at the handoff when the decode instance's load with the request would exceed 1.0: prefill wasted),
  'current_load' and 'predicted_load' (early rejection at `threshold`, plus the same late check). Per variant:
  goodput, attainment, rejected before prefill, prefill wasted (requests and prompt tokens), and the decode load's
  oscillation (std / mean of the decode instance's batch size over its steps), plus a plot of the decode batch
  over time.
- `shifting_mix`: phases one after the other (DEFAULT_PHASES): ShareGPT lengths (prompt median 1730, output median
  415; no times: Poisson at 2.5 req/s), then the Azure code trace (prompt median 1469, output median 13) at its own
  times x1.5: a decode-heavy phase, then a prefill-heavy one. Every instance takes 32 sequences (at 256 a TP8
  Llama-2-70B token machine decodes so fast that every shared trace is prefill-bound: 32 stands in for a tight TBT
  target or a memory-bound token machine). Four
  machines: fixed 2P2D, 1P3D and 3P1D; Splitwise's borrowing pool on 2P2D (mixed_pool='borrow'); online
  rebalancing from 2P2D (deployment.rebalance). Every group has the same budget and sequence limit (rebalancing
  needs equal groups; the others get the same for a fair comparison). Per design: goodput, attainment overall and
  per phase, TTFT / TBT percentiles, flips or pool moves.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Dict, List, Optional, Sequence

from pdjax.config.files import REPO_ROOT, config_file, replay_trace_lengths, shared_trace
from pdjax.config.serving import serve_config_from_dict
from pdjax.metrics import summarize_run
from pdjax.metrics.report import atomic_open
from pdjax.scheduler.admission import admission_report
from pdjax.sim.run import simulate_config
from pdjax.workload import make_workload

SPLITWISE_CONFIG = os.path.join(REPO_ROOT, "configs", "sim", "splitwise.py")
REJECTION_VARIANTS = ("none", "late", "current_load", "predicted_load")
MOONCAKE = "mooncake_fast25_conversation.csv"
SHAREGPT = "sarathi_sharegpt_8k_filtered_llama2_tok.csv"
# (trace, rows, scale): a decode-heavy phase (ShareGPT lengths, Poisson), then a prefill-heavy one (Azure code)
DEFAULT_PHASES = (("sharegpt", 600, 2.5), ("code", 600, 1.5))
MIX_DESIGNS = ("fixed-2P2D", "fixed-1P3D", "fixed-3P1D", "borrow-2P2D", "rebalance-2P2D")


def base_config(trace: str, num_requests: int, time_scale: float, prefill: int, decode: int):
    """configs/sim/splitwise.py's ConfigDict for `trace` ('conv' / 'code') without a mixed pool, resized: the first
    `num_requests` rows, arrivals x time_scale, `prefill` + `decode` machines with equal groups (budget 2048,
    256 sequences)."""
    c = config_file(SPLITWISE_CONFIG, os.path.basename(SPLITWISE_CONFIG), f"aa-{trace}-off")
    c.workload.num_requests = num_requests
    c.workload.trace_time_scale = time_scale
    c.deployment.prefill.num_instances, c.deployment.decode.num_instances = prefill, decode
    for role in ("prefill", "decode"):
        c.deployment[role].token_budget = 2048
        c.deployment[role].max_num_seqs = 256
    return c


def _serve_config(c, **deployment):
    for key, value in deployment.items():
        c.deployment[key] = value
    return serve_config_from_dict(c.to_dict())


def _row(cfg, result, setup, wall: float, extra: Optional[dict] = None) -> Dict[str, Any]:
    s = summarize_run(result.requests, result.iterations, cfg.slo.as_dict())
    decode_names = setup.groups["decode"].names
    row = {"goodput_rps": s["goodput_rps"], "slo_attainment": s["slo_attainment"],
           "num_met_slo": round(s["slo_attainment"] * s["num_requests"]),
           "num_completed": s["num_completed"], "num_requests": s["num_requests"],
           "ttft_p50": s["ttft"]["p50"], "ttft_p90": s["ttft"]["p90"], "tbt_p99": s["tbt"]["p99"],
           "duration_s": s["duration_s"], "sim_wall_s": round(wall, 2),
           **admission_report(result.requests, result.iterations, decode_names)}
    return {**row, **(extra or {})}


REJECTION_KEYS = {"none": {}, "late": {"admission_handoff_load": 1.0},
                  "current_load": {"admission": "current_load", "admission_handoff_load": 1.0},
                  "predicted_load": {"admission": "predicted_load", "admission_handoff_load": 1.0}}


def rejection_config(trace: str, num_requests: int, time_scale: float, prefill: int, decode: int):
    """The early-rejection runs' ConfigDict: 'conv' (Azure 2023) or 'mooncake' (Mooncake's conversation trace, its
    own times x time_scale; prompts longer than the model's 16k positions cut to fit, workload.fit_to_model)."""
    c = base_config("code" if trace == "code" else "conv", num_requests, time_scale, prefill, decode)
    if trace == "mooncake":
        replay_trace_lengths(c.workload, shared_trace(MOONCAKE), num_requests)
        c.workload.fit_to_model = True
    elif trace not in ("conv", "code"):
        raise ValueError(f"trace={trace!r}, expected 'conv', 'code' or 'mooncake'")
    return c


def early_rejection(num_requests: int = 5000, time_scale: float = 0.25, threshold: float = 0.9,
                    prefill: int = 3, decode: int = 1, variants: Sequence[str] = REJECTION_VARIANTS,
                    trace: str = "conv", decode_seqs: int = 256, log=print) -> Dict[str, Any]:
    """The early-rejection comparison (module docstring): {'setup', 'rows': {variant: row}, 'series': {variant:
    [(time, decode batch)]}}."""
    rows, series = {}, {}
    for v in variants:
        if v not in REJECTION_KEYS:
            raise ValueError(f"variant {v!r}, expected one of {REJECTION_VARIANTS}")
        keys = dict(REJECTION_KEYS[v])
        if "admission" in keys:
            keys["admission_threshold"] = threshold
        c = rejection_config(trace, num_requests, time_scale, prefill, decode)
        c.deployment.decode.max_num_seqs = decode_seqs
        cfg = _serve_config(c, **keys)
        start = time.perf_counter()
        result, setup = simulate_config(cfg)
        admission = (result.mixed_pool or {}).get("admission", {})
        rows[v] = _row(cfg, result, setup, time.perf_counter() - start,
                       {"decision_switches": admission.get("decision_switches", 0)})
        names = set(setup.groups["decode"].names)
        series[v] = [(it.start_time, it.num_seqs) for it in result.iterations if it.instance in names]
        log(f"early_rejection {v}: {rows[v]}")
    name = {"mooncake": MOONCAKE, "code": "azure_llm_2023_code.csv"}.get(trace, "azure_llm_2023_conv.csv")
    return {"setup": {"trace": name,
                      "num_requests": num_requests, "time_scale": time_scale, "threshold": threshold,
                      "machines": f"{prefill}P{decode}D", "decode_max_num_seqs": decode_seqs,
                      "hardware": "a100-80gb-sxm x8 (TP8)",
                      "model": "llama-2-70b-16k"}, "rows": rows, "series": series}


def phase_workload(trace: str, num_requests: int, scale: float, seed: int = 0) -> list:
    """One phase: the first `num_requests` rows of a shared trace ('conv' / 'code': the Azure 2023 traces at their
    own times x scale; 'sharegpt': the ShareGPT lengths (no times), Poisson arrivals at `scale` req/s)."""
    if trace == "sharegpt":
        c = base_config("conv", num_requests, 1.0, 2, 2)
        replay_trace_lengths(c.workload, shared_trace(SHAREGPT), num_requests)
        c.workload.arrival, c.workload.rate = "poisson", scale
    else:
        c = base_config(trace, num_requests, scale, 2, 2)
    return make_workload(serve_config_from_dict(c.to_dict()).workload, seed)


def shifting_workload(phases: Sequence[tuple], seed: int = 0) -> list:
    """The phases (trace, num_requests, scale: phase_workload) one after the other, each starting at the previous
    one's last arrival; ids '<trace>-<i>'."""
    out, offset = [], 0.0
    for trace, n, scale in phases:
        reqs = phase_workload(trace, n, scale, seed)
        out += [dataclasses.replace(r, request_id=f"{trace}-{r.request_id}", arrival_time=offset + r.arrival_time)
                for r in reqs]
        offset += max(r.arrival_time for r in reqs)
    return out


MIX_KEYS = {"fixed-2P2D": (2, 2, {}), "fixed-1P3D": (1, 3, {}), "fixed-3P1D": (3, 1, {}),
            "borrow-2P2D": (2, 2, {"mixed_pool": "borrow"}), "rebalance-2P2D": (2, 2, {"rebalance": True})}


def shifting_mix(phases: Sequence[tuple] = DEFAULT_PHASES, designs: Sequence[str] = MIX_DESIGNS,
                 max_num_seqs: int = 32, window_s: float = 5.0, flip_s: float = 1.0, log=print) -> Dict[str, Any]:
    """The rebalancing comparison (module docstring): {'setup', 'rows': {design: row}}."""
    workload = shifting_workload(phases)
    names = [p[0] for p in phases]
    starts = {n: min(r.arrival_time for r in workload if r.request_id.startswith(n + "-")) for n in names}
    rows = {}
    for d in designs:
        if d not in MIX_KEYS:
            raise ValueError(f"design {d!r}, expected one of {MIX_DESIGNS}")
        prefill, decode, keys = MIX_KEYS[d]
        keys = dict(keys)
        if keys.get("rebalance"):
            keys.update(rebalance_window_s=window_s, rebalance_flip_s=flip_s)
        c = base_config("conv", len(workload), 1.0, prefill, decode)
        for role in ("prefill", "decode"):
            c.deployment[role].max_num_seqs = max_num_seqs
        cfg = _serve_config(c, **keys)
        start = time.perf_counter()
        result, setup = simulate_config(cfg, workload=workload)
        pool = result.mixed_pool or {}
        extra = {"phases": _phase_attainment(cfg, result.requests, names),
                 "flips": [(round(f["served"], 2), f["instance"], f["dst"]) for f in pool.get("flips", [])],
                 "num_moves": len(pool.get("moves", []))}
        rows[d] = _row(cfg, result, setup, time.perf_counter() - start, extra)
        log(f"shifting_mix {d}: {rows[d]}")
    return {"setup": {"phases": [list(p) for p in phases], "phase_starts_s": starts, "max_num_seqs": max_num_seqs,
                      "window_s": window_s, "flip_s": flip_s, "machines": 4, "hardware": "a100-80gb-sxm x8 (TP8)",
                      "model": "llama-2-70b-16k"}, "rows": rows}


def _phase_attainment(cfg, records, names: Sequence[str]) -> Dict[str, Any]:
    out = {}
    for phase in names:
        mine = [r for r in records if r.request_id.startswith(phase + "-")]
        s = summarize_run(mine, (), cfg.slo.as_dict())
        out[phase] = {"slo_attainment": s["slo_attainment"], "ttft_p90": s["ttft"]["p90"], "tbt_p99": s["tbt"]["p99"]}
    return out


def plot_decode_series(series: Dict[str, List], path: str) -> str:
    """The decode instance's batch size over time per variant (one panel each), written atomically to `path`."""
    import matplotlib   # noqa: PLC0415 (plots only; matplotlib is slow to import)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt   # noqa: PLC0415 (after the backend is chosen)
    fig, axes = plt.subplots(len(series), 1, figsize=(8, 1.8 * len(series)), sharex=True, squeeze=False)
    for ax, (name, points) in zip(axes[:, 0], series.items()):
        ax.plot([t for t, _ in points], [n for _, n in points], lw=0.6)
        ax.set_ylabel(f"{name}\nbatch")
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png")
    plt.close(fig)
    return path
