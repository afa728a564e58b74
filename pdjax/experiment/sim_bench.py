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
and, run only when named (not in DEFAULT_CASES):
    replicas_rr  configs/sim/chat10k.py:replicas-round_robin  the same behind round_robin, which reads no replica:
                                                             `replicas` less it is what cache-aware routing costs
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

instructions=True (`--instructions`): each case's process runs under valgrind's callgrind instead, with
instrumentation off until simulate_config and its two halves counted apart (callgrind_control zeroes and dumps the
counters), PYTHONHASHSEED=0: the JSON gives per case `instructions` (the simulation, the part wall_s times: the
instances built and the requests simulated), instructions_per_iteration and build_instructions (the setup and the
requests built before it), beside num_iterations and records_sha256, no timings. Deterministic, so a change of
1% shows where wall time on a shared machine cannot; about 50x slower than a plain run (minutes per case at the
default sizes).

pythons (`--pythons=PATH,...`): the cases' processes run under each of these interpreters in turn, case by case (side
by side in one run: the machine's noise falls on all of them alike), each importing this checkout's pdjax (its
dependencies installed for it, e.g. a venv made with that interpreter and `pip install -e .`). The JSON then gives,
per interpreter, its version and its own `interpreter_loops_per_s` (measured in each case's process before the
simulation; the mean of its processes) and its cases, each with iterations_per_interpreter_loop over its process's
rate. The same code runs 5-23% faster under a distribution's optimized build of one CPython version than under
pyenv's default build (experiments/README.md); the records are the same under every interpreter (real-text prompts
read a pinned text: pdjax.workload.tokens.pinned_topics).
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import resource
import shutil
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
from pdjax.sim.run import build_simulation, simulate_config, simulate_setup

REPO = pathlib.Path(pdjax.__file__).resolve().parents[1]
CASES = {
    "chat10k": ("configs/sim/chat10k.py", None, 10_000),
    "disagg": ("configs/sim/disagg_paper.py", "1p1d-chat", 4_000),
    "pipeline": ("configs/sim/paper_base.py", "llama70b-chat", 2_000),
    "replicas": ("configs/sim/chat10k.py", "replicas-kv_centric", 10_000),
    "replicas_rr": ("configs/sim/chat10k.py", "replicas-round_robin", 10_000),
}
DEFAULT_CASES = ("chat10k", "disagg", "pipeline", "replicas")
RECORD_FILES = ("requests.csv", "iterations.csv", "token_times.csv")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0     # Linux: KiB


def _callgrind(*args: str) -> None:
    """callgrind_control on this process (run under valgrind --tool=callgrind: `run(instructions=True)`)."""
    subprocess.run(["callgrind_control", *args, str(os.getpid())], check=True, capture_output=True)


def _counted_simulation(cfg, workload):
    """simulate_config under callgrind (`run(instructions=True)`), its two halves dumped apart: the requests'
    build (callgrind.out.1) and the simulation bench_sim's wall_s times (callgrind.out.2)."""
    _callgrind("--instr=on")
    _callgrind("-z")
    setup, requests = build_simulation(cfg, workload)
    _callgrind("-d", "build")
    result = simulate_setup(setup, requests)
    _callgrind("-d", "simulation")
    return result


def run_case(name: str, num_requests: int, repeat: int, instructions: bool = False, rate: bool = False) -> dict:
    """Simulate case `name` (in this process) `repeat` times; returns its JSON entry. instructions: this process runs
    under callgrind (`run`): each simulate_config is counted by `_counted_simulation`. rate: the entry also gives
    this interpreter's interpreter_loops_per_s, measured first (`run` with pythons)."""
    loops_per_s = interpreter_rate() if rate else None
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
            if instructions:
                result = _counted_simulation(prep.cfg, prep.workload)
            else:
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
            "records_sha256": digest.hexdigest()} | ({} if loops_per_s is None else {
                "interpreter_loops_per_s": round(loops_per_s)})


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


def _run_process(name: str, num_requests: int, repeat: int, instructions: bool, python: str = "") -> dict:
    """Case `name` in a process of its own, run by interpreter `python` ('': this one; else its entry gives its rate:
    run_case) (under callgrind when `instructions`: then its instructions and records alone); UserError naming the
    case when the process fails (its stderr printed first)."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [python or sys.executable, "-m", "pdjax.experiment.sim_bench", name, str(num_requests), str(repeat),
                   *(["rate"] if python and not instructions else [])]
        env = None
        if instructions:
            command = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                       f"--callgrind-out-file={tmp}/callgrind.out", *command, "instructions"]
            env = {**os.environ, "PYTHONHASHSEED": "0"}    # the same dict and set orders every run
        start = time.perf_counter()
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            raise UserError(f"bench_sim case {name!r} failed (exit {proc.returncode})")
        case = {**json.loads(proc.stdout.strip().splitlines()[-1]),
                "process_wall_s": round(time.perf_counter() - start, 2)}
        if not instructions:
            return case
        build, count = (_dumped_instructions(pathlib.Path(tmp, f"callgrind.out.{part}")) for part in (1, 2))
    return {key: case[key] for key in ("config", "num_requests", "num_iterations", "records_sha256")} | {
        "instructions": count, "instructions_per_iteration": round(count / max(case["num_iterations"], 1)),
        "build_instructions": build}


def _dumped_instructions(path: pathlib.Path) -> int:
    """The instructions (Ir) of a callgrind dump: its summary line."""
    return int(next(line.split()[1] for line in path.read_text().splitlines() if line.startswith("summary:")))


def _add_ratio(case: dict, loops_per_s: float) -> None:
    """A case's iterations_per_interpreter_loop: its speed over an interpreter_rate."""
    case["iterations_per_interpreter_loop"] = round(case["iterations_per_s"] / loops_per_s, 4)


