"""launch/: the local N-process launcher (dry run, for real, a failing process, the timeout, a real
jax.distributed run on CPU, without gloo's chatter, stopped by SIGTERM at once), the Cloud TPU pod and SLURM
launchers' dry-run command lines."""
import importlib.util
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time

from multiprocess_util import CPP_ABORT_MARKS, DRIVER

REPO = pathlib.Path(__file__).resolve().parent.parent
LOCAL = str(REPO / "launch" / "local.py")
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PROJECT", "REPO_DIR", "JAX_PORT",
                                                              "PROCS_PER_NODE") and not k.startswith("SLURM_")}


def _local(*args, timeout=60, cwd=None):
    return subprocess.run([sys.executable, LOCAL, *args], capture_output=True, text=True, timeout=timeout,
                          env=CLEAN_ENV, cwd=cwd)


def test_local_runs_as_a_script_from_any_directory(tmp_path):
    """It imports its process helpers from its own checkout's pdjax (pdjax.procs), wherever it is started."""
    out = _local("-n", "1", "--port", "1234", "--dry_run", "--", "true", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("JAX_PROCESS_ID=0 true")


def test_local_dry_run_prints_each_process_command_line():
    out = _local("-n", "2", "--port", "1234", "--devices_per_process", "4", "--dry_run", "--",
                 "python3", "-m", "experiments.serve", "--workdir=/tmp/a b")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_COORDINATOR_ADDRESS=127.0.0.1:1234 "
        f"JAX_NUM_PROCESSES=2 JAX_PROCESS_ID={i} python3 -m experiments.serve '--workdir=/tmp/a b'" for i in (0, 1)]


def test_local_runs_every_process_with_its_settings():
    code = ("import os; e = os.environ; os.write(1, ' '.join(['process', e['JAX_PROCESS_ID'], e['JAX_NUM_PROCESSES'], "
            "e['JAX_COORDINATOR_ADDRESS'], e['JAX_PLATFORMS'], e['XLA_FLAGS']]).encode() + b'\\n')")   # one write
    out = _local("-n", "3", "--port", "23456", "--devices_per_process", "2", "--", sys.executable, "-c", code)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == [
        f"process {i} 3 127.0.0.1:23456 cpu --xla_force_host_platform_device_count=2" for i in range(3)]


def test_local_ends_all_processes_when_one_fails():
    code = ("import os, sys, time; i = int(os.environ['JAX_PROCESS_ID']); print(os.getpid(), flush=True); "
            "time.sleep(0.5); sys.exit(3) if i == 1 else time.sleep(120)")
    start = time.monotonic()
    out = _local("-n", "3", "--grace", "2", "--", sys.executable, "-c", code)
    assert time.monotonic() - start < 30
    assert out.returncode == 3
    last_line = out.stderr.strip().splitlines()[-1]
    assert last_line == "launch/local.py: process 1 of 3 exited with status 3; ended the others"
    for pid in map(int, out.stdout.split()):     # none of the sleepers is left
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


def test_local_timeout_ends_everything():
    start = time.monotonic()
    out = _local("-n", "2", "--timeout", "1", "--grace", "1", "--", "sleep", "120")
    assert time.monotonic() - start < 20
    assert out.returncode == 124
    assert "timed out after 1 s; ended processes [0, 1]" in out.stderr


def test_local_argument_errors():
    out = _local("-n", "0", "--", "true")
    assert out.returncode == 2 and "--num_processes=0, expected >= 1" in out.stderr
    out = _local("-n", "2")
    assert out.returncode == 2 and "no command given" in out.stderr


