"""Capacity search in simulation (DESIGN.md §4): the highest arrival rate whose run meets the latency limits with
median scheduling delay <= 2 s, by bisection on the rate, with the probes of each round in parallel processes.

Parallel bisection: each round probes `parallel` rates evenly spaced inside the bracket (lo holds, hi fails) at
once; the bracket shrinks to the highest holding rate below the lowest failing one, so a round divides it by
parallel + 1 (plain bisection: 2). Holding is assumed monotone in the rate, as in pdjax.metrics.capacity_search
(whose `holds` rule this uses unchanged). Each probe simulates the whole config at that rate (same seed: the
arrival process is rescaled, the lengths are the same) and keeps only its summary. No JAX.

Worker lifetime: pool workers die with the process that started them, even when it is killed with SIGKILL,
and an interrupted search (Ctrl-C, SIGTERM turned into SystemExit, an error) terminates its workers instead of
waiting for the probes in flight (pdjax.procs.WorkerPool, the pool of pdjax.procs.parallel_map, kept across the
rounds).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from pdjax.config.serving import serve_config_from_dict
from pdjax.metrics import holds, summarize_run
from pdjax.metrics.capacity import bisect_rate
from pdjax.procs import WorkerPool
from pdjax.sim.run import sim_info, simulate_config


@dataclasses.dataclass
class ParallelCapacityResult:
    capacity_rps: Optional[float]                       # highest rate that held; None if even lo failed
    bracket: Tuple[float, float]                        # (highest holding, lowest failing) at the end
    probes: List[Tuple[float, bool, Dict[str, Any]]]    # (rate, held, summary) in the order run
    rounds: int


def simulate_summary(config_dict: Mapping[str, Any], rate: float) -> Dict[str, Any]:
    """Summary (results.json schema, no files) of `config_dict` (a serve config, backend ignored) at `rate`."""
    d = copy.deepcopy(dict(config_dict))
    d["backend"] = "sim"
    d["workload"] = dict(d.get("workload") or {}, rate=float(rate))
    cfg = serve_config_from_dict(d)
    result, setup = simulate_config(cfg)
    summary = summarize_run(result.requests, result.iterations, cfg.slo.as_dict())
    summary["sim"] = sim_info(result, setup, cfg)
    return summary


def _probe_rates(good: float, bad: float, n: int) -> List[float]:
    return [good + (bad - good) * (i + 1) / (n + 1) for i in range(n)]


def parallel_capacity_search(run_fn: Callable[[float], Mapping[str, Any]], lo: float, hi: float, *,
                             limits: Mapping[str, float], parallel: int = 2, rel_tol: float = 0.05,
                             max_rounds: int = 8, max_sched_delay_p50_s: float = 2.0,
                             min_slo_attainment: Optional[float] = None,
                             map_fn: Optional[Callable] = None) -> ParallelCapacityResult:
    """Search the capacity in [lo, hi] req/s. run_fn(rate) -> summary; `map_fn(fn, rates)` runs a round (default:
    a pdjax.procs.WorkerPool of `parallel` processes, kept across the rounds; pass the builtin `map` to run
    in-process). Stops when the bracket is
    within rel_tol of its low end or after max_rounds rounds (the first round probes lo and hi)."""
    if not 0 < lo < hi:
        raise ValueError(f"lo={lo!r}, hi={hi!r}: expected 0 < lo < hi (req/s)")
    if not isinstance(parallel, int) or parallel < 1:
        raise ValueError(f"parallel={parallel!r}, expected a positive int")
    if not rel_tol > 0:
        raise ValueError(f"rel_tol={rel_tol!r}, expected > 0")
    probes: List[Tuple[float, bool, Dict[str, Any]]] = []
    rounds = 0
    pool = WorkerPool(parallel) if map_fn is None else None    # parallel=1: each round in this process
    map_fn = map_fn or pool.map
    try:
        def run_round(rates: Sequence[float]) -> List[bool]:
            nonlocal rounds
            rounds += 1
            summaries = list(map_fn(run_fn, list(rates)))
            oks = []
            for rate, summary in zip(rates, summaries):
                ok = holds(summary, limits, max_sched_delay_p50_s, min_slo_attainment)
                probes.append((rate, ok, dict(summary)))
                oks.append(ok)
            return oks

        ok_lo, ok_hi = run_round([lo, hi])
        if not ok_lo:
            return ParallelCapacityResult(None, (0.0, lo), probes, rounds)
        if ok_hi:
            return ParallelCapacityResult(hi, (hi, float("inf")), probes, rounds)
        good, bad = bisect_rate(run_round, lo, hi, rel_tol=rel_tol, more=lambda: rounds < max_rounds,
                                split=lambda g, b: _probe_rates(g, b, parallel))
        return ParallelCapacityResult(good, (good, bad), probes, rounds)
    except BaseException:       # an error, Ctrl-C or SystemExit: stop the probes in flight, do not wait for them
        if pool is not None:
            pool.close(abort=True)
        raise
    finally:
        if pool is not None:
            pool.close()


class ConfigProbe:
    """A picklable run_fn: simulate `config_dict` at a rate (for process pools)."""

    def __init__(self, config_dict: Mapping[str, Any]):
        self.config_dict = dict(config_dict)

    def __call__(self, rate: float) -> Dict[str, Any]:
        return simulate_summary(self.config_dict, rate)


def probe_row(rate, held, summary):
    """One probe as a flat dict (rate, held, P99 TBT, P50/P99 TTFT, median scheduling delay, sim speed)."""
    get = lambda k, s="p99": (summary.get(k) or {}).get(s)  # noqa: E731
    return {"rate": rate, "held": held, "tbt_p99": get("tbt"), "ttft_p50": get("ttft", "p50"),
            "ttft_p99": get("ttft"), "sched_delay_p50": get("sched_delay", "p50"),
            "num_completed": summary.get("num_completed"),
            "sim_iterations_per_s": (summary.get("sim") or {}).get("iterations_per_s")}


def search_config_capacity(config_dict, *, tbt_p99, ttft_p99=None, lo=0.05, hi=16.0, parallel=2, rel_tol=0.05,
                           max_rounds=8, map_fn=None) -> dict:
    """Capacity of a serve config dict under P99 TBT (and optional P99 TTFT) limits: a JSON-ready report with
    capacity_rps, the final bracket and one row per probe."""
    limits = {}
    for key, name, value in (("tbt.p99", "tbt_p99", tbt_p99), ("ttft.p99", "ttft_p99", ttft_p99)):
        if value is not None:
            if not value > 0:
                raise ValueError(f"capacity: {name}={value!r}, expected a limit in seconds > 0")
            limits[key] = value
    if not limits:
        raise ValueError("capacity: no limit given; expected tbt_p99 and/or ttft_p99 (seconds)")
    res = parallel_capacity_search(ConfigProbe(config_dict), lo, hi, limits=limits, parallel=parallel,
                                   rel_tol=rel_tol, max_rounds=max_rounds, map_fn=map_fn)
    low, high = res.bracket
    open_above = high == float("inf")       # every probe up to hi held: hi is a lower bound, not the capacity
    report = {"capacity_rps": None if open_above else res.capacity_rps, "bracket": [low, high],
              "rounds": res.rounds, "limits": limits, "max_sched_delay_p50_s": 2.0,
              "probes": [probe_row(r, ok, s) for r, ok, s in res.probes]}
    if open_above:
        report["capacity_at_least_rps"] = hi
        report["note"] = f"the top probe (hi={hi} req/s) held: the capacity is above it; raise hi"
    elif res.capacity_rps is None:
        report["note"] = f"the bottom probe (lo={lo} req/s) failed: the capacity is below it; lower lo"
    return report
