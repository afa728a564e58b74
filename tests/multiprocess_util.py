"""Starting N processes of one command on localhost as launch/local.py does (pdjax.procs: the jax.distributed env,
CPU devices per process), each logging to tmp_path/p{i}.log, bounded by a timeout and SIGKILLed at the end. Shared by
the multi-process tests."""
import os
import pathlib

from pdjax.procs import end_processes, free_port, local_process_env, start_local_processes, wait_processes

REPO = pathlib.Path(__file__).resolve().parent.parent
BASE_ENV = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}
RUN_TIMEOUT = 240

__all__ = ["BASE_ENV", "REPO", "RUN_TIMEOUT", "end_processes", "free_port", "local_process_env", "logs", "run_all",
           "start"]


def start(cmd, n, tmp_path, devices=4):
    """N processes of `cmd` (a shared coordinator port), logs in tmp_path."""
    outputs = [open(tmp_path / f"p{i}.log", "w") for i in range(n)]
    return start_local_processes(cmd, n, devices, free_port(), base_env=BASE_ENV, cwd=REPO, outputs=outputs)


def logs(tmp_path, n, tail=3000):
    """The last `tail` characters of each process's log."""
    return [(tmp_path / f"p{i}.log").read_text()[-tail:] for i in range(n)]


def run_all(cmd, n, tmp_path, timeout=RUN_TIMEOUT, devices=4):
    """start(), wait until all exit (or one fails, or the timeout), end them; assert every exit code is 0."""
    procs = start(cmd, n, tmp_path, devices)
    try:
        codes = wait_processes(procs, timeout, poll_s=0.2)
    finally:
        end_processes(procs, 0.0)
    assert codes == [0] * n, f"exit codes {codes}\n" + "\n----\n".join(logs(tmp_path, n))


# A small multi-process program on pdjax.serving.distributed (no model): initialize (watchdog, SIGTERM handler),
# one cross-process collective (gloo connects: its "[Gloo] Rank ..." lines), "ready <id>", then by argv[1]:
# "exit" ends normally; "block" waits inside JAX (a coordination-service get nobody answers), where Python runs
# no signal handler; "fail1" makes process 1 fail as a step would (end_after_failure).
DRIVER = r"""
import os, sys
from pdjax.serving import distributed
settings = distributed.settings_from_env(timeout_s=float(os.environ.get("PDJAX_TEST_TIMEOUT_S", "20")))
distributed.initialize(settings)
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("x",))
x = jax.device_put(np.ones(jax.device_count(), np.float32), NamedSharding(mesh, P("x")))
total = float(jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))(x))
print(f"ready {settings.process_id} {total:g}", flush=True)
mode = sys.argv[1]
try:
    if mode == "block":
        from jax._src import distributed as jax_distributed
        jax_distributed.global_state.client.blocking_key_value_get("never/set", 600_000)
    if mode == "fail1" and settings.process_id == 1:
        raise RuntimeError("boom in process 1")
    if mode == "fail1":
        jax.jit(lambda a: a * 2, out_shardings=NamedSharding(mesh, P()))(x).block_until_ready()
        import time; time.sleep(120)
except Exception as e:
    distributed.end_after_failure(e)
"""

# What JAX's coordination client prints when it aborts the process (the ~60-line C++ report).
CPP_ABORT_MARKS = ("Check failure stack trace", "Terminating process because the JAX distributed service",
                   "Fatal Python error", "preemption_notifier", "SIGTERM caught")
