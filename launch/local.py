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
Output of the processes is passed through (process 0 is the one that writes results): stderr as it is, stdout line by
line without gloo's "[Gloo] Rank ... is connected to ..." lines (printed to stdout by its C++ side at every CPU
communicator's set-up, with no setting to turn them off); --verbose keeps them.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import signal
import sys
from typing import Dict, List, Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))   # this checkout's pdjax, run as a script
from pdjax.procs import (end_processes, forward_lines, free_port, local_process_env, port_is_free,
                         start_local_processes, wait_processes)


def is_gloo_chatter(line: bytes) -> bool:
    """gloo's (CPU collectives) "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer
    ranks is : 1", printed to stdout at every communicator's set-up, unconditionally (a std::cout line, no log
    level); the communicators of one process set up at once, so their lines come cut and mixed ("[Gloo] Rank
    [Gloo] Rank 2 is connected ...", "3 is connected to ...")."""
    return line.startswith(b"[Gloo]") or b"Expected number of connected peer ranks" in line


def command_lines(command: Sequence[str], n: int, port: int, devices: int, base: Dict[str, str]) -> List[str]:
    return [" ".join(f"{k}={shlex.quote(v)}" for k, v in local_process_env(base, i, n, port, devices).items()) + " "
            + shlex.join(command) for i in range(n)]


def launch(command: Sequence[str], n: int, port: int, devices: int, timeout: float, grace: float,
           verbose: bool = False) -> int:
    procs: List = []
    forwarders: List = []

    def on_signal(signum, frame):
        del frame
        raise SystemExit(128 + signum)

    def drain():      # the processes' last lines before ours
        for t in forwarders:
            t.join(timeout=5.0)

    signal.signal(signal.SIGTERM, on_signal)
    try:
        procs.extend(start_local_processes(command, n, devices, port, base_env=dict(os.environ), pipe=True))
        drop = (lambda line: False) if verbose else is_gloo_chatter
        forwarders.extend(forward_lines(p.stdout, sys.stdout.buffer, drop) for p in procs)
        codes = wait_processes(procs, timeout)
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i, code = failed[0]
            end_processes(procs, grace)
            drain()
            print(f"launch/local.py: process {i} of {n} exited with status {code}; ended the others",
                  file=sys.stderr)
            return code if 0 < code < 256 else 1
        if all(c == 0 for c in codes):
            drain()
            return 0
        running = [i for i, c in enumerate(codes) if c is None]
        end_processes(procs, grace)
        drain()
        print(f"launch/local.py: timed out after {timeout:g} s; ended processes {running}", file=sys.stderr)
        return 124
    except BaseException:
        end_processes(procs, grace)
        drain()
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
    p.add_argument("-v", "--verbose", action="store_true", help="pass every output line through (also gloo's "
                   "'[Gloo] Rank ... is connected to ...' lines, left out by default)")
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
    if args.port and not args.dry_run and not port_is_free(port):
        p.error(f"--port={port} is in use on 127.0.0.1 (the coordinator would fail to start its RPC server); "
                f"give another, or --port=0 for a free one")
    if args.dry_run:
        print("\n".join(command_lines(command, args.num_processes, port, args.devices_per_process,
                                      dict(os.environ))))
        return 0
    return launch(command, args.num_processes, port, args.devices_per_process, args.timeout, args.grace,
                  args.verbose)


if __name__ == "__main__":
    sys.exit(main())