def test_local_processes_form_one_jax_distributed_runtime():
    code = ("import os, jax; jax.distributed.initialize(num_processes=int(os.environ['JAX_NUM_PROCESSES']), "
            "process_id=int(os.environ['JAX_PROCESS_ID'])); "
            "os.write(1, f'process {jax.process_index()} {jax.process_count()} {jax.device_count()} "
            "{jax.local_device_count()}\\n'.encode())")
    out = _local("-n", "2", "--devices_per_process", "2", "--timeout", "120", "--", sys.executable, "-c", code,
                 timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(line for line in out.stdout.splitlines() if line.startswith("process")) == [
        "process 0 2 4 2", "process 1 2 4 2"]


def test_gloo_chatter_is_recognized_when_cut_and_mixed():
    spec = importlib.util.spec_from_file_location("launch_local", LOCAL)
    local = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(local)
    lines = [b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n",
             b"[Gloo] Rank [Gloo] Rank 2 is connected to 3 peer ranks. "
             b"Expected number of connected peer ranks is : 3\n",
             b"3 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n"]
    assert all(local.is_gloo_chatter(line) for line in lines)
    assert not local.is_gloo_chatter(b"requests 8 (completed 8, rejected 0, preempted 0)\n")


def _driver_run(mode, *launcher_args):
    return subprocess.Popen([sys.executable, LOCAL, "-n", "2", "--devices_per_process", "2", "--timeout", "200",
                             *launcher_args, "--", sys.executable, "-c", DRIVER, mode],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=CLEAN_ENV, cwd=REPO)


def test_local_leaves_out_gloos_connection_lines():
    """Regression (issue 16 item 10): gloo prints "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of
    connected peer ranks is : 1" (stdout, no log level) for every CPU communicator, interleaved into garbage;
    the launcher leaves them out unless --verbose."""
    out, _ = _driver_run("exit").communicate(timeout=240)
    assert sorted(line for line in out.splitlines() if line.startswith("ready")) == ["ready 0 4", "ready 1 4"], out
    assert "Gloo" not in out and "peer ranks" not in out, out
    verbose, _ = _driver_run("exit", "--verbose").communicate(timeout=240)
    assert "[Gloo] Rank 0 is connected to" in verbose        # the run above did set up gloo communicators


def test_sigterm_stops_a_two_process_run_at_once_in_one_line_each():
    """Regression (issue 16 item 10): JAX's preemption notifier took SIGTERM (logged it, stopped nothing), so the
    launcher's stop cost its whole grace period, then SIGKILL, and the process said nothing; process 1 then
    aborted with JAX's C++ stack when process 0 went. Now each process says it was stopped and ends at once,
    even while its main thread waits inside JAX (where Python runs no signal handler), process 0 last."""
    proc = _driver_run("block", "--grace", "30")
    lines = []
    try:
        while len([line for line in lines if line.startswith("ready")]) < 2:
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        time.sleep(1.0)          # both wait inside the coordination service's get now
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines) + out
    assert took < 10, f"took {took:.1f} s (the grace period is 30 s)\n{out}"
    assert proc.returncode == 128 + signal.SIGTERM, out
    errors = sorted(line for line in out.splitlines() if line.startswith("error:"))
    assert errors == ["error: process 0 of 2: stopped by SIGTERM", "error: process 1 of 2: stopped by SIGTERM"], out
    assert not [mark for mark in CPP_ABORT_MARKS if mark in out], out


