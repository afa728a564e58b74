"""Latency metrics with exactly the DESIGN.md §4 definitions, SLO attainment, goodput and run summaries.

Per request (completed requests only, see records.py):
- TTFT = first token time - arrival.
- TBT = every gap between consecutive output tokens; `tbts` pools the gaps of all requests (a request with n
  tokens gives n-1 gaps), so long requests weigh more, as in Sarathi-Serve's P99 TBT.
- TPOT = (last - first token time) / (output tokens - 1), only for requests with >= 2 tokens.
- E2E = last token time - arrival.  Scheduling delay = first scheduled - arrival.
- Normalized latency = E2E / output tokens (s/token).
Statistics: {'mean','p50','p90','p99'} with numpy's default (linear) percentile; all None when there are no
values (JSON has no NaN).

SLOs (`SLOs`, the one SLO type: pdjax.config.slo.SLOConfig): a request meets them when it completed and each given
bound holds:
- TTFT <= ttft_s;  TPOT <= tpot_s;
- TBT: the request's `tbt_quantile` gap <= tbt_s. The default quantile 1.0 is the request's *max* gap: one
  generation stall breaks it, which is the failure stall-free batching removes. 0.99 gives its own P99 gap.
A 1-token request has no gaps, so it meets the TBT and TPOT bounds trivially. Requests not served (rejected,
aborted, unfinished) never meet SLOs; they stay in the denominator of slo_attainment and are left out of the
latency statistics. With no SLOs given, "meeting SLOs" means completing.
SLO rules (both in every summary, under `slo_rules`): `pdjax` is the above (the share of requests meeting every
bound together); `distserve` is DistServe's: the P90 of TTFT over all requests and the P90 of TPOT over all
requests with >= 2 tokens, each within its own target, computed separately (unserved requests count as
infinitely late, so a P90 that falls among them is reported as None and fails).
Throughput and goodput use the run duration: earliest arrival to the latest token, finish or iteration end.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

import numpy as np

from pdjax.config.slo import SLOConfig
from pdjax.metrics.records import IterationRecord, RequestRecord

STAT_KEYS = ("mean", "p50", "p90", "p99")
LATENCY_METRICS = ("ttft", "tbt", "tpot", "e2e", "sched_delay", "normalized_latency")


SLOs = SLOConfig     # the one SLO type (pdjax.config.slo): bounds in seconds, 0 = none; ttft_s ... its aliases


def completed(records: Iterable[RequestRecord]) -> List[RequestRecord]:
    return [r for r in records if r.completed]


def ttfts(records: Iterable[RequestRecord]) -> List[float]:
    return [r.token_times[0] - r.arrival_time for r in completed(records)]


def request_gaps(record: RequestRecord) -> List[float]:
    t = record.token_times
    return [b - a for a, b in zip(t, t[1:])]


def tbts(records: Iterable[RequestRecord]) -> List[float]:
    return [gap for r in completed(records) for gap in request_gaps(r)]


def tpots(records: Iterable[RequestRecord]) -> List[float]:
    return [(r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
            for r in completed(records) if len(r.token_times) >= 2]


def e2es(records: Iterable[RequestRecord]) -> List[float]:
    return [r.token_times[-1] - r.arrival_time for r in completed(records)]


def sched_delays(records: Iterable[RequestRecord]) -> List[float]:
    return [r.first_scheduled_time - r.arrival_time for r in completed(records)]


def normalized_latencies(records: Iterable[RequestRecord]) -> List[float]:
    return [(r.token_times[-1] - r.arrival_time) / len(r.token_times) for r in completed(records)]


def stats(values: Sequence[float]) -> Dict[str, Optional[float]]:
    """{'mean','p50','p90','p99'} of `values` (None each when empty)."""
    if len(values) == 0:
        return {k: None for k in STAT_KEYS}
    arr = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"mean": float(arr.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def meets_slos(record: RequestRecord, slos: SLOs) -> bool:
    if not record.completed:
        return False
    t = record.token_times
    if slos.ttft_s is not None and t[0] - record.arrival_time > slos.ttft_s:
        return False
    if len(t) >= 2:
        if slos.tpot_s is not None and (t[-1] - t[0]) / (len(t) - 1) > slos.tpot_s:
            return False
        if slos.tbt_s is not None:
            gaps = request_gaps(record)
            bound = max(gaps) if slos.tbt_quantile == 1 else float(np.percentile(gaps, 100 * slos.tbt_quantile))
            if bound > slos.tbt_s:
                return False
    return True


def run_duration(records: Sequence[RequestRecord], iterations: Sequence[IterationRecord] = ()) -> float:
    """Seconds from the earliest arrival to the latest token, finish or iteration end (0 for an empty run)."""
    if not records:
        return 0.0
    start = min(r.arrival_time for r in records)
    ends = [r.token_times[-1] for r in records if r.token_times]
    ends += [r.finish_time for r in records if r.finish_time is not None]
    ends += [it.end_time for it in iterations]
    return max(max(ends, default=start) - start, 0.0)


def slo_attainment(records: Sequence[RequestRecord], slos: SLOs) -> Optional[float]:
    """Share of all requests (rejected included) meeting `slos`; None for no requests."""
    if not records:
        return None
    return sum(meets_slos(r, slos) for r in records) / len(records)


SLO_RULES = ("pdjax", "distserve")
TPOT_DEFINITION = "per request: (last - first token time) / (output tokens - 1), requests with >= 2 tokens"


def percentile_with_unserved(values: Sequence[float], num_unserved: int, q: float) -> Optional[float]:
    """numpy's linear percentile of `values` plus `num_unserved` infinitely late ones; None where it is infinite
    (it interpolates towards an unserved value) or there are no values at all."""
    ordered = sorted(values) + [float("inf")] * num_unserved
    if not ordered:
        return None
    h = (len(ordered) - 1) * q
    lo, hi = int(np.floor(h)), int(np.ceil(h))
    if ordered[hi] == float("inf"):
        return None
    return float(ordered[lo] + (h - lo) * (ordered[hi] - ordered[lo]))


def distserve_slo_check(records: Sequence[RequestRecord], slos: SLOs, quantile: float = 0.9) -> Dict[str, Any]:
    """DistServe's rule (module docstring): {'ttft_p90_s', 'tpot_p90_s', 'ttft_ok', 'tpot_ok', 'passes'};
    a bound not given holds trivially."""
    served = completed(records)
    unserved = len(records) - len(served)
    ttft_q = percentile_with_unserved(ttfts(served), unserved, quantile)
    tpot_q = percentile_with_unserved(tpots(served), unserved, quantile)
    ttft_ok = slos.ttft_s is None or (ttft_q is not None and ttft_q <= slos.ttft_s)
    tpot_ok = slos.tpot_s is None or (tpot_q is not None and tpot_q <= slos.tpot_s)
    return {"quantile": quantile, "ttft_p90_s": ttft_q, "tpot_p90_s": tpot_q, "ttft_ok": ttft_ok,
            "tpot_ok": tpot_ok, "passes": bool(records) and ttft_ok and tpot_ok}


def goodput_rps(records: Sequence[RequestRecord], slos: SLOs, duration_s: float) -> float:
    """Requests meeting `slos` per second of run duration (0 for an empty run)."""
    met = sum(meets_slos(r, slos) for r in records)
    return met / duration_s if duration_s > 0 else 0.0


def summarize_iterations(iterations: Sequence[IterationRecord]) -> Dict[str, Any]:
    """Per-iteration telemetry: step time stats and max, token mix, batch size, busy time; per instance too."""
    def one(its: Sequence[IterationRecord]) -> Dict[str, Any]:
        if not its:
            return {"num_iterations": 0}
        step_times = [it.step_time for it in its]
        return {
            "num_iterations": len(its),
            "step_time": stats(step_times),
            "step_time_max": max(step_times),
            "busy_time_s": float(sum(step_times)),
            "total_prefill_tokens": int(sum(it.num_prefill_tokens for it in its)),
            "total_decode_tokens": int(sum(it.num_decode_tokens for it in its)),
            "mean_tokens_per_iteration": float(np.mean([it.num_tokens for it in its])),
            "mean_seqs_per_iteration": float(np.mean([it.num_seqs for it in its])),
            "num_compiles": int(sum(it.num_compiles for it in its)),
            "num_mixed_iterations": sum(1 for it in its if it.num_prefill_tokens and it.num_decode_tokens),
        }
    out = one(iterations)
    instances = sorted({it.instance for it in iterations})
    if len(instances) > 1:
        out["per_instance"] = {name: one([it for it in iterations if it.instance == name]) for name in instances}
    return out


def rejection_kind(reason: str) -> str:
    """A reject reason with its numbers and quoted values blanked ('prompt of N tokens exceeds
    max_model_len=N'), so requests refused for the same rule count together."""
    return re.sub(r"-?\d+(\.\d+)?", "N", re.sub(r"'[^']*'", "'...'", reason or "(no reason given)"))


def rejection_counts(records: Sequence[RequestRecord]) -> Dict[str, int]:
    """{rejection_kind: number of rejected requests}, most frequent first."""
    counts: Dict[str, int] = {}
    for r in records:
        if r.finish_reason == "rejected":
            kind = rejection_kind(r.reject_reason)
            counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def summarize_run(records: Sequence[RequestRecord], iterations: Sequence[IterationRecord] = (),
                  slos: Any = None) -> Dict[str, Any]:
    """The results.json summary of a run (see module docstring for every definition)."""
    slos = SLOs.from_dict(slos)
    records = list(records)
    done = completed(records)
    duration = run_duration(records, iterations)
    output_tokens = sum(len(r.token_times) for r in records)
    reasons = [r.finish_reason for r in records]
    attainment = slo_attainment(records, slos)
    summary: Dict[str, Any] = {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_rejected": reasons.count("rejected"),
        "rejections": rejection_counts(records),
        "num_aborted": reasons.count("aborted"),
        "num_unfinished": reasons.count("unfinished"),
        "num_preempted_requests": sum(1 for r in records if r.num_preemptions > 0),
        "num_preemptions": sum(r.num_preemptions for r in records),
        "total_prompt_tokens": sum(r.num_prompt_tokens for r in done),
        "total_output_tokens": output_tokens,
        "duration_s": duration,
        "throughput_tok_s": output_tokens / duration if duration > 0 else 0.0,
        "throughput_req_s": len(done) / duration if duration > 0 else 0.0,
        "ttft": stats(ttfts(done)),
        "tbt": stats(tbts(done)),
        "tpot": stats(tpots(done)),
        "e2e": stats(e2es(done)),
        "sched_delay": stats(sched_delays(done)),
        "normalized_latency": stats(normalized_latencies(done)),
        "tbt_max": max(tbts(done), default=None),
        "slos": slos.summary_dict(),
        "slo_attainment": attainment,
        "goodput_rps": goodput_rps(records, slos, duration),
        "slo_rules": {"pdjax": {"attainment": attainment},
                      "distserve": distserve_slo_check(records, slos)},
        "tpot_definition": TPOT_DEFINITION,
        "iterations": summarize_iterations(list(iterations)),
    }
    return summary


def metric_value(summary: Mapping[str, Any], path: str) -> Optional[float]:
    """summary['tbt']['p99'] for path 'tbt.p99'; KeyError naming the path when absent."""
    node: Any = summary
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(f"summary has no {path!r} (missing {part!r})")
        node = node[part]
    return node
