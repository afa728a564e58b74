#!/usr/bin/env python3
"""Run one command as N cooperating JAX processes on this machine (multi-controller JAX, CPU devices).

    python3 launch/local.py -n 2 [--devices_per_process 4] [--port PORT] [--timeout 600] [--dry_run] \
        -- python3 -m experiments.serve --config=configs/serve.py --workdir=/tmp/serve2

Process i gets, on top of this environment:
    JAX_PLATFORMS=cpu
    XLA_FLAGS=<yours> --xla_force_host_platform_device_count=<devices_per_process>
    JAX_COORDINATOR_ADDRESS=127.0.0.1:<port>   JAX_NUM_PROCESSES=<n>   JAX_PROCESS_ID=<i>
which jax.distributed.initialize() reads, so every process sees n x devices_per_process global devices. The
launcher waits for all of them. When one exits non-zero the others are terminated (SIGTERM, SIGKILL after
--grace seconds) and the launcher exits with that status, naming the process; after --timeout seconds all are
ended and it exits 124. Ctrl-C / SIGTERM of the launcher ends them too. Each process runs in its own session, so
its children go with it. --dry_run prints the N command lines (environment assignments + the command) instead.
Output of the processes is passed through as it is (process 0 is the one that writes results).
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(base: Dict[str, str], i: int, n: int, port: int, devices: int) -> Dict[str, str]:
    """The variables process i of n gets on top of `base` (only the changed ones)."""
    xla = base.get("XLA_FLAGS", "")
    xla = " ".join(f for f in xla.split() if not f.startswith("--xla_force_host_platform_device_count"))
    return {"JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"{xla} --xla_force_host_platform_device_count={devices}".strip(),
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(n), "JAX_PROCESS_ID": str(i)}


def command_lines(command: Sequence[str], n: int, port: int, devices: int, base: Dict[str, str]) -> List[str]:
    return [" ".join(f"{k}={shlex.quote(v)}" for k, v in process_env(base, i, n, port, devices).items()) + " "
            + shlex.join(command) for i in range(n)]


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


def wait_processes(procs: Sequence[subprocess.Popen], timeout: float, poll_s: float = 0.05) -> List[Optional[int]]:
    """Wait until every process exited 0, one exited non-zero, or `timeout` seconds passed; the exit codes then
    (None: still running). Ends nothing: pair with end_processes."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes) or time.monotonic() > deadline:
            return codes
        time.sleep(poll_s)


def launch(command: Sequence[str], n: int, port: int, devices: int, timeout: float, grace: float) -> int:
    procs: List[subprocess.Popen] = []

    def on_signal(signum, frame):
        del frame
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    try:
        for i in range(n):
            env = {**os.environ, **process_env(dict(os.environ), i, n, port, devices)}
            procs.append(subprocess.Popen(list(command), env=env, start_new_session=True))
        codes = wait_processes(procs, timeout)
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i, code = failed[0]
            end_processes(procs, grace)
            print(f"launch/local.py: process {i} of {n} exited with status {code}; ended the others",
                  file=sys.stderr)
            return code if 0 < code < 256 else 1
        if all(c == 0 for c in codes):
            return 0
        running = [i for i, c in enumerate(codes) if c is None]
        end_processes(procs, grace)
        print(f"launch/local.py: timed out after {timeout:g} s; ended processes {running}", file=sys.stderr)
        return 124
    except BaseException:
        end_processes(procs, grace)
        raise


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="launch/local.py", description=__doc__.split("\n")[0],
                                usage="%(prog)s -n N [options] -- COMMAND...")
    p.add_argument("-n", "--num_processes", type=int, required=True)
    p.add_argument("--devices_per_process", type=int, default=1, help="CPU devices each process gets")
    p.add_argument("--port", type=int, default=0, help="coordinator port on 127.0.0.1 (0: a free one)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before every process is ended")
    p.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--dry_run", action="store_true", help="print the command lines, run nothing")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command every process runs (after --)")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command given (put it after --)")
    for name in ("num_processes", "devices_per_process"):
        if getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)}, expected >= 1")
    if not 0 <= args.port < 65536:
        p.error(f"--port={args.port}, expected 0..65535")
    if args.timeout <= 0:
        p.error(f"--timeout={args.timeout}, expected > 0")
    port = args.port or free_port()
    if args.dry_run:
        print("\n".join(command_lines(command, args.num_processes, port, args.devices_per_process,
                                      dict(os.environ))))
        return 0
    return launch(command, args.num_processes, port, args.devices_per_process, args.timeout, args.grace)


if __name__ == "__main__":
    sys.exit(main())