def test_tpu_pod_dry_run():
    env = {**CLEAN_ENV, "DRY_RUN": "1", "PROJECT": "my-project", "TOPOLOGY": "v5e:4x4"}
    serve = ["python3", "-m", "experiments.serve", "--config=configs/serve.py", "--config.deployment.colocated.tp=4",
             "--workdir=/tmp/a b"]
    out = subprocess.run(["bash", str(REPO / "launch" / "tpu_pod.sh"), "my-tpu", "us-west4-a", *serve], env=env,
                         capture_output=True, text=True, check=True)
    check, launch = out.stdout.splitlines()
    assert shlex.split(check) == ["python3", "-m", "experiments.aot_compile", "--topology=v5e:4x4",
                                  "--config=configs/serve.py", "--config.deployment.colocated.tp=4"]
    assert shlex.split(launch) == [
        "gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-tpu", "--zone=us-west4-a", "--worker=all",
        "--command=cd pdjax && python3 -m experiments.serve --config=configs/serve.py "
        "--config.deployment.colocated.tp=4 --workdir=/tmp/a\\ b", "--project=my-project"]
    del env["TOPOLOGY"]
    refused = subprocess.run(["bash", str(REPO / "launch" / "tpu_pod.sh"), "my-tpu", "us-west4-a", *serve], env=env,
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "set TOPOLOGY" in refused.stderr and not refused.stdout
    skipped = subprocess.run(["bash", str(REPO / "launch" / "tpu_pod.sh"), "my-tpu", "us-west4-a", *serve],
                             env={**env, "SKIP_AOT": "1"}, capture_output=True, text=True, check=True)
    assert len(skipped.stdout.splitlines()) == 1 and skipped.stdout.startswith("gcloud")
    bad = subprocess.run(["bash", str(REPO / "launch" / "tpu_pod.sh"), "my-tpu"], env=env, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "usage:" in bad.stderr


def test_slurm_dry_run():
    sbatch = str(REPO / "launch" / "slurm.sbatch")
    env = {**CLEAN_ENV, "DRY_RUN": "1", "SLURM_JOB_NODELIST": "gpu[07-08],gpu11", "SLURM_JOB_NUM_NODES": "3",
           "PATH": "/usr/bin:/bin"}    # no scontrol: the script's own node-list parsing
    out = subprocess.run(["bash", sbatch, "python3", "-m", "experiments.serve", "--workdir=/w"], env=env,
                         capture_output=True, text=True, check=True)
    assert shlex.split(out.stdout) == [
        "srun", "--ntasks=3", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        "--export=ALL,JAX_COORDINATOR_ADDRESS=gpu07:62345,JAX_NUM_PROCESSES=3",
        "bash", "-c", 'export JAX_PROCESS_ID=$SLURM_PROCID; exec "$@"', "pdjax-task",
        "python3", "-m", "experiments.serve", "--workdir=/w"]
    env.update(SLURM_JOB_NODELIST="node5", SLURM_JOB_NUM_NODES="2", PROCS_PER_NODE="4", JAX_PORT="7000")
    out = subprocess.run(["bash", sbatch, "true"], env=env, capture_output=True, text=True, check=True)
    words = shlex.split(out.stdout)
    assert words[1:3] == ["--ntasks=8", "--ntasks-per-node=4"]
    assert words[4] == "--export=ALL,JAX_COORDINATOR_ADDRESS=node5:7000,JAX_NUM_PROCESSES=8"
    assert words[7] == 'export JAX_PROCESS_ID=$SLURM_PROCID; export CUDA_VISIBLE_DEVICES=$SLURM_LOCALID; exec "$@"'
    checked = subprocess.run(["bash", sbatch, "python3", "-m", "experiments.serve", "--config.model.dtype=bfloat16"],
                             env={**env, "TOPOLOGY": "v6e:2x4"}, capture_output=True, text=True, check=True)
    assert shlex.split(checked.stdout.splitlines()[0]) == ["python3", "-m", "experiments.aot_compile",
                                                           "--topology=v6e:2x4", "--config.model.dtype=bfloat16"]
    del env["SLURM_JOB_NODELIST"]
    bad = subprocess.run(["bash", sbatch, "true"], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "not inside a SLURM allocation" in bad.stderr


def test_local_launch_on_a_port_in_use_names_the_port():
    """issue 27: on a port in use the launcher waited and said "Failed to start RPC server" without the port."""
    import socket
    with socket.socket(socket.AF_INET) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, str(REPO / "launch" / "local.py"), "-n", "2", "--port", str(port), "--",
                              sys.executable, "-c", "pass"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"--port={port} is in use on 127.0.0.1" in out.stderr, out.stderr
