"""Simulator speed and memory: simulated iterations per wall second and peak memory of the colocated loop
(configs/sim/chat10k.py: 10,000 requests), the disaggregated loop and the pipelined loop.

    python -m experiments.bench_sim [--cases=chat10k,disagg,pipeline] [--num_requests=N] [--repeat=1]

Each case runs in a fresh Python process (so its peak memory is its own): the config is prepared as
`experiments.serve --config.backend=sim` prepares it (pdjax.experiment.run.prepare_experiment), then simulated
(pdjax.sim.run.simulate_config). Cases:
    chat10k   configs/sim/chat10k.py                         colocated, Mistral-7B, Sarathi 512, 10,000 requests
    disagg    configs/sim/disagg_paper.py:1p1d-chat          1 prefill + 1 decode Llama-2-13B, 4,000 requests
    pipeline  configs/sim/paper_base.py:llama70b-chat        Llama-2-70B TP4 x PP2 (2 batches in flight), 2,000
--num_requests replaces every case's request count (the smoke test runs a handful).

Prints JSON: per case num_requests, num_iterations, wall_s (the simulate call alone, best of --repeat runs),
iterations_per_s, cpu_s and iterations_per_cpu_s (the same in this process's CPU seconds: steadier than wall time
when other jobs share the cores), peak_rss_mb (the process's maximum resident set, ru_maxrss, read right after the
simulation; it includes the interpreter and imports), base_rss_mb (the same before the simulation: imports, config and
workload), records_sha256 (SHA-256 of the run's requests.csv, iterations.csv and token_times.csv as
write_run_outputs writes them: equal before and after an optimization = byte-identical results); and the
machine's load average (os.getloadavg) before and after, since the machine may be shared.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

from pdjax.config.files import config_file
from pdjax.experiment.run import prepare_experiment
from pdjax.metrics import write_run_outputs
from pdjax.sim.run import simulate_config

REPO = pathlib.Path(__file__).resolve().parents[1]
CASES = {
    "chat10k": ("configs/sim/chat10k.py", None, 10_000),
    "disagg": ("configs/sim/disagg_paper.py", "1p1d-chat", 4_000),
    "pipeline": ("configs/sim/paper_base.py", "llama70b-chat", 2_000),
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


def _case_list(text: str):
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if n not in CASES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of {sorted(CASES)}")
    return names


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (expected >= 0)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is out of range, expected an integer >= 0")
    return value


def _positive(text: str) -> int:
    value = _non_negative(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range, expected an integer >= 1")
    return value


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=_case_list, default=list(CASES), help="comma-separated cases")
    parser.add_argument("--num_requests", type=_non_negative, default=0, help="requests per case (0: its own)")
    parser.add_argument("--repeat", type=_positive, default=1, help="runs per case (best wall time)")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)   # run one case in this process
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_case(args.child, args.num_requests, args.repeat)))
        return {}
    load_before = os.getloadavg()
    cases = {}
    for name in args.cases:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "experiments.bench_sim", f"--child={name}",
                               f"--num_requests={args.num_requests}", f"--repeat={args.repeat}"],
                              cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            raise SystemExit(f"error: bench_sim case {name!r} failed (exit {proc.returncode})")
        cases[name] = {**json.loads(proc.stdout.strip().splitlines()[-1]),
                       "process_wall_s": round(time.perf_counter() - start, 2)}
    out = {"cases": cases, "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()),
           "cpus": os.cpu_count()}
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
