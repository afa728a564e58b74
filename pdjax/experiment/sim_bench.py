"""Simulator speed and memory: simulated iterations per wall second and peak memory of the colocated loop
(configs/sim/chat10k.py: 10,000 requests), the disaggregated loop and the pipelined loop.

The command line is experiments/bench_sim.py; `run` returns its JSON. Each case runs in a fresh Python process (so
its peak memory is its own: `python -m pdjax.experiment.sim_bench CASE NUM_REQUESTS REPEAT`, `run_case`): the
config is prepared as `experiments.serve --config.backend=sim` prepares it
(pdjax.experiment.run.prepare_experiment), then simulated (pdjax.sim.run.simulate_config). Cases:
    chat10k   configs/sim/chat10k.py                         colocated, Mistral-7B, Sarathi 512, 10,000 requests
    disagg    configs/sim/disagg_paper.py:1p1d-chat          1 prefill + 1 decode Llama-2-13B, 4,000 requests
    pipeline  configs/sim/paper_base.py:llama70b-chat        Llama-2-70B TP4 x PP2 (2 batches in flight), 2,000
    replicas  configs/sim/chat10k.py:replicas-kv_centric     chat10k on 4 replicas at 4x the rate, prefix caching,
                                                             kv_centric router, host KV tiers, 10,000 requests
num_requests replaces every case's request count (the smoke test runs a handful).

JSON: per case num_requests, num_iterations, wall_s (the simulate call alone, best of `repeat` runs),
iterations_per_s, cpu_s and iterations_per_cpu_s (the same in this process's CPU seconds: steadier than wall time
when other jobs share the cores), peak_rss_mb (the process's maximum resident set, ru_maxrss, read right after the
simulation; it includes the interpreter and imports), base_rss_mb (the same before the simulation: imports, config and
workload), records_sha256 (SHA-256 of the run's requests.csv, iterations.csv and token_times.csv as
write_run_outputs writes them: equal before and after an optimization = byte-identical results); and the
machine's load average (os.getloadavg) before and after, since the machine may be shared; and the machine's own
ceiling for an interpreter-bound program, `interpreter_loops_per_s` (`interpreter_rate`: a fixed loop of the
operations the simulator is made of), with each case's iterations_per_s over it (`iterations_per_interpreter_loop`):
the same machine runs 20-30% faster or slower from one day to the next at the same load average, the ratio does not
move with it.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time
from typing import Sequence

import pdjax
from pdjax.config.files import config_file
from pdjax.errors import UserError
from pdjax.experiment.run import prepare_experiment
from pdjax.metrics import write_run_outputs
from pdjax.sim.run import simulate_config

REPO = pathlib.Path(pdjax.__file__).resolve().parents[1]
CASES = {
    "chat10k": ("configs/sim/chat10k.py", None, 10_000),
    "disagg": ("configs/sim/disagg_paper.py", "1p1d-chat", 4_000),
    "pipeline": ("configs/sim/paper_base.py", "llama70b-chat", 2_000),
    "replicas": ("configs/sim/chat10k.py", "replicas-kv_centric", 10_000),
}
RECORD_FILES = ("requests.csv", "iterations.csv", "token_times.csv")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0     # Linux: KiB


def run_case(name: str, num_requests: int, repeat: int) -> dict:
    """Simulate case `name` (in this process) `repeat` times; returns its JSON entry."""
    path, arg, default_requests = CASES[name]
    config = config_file(str(REPO / "x"), path, arg)
    config.workload.num_requests = num_requests or default_requests
    with tempfile.TemporaryDirectory() as tmp:
        prep = prepare_experiment(config, os.path.join(tmp, "run"))
        base_rss = _rss_mb()
        best = best_cpu = None
        for _ in range(repeat):
            records = iterations = None   # the last repeat's records only: a peak of one simulation's memory
            cpu_start = time.process_time()
            result, _ = simulate_config(prep.cfg, prep.workload)
            cpu = time.process_time() - cpu_start
            if best is None or result.wall_s < best:
                best = result.wall_s
            if best_cpu is None or cpu < best_cpu:
                best_cpu = cpu
            peak_rss = _rss_mb()
            records, iterations = result.requests, result.iterations
            del result
        write_run_outputs(prep.workdir, prep.config, records, iterations, plots=False)
        digest = hashlib.sha256()
        for file in RECORD_FILES:
            digest.update(pathlib.Path(prep.workdir, file).read_bytes())
    return {"config": path + (f":{arg}" if arg else ""), "num_requests": config.workload.num_requests,
            "num_iterations": len(iterations), "wall_s": best,
            "iterations_per_s": len(iterations) / best if best > 0 else float("inf"),
            "cpu_s": best_cpu, "iterations_per_cpu_s": len(iterations) / best_cpu if best_cpu > 0 else float("inf"),
            "peak_rss_mb": round(peak_rss, 1), "base_rss_mb": round(base_rss, 1),
            "records_sha256": digest.hexdigest()}


class _Slot:
    __slots__ = ("n",)


def interpreter_rate(loops: int = 500_000, repeat: int = 5) -> float:
    """The machine's own ceiling for this single-threaded Python simulator: loops per second (best of `repeat`) of a
    fixed interpreter-bound loop of the operations the simulator's hot paths are made of (an attribute read and
    write, a list append, a dict write and read, a float add, a comparison). Speeds divided by it compare across
    machines and days (the same cores run this and the simulation)."""
    best = float("inf")
    for _ in range(repeat):
        obj, out, table, acc = _Slot(), [], {}, 0.0
        obj.n = 0
        start = time.perf_counter()
        for i in range(loops):
            obj.n = obj.n + 1
            out.append(i)
            table[i & 1023] = i
            acc += table.get(i & 511, 0) * 0.5
            if acc < 0:
                break
        best = min(best, time.perf_counter() - start)
    return loops / best


def run(cases: Sequence[str] = tuple(CASES), num_requests: int = 0, repeat: int = 1) -> dict:
    """Every case in its own process (module docstring); UserError naming a case whose process failed (its
    stderr printed first). Each case also gives its speed over the machine's interpreter_rate (measured before and
    after the cases; the ratio uses their mean)."""
    load_before = os.getloadavg()
    ceiling_before = interpreter_rate()
    out = {}
    for name in cases:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pdjax.experiment.sim_bench", name, str(num_requests),
                               str(repeat)], cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            raise UserError(f"bench_sim case {name!r} failed (exit {proc.returncode})")
        out[name] = {**json.loads(proc.stdout.strip().splitlines()[-1]),
                     "process_wall_s": round(time.perf_counter() - start, 2)}
    ceiling = (ceiling_before + interpreter_rate()) / 2
    for case in out.values():
        case["iterations_per_interpreter_loop"] = round(case["iterations_per_s"] / ceiling, 4)
    return {"cases": out, "interpreter_loops_per_s": round(ceiling), "load_average_before": list(load_before),
            "load_average_after": list(os.getloadavg()), "cpus": os.cpu_count()}


if __name__ == "__main__":    # one case of `run`: CASE NUM_REQUESTS REPEAT
    print(json.dumps(run_case(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
