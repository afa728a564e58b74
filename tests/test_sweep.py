"""Sweep expansion, resume after a crash, and summary.csv (with a fake point runner: no model needed)."""
import copy
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

    def killed_run(cfg, workdir):
        fake_run(cfg, workdir)
        calls.append(cfg["scheduler"]["token_budget"])
        if len(calls) == 4:
            raise KeyboardInterrupt("killed midway")     # a kill, not a failing point: nothing is recorded

    with pytest.raises(KeyboardInterrupt):
        sweep_lib.run_sweep(SWEEP, str(tmp_path), killed_run, log=lambda s: None)
    dirs = os.listdir(tmp_path)
    done = [d for d in dirs if ".partial-" not in d]
    assert len(done) == 3          # the 4th point was killed after writing: only its partial dir exists
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
        assert row["status"] == "ok" and row["error"] == ""


def test_each_point_runs_in_a_fresh_empty_directory(tmp_path):
    seen = []

    def run(cfg, workdir):
        seen.append((os.path.isdir(workdir), os.listdir(workdir) if os.path.isdir(workdir) else None))
        fake_run(cfg, workdir)

    sweep_lib.run_sweep(SWEEP, str(tmp_path), run, log=lambda s: None)
    assert seen == [(True, [])] * 6


def _with(sweep, dotted, value):
    sweep = copy.deepcopy(sweep)
    sweep_lib.set_dotted(sweep["base"], dotted, value)
    return sweep


def test_rerun_with_a_changed_config_refuses_naming_the_point_and_keys(tmp_path):
    sweep_lib.run_sweep(SWEEP, str(tmp_path), fake_run, log=lambda s: None)
    ran = []

    def counting_run(cfg, workdir):
        ran.append(cfg["scheduler"]["token_budget"])
        fake_run(cfg, workdir)

    changed = _with(SWEEP, "workload.rate", 2.0)
    with pytest.raises(sweep_lib.SweepConfigChanged) as info:
        sweep_lib.run_sweep(changed, str(tmp_path), counting_run, log=lambda s: None)
    message = str(info.value)
    assert "\n" not in message
    assert "point policy=orca,token_budget=256" in message
    assert "workload.rate: 1.0 -> 2.0" in message and "--rerun_changed" in message
    assert ran == []
    # --rerun_changed reruns exactly the changed points; their config.json is the new config
    logs = []
    rows = sweep_lib.run_sweep(changed, str(tmp_path), counting_run, rerun_changed=True, log=logs.append)
    assert len(ran) == 6 and len(rows) == 6
    assert any("rerunning policy=orca,token_budget=256: config changed (workload.rate: 1.0 -> 2.0)" in s
               for s in logs)
    with open(tmp_path / "policy=orca,token_budget=256" / "config.json") as f:
        assert json.load(f)["workload"]["rate"] == 2.0
    assert (tmp_path / "policy=orca,token_budget=256" / "calls.log").read_text() == "x\n"   # a fresh dir
    # now the stored configs match: nothing reruns, with or without the flag
    sweep_lib.run_sweep(changed, str(tmp_path), counting_run, log=lambda s: None)
    assert len(ran) == 6


def test_changed_config_check_sees_nested_added_and_removed_keys(tmp_path):
    sweep_lib.run_sweep(SWEEP, str(tmp_path), fake_run, log=lambda s: None)
    extra = copy.deepcopy(SWEEP)
    extra["base"]["workload"]["num_requests"] = 12
    with pytest.raises(sweep_lib.SweepConfigChanged, match=r"workload.num_requests: \(absent\) -> 12"):
        sweep_lib.run_sweep(extra, str(tmp_path), fake_run, log=lambda s: None)
    # a point that only gains a grid neighbour is still done; the new point runs
    grown = copy.deepcopy(SWEEP)
    grown["grid"]["token_budget"] = ("scheduler.token_budget", [256, 512, 1024, 2048])
    ran = []
    sweep_lib.run_sweep(grown, str(tmp_path), lambda c, w: (ran.append(w), fake_run(c, w)), log=lambda s: None)
    assert [os.path.basename(w).split(".partial-")[0] for w in ran] == [
        "policy=orca,token_budget=2048", "policy=sarathi,token_budget=2048"]
    # a finished point without config.json (e.g. copied in by hand) cannot be trusted
    os.remove(tmp_path / "policy=orca,token_budget=256" / "config.json")
    with pytest.raises(sweep_lib.SweepConfigChanged, match="config.json is missing"):
        sweep_lib.run_sweep(grown, str(tmp_path), fake_run, log=lambda s: None)


