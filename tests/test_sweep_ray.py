"""Sweeps on Ray (`--executor=ray`): the same summary.csv as the local executor, finished points skipped, a point
whose worker dies retried and then recorded, resources derived from each point's config. One local Ray cluster
(2 CPUs) for the module; skipped when Ray (the `cluster` extra) is not installed."""
import csv
import functools
import json
import os
import socket
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")

from pdjax.config.files import config_file
from pdjax.experiment import sweep as sweep_lib
from pdjax.experiment.run import run_experiment, to_plain_dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The test's run functions travel to the Ray workers by value (this module is not importable there).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def _sim_grid(num_requests=8):
    sweep = to_plain_dict(config_file(os.path.join(REPO, "README.md"), "configs/sweeps/budget.py", "sim"))
    sweep["base"]["workload"]["num_requests"] = num_requests
    return sweep


def test_ray_sweep_of_a_sim_grid_matches_the_local_summary_and_resumes(cluster, tmp_path):
    local = tmp_path / "local"
    sweep_lib.run_sweep(_sim_grid(), str(local), run_experiment, log=lambda s: None)
    # Through the entry point, joining the module's cluster (--ray_address).
    cmd = [sys.executable, "-m", "experiments.sweep", "--config=configs/sweeps/budget.py:sim",
           "--config.base.workload.num_requests=8", f"--workdir={tmp_path / 'ray'}", "--executor=ray",
           f"--ray_address={cluster}"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sweep: 5 points, 0 already done, 5 to run" in out.stdout
    assert (tmp_path / "ray" / "summary.csv").read_bytes() == (local / "summary.csv").read_bytes()
    logs = []
    rows = sweep_lib.run_sweep(_sim_grid(), str(tmp_path / "ray"), run_experiment, executor="ray", log=logs.append)
    assert "sweep: 5 points, 5 already done, 0 to run" in logs
    assert [r["status"] for r in rows] == ["ok"] * 5


def _real_point(tmp_path):
    """budget.py's real-engine grid cut to one point: the committed tiny-byte checkpoint, 2 requests, one bucket
    of each kind (a few compiles), no compilation cache (the worker compiles, as a fresh machine would)."""
    sweep = to_plain_dict(config_file(os.path.join(REPO, "README.md"), "configs/sweeps/budget.py", "real"))
    base = sweep["base"]
    base["workload"].update(num_requests=2, max_output_len=4)
    base["scheduler"].update(max_model_len=128, max_num_seqs=4)
    base["engine"].update(mode="offline", token_buckets=[256], seq_buckets=[4], page_buckets=[8],
                          compilation_cache=False)
    sweep["grid"] = {"token_budget": ("scheduler.token_budget", [256])}
    return sweep


def test_a_real_engine_point_runs_on_ray(cluster, tmp_path):
    """Ray takes max_calls (the fresh worker a real-engine point needs) only in ray.remote, not in .options():
    every real-engine Ray sweep failed with "Setting 'max_calls' is not supported in '.options()'"."""
    @ray.remote
    def imported_pdjax():
        import pdjax
        return pdjax.__file__

    # The workers import this checkout's pdjax (Ray puts the driver's working directory on their sys.path).
    assert ray.get(imported_pdjax.remote()).startswith(os.path.join(REPO, "pdjax"))
    logs = []
    rows = sweep_lib.run_sweep(_real_point(tmp_path), str(tmp_path / "w"), run_experiment,
                               executor="ray", platform="cpu", log=logs.append)
    assert [r["status"] for r in rows] == ["ok"], logs
    assert rows[0]["throughput_tok_s"] > 0
    # The same point run here, in this process: the same requests served to the same tokens.
    sweep_lib.run_sweep(_real_point(tmp_path), str(tmp_path / "local"), run_experiment, log=lambda s: None)
    ray_dir, local_dir = tmp_path / "w" / "token_budget=256", tmp_path / "local" / "token_budget=256"
    with open(ray_dir / "results.json") as f:
        assert json.load(f)["num_completed"] == 2
    outputs = [json.loads((d / "outputs.json").read_text()) for d in (ray_dir, local_dir)]
    assert sorted(outputs[0]) == ["r0", "r1"] and all(outputs[0].values())
    assert outputs[0] == outputs[1]


BASE = {"backend": "sim", "scheduler": {"policy": "sarathi", "token_budget": 512}, "workload": {"rate": 1.0}}
SWEEP = {"base": BASE, "grid": {"token_budget": ("scheduler.token_budget", [256, 512, 1024, 2048])}}


def _dying_run(cfg, workdir, marks):
    """Dies (os._exit, as when OOM-killed) on the first attempt of budget 512 and on every attempt of 2048."""
    budget = cfg["scheduler"]["token_budget"]
    with open(os.path.join(marks, f"{budget}.attempts"), "a") as f:
        f.write("x")
    with open(os.path.join(marks, f"{budget}.attempts")) as f:
        attempts = len(f.read())
    if budget == 2048 or (budget == 512 and attempts == 1):
        os._exit(1)
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump({"ttft": {"p50": budget / 1000}, "throughput_tok_s": 100.0}, f)


def test_a_dead_worker_is_retried_then_recorded_and_the_sweep_goes_on(cluster, tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    logs = []
    with pytest.raises(sweep_lib.SweepFailed) as info:
        sweep_lib.run_sweep(SWEEP, str(tmp_path / "w"), functools.partial(_dying_run, marks=str(marks)),
                            executor="ray", max_retries=1, log=logs.append)
    assert info.value.failed == ["token_budget=2048"]
    attempts = {b: len((marks / f"{b}.attempts").read_text()) for b in (256, 512, 1024, 2048)}
    assert attempts == {256: 1, 512: 2, 1024: 1, 2048: 2}      # 2048: the first try + max_retries=1
    assert any(line.startswith("sweep: the worker of token_budget=512 died") for line in logs)
    with open(tmp_path / "w" / "summary.csv") as f:
        rows = {r["token_budget"]: r for r in csv.DictReader(f)}
    assert [r["status"] for r in rows.values()] == ["ok", "ok", "ok", "failed"]
    assert rows["512"]["ttft_p50"] == "0.512"
    assert rows["2048"]["error"] == ("WorkerCrashedError: the point's worker process died on all 2 attempts "
                                     "(killed, or out of memory?)")
    assert "attempt 2:" in (tmp_path / "w" / "token_budget=2048" / "error.txt").read_text()
    assert not [e for e in os.listdir(tmp_path / "w") if ".partial-" in e]


def test_point_resources_follow_the_deployment():
    sim = {"backend": "sim"}
    assert sweep_lib.point_resources(sim, "gpu") == {"num_cpus": 1}
    real = {"backend": "real"}
    disagg = {"backend": "real", "deployment": {"kind": "disaggregated", "prefill": {"tp": 2},
                                                "decode": {"num_instances": 2}}}
    assert sweep_lib.point_resources(real, "gpu") == {"num_cpus": 1, "num_gpus": 1}
    replicas = {"backend": "real", "deployment": {"colocated": {"num_instances": 2, "tp": 2}}}
    assert sweep_lib.point_resources(replicas, "gpu") == {"num_cpus": 1, "num_gpus": 4}
    assert sweep_lib.point_resources(disagg, "gpu") == {"num_cpus": 1, "num_gpus": 4}
    assert sweep_lib.point_resources(disagg, "tpu") == {"num_cpus": 1, "resources": {"TPU": 4}}
    assert sweep_lib.point_resources(disagg, "cpu") == {"num_cpus": 4}
    assert sweep_lib.point_resources(disagg, "cpu", max_node_cpus=2) == {"num_cpus": 2}
    nodes = [{"Alive": True, "Resources": {"CPU": 8.0, "GPU": 2.0}}]
    sweep_lib._check_feasible([("a", {"num_cpus": 1, "num_gpus": 2})], nodes, "here")
    with pytest.raises(ValueError, match=r"sweep point b needs CPU=1, GPU=4 on one node; no node of the Ray "
                                         r"cluster \(here\) has that \(nodes: CPU=8, GPU=2\)"):
        sweep_lib._check_feasible([("b", {"num_cpus": 1, "num_gpus": 4})], nodes, "here")
    assert sweep_lib.sweep_platform("auto", {"CPU": 4, "GPU": 1}) in ("gpu", "cpu", "tpu")   # $JAX_PLATFORMS first
    assert sweep_lib.sweep_platform("tpu", {"CPU": 4}) == "tpu"


def _closed_port():
    """A port on 127.0.0.1 that nothing listens at (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_ray_address_fails_at_once_in_one_line(tmp_path):
    """ray.init retries an address nothing answers at forever (a warning every ~40 s); the sweep must say so."""
    address = f"127.0.0.1:{_closed_port()}"
    cmd = [sys.executable, "-m", "experiments.sweep", "--config=configs/sweeps/budget.py:sim",
           f"--workdir={tmp_path / 'w'}", "--executor=ray", f"--ray_address={address}"]
    try:
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the sweep still waited for {address} after 60 s")
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.splitlines() == [
        f"error: ray_address={address!r}: no Ray cluster answers there (Connection refused); expected the address "
        "of a running cluster's head (ray start --head prints it), or none (a local cluster is started)"]
    assert not (tmp_path / "w").exists()     # refused before the workdir is made
    with pytest.raises(ValueError, match=r"ray_address='nohost', expected HOST:PORT"):
        sweep_lib.check_ray_address("nohost")
    sweep_lib.check_ray_address("auto")      # Ray finds the cluster itself


def test_no_cluster_at_auto_is_a_value_error_naming_the_address(tmp_path, monkeypatch):
    """ray.init(address='auto') raises ConnectionError when no cluster runs on this machine (not testable for
    real on a shared machine, where another cluster may run: Ray's own error is stood in for here)."""
    def no_cluster(**kwargs):
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_cluster)
    with pytest.raises(ValueError, match=r"^ray_address='auto': Could not find any running Ray instance"):
        sweep_lib.run_sweep(SWEEP, str(tmp_path / "w"), _dying_run, executor="ray", ray_address="auto",
                            log=lambda s: None)
