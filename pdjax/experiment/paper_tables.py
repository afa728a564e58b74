"""Paper-scale tables in simulation (issue 6 item 7), each runnable in minutes on a 2-core CPU (the command line
is experiments/sim_paper.py: JSON of each `table_*` and its Markdown `render`).

Hardware/cost: the A100 profile shipped in pdjax/sim/profiles/a100.json (fitted on Vidur's A100 operator
profiles), A100-80GB PCIe pairs joined by NVLink bridges (Sarathi-Serve's testbed).
- ablation: configs/sweeps/sarathi_ablation_paper.py:chat|arxiv (the artifact's setup: trace lengths, chat 8192 /
  1.0 req/s, arxiv 16384 / 0.5 req/s) through the sweep machinery (summary.csv in <workdir>/ablation_<trace>),
  P50 TTFT and P99 TBT per scheme.
- chunking: one prompt of 2k/4k/8k/16k tokens prefilled alone in chunks of 512/1024/2048 (each chunk re-reads
  the KV of the earlier ones), total prefill time relative to one unchunked iteration.
- capacity: configs/sim/capacity_paper.py for every trace (chat, arxiv) x model (Mistral-7B 1 GPU, Yi-34B TP2,
  Llama-2-70B TP4 x PP2 over two nodes) x SLO (strict, relaxed; the SLO is the config's slo.tbt) x policy, parallel
  bisection (experiments.capacity).
- mixing: Mistral-7B on one A100, decode batches of n requests at 1k context: decode-only, + a whole 2k-token
  prefill, + a budgeted chunk (512 - n tokens), iteration time and the decodes' slowdown.
- tile: batches of 128/129, 256/257, 512/513 tokens (a chunk alone, or a chunk + 32 decodes), Mistral-7B, one A100.
- disagg: configs/sim/disagg_paper.py, Llama-2-13B on 2x A100-80GB SXM: colocated Sarathi (2 replicas TP1, or
  1 replica TP2) vs disaggregated 1 prefill + 1 decode GPU, chat and arxiv lengths over a grid of Poisson rates
  (512 requests each): P50/P99 TTFT, TBT and TPOT, SLO attainment and goodput per point, and per layout the highest
  rate of the grid with >= 90% attainment (DistServe's goodput), in total and per GPU.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List

import pdjax
from pdjax.config.files import config_file
from pdjax.config.model_specs import get_model_spec
from pdjax.config.serving import serve_config_from_dict
from pdjax.errors import UserError
from pdjax.experiment.run import run_experiment, to_plain_dict
from pdjax.experiment.sweep import check_point, run_sweep
from pdjax.metrics import summarize_run, write_json
from pdjax.sim.capacity import search_config_capacity
from pdjax.sim.cost_model import BatchComposition, iteration_time
from pdjax.sim.hardware import get_hardware_spec
from pdjax.sim.profile import load_profile
from pdjax.sim.run import simulate_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(pdjax.__file__)))   # the repository


def _load_config(rel_path: str, arg: str):
    return config_file(os.path.join(ROOT, "README.md"), rel_path, arg)


def _a100(model: str, tp: int):
    return get_model_spec(model), get_hardware_spec("a100-80gb-pcie"), tp, load_profile("a100").params


def _time(batch, model, hw, tp, params) -> float:
    return iteration_time(batch, model, hw, tp, 1, params).total


def markdown(title: str, columns: List[str], rows: List[List[Any]]) -> str:
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = [f"### {title}", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- tables
def _requests_override(config: dict, num_requests: int) -> dict:
    """`config` (a plain serve-config dict) with workload.num_requests set, unless num_requests is 0."""
    if num_requests:
        config["workload"]["num_requests"] = num_requests
    return config


def table_ablation(workdir: str, parallel: int, num_requests: int = 0) -> Dict[str, Any]:
    out = {}
    for trace in ("chat", "arxiv"):
        sweep = to_plain_dict(_load_config("configs/sweeps/sarathi_ablation_paper.py", trace))
        _requests_override(sweep["base"], num_requests)
        rows = run_sweep(sweep, os.path.join(workdir, f"ablation_{trace}"), run_experiment, parallel=parallel,
                         validate=check_point, log=lambda line: print(line, file=sys.stderr))  # stdout: JSON
        out[trace] = [{"scheme": r["policy"], "token_budget": r["token_budget"],
                       "ttft_p50_s": r["ttft_p50"], "ttft_p99_s": r.get("ttft_p99"), "tbt_p99_s": r["tbt_p99"],
                       "tbt_p50_s": r["tbt_p50"],
                       "sched_delay_p50_s": r["sched_delay_p50"]} for r in rows]
    return out


def table_chunking() -> List[Dict[str, Any]]:
    model, hw, tp, params = _a100("yi-34b", 2)
    rows = []
    for prompt in (2048, 4096, 8192, 16384):
        whole = _time(BatchComposition(((prompt, 0),)), model, hw, tp, params)
        row = {"prompt": prompt, "unchunked_s": whole}
        for chunk in (512, 1024, 2048):
            total = sum(_time(BatchComposition(((min(chunk, prompt - start), start),)), model, hw, tp, params)
                        for start in range(0, prompt, chunk))
            row[f"chunk{chunk}_relative"] = total / whole
        rows.append(row)
    return rows


CAPACITY_MODELS = ("mistral7b", "yi34b", "llama70b")
CAPACITY_TRACES = ("chat", "arxiv")


def table_capacity(workdir: str, parallel: int, traces=CAPACITY_TRACES, num_requests: int = 0
                   ) -> List[Dict[str, Any]]:
    rows = []
    bad = sorted(set(traces) - set(CAPACITY_TRACES))
    if bad:
        raise UserError(f"--capacity_traces: {bad} not in {list(CAPACITY_TRACES)}")
    for trace in traces:
        for model in CAPACITY_MODELS:
            for slo_name in ("strict", "relaxed"):
                for policy in ("sarathi", "vllm_v0", "orca"):
                    arg = f"{model}-{policy}-{slo_name}-{trace}"
                    cfg = _requests_override(to_plain_dict(_load_config("configs/sim/capacity_paper.py", arg)),
                                             num_requests)
                    slo = cfg["slo"]["tbt"]          # the config carries its P99 TBT SLO
                    report = search_config_capacity(cfg, tbt_p99=slo, lo=0.05, hi=8.0, parallel=parallel,
                                                    rel_tol=0.05, max_rounds=8)
                    os.makedirs(os.path.join(workdir, "capacity"), exist_ok=True)
                    write_json(os.path.join(workdir, "capacity", f"{arg}.json"), report)
                    dep = cfg["deployment"]["colocated"]
                    rows.append({"trace": trace, "model": model, "layout": f"tp{dep['tp']}pp{dep['pp']}",
                                 "slo": f"{slo_name} (P99 TBT {slo} s)", "policy": policy,
                                 "token_budget": cfg["scheduler"]["token_budget"],
                                 "max_num_seqs": cfg["scheduler"]["max_num_seqs"],
                                 "capacity_rps": report["capacity_rps"], "probes": len(report["probes"])})
    return rows


def table_mixing() -> List[Dict[str, Any]]:
    model, hw, tp, params = _a100("mistral-7b", 1)
    rows = []
    for n in (8, 16, 32, 64, 128, 256):
        decode_only = _time(BatchComposition((), ((n, 1024),)), model, hw, tp, params)
        whole = _time(BatchComposition(((2048, 0),), ((n, 1024),)), model, hw, tp, params)
        chunk_tokens = max(512 - n, 0)
        chunk = (_time(BatchComposition(((chunk_tokens, 0),), ((n, 1024),)), model, hw, tp, params)
                 if chunk_tokens else decode_only)
        rows.append({"decodes": n, "decode_only_s": decode_only, "with_whole_prefill_2048_s": whole,
                     "with_chunk_s": chunk, "chunk_tokens": chunk_tokens,
                     "whole_prefill_slowdown": whole / decode_only, "chunk_slowdown": chunk / decode_only})
    return rows


def table_tile() -> List[Dict[str, Any]]:
    model, hw, tp, params = _a100("mistral-7b", 1)
    rows = []
    for decodes in (0, 32):
        dec = ((decodes, 1024),) if decodes else ()
        for total in (128, 256, 512):
            chunk = total - decodes          # the batch holds `total` tokens, then one more
            t0 = _time(BatchComposition(((chunk, 0),), dec), model, hw, tp, params)
            t1 = _time(BatchComposition(((chunk + 1, 0),), dec), model, hw, tp, params)
            rows.append({"decodes": decodes, "batch_tokens": total, "time_s": t0, "batch_tokens_plus_1": total + 1,
                         "time_plus_1_s": t1, "ratio": t1 / t0, "gemm_token_tile": params.gemm_token_tile})
    return rows


DISAGG_RATES = {"chat": (1.0, 2.0, 3.0, 4.0, 5.0), "arxiv": (0.5, 1.0, 1.5, 2.0, 2.5)}
DISAGG_LAYOUTS = {"2xtp1": "colocated sarathi, 2 replicas TP1", "1xtp2": "colocated sarathi, 1 replica TP2",
                  "1p1d": "disaggregated 1 prefill + 1 decode GPU"}
DISAGG_MIN_ATTAINMENT = 0.9


def table_disagg(num_requests: int = 0) -> Dict[str, Any]:
    out = {}
    for trace, rates in DISAGG_RATES.items():
        rows, best = [], {}
        for rate in rates:
            for layout in DISAGG_LAYOUTS:
                config = _requests_override(
                    to_plain_dict(_load_config("configs/sim/disagg_paper.py", f"{layout}-{trace}")), num_requests)
                config["workload"]["rate"] = rate
                cfg = serve_config_from_dict(config)
                result, _ = simulate_config(cfg)
                s = summarize_run(result.requests, result.iterations, cfg.slo.as_dict())
                row = {"rate_rps": rate, "layout": layout, "ttft_p50_s": s["ttft"]["p50"],
                       "ttft_p99_s": s["ttft"]["p99"], "tbt_p50_s": s["tbt"]["p50"], "tbt_p99_s": s["tbt"]["p99"],
                       "tpot_p50_s": s["tpot"]["p50"], "tpot_p99_s": s["tpot"]["p99"],
                       "slo_attainment": s["slo_attainment"], "goodput_rps": s["goodput_rps"],
                       "num_preemptions": s["num_preemptions"]}
                transfers = getattr(result, "transfer_stats", None)    # disaggregated runs only
                row["kv_transfer_p99_s"] = transfers()["transfer_s"]["p99"] if transfers else None
                rows.append(row)
                if s["slo_attainment"] >= DISAGG_MIN_ATTAINMENT:
                    best[layout] = max(best.get(layout, 0.0), rate)
        slos = {k: v for k, v in to_plain_dict(_load_config("configs/sim/disagg_paper.py", f"1p1d-{trace}"))
                ["slo"].items() if v}
        out[trace] = {"slos": slos, "rows": rows,
                      "max_rate_at_90pct": {layout: {"rate_rps": best.get(layout, 0.0),
                                                     "per_gpu_rps": best.get(layout, 0.0) / 2}
                                            for layout in DISAGG_LAYOUTS}}
    return out


def render(name: str, table: Any) -> str:
    if name == "ablation":
        parts = []
        for trace, rows in table.items():
            parts.append(markdown(f"Sarathi ablation, Yi-34B TP2 A100, {trace} trace",
                                  ["scheme", "budget", "P50 TTFT (s)", "P99 TTFT (s)", "P99 TBT (s)",
                                   "P50 sched delay (s)"],
                                  [[r["scheme"], r["token_budget"], r["ttft_p50_s"], r["ttft_p99_s"], r["tbt_p99_s"],
                                    r["sched_delay_p50_s"]] for r in rows]))
        return "\n\n".join(parts)
    if name == "disagg":
        parts = []
        for trace, t in table.items():
            slos = ", ".join(f"{k.upper()} {v} s" for k, v in t["slos"].items())
            cols = ["rate", "layout", "P50 TTFT", "P99 TTFT", "P50 TBT", "P99 TBT", "P99 TPOT", "attain.",
                    "goodput (req/s)", "preempt.", "P99 KV xfer"]
            parts.append(markdown(f"Llama-2-13B, 2x A100-80GB SXM, {trace} (SLOs {slos})", cols,
                                  [[r["rate_rps"], r["layout"], r["ttft_p50_s"], r["ttft_p99_s"], r["tbt_p50_s"],
                                    r["tbt_p99_s"], r["tpot_p99_s"], r["slo_attainment"], r["goodput_rps"],
                                    r["num_preemptions"], r["kv_transfer_p99_s"] if r["kv_transfer_p99_s"] is not None
                                    else "-"] for r in t["rows"]]))
            parts.append(markdown(f"{trace}: highest rate of the grid with >= 90% SLO attainment", [
                "layout", "what", "rate (req/s)", "per GPU"], [[k, DISAGG_LAYOUTS[k], v["rate_rps"], v["per_gpu_rps"]]
                                                              for k, v in t["max_rate_at_90pct"].items()]))
        return "\n\n".join(parts)
    rows = table
    cols = list(rows[0])
    return markdown(name, cols, [[r[c] for c in cols] for r in rows])
