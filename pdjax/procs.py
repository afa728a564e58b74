"""Process helpers shared by the launchers, the multi-process runs, the process pools and the tests (no JAX).

- Local multi-controller runs (launch/local.py, the multi-process tests and benchmarks): `free_port`,
  `local_process_env` (the jax.distributed environment of process i of n on this machine, CPU devices),
  `start_local_processes`, `wait_processes` (until all exited 0, one failed, or a timeout), `end_processes`
  (SIGTERM each process group, SIGKILL after a grace period), `forward_lines` (pass a process's output through,
  dropping lines that match, e.g. gloo's connection chatter).
- Worker pools whose workers die with the process that started them, even when it is SIGKILLed: `die_with_parent`
  (the pool initializer: prctl PR_SET_PDEATHSIG on Linux plus a thread polling the parent pid), `process_pool`,
  and `stop_pool` (an interrupted pool terminates its workers instead of waiting for the tasks in flight).
- Ending at once: `exit_now(code)` runs the hooks registered with `on_exit_now` (a multi-process run's process 0
  waits there for its peers to leave: pdjax.serving.distributed), then `os._exit` (no interpreter shutdown).
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Dict, List, Optional, Sequence

# ------------------------------------------------------------------------------------------------ local runs


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now ('[::1]'-style IPv6 hosts too)."""
    family = socket.AF_INET6 if host.startswith("[") or ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.bind((host.strip("[]"), 0))
        return sock.getsockname()[1]


def local_process_env(base: Dict[str, str], i: int, n: int, port: int, devices: int) -> Dict[str, str]:
    """The variables process i of n on this machine gets on top of `base` (only the changed ones): CPU platform,
    `devices` host devices (replacing any device count in base's XLA_FLAGS), the coordinator on 127.0.0.1:port."""
    xla = base.get("XLA_FLAGS", "")
    xla = " ".join(f for f in xla.split() if not f.startswith("--xla_force_host_platform_device_count"))
    return {"JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"{xla} --xla_force_host_platform_device_count={devices}".strip(),
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(n), "JAX_PROCESS_ID": str(i)}


def start_local_processes(command: Sequence[str], n: int, devices: int, port: int, *, base_env: Dict[str, str],
                          cwd: Optional[str] = None, outputs: Optional[Sequence[IO]] = None,
                          pipe: bool = False) -> List[subprocess.Popen]:
    """n processes of `command`, process i with `local_process_env(base_env, i, ...)`, each in its own session
    (its children end with it: `end_processes`). Output: into outputs[i] (stdout and stderr), or stdout into a
    pipe when `pipe` (read it with `forward_lines`; stderr inherited), else inherited."""
    procs = []
    try:
        for i in range(n):
            env = {**base_env, **local_process_env(base_env, i, n, port, devices)}
            if outputs is not None:
                streams = {"stdout": outputs[i], "stderr": subprocess.STDOUT}
            elif pipe:
                streams = {"stdout": subprocess.PIPE}
            else:
                streams = {}
            procs.append(subprocess.Popen(list(command), cwd=cwd, env=env, start_new_session=True, **streams))
    except BaseException:
        end_processes(procs, 0.0)
        raise
    return procs


def wait_processes(procs: Sequence[subprocess.Popen], timeout: float, poll_s: float = 0.05) -> List[Optional[int]]:
    """Wait until every process exited 0, one exited non-zero, or `timeout` seconds passed; the exit codes then
    (None: still running). Ends nothing: pair with end_processes."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes) or time.monotonic() > deadline:
            return codes
        time.sleep(poll_s)


def end_processes(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM every live process group, then SIGKILL what is left after `grace` seconds."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in live):
        time.sleep(0.05)
    for p in live:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


def forward_lines(source: IO[bytes], sink: IO[bytes],
                  drop: Callable[[bytes], bool] = lambda line: False) -> threading.Thread:
    """A started daemon thread copying `source` to `sink` line by line (flushed per line), leaving out the lines
    for which `drop(line)`; it ends at the source's end of file (join it to drain)."""
    def copy():
        with source:
            for line in iter(source.readline, b""):
                if not drop(line):
                    sink.write(line)
                    sink.flush()
    thread = threading.Thread(target=copy, daemon=True, name="forward-lines")
    thread.start()
    return thread


# ------------------------------------------------------------------------------------------------ worker pools
_PR_SET_PDEATHSIG = 1          # linux/prctl.h


def _watch_parent(parent_pid: int, interval_s: float) -> None:
    while True:
        time.sleep(interval_s)
        if os.getppid() != parent_pid:      # reparented: the parent is gone
            os._exit(1)


def die_with_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Pool-worker initializer: end this process as soon as `parent_pid` (the process that started the pool)
    dies, however it dies. On Linux the kernel sends SIGKILL at the parent's death (PR_SET_PDEATHSIG; the pool
    must be used from the thread that created it, as here); everywhere, a daemon thread polls the parent pid.
    SIGINT is ignored: on Ctrl-C (sent to the whole process group) the parent decides and stops its workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:          # the parent died before the line above took effect
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid, interval_s), daemon=True,
                     name="die-with-parent").start()


def process_pool(max_workers: int, method: str) -> concurrent.futures.ProcessPoolExecutor:
    """A ProcessPoolExecutor (start method `method`) whose workers die with this process (`die_with_parent`)."""
    return concurrent.futures.ProcessPoolExecutor(max_workers=max_workers,
                                                  mp_context=multiprocessing.get_context(method),
                                                  initializer=die_with_parent, initargs=(os.getpid(),))


def stop_pool(pool: concurrent.futures.ProcessPoolExecutor, *, abort: bool, grace_s: float = 5.0) -> None:
    """Shut `pool` down: wait for its work when not `abort`; else cancel what has not started and terminate the
    workers (SIGTERM, then SIGKILL after grace_s) instead of waiting for the tasks in flight."""
    if not abort:
        pool.shutdown(wait=True)
        return
    procs = list((getattr(pool, "_processes", None) or {}).values())   # taken before shutdown clears it
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


# ------------------------------------------------------------------------------------------------ ending at once
_EXIT_HOOKS: List[Callable[[int], None]] = []


def on_exit_now(hook: Callable[[int], None]) -> None:
    """Run `hook(code)` in `exit_now` before the process ends (e.g. process 0 of a multi-process run waiting for
    its peers to leave first)."""
    _EXIT_HOOKS.append(hook)


def exit_now(code: int) -> None:
    """Flush stdout and stderr, run the `on_exit_now` hooks (their errors ignored), end the process with `code`
    at once (os._exit: no interpreter shutdown, whose atexit handlers and threads could hang or print after the
    line the user should see last)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001  (a closed stream: nothing to flush)
            pass
    for hook in list(_EXIT_HOOKS):
        try:
            hook(code)
        except Exception:  # noqa: BLE001  (ending either way)
            pass
    os._exit(code)
