"""Capacity search in simulation (DESIGN.md §4): the highest arrival rate whose run meets the latency limits with
median scheduling delay <= 2 s, by bisection on the rate, with the probes of each round in parallel processes.

Parallel bisection: each round probes `parallel` rates evenly spaced inside the bracket (lo holds, hi fails) at
once; the bracket shrinks to the highest holding rate below the lowest failing one, so a round divides it by
parallel + 1 (plain bisection: 2). Holding is assumed monotone in the rate, as in pdjax.metrics.capacity_search
(whose `holds` rule this uses unchanged). Each probe simulates the whole config at that rate (same seed: the
arrival process is rescaled, the lengths are the same) and keeps only its summary. No JAX.

Worker lifetime: pool workers die with the process that started them, even when it is killed with SIGKILL
(`die_with_parent`, the pool initializer: prctl PR_SET_PDEATHSIG on Linux plus a thread polling the parent pid),
and an interrupted search (Ctrl-C, SIGTERM turned into SystemExit, an error) terminates its workers instead of
waiting for the probes in flight (`stop_pool`). pdjax.experiment.sweep uses the same two helpers.
"""
from __future__ import annotations

import concurrent.futures
import copy
import ctypes
import dataclasses
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from pdjax.metrics import holds, summarize_run


@dataclasses.dataclass
class ParallelCapacityResult:
    capacity_rps: Optional[float]                       # highest rate that held; None if even lo failed
    bracket: Tuple[float, float]                        # (highest holding, lowest failing) at the end
    probes: List[Tuple[float, bool, Dict[str, Any]]]    # (rate, held, summary) in the order run
    rounds: int


_PR_SET_PDEATHSIG = 1          # linux/prctl.h


def _watch_parent(parent_pid: int, interval_s: float) -> None:
    while True:
        time.sleep(interval_s)
        if os.getppid() != parent_pid:      # reparented: the parent is gone
            os._exit(1)


def die_with_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Pool-worker initializer: end this process as soon as `parent_pid` (the process that started the pool)
    dies, however it dies. On Linux the kernel sends SIGKILL at the parent's death (PR_SET_PDEATHSIG; the pool
    must be used from the thread that created it, as here); everywhere, a daemon thread polls the parent pid.
    SIGINT is ignored: on Ctrl-C (sent to the whole process group) the parent decides and stops its workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:          # the parent died before the line above took effect
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid, interval_s), daemon=True,
                     name="die-with-parent").start()


def process_pool(max_workers: int, method: str) -> concurrent.futures.ProcessPoolExecutor:
    """A ProcessPoolExecutor whose workers die with this process (`die_with_parent`)."""
    return concurrent.futures.ProcessPoolExecutor(max_workers=max_workers,
                                                  mp_context=multiprocessing.get_context(method),
                                                  initializer=die_with_parent, initargs=(os.getpid(),))


def stop_pool(pool: concurrent.futures.ProcessPoolExecutor, *, abort: bool, grace_s: float = 5.0) -> None:
    """Shut `pool` down: wait for its work when not `abort`; else cancel what has not started and terminate the
    workers (SIGTERM, then SIGKILL after grace_s) instead of waiting for the tasks in flight."""
    if not abort:
        pool.shutdown(wait=True)
        return
    procs = list((getattr(pool, "_processes", None) or {}).values())   # taken before shutdown clears it
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def simulate_summary(config_dict: Mapping[str, Any], rate: float) -> Dict[str, Any]:
    """Summary (results.json schema, no files) of `config_dict` (a serve config, backend ignored) at `rate`."""
    from pdjax.config.serving import serve_config_from_dict  # noqa: PLC0415
    from pdjax.sim.run import sim_info, simulate_config  # noqa: PLC0415

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
    a process pool of `parallel` workers; pass the builtin `map` to run in-process). Stops when the bracket is
    within rel_tol of its low end or after max_rounds rounds (the first round probes lo and hi)."""
    if not 0 < lo < hi:
        raise ValueError(f"lo={lo!r}, hi={hi!r}: expected 0 < lo < hi (req/s)")
    if not isinstance(parallel, int) or parallel < 1:
        raise ValueError(f"parallel={parallel!r}, expected a positive int")
    if not rel_tol > 0:
        raise ValueError(f"rel_tol={rel_tol!r}, expected > 0")
    probes: List[Tuple[float, bool, Dict[str, Any]]] = []
    pool = None
    if map_fn is None:
        # fork is fast and the simulator holds no threads; but a parent that loaded JAX (multithreaded) could
        # deadlock a forked child, so spawn then.
        pool = process_pool(parallel, "spawn" if "jax" in sys.modules else "fork")
        map_fn = pool.map
    try:
        def run_round(rates: Sequence[float]) -> List[bool]:
            summaries = list(map_fn(run_fn, list(rates)))
            oks = []
            for rate, summary in zip(rates, summaries):
                ok = holds(summary, limits, max_sched_delay_p50_s, min_slo_attainment)
                probes.append((rate, ok, dict(summary)))
                oks.append(ok)
            return oks

        ok_lo, ok_hi = run_round([lo, hi])
        rounds = 1
        if not ok_lo:
            return ParallelCapacityResult(None, (0.0, lo), probes, rounds)
        if ok_hi:
            return ParallelCapacityResult(hi, (hi, float("inf")), probes, rounds)
        good, bad = lo, hi
        while bad - good > rel_tol * good and rounds < max_rounds:
            rates = _probe_rates(good, bad, parallel)
            oks = run_round(rates)
            rounds += 1
            bad = min([bad] + [r for r, ok in zip(rates, oks) if not ok])
            good = max([good] + [r for r, ok in zip(rates, oks) if ok and r < bad])
        return ParallelCapacityResult(good, (good, bad), probes, rounds)
    except BaseException:       # an error, Ctrl-C or SystemExit: stop the probes in flight, do not wait for them
        if pool is not None:
            stop_pool(pool, abort=True)
            pool = None
        raise
    finally:
        if pool is not None:
            stop_pool(pool, abort=False)


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
    if tbt_p99 is not None:
        limits["tbt.p99"] = tbt_p99
    if ttft_p99 is not None:
        limits["ttft.p99"] = ttft_p99
    if not limits:
        raise ValueError("capacity: no limit given; expected tbt_p99 and/or ttft_p99 (seconds)")
    res = parallel_capacity_search(ConfigProbe(config_dict), lo, hi, limits=limits, parallel=parallel,
                                   rel_tol=rel_tol, max_rounds=max_rounds, map_fn=map_fn)
    return {"capacity_rps": res.capacity_rps, "bracket": list(res.bracket), "rounds": res.rounds,
            "limits": limits, "max_sched_delay_p50_s": 2.0,
            "probes": [probe_row(r, ok, s) for r, ok, s in res.probes]}
