"""A killed parallel sweep leaves no worker behind (SIGKILL and SIGTERM of the sweep process), on the simulator
backend through the real entry point (`python -m experiments.sweep`)."""
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _children(pid):
    """Live (not zombie) processes whose parent is `pid`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def _finished_points(workdir):
    if not os.path.isdir(workdir):
        return set()
    return {d for d in os.listdir(workdir) if os.path.isdir(os.path.join(workdir, d)) and ".partial-" not in d}


def _start_sweep(workdir):
    cmd = [sys.executable, "-m", "experiments.sweep", "--config=configs/sweeps/budget.py:sim",
           "--config.base.workload.num_requests=3000", "--parallel=2", f"--workdir={workdir}"]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_for_running_point(proc, workdir, timeout_s=120):
    """Wait until both workers are up and one is inside a point (a .partial- directory exists)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the sweep ended before a point was running"
        if os.path.isdir(workdir) and any(".partial-" in d for d in os.listdir(workdir)):
            workers = _children(proc.pid)
            if len(workers) >= 2:
                return workers
        time.sleep(0.05)
    raise AssertionError("no point started in time")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_parallel_sweep_leaves_no_workers(tmp_path, sig):
    workdir = str(tmp_path / "sweep")
    proc = _start_sweep(workdir)
    workers = []
    try:
        workers = _wait_for_running_point(proc, workdir)
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(w) for w in workers):
            time.sleep(0.05)
        assert not [w for w in workers if _alive(w)], "sweep workers outlived the killed sweep"
        done = _finished_points(workdir)
        time.sleep(4)     # a point takes ~2-4 s here: an orphan would finish one and rename it by now
        assert _finished_points(workdir) == done
    finally:
        if proc.poll() is None:
            proc.kill()
        for w in workers:     # on failure, do not leave the orphans of this test running
            if _alive(w):
                os.kill(w, signal.SIGKILL)


CAPACITY_SCRIPT = """
import time
from pdjax.sim.capacity import parallel_capacity_search

def slow_probe(rate):
    time.sleep(120)
    return {}

parallel_capacity_search(slow_probe, 1.0, 2.0, limits={"tbt.p99": 0.1}, parallel=2)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_killed_capacity_search_leaves_no_workers():
    proc = subprocess.Popen([sys.executable, "-c", CAPACITY_SCRIPT], cwd=REPO)
    workers = []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None
            time.sleep(0.05)
            workers = _children(proc.pid)
        assert len(workers) == 2
        time.sleep(0.5)       # let the workers take their probes
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_alive(w) for w in workers):
            time.sleep(0.05)
        assert not [w for w in workers if _alive(w)], "capacity-search workers outlived the killed search"
    finally:
        if proc.poll() is None:
            proc.kill()
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
