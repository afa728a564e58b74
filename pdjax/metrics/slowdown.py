"""Splitwise's SLOs: latency as a slowdown against the request's own unloaded run (no JAX).

For each request, three slowdowns against its reference (the same request served alone on a reference
machine, Splitwise's DGX-A100): TTFT / reference TTFT, mean TBT / reference mean TBT (the per-request mean gap,
requests with >= 2 tokens), E2E / reference E2E. A configuration passes when the P50, P90 and P99 of each of the
three are within their factors: all nine. Unserved requests count as infinitely slowed (a percentile that
falls among them is None and fails). The factors below are Splitwise's (Patel et al., ISCA 2024, Table 4),
checked against its public simulator: Mutinifni/splitwise-sim commit 3780880, notebooks/plots.ipynb `get_slo`
(ttft_slowdown: p50 2, p90 3, p99 6; tbt_slowdown and e2e_slowdown: p50 1.25, p90 1.5, p99 5) and its `slos`
dict of all nine, applied by notebooks/utils.py `find_within_slo`. Two differences, both deliberate: splitwise-sim
keeps a configuration when each percentile is strictly below its factor (`<`), pdjax when it is at most the
factor (`<=`: a request alone, slowdown exactly 1, passes a factor of 1); and its reference TBT is its performance
model's batch-1 token time at the prompt's size and its reference E2E = TTFT + TBT x (tokens - 1)
(notebooks/perf_model.py `add_baseline_perf`), where pdjax sums the batch-1 decode steps at their growing
contexts (pdjax.sim.reference).

Why both this and pdjax's rule (pdjax.metrics.latency): a per-request *mean* TBT hides a colocated prefill's
stall that a max-gap bound catches, and a max-gap bound punishes every chunk a mean absorbs; they reward
opposite designs, so results report both.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from pdjax.metrics.latency import percentile_with_unserved, request_gaps
from pdjax.metrics.records import RequestRecord

SPLITWISE_SLO_FACTORS: Dict[str, Dict[str, float]] = {
    "ttft": {"p50": 2.0, "p90": 3.0, "p99": 6.0},
    "tbt": {"p50": 1.25, "p90": 1.5, "p99": 5.0},
    "e2e": {"p50": 1.25, "p90": 1.5, "p99": 5.0},
}
_QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}


def request_latencies(record: RequestRecord) -> Tuple[float, Optional[float], float]:
    """(TTFT, mean TBT or None for a 1-token request, E2E) of a completed request, seconds."""
    t = record.token_times
    gaps = request_gaps(record)
    return t[0] - record.arrival_time, (sum(gaps) / len(gaps) if gaps else None), t[-1] - record.arrival_time


def slowdowns(records: Sequence[RequestRecord],
              reference: Mapping[str, Tuple[float, Optional[float], float]]) -> Dict[str, list]:
    """{'ttft', 'tbt', 'e2e'}: the served requests' slowdowns; `reference` maps each request id to its
    unloaded (TTFT, mean TBT, E2E) (`request_latencies` of its run alone)."""
    out: Dict[str, list] = {"ttft": [], "tbt": [], "e2e": []}
    for r in records:
        if not r.completed:
            continue
        if r.request_id not in reference:
            raise ValueError(f"request {r.request_id!r} has no unloaded reference run")
        got, ref = request_latencies(r), reference[r.request_id]
        for key, g, base in zip(("ttft", "tbt", "e2e"), got, ref):
            if g is not None and base:
                out[key].append(g / base)
    return out


def splitwise_slo_check(records: Sequence[RequestRecord],
                        reference: Mapping[str, Tuple[float, Optional[float], float]],
                        factors: Mapping[str, Mapping[str, float]] = SPLITWISE_SLO_FACTORS) -> Dict[str, Any]:
    """{'slowdowns': {metric: {p50, p90, p99}}, 'factors', 'holds': {metric: {pXX: bool}}, 'passes'}."""
    records = list(records)
    unserved = sum(1 for r in records if not r.completed)
    per_metric = slowdowns(records, reference)
    values, holds = {}, {}
    for metric, bounds in factors.items():
        values[metric] = {q: percentile_with_unserved(per_metric[metric], unserved, _QUANTILES[q]) for q in bounds}
        holds[metric] = {q: values[metric][q] is not None and values[metric][q] <= bound
                         for q, bound in bounds.items()}
    passes = bool(records) and all(ok for per_q in holds.values() for ok in per_q.values())
    return {"slowdowns": values, "factors": {m: dict(b) for m, b in factors.items()}, "holds": holds,
            "passes": passes}
