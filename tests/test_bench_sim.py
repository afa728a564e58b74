"""experiments.bench_sim (pdjax.experiment.sim_bench) end to end at a tiny size: every case runs in its own process
and reports its speed, memory and the digest of its records (keys and invariants, not timings)."""
import json
import pathlib
import platform
import shutil
import subprocess
import sys

import pytest

from pdjax.errors import UserError
from pdjax.experiment import sim_bench as bench_sim

REPO = pathlib.Path(__file__).resolve().parents[1]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "experiments.bench_sim", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


def test_bench_sim_smoke(shared_data):
    proc = _cli("--num_requests=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert sorted(out["cases"]) == sorted(bench_sim.DEFAULT_CASES)
    for case in out["cases"].values():
        assert case["num_requests"] == 3 and case["num_iterations"] > 0
        assert case["iterations_per_s"] == pytest.approx(case["num_iterations"] / case["wall_s"])
        assert case["iterations_per_cpu_s"] == pytest.approx(case["num_iterations"] / case["cpu_s"])
        assert case["peak_rss_mb"] >= case["base_rss_mb"] > 0
        assert len(case["records_sha256"]) == 64
        assert case["iterations_per_interpreter_loop"] == pytest.approx(
            case["iterations_per_s"] / out["interpreter_loops_per_s"], rel=1e-3, abs=1e-4)
    assert len(out["load_average_before"]) == 3 and out["cpus"] >= 1
    assert out["interpreter_loops_per_s"] > 0


def test_bench_sim_runs_the_round_robin_baseline_only_when_named(shared_data):
    """replicas_rr (the replicas case behind round_robin: what cache-aware routing costs is the difference) is run
    when named, not by default."""
    assert "replicas_rr" in bench_sim.CASES and "replicas_rr" not in bench_sim.DEFAULT_CASES
    out = bench_sim.run(["replicas", "replicas_rr"], 3, 1)["cases"]
    assert out["replicas_rr"]["config"] == "configs/sim/chat10k.py:replicas-round_robin"
    assert out["replicas"]["config"] == "configs/sim/chat10k.py:replicas-kv_centric"
    assert out["replicas_rr"]["num_requests"] == out["replicas"]["num_requests"] == 3
    assert out["replicas_rr"]["num_iterations"] > 0


def test_interpreter_rate_is_loops_per_second(monkeypatch):
    clock = iter([0.0, 0.5, 10.0, 10.25])       # two runs of 1,000 loops: 0.5 s and 0.25 s (the best)
    monkeypatch.setattr(bench_sim.time, "perf_counter", lambda: next(clock))
    assert bench_sim.interpreter_rate(loops=1000, repeat=2) == 4000.0


def test_bench_sim_rejects_bad_flags():
    proc = _cli("--cases=chat10k,nope")
    assert proc.returncode == 2
    assert "expected a comma-separated list" in proc.stderr
    proc = _cli("--repeat=0")
    assert proc.returncode == 2
    assert "expected an integer >= 1" in proc.stderr


def test_bench_sim_instructions_need_valgrind(monkeypatch):
    monkeypatch.setattr(bench_sim.shutil, "which", lambda tool: None if tool == "callgrind_control" else tool)
    with pytest.raises(UserError, match="callgrind_control not found on PATH"):
        bench_sim.run(["chat10k"], 3, 1, instructions=True)


@pytest.mark.slow
@pytest.mark.skipif(not (shutil.which("valgrind") and shutil.which("callgrind_control")), reason="needs valgrind")
def test_bench_sim_counts_the_simulations_instructions(shared_data):
    """--instructions: the records of a plain run, and a count of the simulation alone that repeats (callgrind is
    deterministic, the hash seed fixed) and grows with the work (twice the requests, more instructions),
    the requests' build counted apart."""
    plain = json.loads(_cli("--cases=replicas", "--num_requests=30").stdout)["cases"]["replicas"]
    counts = []
    for n in (30, 30, 60):
        proc = _cli("--cases=replicas", f"--num_requests={n}", "--instructions")
        assert proc.returncode == 0, proc.stderr[-3000:]
        case = json.loads(proc.stdout)["cases"]["replicas"]
        assert case["instructions_per_iteration"] == round(case["instructions"] / case["num_iterations"])
        assert 0 < case["build_instructions"] < case["instructions"]
        counts.append(case["instructions"])
        if n == 30:
            assert case["records_sha256"] == plain["records_sha256"]
            assert case["num_iterations"] == plain["num_iterations"]
    assert counts[1] == pytest.approx(counts[0], rel=1e-3)
    assert counts[2] > 1.2 * counts[0]     # (simulate_setup also builds the instances: a fixed part)


def test_bench_sim_runs_the_cases_under_each_interpreter_given(shared_data, tmp_path):
    """--pythons: each case under each interpreter (here this one, by two paths), side by side: its version, its
    own loop rate and the cases' ratios over it; the same records as a plain run."""
    alias = tmp_path / "python"
    alias.symlink_to(sys.executable)
    pythons = [sys.executable, str(alias)]
    out = bench_sim.run(["chat10k"], 3, 1, pythons=pythons)
    plain = bench_sim.run(["chat10k"], 3, 1)["cases"]["chat10k"]
    assert list(out["interpreters"]) == pythons and out["cpus"] >= 1
    for entry in out["interpreters"].values():
        assert entry["version"] == platform.python_version() and entry["interpreter_loops_per_s"] > 0
        case = entry["cases"]["chat10k"]
        assert case["records_sha256"] == plain["records_sha256"] and case["num_iterations"] == plain["num_iterations"]
        assert case["iterations_per_interpreter_loop"] == pytest.approx(
            case["iterations_per_s"] / entry["interpreter_loops_per_s"], rel=1e-3, abs=1e-4)


def test_bench_sim_refuses_an_interpreter_without_pdjax(tmp_path):
    bare = tmp_path / "bare-python"     # no site-packages, and the checkout not on its path: no pdjax
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    bare.chmod(0o755)
    with pytest.raises(UserError, match="does not import this checkout's pdjax"):
        bench_sim.run(["chat10k"], 3, 1, pythons=[str(bare)])
    with pytest.raises(UserError, match="cannot be run"):
        bench_sim.run(["chat10k"], 3, 1, pythons=[str(tmp_path / "nope")])
    with pytest.raises(UserError, match="given twice"):
        bench_sim.run(["chat10k"], 3, 1, pythons=[sys.executable, sys.executable])