def _check_valgrind() -> None:
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        raise UserError(f"bench_sim --instructions counts with valgrind's callgrind: {' and '.join(missing)} "
                        "not found on PATH (install valgrind)")


def interpreter_version(python: str) -> str:
    """The Python version of interpreter `python` when it imports this checkout's pdjax (run from the checkout, as
    the cases' processes are); UserError naming it otherwise."""
    probe = "import platform, pdjax.experiment.sim_bench as b; print(platform.python_version(), b.__file__)"
    try:
        proc = subprocess.run([python, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    except OSError as e:
        raise UserError(f"bench_sim --pythons: {python!r} cannot be run ({e.strerror}); expected a Python "
                        "interpreter's path") from e
    version, _, where = proc.stdout.strip().partition(" ")
    if proc.returncode != 0 or pathlib.Path(where).resolve() != pathlib.Path(__file__).resolve():
        raise UserError(f"bench_sim --pythons: {python!r} does not import this checkout's pdjax ({REPO}): "
                        f"{(proc.stderr.strip().splitlines() or ['it imports ' + where])[-1]}; expected an "
                        "interpreter with pdjax's dependencies (e.g. a venv's python after `pip install -e .`)")
    return version


def run(cases: Sequence[str] = DEFAULT_CASES, num_requests: int = 0, repeat: int = 1,
        instructions: bool = False, pythons: Sequence[str] = ()) -> dict:
    """Every case in its own process (module docstring); UserError naming a case whose process failed (its
    stderr printed first). Each case also gives its speed over the machine's interpreter_rate (measured before and
    after the cases; the ratio uses their mean). instructions: the instructions of each case's simulation instead
    (one run each, under callgrind: module docstring); UserError when valgrind or callgrind_control is missing.
    pythons: the cases run under each of these interpreters in turn (module docstring), checked first
    (interpreter_version)."""
    if instructions:
        _check_valgrind()
    if pythons:
        return _run_pythons(cases, num_requests, repeat, instructions, pythons)
    if instructions:
        return {"cases": {name: _run_process(name, num_requests, 1, True) for name in cases},
                "instructions": "callgrind Ir: simulate_setup (instructions), build_simulation (build_instructions)",
                "cpus": os.cpu_count()}
    load_before = os.getloadavg()
    ceiling_before = interpreter_rate()
    out = {name: _run_process(name, num_requests, repeat, False) for name in cases}
    ceiling = (ceiling_before + interpreter_rate()) / 2
    for case in out.values():
        _add_ratio(case, ceiling)
    return {"cases": out, "interpreter_loops_per_s": round(ceiling), "load_average_before": list(load_before),
            "load_average_after": list(os.getloadavg()), "cpus": os.cpu_count()}


def _run_pythons(cases: Sequence[str], num_requests: int, repeat: int, instructions: bool,
                 pythons: Sequence[str]) -> dict:
    """run() under each interpreter of `pythons` in turn, case by case."""
    if len(set(pythons)) != len(pythons):
        raise UserError(f"bench_sim --pythons={','.join(pythons)}: an interpreter is given twice; expected distinct "
                        "paths")
    versions = {python: interpreter_version(python) for python in pythons}
    load_before = os.getloadavg()
    out = {python: {"version": versions[python], "cases": {}} for python in pythons}
    for name in cases:
        for python in pythons:
            out[python]["cases"][name] = _run_process(name, num_requests, repeat, instructions, python)
    for entry in () if instructions else out.values():     # (under callgrind no rate is measured)
        rates = [case.pop("interpreter_loops_per_s") for case in entry["cases"].values()]
        for case, rate in zip(entry["cases"].values(), rates):
            _add_ratio(case, rate)
        entry["interpreter_loops_per_s"] = round(sum(rates) / len(rates))
    return {"interpreters": out, "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()),
            "cpus": os.cpu_count()}


if __name__ == "__main__":    # one case of `run`: CASE NUM_REQUESTS REPEAT [instructions | rate]
    print(json.dumps(run_case(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:] == ["instructions"],
                              sys.argv[4:] == ["rate"])))
