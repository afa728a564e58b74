"""experiments.bench_sim end to end at a tiny size: every case runs in its own process and reports its speed,
memory and the digest of its records (keys and invariants, not timings)."""
import json

import pytest

from experiments import bench_sim


def test_bench_sim_smoke(capsys, shared_data):
    out = bench_sim.main(["--num_requests=3"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(out))
    assert sorted(out["cases"]) == sorted(bench_sim.CASES)
    for case in out["cases"].values():
        assert case["num_requests"] == 3 and case["num_iterations"] > 0
        assert case["iterations_per_s"] == pytest.approx(case["num_iterations"] / case["wall_s"])
        assert case["iterations_per_cpu_s"] == pytest.approx(case["num_iterations"] / case["cpu_s"])
        assert case["peak_rss_mb"] >= case["base_rss_mb"] > 0
        assert len(case["records_sha256"]) == 64
    assert len(out["load_average_before"]) == 3 and out["cpus"] >= 1


def test_bench_sim_rejects_bad_flags(capsys):
    with pytest.raises(SystemExit):
        bench_sim.main(["--cases=chat10k,nope"])
    assert "expected a comma-separated list" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_sim.main(["--repeat=0"])
    assert "expected an integer >= 1" in capsys.readouterr().err
