"""experiments.bench_sim (pdjax.experiment.sim_bench) end to end at a tiny size: every case runs in its own process
and reports its speed, memory and the digest of its records (keys and invariants, not timings)."""
import json
import pathlib
import subprocess
import sys

import pytest

from pdjax.experiment import sim_bench as bench_sim

REPO = pathlib.Path(__file__).resolve().parents[1]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "experiments.bench_sim", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600)


def test_bench_sim_smoke(shared_data):
    proc = _cli("--num_requests=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert sorted(out["cases"]) == sorted(bench_sim.CASES)
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