def test_config_diff():
    assert sweep_lib.config_diff({"a": {"b": 4}}, {"a": {"b": 4.0}}) == []
    assert sweep_lib.config_diff({"a": True}, {"a": 1}) == ["a: True -> 1"]
    assert sweep_lib.config_diff({"a": [1, 2]}, {"a": [1, 3], "c": None}) == ["a: [1, 2] -> [1, 3]",
                                                                              "c: (absent) -> None"]


def failing_run(cfg, workdir):
    """fake_run, but the points with token_budget 512 raise (module level: picklable for parallel sweeps)."""
    if cfg["scheduler"]["token_budget"] == 512:
        raise ValueError(f"boom at budget {cfg['scheduler']['token_budget']}")
    fake_run(cfg, workdir)


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_failing_point_is_recorded_and_the_others_still_run(tmp_path, parallel):
    logs = []
    with pytest.raises(sweep_lib.SweepFailed) as info:
        sweep_lib.run_sweep(SWEEP, str(tmp_path), failing_run, parallel=parallel, log=logs.append)
    failed = ["policy=orca,token_budget=512", "policy=sarathi,token_budget=512"]
    assert info.value.failed == failed
    assert str(info.value) == ("sweep: 2 of 6 points failed: policy=orca,token_budget=512, "
                               "policy=sarathi,token_budget=512 (traceback in each point's error.txt)")
    assert any(s.startswith("sweep: FAILED policy=orca,token_budget=512: ValueError: boom at budget 512")
               for s in logs)
    for name in failed:
        error = (tmp_path / name / "error.txt").read_text()
        assert "Traceback (most recent call last)" in error and "failing_run" in error
        assert error.strip().endswith("ValueError: boom at budget 512")
        assert not (tmp_path / name / "results.json").exists()
        assert (tmp_path / name / "config.json").exists()
    assert not [d for d in os.listdir(tmp_path) if ".partial-" in d]
    with open(tmp_path / "summary.csv") as f:
        table = {r["token_budget"] + r["policy"]: r for r in csv.DictReader(f)}
    assert len(table) == 6
    assert table["512orca"]["status"] == "failed"
    assert table["512orca"]["error"] == "ValueError: boom at budget 512"
    assert table["512orca"]["ttft_p50"] == ""
    assert table["1024orca"]["status"] == "ok" and float(table["1024orca"]["ttft_p50"]) == 1.024
    # a failed point is not done: the rerun retries it (and only it)
    ran = []
    logs = []
    rows = sweep_lib.run_sweep(SWEEP, str(tmp_path), lambda c, w: (ran.append(w), fake_run(c, w)),
                               log=logs.append)
    assert sorted(os.path.basename(w).split(".partial-")[0] for w in ran) == failed
    assert "sweep: 6 points, 4 already done, 2 to run (2 failed before, retried)" in logs
    assert all(r["status"] == "ok" for r in rows)
    assert not (tmp_path / failed[0] / "error.txt").exists()


def dying_run(cfg, workdir):
    if cfg["scheduler"]["token_budget"] == 1024:
        os._exit(3)      # the worker process dies (as when killed by the OOM killer)
    fake_run(cfg, workdir)


def test_a_dead_worker_fails_its_point_not_the_sweep(tmp_path):
    with pytest.raises(sweep_lib.SweepFailed) as info:
        sweep_lib.run_sweep(SWEEP, str(tmp_path), dying_run, parallel=2, log=lambda s: None)
    assert "policy=orca,token_budget=1024" in info.value.failed
    error = (tmp_path / "policy=orca,token_budget=1024" / "error.txt").read_text()
    assert "worker process failed" in error
    rows = sweep_lib.run_sweep(SWEEP, str(tmp_path), fake_run, parallel=2, log=lambda s: None)
    assert [r["status"] for r in rows] == ["ok"] * 6


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
