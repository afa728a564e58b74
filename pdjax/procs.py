"""Process helpers shared by the launchers, the multi-process runs, the process pools and the tests (no JAX).

- Local multi-controller runs (launch/local.py, the multi-process tests and benchmarks): `free_port`,
  `local_process_env` (the jax.distributed environment of process i of n on this machine, CPU devices),
  `start_local_processes`, `wait_processes` (until all exited 0, one failed, or a timeout), `end_processes`
  (SIGTERM each process group, SIGKILL after a grace period), `forward_lines` (pass a process's output through,
  dropping lines that match, e.g. gloo's connection chatter).
- Worker pools whose workers die with the process that started them, even when it is SIGKILLed: `die_with_parent`
  (the pool initializer: prctl PR_SET_PDEATHSIG on Linux plus a thread polling the parent pid), `process_pool`,
  and `stop_pool` (an interrupted pool terminates its workers instead of waiting for the tasks in flight). Their
  one start-method rule is `start_method`.
- Mapping a function over items: `parallel_map(fn, items, workers=..., executor='local' | 'ray')`, results in the
  items' order, `done(i, result)` as each ends, errors raised (the workers stopped at once) or returned; a
  `WorkerPool` keeps local workers across several maps (the rounds of a capacity search). The Ray side:
  `ray_session` (join the cluster at an address, checked by `check_ray_address`, or start a local one) and, per
  task, Ray options and retries of tasks whose worker died.
- Ending at once: `exit_now(code)` runs the hooks registered with `on_exit_now` (a multi-process run's process 0
  waits there for its peers to leave: pdjax.serving.distributed), then `os._exit` (no interpreter shutdown).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import IO, Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence

# ------------------------------------------------------------------------------------------------ local runs


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now ('[::1]'-style IPv6 hosts too)."""
    family = socket.AF_INET6 if host.startswith("[") or ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.bind((host.strip("[]"), 0))
        return sock.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a TCP server could bind `port` on `host` now."""
    with socket.socket(socket.AF_INET) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


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


def start_method(fresh: bool = False) -> str:
    """The one start-method rule of pdjax's worker processes: 'fork' (fast; the simulator holds no threads),
    unless JAX is loaded here (its threads can deadlock a forked child) or the work itself runs JAX (`fresh`: a
    sweep's real-engine point, which must start from a clean interpreter): then 'spawn'."""
    return "spawn" if fresh or "jax" in sys.modules else "fork"


def process_pool(max_workers: int, *, fresh: bool = False) -> concurrent.futures.ProcessPoolExecutor:
    """A ProcessPoolExecutor (start method: `start_method(fresh)`) whose workers die with this process
    (`die_with_parent`)."""
    return concurrent.futures.ProcessPoolExecutor(max_workers=max_workers,
                                                  mp_context=multiprocessing.get_context(start_method(fresh)),
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


# ------------------------------------------------------------------------------------------------ parallel map
EXECUTORS = ("local", "ray")
Done = Callable[[int, Any], None]


def format_error(error: BaseException) -> str:
    """The traceback text of `error` (as traceback.format_exc() prints it inside its except block)."""
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


class WorkerPool:
    """Local worker processes kept across several `map` calls (e.g. the rounds of a capacity search); `workers`
    <= 1: each map runs in this process. The processes start at the first map of more than one item and die
    with this process (`process_pool`); use as a context manager, or call `close` (abort=True: terminate the
    workers instead of waiting for their tasks)."""

    def __init__(self, workers: int, *, fresh: bool = False):
        self.workers, self.fresh = workers, fresh
        self._pool: Optional[concurrent.futures.ProcessPoolExecutor] = None

    def map(self, fn: Callable, items: Sequence, *, done: Optional[Done] = None,
            return_exceptions: bool = False) -> List[Any]:
        """[fn(x) for x in items], in the items' order; done(i, result) as each ends (in the order they end).
        An Exception raised by fn (or a worker that died: BrokenProcessPool) is raised, after the workers are
        terminated, unless `return_exceptions`: then it is the item's result. Anything that interrupts the map
        (Ctrl-C, SystemExit) terminates the workers too."""
        items = list(items)
        if self.workers <= 1 or len(items) <= 1:
            return _map_here(fn, items, done, return_exceptions)
        if self._pool is None:
            self._pool = process_pool(self.workers, fresh=self.fresh)
        try:
            futures = {self._pool.submit(fn, item): i for i, item in enumerate(items)}
            out: List[Any] = [None] * len(items)
            for future in concurrent.futures.as_completed(futures):
                try:
                    result = future.result()
                except Exception as e:  # noqa: BLE001  (raised, or returned, by _settle)
                    result = e
                _settle(out, futures[future], result, done, return_exceptions)
            return out
        except BaseException:   # an error, Ctrl-C or SystemExit: stop the tasks in flight, do not wait for them
            self.close(abort=True)
            raise

    def close(self, abort: bool = False) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            stop_pool(pool, abort=abort)

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(abort=exc_type is not None)


def _settle(out: List[Any], i: int, result: Any, done: Optional[Done], return_exceptions: bool) -> None:
    """Item i ended with `result` (an Exception when it failed): raise that unless return_exceptions, else keep
    it as out[i] and tell `done`."""
    if isinstance(result, Exception) and not return_exceptions:
        raise result
    out[i] = result
    if done is not None:
        done(i, result)


def _map_here(fn: Callable, items: Sequence, done: Optional[Done], return_exceptions: bool) -> List[Any]:
    out: List[Any] = [None] * len(items)
    for i, item in enumerate(items):
        try:
            result = fn(item)
        except Exception as e:  # noqa: BLE001  (raised, or returned, by _settle)
            result = e
        _settle(out, i, result, done, return_exceptions)
    return out


def parallel_map(fn: Callable, items: Sequence, *, workers: int = 1, executor: str = "local",
                 ray_address: Optional[str] = "", done: Optional[Done] = None, return_exceptions: bool = False,
                 fresh: bool = False, task_options: Optional[Callable[[Any], Mapping[str, Any]]] = None,
                 retries: int = 3, on_retry: Optional[Callable[[int, BaseException, int], None]] = None,
                 log: Optional[Callable[[str], None]] = None) -> List[Any]:
    """[fn(x) for x in items] in the items' order, with done(i, result) called as each ends; errors: see
    WorkerPool.map (raised, the rest stopped, or with `return_exceptions` returned as the item's result).

    executor='local': on min(workers, len(items)) processes of this machine (`WorkerPool`; `fresh`: spawned,
    see `start_method`), or in this process when workers <= 1 or there is one item.
    executor='ray' (or a `ray_address`): each item a Ray task in `ray_session(ray_address, workers)`; fn must be
    picklable by Ray (a module-level function of an installed module). `task_options(item)`: the task's Ray
    options (default 1 CPU; a 'max_calls' entry picks a remote function with that max_calls, e.g. 1 for a fresh
    worker per task). A task whose worker died (`worker_died`) is resubmitted up to `retries` times (3, as Ray
    does by default), calling on_retry(i, error, attempt) first; interrupted, the tasks still running are
    cancelled."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor={executor!r}, expected one of {EXECUTORS}")
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers={workers!r}, expected a positive int")
    items = list(items)
    if executor == "ray" or ray_address:
        return _map_ray(fn, items, workers=workers, address=ray_address or "", done=done,
                        return_exceptions=return_exceptions, task_options=task_options, retries=retries,
                        on_retry=on_retry, log=log)
    with WorkerPool(min(workers, len(items)), fresh=fresh) as pool:
        return pool.map(fn, items, done=done, return_exceptions=return_exceptions)


# ------------------------------------------------------------------------------------------------ Ray
RAY_CONNECT_TIMEOUT_S = 10.0
RAY_MISSING = "executor 'ray' needs Ray: pip install -e '.[cluster]'"
_WORKER_DIED = ("WorkerCrashedError", "NodeDiedError", "OutOfMemoryError", "LocalRayletDiedError",
                "ObjectLostError", "OwnerDiedError", "RaySystemError", "ActorDiedError")


def import_ray():
    """The ray module; ValueError (RAY_MISSING) when the optional cluster extra is not installed."""
    try:
        import ray  # noqa: PLC0415 (optional cluster extra)
    except ImportError:
        raise ValueError(RAY_MISSING) from None
    return ray


def check_ray_address(address: str, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """Fail at once on a Ray address that nothing listens at (ray.init retries an unreachable one forever, with a
    warning every ~40 s): a TCP connection to HOST:PORT must open within `timeout_s`. 'auto' and 'local' (Ray
    finds or starts the cluster itself) pass. Raises ValueError naming the address and the problem."""
    if address in ("auto", "local"):
        return
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"ray_address={address!r}, expected HOST:PORT of a Ray cluster's head, 'auto', or none "
                         "(a local cluster is started)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(f"ray_address={address!r}: no Ray cluster answers there ({e.strerror or e}); expected the "
                         "address of a running cluster's head (ray start --head prints it), or none (a local "
                         "cluster is started)") from None


def first_line(error: BaseException) -> str:
    """The first non-blank line of str(error) (its type's name if none), at most 200 characters."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    line = lines[0] if lines else type(error).__name__
    return line if len(line) <= 200 else line[:197] + "..."


@contextlib.contextmanager
def ray_session(address: Optional[str] = "", num_cpus: Optional[int] = None,
                log: Optional[Callable[[str], None]] = None) -> Iterator[Any]:
    """The ray module, initialized: as the caller initialized it, else joined to the cluster at `address`
    (checked first: `check_ray_address`), else a local cluster of `num_cpus` CPUs (None: all) is started; what
    this call started it shuts down at the end. log(line) says what was joined or started and how long it took."""
    ray = import_ray()
    started = not ray.is_initialized()
    if started:
        if address:
            check_ray_address(address)
        t0 = time.perf_counter()
        kwargs = {"address": address} if address else {"num_cpus": num_cpus, "include_dashboard": False}
        try:
            ray.init(logging_level="WARNING", **kwargs)
        except ConnectionError as e:    # e.g. 'auto' with no cluster running here
            raise ValueError(f"ray_address={address!r}: {first_line(e)}") from None
        if log is not None:
            log(f"Ray {'cluster ' + address + ' joined' if address else 'local cluster started'} in "
                f"{time.perf_counter() - t0:.1f} s")
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


def worker_died(error: BaseException) -> bool:
    """A Ray task's error says its worker process (or node) died, not that the task raised."""
    return type(error).__name__ in _WORKER_DIED


def _call(fn, item):
    return fn(item)


def _map_ray(fn: Callable, items: Sequence, *, workers: int, address: str, done: Optional[Done],
             return_exceptions: bool, task_options, retries: int, on_retry, log) -> List[Any]:
    with ray_session(address, max(1, workers), log) as ray:
        remotes: Dict[int, Any] = {}
        pending: Dict[Any, Any] = {}

        def submit(i: int, attempt: int) -> None:
            options = dict(task_options(items[i])) if task_options is not None else {"num_cpus": 1}
            max_calls = int(options.pop("max_calls", 0))
            if max_calls not in remotes:
                remotes[max_calls] = ray.remote(max_calls=max_calls)(_call) if max_calls else ray.remote(_call)
            ref = remotes[max_calls].options(max_retries=0, retry_exceptions=False, **options).remote(fn, items[i])
            pending[ref] = (i, attempt)

        out: List[Any] = [None] * len(items)
        try:
            for i in range(len(items)):
                submit(i, 0)
            while pending:
                (ref,), _ = ray.wait(list(pending), num_returns=1)
                i, attempt = pending.pop(ref)
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayError as e:
                    if worker_died(e) and attempt < retries:
                        if on_retry is not None:
                            on_retry(i, e, attempt)
                        submit(i, attempt + 1)
                        continue
                    result = e
                _settle(out, i, result, done, return_exceptions)
            return out
        except BaseException:   # an error, Ctrl-C or SystemExit (SIGTERM): stop the tasks still running
            for ref in pending:
                try:
                    ray.cancel(ref, force=True)
                except Exception:  # noqa: BLE001  (finished or gone meanwhile)
                    pass
            raise


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
