"""pdjax.procs, the one home of the process helpers (no JAX): free ports, the local jax.distributed environment,
waiting for and ending N processes, forwarding output line by line, ending at once after the exit hooks; and that
nothing else defines or reaches them another way (launch/local.py through sys.path, private copies)."""
import io
import pathlib
import re
import socket
import subprocess
import sys
import time

import pytest

from pdjax import procs

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_free_port_is_bindable_on_ipv4_and_ipv6():
    port = procs.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        port = procs.free_port("[::1]")
    except OSError:
        pytest.skip("no IPv6 loopback")
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", port))


def test_local_process_env_sets_the_device_count_once():
    env = procs.local_process_env({"XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8"}, 1, 3,
                                  4567, 2)
    assert env == {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=2",
                   "JAX_COORDINATOR_ADDRESS": "127.0.0.1:4567", "JAX_NUM_PROCESSES": "3", "JAX_PROCESS_ID": "1"}


def test_wait_and_end_processes(tmp_path):
    cmd = [sys.executable, "-c", "import os, sys, time; i = int(os.environ['JAX_PROCESS_ID']); "
           "print(os.environ['XLA_FLAGS'], flush=True); time.sleep(0.3); sys.exit(5) if i == 1 else time.sleep(60)"]
    logs = [open(tmp_path / f"p{i}.log", "w") for i in range(2)]
    started = time.monotonic()
    ps = procs.start_local_processes(cmd, 2, 3, procs.free_port(), base_env={}, outputs=logs)
    try:
        assert procs.wait_processes(ps, 30) == [None, 5]
    finally:
        procs.end_processes(ps, 1.0)
    assert ps[0].returncode == -15 and time.monotonic() - started < 20
    assert (tmp_path / "p0.log").read_text() == "--xla_force_host_platform_device_count=3\n"


def test_forward_lines_drops_what_it_is_told_and_drains():
    sink = io.BytesIO()
    thread = procs.forward_lines(io.BytesIO(b"a\n[x] b\nc\nno newline"), sink, lambda line: line.startswith(b"[x]"))
    thread.join(5)
    assert sink.getvalue() == b"a\nc\nno newline"


def test_exit_now_runs_the_hooks_then_ends_without_interpreter_shutdown():
    code = ("import atexit; from pdjax import procs; atexit.register(lambda: print('atexit')); "
            "procs.on_exit_now(lambda c: print('hook', c)); print('before'); procs.exit_now(3)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 3 and out.stdout == "before\nhook 3\n", out


def _python_files():
    for top in ("pdjax", "experiments", "tests", "launch"):
        yield from (REPO / top).rglob("*.py")


def test_process_helpers_are_defined_once_and_nothing_reaches_launch_through_sys_path():
    """Regression (issue 17 item 7): tests/multiprocess_util.py and experiments/bench_kv_transfer.py imported
    launch/local.py through sys.path, and sim/placement.py (_die_with_parent) and serving/distributed.py
    (_free_port) kept copies of the shared helpers."""
    helper = re.compile(r"^\s*def _?(free_port|die_with_parent|wait_processes|end_processes|stop_pool|process_pool"
                        r"|parallel_map|check_ray_address|ray_session|start_method)\(", re.M)
    defined = sorted((str(p.relative_to(REPO)), m) for p in _python_files() for m in helper.findall(p.read_text()))
    assert defined == [("pdjax/procs.py", name) for name in sorted(
        ["check_ray_address", "die_with_parent", "end_processes", "free_port", "parallel_map", "process_pool",
         "ray_session", "start_method", "stop_pool", "wait_processes"])]
    reaching = [str(p.relative_to(REPO)) for p in _python_files()
                if re.search(r"sys\.path\.insert\([^\n]*[\"']launch[\"']|^\s*from local import", p.read_text(), re.M)]
    assert reaching == []


def test_procs_imports_no_jax():
    out = subprocess.run([sys.executable, "-c", "import sys, pdjax.procs; print('jax' in sys.modules)"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# ------------------------------------------------------------------------------------------------ parallel_map
def _square_or_fail(x):
    if x == 3:
        raise ValueError("three")
    time.sleep(0.05 * (5 - x))          # later items end first
    return x * x


@pytest.mark.parametrize("workers", [1, 3])
def test_parallel_map_keeps_the_items_order_and_reports_each_end(workers):
    ended = []
    out = procs.parallel_map(_square_or_fail, [0, 1, 2, 4], workers=workers, done=lambda i, r: ended.append((i, r)))
    assert out == [0, 1, 4, 16] and sorted(ended) == [(0, 0), (1, 1), (2, 4), (3, 16)]


@pytest.mark.parametrize("workers", [1, 3])
def test_parallel_map_raises_or_returns_the_errors(workers):
    with pytest.raises(ValueError, match="three"):
        procs.parallel_map(_square_or_fail, [1, 3, 4], workers=workers)
    out = procs.parallel_map(_square_or_fail, [1, 3, 4], workers=workers, return_exceptions=True)
    assert out[0] == 1 and out[2] == 16 and isinstance(out[1], ValueError)


def test_parallel_map_checks_its_options():
    with pytest.raises(ValueError, match="executor='dask'"):
        procs.parallel_map(abs, [1], executor="dask")
    with pytest.raises(ValueError, match="workers=0"):
        procs.parallel_map(abs, [1], workers=0)


def test_one_start_method_rule():
    """fork unless JAX is loaded here or the work needs a fresh interpreter; written once (pdjax.procs)."""
    assert procs.start_method(fresh=True) == "spawn"
    assert procs.start_method() == ("spawn" if "jax" in sys.modules else "fork")
    rule = re.compile(r"[\"']spawn[\"']")
    assert [str(p.relative_to(REPO)) for p in _python_files()
            if p.parts[-2] != "tests" and rule.search(p.read_text())] == ["pdjax/procs.py"]
