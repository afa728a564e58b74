"""Capacity search: the highest arrival rate whose run still meets latency limits (DESIGN.md §4).

`capacity_search(run_fn, lo, hi)` bisects on the rate. A rate *holds* when its summary satisfies every limit
`{metric path: max value}` (default: P99 TBT <= tbt_p99_s when given) and, always, median scheduling delay
<= max_sched_delay_p50_s (2 s), and slo_attainment >= min_slo_attainment when that is given. A summary with a
missing statistic (no completed request) does not hold. Bisection assumes holding is monotone in the rate.

The one rate search of the package: `bracket_rate` (double or halve from a start until the rate where holding
turns False is bracketed) and `bisect_rate` (shrink the bracket to a relative tolerance, one midpoint or a round of
rates at a time). capacity_search here, pdjax.sim.capacity's parallel search, the placement search
(pdjax.sim.placement.rate_search) and the provisioning search (pdjax.sim.provision.highest_rate) are all made of
these two.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from pdjax.metrics.latency import metric_value


@dataclasses.dataclass
class CapacityResult:
    capacity_rps: Optional[float]          # highest rate that held; None if even `lo` failed
    probes: List[Tuple[float, bool, Dict[str, Any]]]   # (rate, held, summary) in the order run


def holds(summary: Mapping[str, Any], limits: Mapping[str, float], max_sched_delay_p50_s: float = 2.0,
          min_slo_attainment: Optional[float] = None) -> bool:
    """Whether `summary` meets every limit (see module docstring)."""
    checks = dict(limits)
    checks["sched_delay.p50"] = min(checks.get("sched_delay.p50", max_sched_delay_p50_s), max_sched_delay_p50_s)
    for path, bound in checks.items():
        value = metric_value(summary, path)
        if value is None or value > bound:
            return False
    if min_slo_attainment is not None:
        attained = summary.get("slo_attainment")
        if attained is None or attained < min_slo_attainment:
            return False
    return True


def bracket_rate(ok: Callable[[float], bool], start: float, *, more: Callable[[], bool],
                 halve: bool = True) -> Tuple[float, float]:
    """(good, bad): the highest rate seen to hold (0.0: none) and the lowest seen to fail (inf: none). Probe
    `start`; while it holds, double until a rate fails; else halve until one holds (halve=False: stop at once);
    each further probe only while more() (the caller's probe budget)."""
    if ok(start):
        good, bad = start, math.inf
        while math.isinf(bad) and more():
            if ok(2 * good):
                good *= 2
            else:
                bad = 2 * good
    else:
        good, bad = 0.0, start
        while halve and good == 0 and more():
            if ok(bad / 2):
                good = bad / 2
            else:
                bad /= 2
    return good, bad


def bisect_rate(ok: Callable, good: float, bad: float, *, rel_tol: float, more: Callable[[], bool],
                split: Optional[Callable[[float, float], Sequence[float]]] = None) -> Tuple[float, float]:
    """Shrink the bracket (good holds, bad fails) until bad - good <= rel_tol * good or more() says stop; a
    bracket with good == 0 or bad == inf is left as is. Returns (good, bad). One probe at a time: ok(rate) -> bool
    on the midpoint. A round at a time: `split(good, bad)` -> the rates of one round (increasing, inside the
    bracket), ok(rates) -> their bools; the bracket becomes the highest holding rate below the lowest failing
    one (a round of k rates divides it by k + 1)."""
    while good > 0 and math.isfinite(bad) and bad - good > rel_tol * good and more():
        if split is None:
            mid = 0.5 * (good + bad)
            if ok(mid):
                good = mid
            else:
                bad = mid
        else:
            rates = split(good, bad)
            oks = ok(rates)
            bad = min([bad] + [r for r, held in zip(rates, oks) if not held])
            good = max([good] + [r for r, held in zip(rates, oks) if held and r < bad])
    return good, bad


def capacity_search(run_fn: Callable[[float], Mapping[str, Any]], lo: float, hi: float, *,
                    tbt_p99_s: Optional[float] = None, limits: Optional[Mapping[str, float]] = None,
                    max_sched_delay_p50_s: float = 2.0, min_slo_attainment: Optional[float] = None,
                    rel_tol: float = 0.05, max_probes: int = 12) -> CapacityResult:
    """Bisect the rate in [lo, hi] req/s until the bracket is within rel_tol of its low end or max_probes runs.

    run_fn(rate) runs a workload at `rate` and returns its summary (summarize_run / results.json schema).
    Returns hi if hi holds, None if lo fails.
    """
    if not 0 < lo < hi:
        raise ValueError(f"lo={lo!r}, hi={hi!r}: expected 0 < lo < hi (req/s)")
    if not rel_tol > 0:
        raise ValueError(f"rel_tol={rel_tol!r}, expected > 0")
    if max_probes < 2:
        raise ValueError(f"max_probes={max_probes!r}, expected >= 2")
    all_limits = dict(limits or {})
    if tbt_p99_s is not None:
        all_limits["tbt.p99"] = tbt_p99_s
    probes: List[Tuple[float, bool, Dict[str, Any]]] = []

    def probe(rate: float) -> bool:
        summary = dict(run_fn(rate))
        ok = holds(summary, all_limits, max_sched_delay_p50_s, min_slo_attainment)
        probes.append((rate, ok, summary))
        return ok

    if not probe(lo):
        return CapacityResult(None, probes)
    if probe(hi):
        return CapacityResult(hi, probes)
    good, _ = bisect_rate(probe, lo, hi, rel_tol=rel_tol, more=lambda: len(probes) < max_probes)
    return CapacityResult(good, probes)
