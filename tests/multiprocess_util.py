"""Starting N processes of one command on localhost as launch/local.py does (the jax.distributed env, CPU devices
per process), each logging to tmp_path/p{i}.log, bounded by a timeout and SIGKILLed at the end. Shared by the
multi-process tests."""
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "launch"))
from local import end_processes, free_port, process_env, wait_processes  # noqa: E402

BASE_ENV = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}
RUN_TIMEOUT = 240


def start(cmd, n, tmp_path, devices=4):
    """N processes of `cmd` (a shared coordinator port), logs in tmp_path."""
    port = free_port()
    procs = []
    for i in range(n):
        env = {**BASE_ENV, **process_env(BASE_ENV, i, n, port, devices)}
        log = open(tmp_path / f"p{i}.log", "w")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return procs


def run_all(cmd, n, tmp_path, timeout=RUN_TIMEOUT, devices=4):
    """start(), wait until all exit (or one fails, or the timeout), end them; assert every exit code is 0."""
    procs = start(cmd, n, tmp_path, devices)
    try:
        codes = wait_processes(procs, timeout, poll_s=0.2)
    finally:
        end_processes(procs, 0.0)
    logs = [(tmp_path / f"p{i}.log").read_text()[-3000:] for i in range(n)]
    assert codes == [0] * n, f"exit codes {codes}\n" + "\n----\n".join(logs)
