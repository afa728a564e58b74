"""Multi-controller runs of experiments.serve on localhost (pdjax.serving.distributed): 2 processes x 4 CPU devices
(8 global devices), each process started like launch/local.py starts it (jax.distributed env), every run bounded by
a timeout and its processes SIGKILLed at the end.

- a colocated tp2 instance on global devices [3, 4] (one device per process) gives exactly the single-process
  greedy tokens, and the online workload leaves identical per-step schedules on both processes (digests);
  only process 0 writes the workdir;
- a pp2 instance with one stage per process, under swap preemption: the single-process tokens and schedules;
- disaggregated across processes (prefill on process 0's device 3, decode on process 1's device 4, the KV crossing
  processes by device_put): same tokens, same schedules (slow);
- the trained orbax checkpoint served by a tp2 group on process 0's devices (process 1 holds none of them): the
  single-process tokens;
- configs that differ between the processes fail at start-up, each process naming the differing key (exit 2);
- faults: a process killed mid-run makes the other exit 1 within the timeout with one error line naming the dead
  process (the peer watchdog), with no results.json; a process that fails ends the run in one line per process,
  with no C++ stack from JAX's coordination client; a process that cannot reach the coordinator exits 1 within
  the timeout, naming itself.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from multiprocess_util import (BASE_ENV, CPP_ABORT_MARKS, DRIVER, REPO, RUN_TIMEOUT, end_processes, free_port,
                               local_process_env, logs, run_all, start)

TINY = ["--config=configs/serve.py", "--config.model.checkpoint=tiny-mha", "--config.model.attention_impl=reference",
        "--config.workload.num_requests=6", "--config.workload.rate=20", "--config.workload.max_output_len=6",
        "--config.scheduler.token_budget=32", "--config.scheduler.max_num_seqs=4",
        "--config.scheduler.max_model_len=64", "--config.scheduler.page_size=8", "--config.scheduler.num_pages=48",
        "--config.engine.compilation_cache=False"]
TP_ACROSS = ["--config.deployment.colocated.tp=2", "--config.deployment.colocated.devices=(3,4)"]
DISAGG_ACROSS = ["--config.deployment.kind=disaggregated", "--config.deployment.prefill.devices=(3,)",
                 "--config.deployment.decode.devices=(4,)"]


def _serve_cmd(args, workdir, *extra):
    return [sys.executable, "-m", "experiments.serve", *TINY, *args, f"--workdir={workdir}", *extra]


def _error_lines(log):
    return [line for line in log.splitlines() if line.startswith("error:")]



def _serve_single(args, workdir):
    """Greedy tokens of `args` served in one process with 8 CPU devices (the deployments' global indices)."""
    env = {**BASE_ENV, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run(_serve_cmd(args, workdir), cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((workdir / "outputs.json").read_text())


def _serve_across(args, tmp_path, expected_tokens):
    """Serve `args` on 2 processes x 4 devices; check the tokens and that both processes took the same
    schedule; returns results.json."""
    workdir, digests = tmp_path / "run", tmp_path / "digests"
    run_all(_serve_cmd(args, workdir, f"--schedule_digest_dir={digests}", "--distributed_timeout_s=60"), 2, tmp_path)
    assert json.loads((workdir / "outputs.json").read_text()) == expected_tokens
    _check_identical_schedules(digests)
    assert sorted(os.listdir(digests)) == ["schedule_p0.json", "schedule_p1.json"]
    return json.loads((workdir / "results.json").read_text())


@pytest.fixture(scope="module")
def single_process_tokens(tmp_path_factory):
    """Greedy tokens of the same workload in one process (8 CPU devices, tp2 on devices [3, 4])."""
    return _serve_single(TP_ACROSS, tmp_path_factory.mktemp("single") / "run")


def _check_identical_schedules(digest_dir):
    a, b = (json.loads((digest_dir / f"schedule_p{i}.json").read_text()) for i in (0, 1))
    assert a["steps"] and a["steps"] == b["steps"] and a["digest"] == b["digest"]


def test_tp_across_two_processes_matches_single_process(tmp_path, single_process_tokens):
    results = _serve_across(TP_ACROSS, tmp_path, single_process_tokens)
    assert results["engine"]["num_processes"] == 2
    (inst,) = results["engine"]["instances"].values()
    assert inst["tp"] == 2 and len(inst["devices"]) == 2


PP_ACROSS = ["--config.deployment.colocated.pp=2", "--config.deployment.colocated.devices=(3,4)"]
# KV pressure: 16 requests at once on 10 pages of 8 tokens, so some are swapped out to host and back.
SWAP_PRESSURE = ["--config.scheduler.num_pages=10", "--config.scheduler.preemption_mode=swap",
                 "--config.scheduler.num_host_pages=32", "--config.workload.num_requests=16",
                 "--config.workload.rate=500", "--config.workload.max_output_len=30"]


def test_pipeline_stages_on_two_processes_match_single_process_with_swap(tmp_path):
    """pp2 with stage 0 on process 0 and stage 1 on process 1, serving the trained orbax checkpoint (each process
    restores it onto its own device): the last stage's ids are read by process 1 and agreed; swapped pages are
    copied by the process holding each stage. Same tokens as one process."""
    args = PP_ACROSS + SWAP_PRESSURE + ["--config.model.checkpoint=checkpoints/tiny-byte"]
    tokens = _serve_single(args, tmp_path / "single")
    results = _serve_across(args, tmp_path, tokens)
    assert results["num_preemptions"] > 0, "no swap happened: the test lost its KV pressure"
    (inst,) = results["engine"]["instances"].values()
    assert inst["pp"] == 2


TP_ON_PROCESS_0 = ["--config.deployment.colocated.tp=2", "--config.deployment.colocated.devices=(0,1)",
                   "--config.model.checkpoint=checkpoints/tiny-byte"]


def test_trained_checkpoint_on_a_tp_group_of_another_process_matches_single_process(tmp_path):
    """Regression (issue 16 item 3): process 1 restored the orbax checkpoint onto its own first device, and a
    committed device array cannot be put on a mesh of devices it does not hold ("device_put's second argument
    must be a Device or a Sharding which represents addressable devices"). Restored host-side, every process puts
    its own shards (none, here, for process 1): the single-process tokens."""
    tokens = _serve_single(TP_ON_PROCESS_0, tmp_path / "single")
    results = _serve_across(TP_ON_PROCESS_0, tmp_path, tokens)
    (inst,) = results["engine"]["instances"].values()
    assert inst["tp"] == 2 and inst["devices"] == [0, 1]


@pytest.mark.slow
def test_disaggregated_across_two_processes_matches_single_process(tmp_path, single_process_tokens):
    results = _serve_across(DISAGG_ACROSS, tmp_path, single_process_tokens)
    assert results["engine"]["kv_transfer"]["num_transfers"] > 0


def test_killed_process_ends_the_run_without_results(tmp_path):
    timeout_s = 10
    workdir = tmp_path / "run"
    cmd = _serve_cmd(TP_ACROSS, workdir, f"--distributed_timeout_s={timeout_s}", "--config.workload.num_requests=400",
                     "--config.workload.rate=40")
    procs = start(cmd, 2, tmp_path)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        # Gloo connects at the first cross-process step (warm-up): the run is under way.
        while "Gloo" not in (tmp_path / "p1.log").read_text() and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), (tmp_path / "p0.log").read_text()[-2000:]
            time.sleep(0.2)
        time.sleep(2.0)
        assert procs[0].poll() is None, "process 0 ended before the kill: the run was too short"
        os.killpg(procs[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        code = procs[0].wait(timeout=timeout_s * 3 + 30)
        waited = time.monotonic() - killed
    finally:
        end_processes(procs, 0.0)
    log = (tmp_path / "p0.log").read_text()
    assert code == 1, log[-3000:]
    assert waited < timeout_s * 3
    assert "error: process 0 of 2: process 1 sent no heartbeat for 10 s" in log, log[-3000:]
    assert not [mark for mark in CPP_ABORT_MARKS if mark in log], log[-3000:]
    assert not (workdir / "results.json").exists()


def test_a_failed_process_ends_the_run_in_one_line_each_without_a_cpp_stack(tmp_path):
    """Regression (issue 16 item 3): after process 1's one-line error, process 0 (following it) ended first and
    took the coordination service with it, so process 1, still looking for a dead peer, aborted inside JAX's
    client with a ~60-line C++ stack. Process 0 now leaves last; process 0's main thread is inside a collective
    with process 1 meanwhile."""
    procs = start([sys.executable, "-c", DRIVER, "fail1"], 2, tmp_path, devices=2)
    try:
        codes = [p.wait(timeout=RUN_TIMEOUT) for p in procs]
    finally:
        end_processes(procs, 0.0)
    p0, p1 = logs(tmp_path, 2, tail=20000)
    assert codes == [1, 1], p0 + p1
    assert _error_lines(p1) == ["error: process 1 of 2: boom in process 1"], p1
    assert _error_lines(p0) == ["error: process 0 of 2: process 1 failed (boom in process 1); ending the run"], p0
    assert not [mark for mark in CPP_ABORT_MARKS if mark in p0 + p1], p0 + p1


def test_processes_given_different_configs_fail_at_start_up_naming_the_key(tmp_path):
    """Regression (issue 16 item 6): only the request lists were compared, so a budget mismatch failed 13 s in
    with "len(sampled_token_ids)=2, expected one per scheduled request (1)". Every process compares the digest
    of its whole resolved config with every other's before anything else and names the differing keys."""
    port, procs, budgets = free_port(), [], (32, 64)
    for i, budget in enumerate(budgets):
        env = {**BASE_ENV, **local_process_env(BASE_ENV, i, 2, port, 4)}
        cmd = _serve_cmd(TP_ACROSS, tmp_path / "run", f"--config.scheduler.token_budget={budget}",
                         "--distributed_timeout_s=30")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(tmp_path / f"p{i}.log", "w"),
                                      stderr=subprocess.STDOUT, start_new_session=True))
    try:
        codes = [p.wait(timeout=RUN_TIMEOUT) for p in procs]
    finally:
        end_processes(procs, 0.0)
    for i, log in enumerate(logs(tmp_path, 2, tail=20000)):
        peer = 1 - i
        assert codes[i] == 2, log
        assert _error_lines(log) == [
            f"error: process {i} of 2: config differs from process {peer}'s at scheduler.token_budget (process "
            f"{peer}: {budgets[peer]}, this process: {budgets[i]}); every process of a run needs the same config"], log
        assert not [mark for mark in CPP_ABORT_MARKS if mark in log], log
    assert not (tmp_path / "run").exists()      # before the workdir is touched


def test_unreachable_coordinator_fails_naming_the_process(tmp_path):
    env = {**BASE_ENV, **local_process_env(BASE_ENV, 1, 2, free_port(), 4)}    # process 1, no process 0 anywhere
    start = time.monotonic()
    out = subprocess.run(_serve_cmd(TP_ACROSS, tmp_path / "run", "--distributed_timeout_s=5"), cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 60
    assert out.returncode == 1, out.stderr[-2000:]
    assert "error: process 1 of 2: could not join the run" in out.stderr
    assert not (tmp_path / "run" / "results.json").exists()
