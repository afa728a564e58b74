"""Sweep expansion, resume after a crash, and summary.csv (with a fake point runner: no model needed)."""
import csv
import json
import os

import pytest

from pdjax.experiment import sweep as sweep_lib

BASE = {"scheduler": {"policy": "sarathi", "token_budget": 512}, "workload": {"rate": 1.0}}
SWEEP = {"base": BASE, "grid": {"policy": ("scheduler.policy", ["orca", "sarathi"]),
                                "token_budget": ("scheduler.token_budget", [256, 512, 1024])}}


def fake_run(cfg, workdir):
    """Writes a results.json whose numbers are a function of the config, so rows are checkable."""
    os.makedirs(workdir, exist_ok=True)
    budget = cfg["scheduler"]["token_budget"]
    summary = {"ttft": {"p50": budget / 1000, "p90": 1, "p99": 2}, "tbt": {"p50": 0.01, "p99": 0.02},
               "tpot": {"p50": 0.01}, "e2e": {"p50": 3}, "sched_delay": {"p50": 0.1},
               "throughput_tok_s": 100.0, "slo_attainment": 0.9, "goodput_rps": 1.5}
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(summary, f)
    with open(os.path.join(workdir, "calls.log"), "a") as f:
        f.write("x\n")


def test_expand_grid_is_cartesian_and_applies_overrides():
    points = sweep_lib.expand_grid(SWEEP)
    assert len(points) == 6
    names = [p[0] for p in points]
    assert names[0] == "policy=orca,token_budget=256"
    for _, values, cfg in points:
        assert cfg["scheduler"]["policy"] == values["policy"]
        assert cfg["scheduler"]["token_budget"] == values["token_budget"]
    assert BASE["scheduler"]["policy"] == "sarathi"  # base untouched


def test_unknown_sweep_key_fails_early():
    bad = {"base": BASE, "grid": {"x": ("scheduler.tokn_budget", [1])}}
    with pytest.raises(KeyError, match="tokn_budget"):
        sweep_lib.expand_grid(bad)
    with pytest.raises(ValueError, match="empty 'grid'"):
        sweep_lib.expand_grid({"base": BASE, "grid": {}})


def test_sweep_writes_summary_and_resumes_without_recomputing(tmp_path):
    calls = []

    def crashing_run(cfg, workdir):
        fake_run(cfg, workdir)
        calls.append(cfg["scheduler"]["token_budget"])
        if len(calls) == 4:
            raise RuntimeError("killed midway")

    with pytest.raises(RuntimeError):
        sweep_lib.run_sweep(SWEEP, str(tmp_path), crashing_run, log=lambda s: None)
    dirs = os.listdir(tmp_path)
    done = [d for d in dirs if ".partial-" not in d]
    assert len(done) == 3          # the 4th point crashed after writing: only its partial dir exists
    assert len([d for d in dirs if ".partial-" in d]) == 1
    assert not (tmp_path / "summary.csv").exists()

    reran = []

    def counting_run(cfg, workdir):
        reran.append(cfg["scheduler"]["token_budget"])
        fake_run(cfg, workdir)

    rows = sweep_lib.run_sweep(SWEEP, str(tmp_path), counting_run, log=lambda s: None)
    assert len(reran) == 3
    assert not [d for d in os.listdir(tmp_path) if ".partial-" in d]
    for d in os.listdir(tmp_path):
        if os.path.isdir(tmp_path / d):
            assert (tmp_path / d / "calls.log").read_text().count("x") == 1
    with open(tmp_path / "summary.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows) == 6
    assert list(table[0])[:2] == ["policy", "token_budget"]
    for row in table:
        assert float(row["ttft_p50"]) == pytest.approx(int(row["token_budget"]) / 1000)
        assert float(row["goodput_rps"]) == 1.5


def test_parallel_sweep_matches_serial(tmp_path):
    serial = sweep_lib.run_sweep(SWEEP, str(tmp_path / "a"), fake_run, log=lambda s: None)
    par = sweep_lib.run_sweep(SWEEP, str(tmp_path / "b"), fake_run, parallel=2, log=lambda s: None)
    assert serial == par


def test_invalid_point_fails_before_any_point_runs(tmp_path):
    ran = []

    def validate(cfg):
        if cfg["scheduler"]["token_budget"] > 512:
            raise ValueError(f"token_budget={cfg['scheduler']['token_budget']} too large")

    with pytest.raises(ValueError, match="token_budget=1024"):
        sweep_lib.run_sweep(SWEEP, str(tmp_path), lambda c, w: ran.append(w), validate=validate,
                            log=lambda s: None)
    assert ran == []


def test_comparison_plot_is_written(tmp_path):
    rows = sweep_lib.run_sweep(SWEEP, str(tmp_path), fake_run, log=lambda s: None)
    path = sweep_lib.write_sweep_plots(rows, ["policy", "token_budget"], str(tmp_path))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_column_can_set_several_keys_together():
    sweep = {"base": BASE, "grid": {"policy": (("scheduler.policy", "scheduler.token_budget"),
                                               [("orca", 2048), ("sarathi", 256)])}}
    points = sweep_lib.expand_grid(sweep)
    assert [p[0] for p in points] == ["policy=orca,token_budget=2048", "policy=sarathi,token_budget=256"]
    assert [p[2]["scheduler"]["token_budget"] for p in points] == [2048, 256]
    assert points[0][1] == {"policy": "orca", "token_budget": 2048}
    assert sweep_lib.sweep_columns(sweep) == ["policy", "token_budget"]
    with pytest.raises(ValueError, match="one value per key"):
        sweep_lib.expand_grid({"base": BASE, "grid": {"p": (("scheduler.policy", "workload.rate"), ["orca"])}})
