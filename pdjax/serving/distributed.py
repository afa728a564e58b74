"""Multi-controller runs (jax.distributed): every process runs the same program on the global device list and
takes the same scheduling decisions; process 0 owns the clock and writes the results.

Start-up (`initialize`, before any other JAX use): with num_processes > 1, CPU collectives go to gloo
(`jax_cpu_collectives_implementation`), JAX's preemption service is off (its notifier takes SIGTERM and stops
nothing), then `jax.distributed.initialize(coordinator_address, num_processes, process_id,
initialization_timeout=timeout_s, heartbeat_timeout_seconds=timeout_s)`; jax 0.10 reads only
JAX_COORDINATOR_ADDRESS from the environment, so the entry point passes the other two (defaults from
JAX_NUM_PROCESSES / JAX_PROCESS_ID, as the launchers set them). Meshes are then built from `jax.devices()`, the
global list, so a deployment's device indices may span processes. Before anything else the entry point calls
`check_same_config`: every process compares the digest of its whole resolved config with every other's, and a
difference fails every process at once with one line naming the keys (ConfigMismatchError, a UserError: exit 2).

THE RULE for identical decisions. Everything a scheduler sees is either (a) identical on every process by
construction: the request list (same config, same seed; checked once at the start with `check_same`, after
`check_same_config`), the
sampled token ids (results of the same SPMD step, replicated), or (b) a value read locally on one process, which
is then *agreed*: process 0's reading is broadcast and every process uses it instead of its own. The engines
read such values only through their Coordinator, at fixed points of the loop that every process reaches in the
same order (same program, same decisions so far, by induction):
- `now(local_elapsed)`: every clock reading of the engine loop (the time passed to `schedule(now)` and
  `update(..., now)`, the arrival admission bound `admit(t)`, token and iteration stamps). The admission of
  arrivals is a pure function of that time and the request list, so every process admits the same requests.
- `agree(value)` / `admit_count(n)`: any other local observation that steers control flow, e.g. which KV
  transfers have landed this round (`StagedKV.is_ready()` is per process: process 0's answer decides; a process
  whose own shards lag behind still computes correctly, since JAX orders the decode-side scatter after the copy
  by data dependency).
- `collect(runner, handle)` = `agree(ids, source=k)`: the sampled token ids of a runner whose output devices
  (its mesh; a pipeline's last stage) are not on every process, as process k (the lowest process holding them)
  fetched them (both engines collect through it): a process without those devices cannot read the ids, yet
  schedules the instance like everyone else. Swapped-out KV pages stay on the process holding their stage
  (pdjax.runtime.runner.host_local).
- `barrier(name)`: all processes reach `name` (coordination service barrier, not a device collective: a gloo
  collective while a transfer is in flight hung in tests).
- `wait_for_peers(name, waiting_for)`: the same for a point processes reach far apart: serving starts after
  'warmed-up' (pdjax.serving.run). On CPU, JAX's persistent compilation cache serves process 0 only (only
  process 0 writes entries, and the cache key hashes the local client's topology, so the other processes' keys
  never match its entries): process 1 may compile its warm-up for minutes after process 0 is done. Without this
  wait process 0 served meanwhile, and its first step that needed process 1 (collecting a decode step of an
  instance on process 1's devices) absorbed the whole lag (72-293 s under load), or failed after timeout_s.
  Longer than timeout_s it prints a note per timeout_s naming the process; results.json engine.peer_warmup_wait_s.
Broadcasts go through the coordination service's key-value store (`pdjax/<seq>` keys, set by process 0, read
with a blocking get by the others), never through device collectives, so they cannot interleave with the
steps' collectives. Faults end the run within about `timeout_s` (flag --distributed_timeout_s), with no
results.json (process 0 writes only after the 'served' barrier, which every process must reach):
- a process cannot reach the coordinator at start-up: it exits 1 with "error: process I of N: could not join
  the run at ADDR within T s" (a watchdog, because jax's client would abort unnamed at its deadline);
- a process dies (or hangs) mid-run: `PeerWatchdog` (started by `initialize`) has every process bump its own
  heartbeat key in the coordination service each min(timeout_s / 10, 1 s) and watch everyone else's; a peer
  whose key has not moved for timeout_s ends this process with exit 1 and "error: process I of N: process J sent
  no heartbeat for T s (it died or hangs); ending the run" (lost contact with the coordination service itself,
  i.e. process 0 died: "error: process I of N: lost the coordinator at ADDR (process 0) for T s"). jax's own heartbeat
  timeout is set to 2 x timeout_s + 10 s, so ours fires first (jax's would abort with SIGABRT and no name of
  ours; a Python callback cannot be installed in its place on jax 0.10.2: missed_heartbeat_callback fails with
  std::bad_cast). A process that passed the end-of-serving barrier marks itself done (`Coordinator.done`), so
  peers finishing at different times are not mistaken for dead ones;
- the step of a process fails (usually a collective or transfer whose peer just died: "Gloo all-reduce failed:
  Connection closed by peer"): the entry point calls `end_after_failure`, which prints what this process saw
  ("error: process I of N: CAUSE"), marks the process failed (its peers end at their next look, naming it),
  waits up to timeout_s for the watchdog to name a dead peer (a second line, "error: ... process J sent no
  heartbeat ..."), and exits 1 without jax's shutdown barrier (which would wait for the dead peer and abort);
- a process waiting in the coordinator (`agree`, `barrier`) for longer than timeout_s raises `DistributedError`
  naming itself and the process it waited for; the entry point exits 1;
- SIGTERM (a launcher stopping the run): "error: process I of N: stopped by SIGTERM", exit 143, at once, also while
  the main thread waits inside JAX (`_stop_on_sigterm`); a process that ends after a one-line user error
  (cli.fail -> pdjax.procs.exit_now) says "exited (status 2)" to its peers. A peer's failed, stopped, ended or
  exited state ends the others at their next look (about a second), naming it.
Every such end is one line per process and `exit_now`, never interpreter shutdown, and in order: every peer's
JAX client polls the coordination service that process 0 hosts and aborts with a ~60-line C++ stack the moment it
goes, so a peer marks its exit and ends, and process 0 waits (a few seconds at most) for every peer not known dead
to have left (`PeerWatchdog.leave`). Not covered: process 0 killed outright (SIGKILL, out of memory): the others'
JAX clients abort at once with that report (jax 0.10.2 offers no hook to replace it, see above).
KV transfers between instances on different processes go through `pdjax.serving.kv_transfer.transfer_kv` like any
other (every process calls it; identical layouts by JAX's cross-host device_put, different TP layouts as head
pieces device to device, reassembled on arrival: `kv_transfer.crossing_route`); `initialize` gives each process
its cross-host transfer socket. A single-process Coordinator (`Coordinator()`) returns its
arguments unchanged: the engines behave exactly as without one.

Debugging aid: `Coordinator.digest(instance, out)` folds every step's SchedulerOutput into a per-process
digest (`schedule_digest`), which tests compare across processes.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np

from pdjax.errors import UserError
from pdjax.metrics import write_json
from pdjax.procs import exit_now, free_port, on_exit_now

__all__ = ["ConfigMismatchError", "Coordinator", "DistributedCoordinator", "DistributedError", "DistributedSettings",
           "config_differences", "flat_config", "initialize", "settings_from_env", "make_coordinator",
           "schedule_digest_line"]


class DistributedError(RuntimeError):
    """A multi-process run cannot go on: a process died, timed out, or disagrees."""


class ConfigMismatchError(UserError):
    """The processes of a run were given different configs: a user error (one line, exit 2) naming the keys."""


class DistributedSettings:
    """coordinator_address, num_processes, process_id, timeout_s of a run (num_processes 1: single process)."""

    def __init__(self, coordinator_address: str = "", num_processes: int = 1, process_id: int = 0,
                 timeout_s: float = 60.0):
        if not isinstance(num_processes, int) or num_processes < 1:
            raise ValueError(f"num_processes={num_processes!r}, expected a positive int")
        if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
            raise ValueError(f"process_id={process_id!r}, expected 0 <= process_id < num_processes={num_processes}")
        if num_processes > 1 and not coordinator_address:
            raise ValueError(f"num_processes={num_processes} needs a coordinator_address (host:port)")
        if not timeout_s > 0:
            raise ValueError(f"distributed timeout_s={timeout_s!r}, expected > 0")
        self.coordinator_address, self.num_processes = coordinator_address, num_processes
        self.process_id, self.timeout_s = process_id, float(timeout_s)

    @property
    def multi(self) -> bool:
        return self.num_processes > 1

    def __repr__(self) -> str:
        return (f"DistributedSettings({self.coordinator_address!r}, num_processes={self.num_processes}, "
                f"process_id={self.process_id}, timeout_s={self.timeout_s:g})")


def settings_from_env(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
                      process_id: Optional[int] = None, timeout_s: float = 60.0,
                      env: Optional[Dict[str, str]] = None) -> DistributedSettings:
    """Explicit values win; unset ones come from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID."""
    env = os.environ if env is None else env

    def as_int(name, value):
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{name}={value!r}, expected an int") from None

    if coordinator_address is None:
        coordinator_address = env.get("JAX_COORDINATOR_ADDRESS", "")
    if num_processes is None:
        num_processes = as_int("JAX_NUM_PROCESSES", env.get("JAX_NUM_PROCESSES", "1") or "1")
    if process_id is None:
        process_id = as_int("JAX_PROCESS_ID", env.get("JAX_PROCESS_ID", "0") or "0")
    return DistributedSettings(coordinator_address, num_processes, process_id, timeout_s)


_INITIALIZED: Optional[DistributedSettings] = None


def _own_host() -> str:
    return socket.gethostbyname(socket.gethostname())


def initialize(settings: DistributedSettings) -> None:
    """jax.distributed.initialize for a multi-process run (no-op for one process); call before any JAX use.
    Raises DistributedError naming the process when the coordinator cannot be reached in timeout_s."""
    global _INITIALIZED
    if not settings.multi or _INITIALIZED is not None:
        return
    import jax  # noqa: PLC0415 (this module is JAX-free: serve's sim path reads its settings)
    if "jax_cpu_collectives_implementation" in jax.config.values:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if "jax_enable_preemption_service" in jax.config.values:
        # Its notifier takes SIGTERM for itself (logs it, stops nothing): `_stop_on_sigterm` ends the run instead.
        jax.config.update("jax_enable_preemption_service", False)
    if os.environ.get("PDJAX_CROSS_HOST_TRANSFER", "1") != "0" and \
            "jax_cross_host_transfer_socket_address" in jax.config.values and \
            not jax.config.values["jax_cross_host_transfer_socket_address"]:
        # Cross-process device_put (KV transfers between instances on different processes) needs a socket per
        # process; the host is the one the coordinator is reached by (localhost for launch/local.py).
        host = settings.coordinator_address.rsplit(":", 1)[0]
        host = host if host in ("127.0.0.1", "localhost", "[::1]") else _own_host()
        jax.config.update("jax_cross_host_transfer_socket_address", f"{host}:{free_port(host)}")   # ':0' hangs
    timeout = max(1, int(round(settings.timeout_s)))
    message = (f"process {settings.process_id} of {settings.num_processes}: could not join the run at "
               f"{settings.coordinator_address} within {settings.timeout_s:g} s")

    def give_up():   # jax's client would abort (SIGABRT, no name) when its connect deadline passes: end first
        sys.stderr.write(f"error: {message}\n")
        sys.stderr.flush()
        os._exit(1)

    watchdog = threading.Timer(settings.timeout_s, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(settings.coordinator_address, num_processes=settings.num_processes,
                                   process_id=settings.process_id, initialization_timeout=timeout + 2,
                                   heartbeat_timeout_seconds=2 * timeout + 10, shutdown_timeout_seconds=timeout)
    except Exception as e:   # XlaRuntimeError and friends
        raise DistributedError(f"{message}: {str(e).splitlines()[0][:300]}") from e
    finally:
        watchdog.cancel()
    _INITIALIZED = settings
    global _PEER_WATCHDOG
    from jax._src import distributed as jax_distributed  # noqa: PLC0415 (JAX-free module)
    _PEER_WATCHDOG = PeerWatchdog(settings, jax_distributed.global_state.client)
    _PEER_WATCHDOG.start()
    on_exit_now(_leave_before_exit)     # every exit_now (cli.fail's user errors too) leaves the run in order
    _stop_on_sigterm()


# How a process ends a multi-process run (after `initialize`): one line, its state for the peers, then exit_now, whose
# hook (`_leave_before_exit`) has process 0 outlive its peers (see `PeerWatchdog.leave`). Only the first thread to
# end the process goes on (`_claim_ending`): a second cause (the main thread's collective failing because the
# watchdog's peer died, a SIGTERM meanwhile) prints nothing more.
_ENDING_LOCK = threading.RLock()     # re-entered by a signal handler running inside the main thread's claim
_ENDING_THREAD: Optional[int] = None


def _claim_ending() -> None:
    """Return in the first thread that ends this process (and again in it); block any other one until the exit."""
    global _ENDING_THREAD
    with _ENDING_LOCK:
        if _ENDING_THREAD is None:
            _ENDING_THREAD = threading.get_ident()
        mine = _ENDING_THREAD == threading.get_ident()
    if not mine:
        threading.Event().wait()     # the first one ends the process


def _end(message: str, state: Optional[str], code: int) -> None:
    """Print `error: message`, set this process's state (None: keep it) for the peers, end with `code`."""
    _claim_ending()
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    if _PEER_WATCHDOG is not None and state is not None:
        _PEER_WATCHDOG.done(state)
    exit_now(code)


def _fatal(message: str) -> None:
    """The watchdog's end: one error line, this process's state "ended: ..." (peers looking for a culprit skip
    it), then end the process at once (other threads may be blocked inside JAX)."""
    _end(message, _ended_state(message), 1)


def _leave_before_exit(code: int) -> None:
    """exit_now hook of a multi-process run: a process ending without a state of its own (a user error:
    cli.fail) tells its peers it exited, then leaves in order (`PeerWatchdog.leave`)."""
    _claim_ending()
    watchdog = _PEER_WATCHDOG
    if watchdog is None:
        return
    if watchdog.state is None:
        watchdog.done(f"exited (status {code})")
    watchdog.leave()


def _stop_on_sigterm() -> None:
    """SIGTERM (how launchers stop a run) ends this process: one line, its peers told, exit 128 + 15. Python runs a
    signal handler in the main thread between bytecodes only, never while that thread waits inside JAX (a
    collective, a blocking coordination-service get), so a thread reads the C-level handler's wakeup byte
    (signal.set_wakeup_fd) and ends the process from there; the handler itself does the same when it runs first."""
    s = _INITIALIZED

    def stop(*_):
        if _ENDING_THREAD is not None:      # already ending (the handler may run inside that very thread)
            return
        _end(f"process {s.process_id} of {s.num_processes}: stopped by SIGTERM", "stopped by SIGTERM",
             128 + signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, stop)
    except ValueError:      # not the main thread: SIGTERM keeps its default (ends the process, silently)
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def watch():
        while True:
            if int(signal.SIGTERM) in os.read(read_fd, 64):
                stop()

    threading.Thread(target=watch, name="pdjax-sigterm", daemon=True).start()


def _ended_state(message: str) -> str:
    """The state a process that ends because of `message` (a watchdog line) shows its peers."""
    reason = message.split(": ", 1)[-1]
    return f"ended: {reason[:-len('; ending the run')] if reason.endswith('; ending the run') else reason}"


# A peer's state (its pdjax/alive key) that ends the run: it failed, was stopped, ended because of another, or
# exited; "done" is a normal finish; anything else is a heartbeat count.
_ENDING_STATES = ("failed", "stopped", "ended", "exited")


class PeerWatchdog:
    """Every process bumps `pdjax/alive/<id>` in the coordination service and watches everyone else's (module
    docstring). `on_dead(message)` ends the process (default: one error line, exit 1); `clock`, `sleep` and the
    interval are injectable for tests. `done(state)` sets this process's final state (peers stop watching it; one
    in _ENDING_STATES ends them too) and stops the threads; `leave()` orders the exits."""

    def __init__(self, settings: DistributedSettings, client, *, on_dead: Callable[[str], None] = _fatal,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 interval_s: Optional[float] = None):
        self.settings, self.client, self.on_dead, self.clock, self.sleep = settings, client, on_dead, clock, sleep
        # At most 1 s: a peer ending the run is followed within about a second.
        self.interval_s = interval_s if interval_s is not None else max(0.05, min(1.0, settings.timeout_s / 10))
        self.linger_s = 3 * self.interval_s + 2.0       # process 0's longest wait in `leave`
        self._stop = threading.Event()
        self._beats = 0
        self._seen: Dict[int, Tuple[str, float]] = {}   # peer -> (last value, when it last changed)
        self._lost_since: Optional[float] = None
        self.peers_finished = False
        self.dead_peers: set = set()                    # peers named for a stalled heartbeat
        self.state: Optional[str] = None                # this process's final state, once `done`
        self._thread: Optional[threading.Thread] = None

    def _key(self, process_id: int) -> str:
        return f"pdjax/alive/{process_id}"

    def _exit_key(self, process_id: int) -> str:
        return f"pdjax/exited/{process_id}"

    def beat(self) -> None:
        self._beats += 1
        self.client.key_value_set(self._key(self.settings.process_id), str(self._beats), allow_overwrite=True)

    def check(self, beat: bool = True, culprits_only: bool = False) -> Optional[str]:
        """One look at every peer: the error message when one ended the run (failed, was stopped, ended or
        exited) or one (or the service) is gone for timeout_s, else None. Peers that are done are not watched.
        culprits_only (this process failed and is looking for a cause): only a failed or dead peer is named;
        peers that ended, exited or were stopped count as finished."""
        s, now = self.settings, self.clock()
        me = f"process {s.process_id} of {s.num_processes}"
        try:
            if beat:
                self.beat()
            values = {}
            for peer in range(s.num_processes):
                if peer != s.process_id:
                    try:
                        values[peer] = self.client.key_value_try_get(self._key(peer))
                    except Exception:  # noqa: BLE001  (not set yet: a peer still starting)
                        values[peer] = ""
        except Exception:  # noqa: BLE001  (the coordination service is unreachable)
            self._lost_since = now if self._lost_since is None else self._lost_since
            if now - self._lost_since >= s.timeout_s:
                return f"{me}: lost the coordinator at {s.coordinator_address} (process 0) for {s.timeout_s:g} s"
            return None
        self._lost_since = None
        self.peers_finished = all(v == "done" or v.startswith(_ENDING_STATES) for v in values.values())
        for peer, value in values.items():
            if value.startswith("failed") or (value.startswith(_ENDING_STATES) and not culprits_only):
                return f"{me}: process {peer} {value}; ending the run"
            last = self._seen.get(peer)
            if last is None or value != last[0]:
                self._seen[peer] = (value, now)
            elif value != "done" and not value.startswith(_ENDING_STATES) and now - last[1] >= s.timeout_s:
                self.dead_peers.add(peer)
                return (f"{me}: process {peer} sent no heartbeat for {s.timeout_s:g} s (it died or hangs); "
                        "ending the run")
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            message = self.check()
            if message is not None and not self._stop.is_set():
                self.on_dead(message)
                return

    def start(self) -> None:
        self.beat()
        self._thread = threading.Thread(target=self._run, name="pdjax-peer-watchdog", daemon=True)
        self._thread.start()

    def done(self, state: str = "done") -> None:
        self._stop.set()
        self.state = state
        try:
            self.client.key_value_set(self._key(self.settings.process_id), state, allow_overwrite=True)
        except Exception:  # noqa: BLE001  (the run is over either way)
            pass

    def _has_left(self, peer: int) -> bool:
        """Whether `peer` marked its exit, or finished normally (it leaves through jax's own shutdown)."""
        for key, wanted in ((self._exit_key(peer), None), (self._key(peer), "done")):
            try:
                value = self.client.key_value_try_get(key)
            except Exception:  # noqa: BLE001  (not set)
                continue
            if wanted is None or value == wanted:
                return True
        return False

    def leave(self) -> None:
        """Right before this process ends at once. Every peer's JAX client polls the coordination service that
        process 0 hosts, and aborts with a long C++ stack the moment it goes: so a peer marks its exit
        (`pdjax/exited/<id>`) and ends, and process 0 first waits (at most linger_s) until every peer not known
        dead marked its exit or finished."""
        self._stop.set()
        s = self.settings
        if s.process_id != 0:
            try:
                self.client.key_value_set(self._exit_key(s.process_id), "1", allow_overwrite=True)
            except Exception:  # noqa: BLE001  (the service is gone: nothing to order)
                pass
            return
        deadline = self.clock() + self.linger_s
        waiting = [p for p in range(1, s.num_processes) if p not in self.dead_peers]
        while waiting and self.clock() < deadline:
            waiting = [p for p in waiting if not self._has_left(p)]
            if waiting:
                self.sleep(0.02)
        if s.num_processes > 1 + len(self.dead_peers):
            self.sleep(0.2)      # a peer ends right after its mark

    def find_dead_peer(self) -> Optional[str]:
        """After this process failed (its key says so, it beats no more): keep checking for up to timeout_s for
        a dead or failed peer; its message, or None once every peer ended (they saw this failure) or kept
        beating to the end."""
        deadline = self.clock() + self.settings.timeout_s + 2 * self.interval_s
        while self.clock() < deadline:
            message = self.check(beat=False, culprits_only=True)
            if message is not None or self.peers_finished:
                return message
            self.sleep(self.interval_s)
        return None


_PEER_WATCHDOG: Optional[PeerWatchdog] = None


def end_after_failure(error: BaseException) -> None:
    """A multi-process run failed in this process with `error` (typically a collective or a transfer whose peer
    died: "Gloo all-reduce failed: Connection closed by peer"). Print one error line, tell the peers (they end
    at once, naming this process), name the dead peer when the watchdog finds one within timeout_s (a second
    line) and end the process with exit 1 at once (jax's shutdown barrier at exit would wait for the dead peer
    and then abort), in order (`PeerWatchdog.leave`)."""
    _claim_ending()
    s, watchdog = _INITIALIZED, _PEER_WATCHDOG
    cause = " ".join(str(error).split())[:300] or type(error).__name__
    me = f"process {s.process_id} of {s.num_processes}" if s is not None else "this process"
    sys.stderr.write(f"error: {me}: {cause}\n")
    sys.stderr.flush()
    if watchdog is not None:
        watchdog.done(f"failed ({cause})")
        dead = watchdog.find_dead_peer()
        if dead:
            sys.stderr.write(f"error: {dead}\n")
    exit_now(1)


def schedule_digest_line(instance: str, out) -> str:
    """One canonical line for a SchedulerOutput (what was scheduled, not when)."""
    return json.dumps([instance, out.step, list(out.req_ids), list(out.num_new_tokens),
                       list(out.num_computed_tokens), [list(p) for p in out.page_tables], list(out.do_sample),
                       list(out.kv_handoff_req_ids), list(out.preempted_req_ids), list(out.swap_out),
                       list(out.swap_in)], separators=(",", ":"))


def flat_config(config: Mapping[str, Any], prefix: str = "") -> Dict[str, Any]:
    """A nested config dict as {"scheduler.token_budget": 256, ...} (lists and scalars are leaves)."""
    out: Dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flat_config(value, f"{name}."))
        else:
            out[name] = value
    return out


def config_differences(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> List[str]:
    """The keys (of two `flat_config`s) whose values differ or that only one has, sorted."""
    return sorted(k for k in set(mine) | set(theirs) if k not in mine or k not in theirs or mine[k] != theirs[k])


def _config_mismatch_message(me: str, peer: int, mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> str:
    def show(flat, key):
        return json.dumps(flat[key], default=repr)[:60] if key in flat else "(none)"
    keys = config_differences(mine, theirs)
    listed = ", ".join(f"{k} (process {peer}: {show(theirs, k)}, this process: {show(mine, k)})" for k in keys[:5])
    more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
    return (f"{me}: config differs from process {peer}'s at {listed}{more}; every process of a run needs the same "
            f"config")


class Coordinator:
    """Single process: every agreement is the process's own value; barriers return at once."""

    process_id = 0
    num_processes = 1

    def __init__(self, record_digest: bool = False):
        self.record_digest = record_digest
        self._digest = hashlib.sha256()
        self.step_digests: List[str] = []

    @property
    def is_main(self) -> bool:
        """Whether this process writes results (process 0)."""
        return self.process_id == 0

    def agree(self, value: Any, source: int = 0) -> Any:
        """Process `source`'s `value` (JSON-serializable; default process 0's) on every process."""
        return value

    def now(self, local_elapsed: float) -> float:
        """The engine clock every process uses: process 0's elapsed seconds."""
        return self.agree(float(local_elapsed))

    def admit_count(self, n: int) -> int:
        """A count (arrivals admitted, transfers landed, ...) as process 0 saw it."""
        return int(self.agree(int(n)))

    def barrier(self, name: str) -> None:
        """Return once every process reached `name`."""

    def wait_for_peers(self, name: str, waiting_for: str, limit_s: Optional[float] = None) -> float:
        """A barrier for a point the processes reach at very different times (the end of warm-up); seconds this
        process waited (one process: 0)."""
        return 0.0

    def done(self) -> None:
        """This process is past the end-of-serving barrier: the peer watchdog stops watching it (and it others)."""

    def collect(self, runner, handle):
        """`runner.collect(handle)` (int32[num_seqs] sampled ids) on every process. The ids live on the runner's
        `output_devices` (its mesh; a pipeline's last stage): when those are not on every process, the lowest
        process holding them reads them and the others get its value (`agree`), so every scheduler sees them."""
        if self.num_processes == 1:
            return runner.collect(handle)
        procs = sorted({d.process_index for d in getattr(runner, "output_devices", ())})
        if not procs or len(procs) == self.num_processes:
            return runner.collect(handle)
        local = runner.collect(handle) if self.process_id == procs[0] else None
        ids = self.agree(None if local is None else [int(x) for x in local], source=procs[0])
        return np.asarray(ids, np.int32)

    def check_same_config(self, config: Mapping[str, Any]) -> None:
        """Raise ConfigMismatchError naming the differing keys when another process's resolved `config` (a plain
        nested dict: JSON values) differs from this one's; every process calls it at start-up."""

    def check_same(self, name: str, value: Any) -> None:
        """Raise DistributedError when `value` (JSON-serializable) differs from process 0's."""
        theirs = self.agree(value)
        if theirs != value:
            raise DistributedError(f"process {self.process_id}: {name} differs from process 0's "
                                   f"(same program, config and seed expected on every process)")

    def digest(self, instance: str, out) -> None:
        """Fold one step's SchedulerOutput into this process's schedule digest (when record_digest)."""
        if not self.record_digest:
            return
        line = schedule_digest_line(instance, out)
        self._digest.update(line.encode() + b"\n")
        self.step_digests.append(hashlib.sha256(line.encode()).hexdigest()[:16])

    @property
    def schedule_digest(self) -> str:
        return self._digest.hexdigest()

    def write_digest(self, directory: str) -> str:
        """Write this process's schedule digest to DIRECTORY/schedule_p<process_id>.json (atomically)."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"schedule_p{self.process_id}.json")
        write_json(path, {"process_id": self.process_id, "num_processes": self.num_processes,
                          "digest": self.schedule_digest, "steps": self.step_digests})
        return path


class DistributedCoordinator(Coordinator):
    """Process 0 broadcasts through the coordination service's key-value store (see the module docstring)."""

    def __init__(self, settings: DistributedSettings, client=None, prefix: str = "pdjax",
                 record_digest: bool = False):
        super().__init__(record_digest)
        if client is None:
            from jax._src import distributed as jax_distributed  # noqa: PLC0415 (JAX-free module)
            client = jax_distributed.global_state.client
            if client is None:
                raise DistributedError("jax.distributed is not initialized (call pdjax.serving.distributed."
                                       "initialize first)")
        self.client = client
        self.process_id, self.num_processes = settings.process_id, settings.num_processes
        self.timeout_ms = max(1, int(settings.timeout_s * 1000))
        self.timeout_s = settings.timeout_s
        self.prefix = prefix
        self._seq = 0
        self._barriers: Dict[str, int] = {}

    def _fail(self, what: str, error: BaseException) -> DistributedError:
        return DistributedError(
            f"process {self.process_id} of {self.num_processes}: {what} got no answer within {self.timeout_s:g} s "
            f"(a process died or cannot reach the coordinator): {str(error).splitlines()[0][:300]}")

    def agree(self, value: Any, source: int = 0) -> Any:
        key = f"{self.prefix}/{self._seq}"
        self._seq += 1
        if self.process_id == source:
            try:
                self.client.key_value_set(key, json.dumps(value))
            except Exception as e:
                raise self._fail(f"broadcast {key}", e) from e
            return value
        try:
            text = self.client.blocking_key_value_get(key, self.timeout_ms)
        except Exception as e:
            raise self._fail(f"waiting for process {source}'s value {key}", e) from e
        return json.loads(text)

    def wait_for_peers(self, name: str, waiting_for: str, limit_s: Optional[float] = None) -> float:
        """Every process marks `<prefix>/reached/<name>/<id>` and waits for every other's mark. Unlike `barrier`,
        a wait past timeout_s is no fault: it prints a note naming the process waited for and goes on (a peer
        that died meanwhile ends the run through the peer watchdog) up to limit_s (default 20 x timeout_s),
        then raises DistributedError naming it. Returns the seconds waited."""
        limit = 20 * self.timeout_s if limit_s is None else float(limit_s)
        me = f"process {self.process_id} of {self.num_processes}"
        base = f"{self.prefix}/reached/{name}"
        try:
            self.client.key_value_set(f"{base}/{self.process_id}", "1")
        except Exception as e:
            raise self._fail(f"marking {name!r}", e) from e
        start = time.monotonic()
        for peer in (p for p in range(self.num_processes) if p != self.process_id):
            while True:
                waited = time.monotonic() - start
                slice_s = max(0.001, min(self.timeout_s, limit - waited))
                try:
                    self.client.blocking_key_value_get(f"{base}/{peer}", max(1, int(slice_s * 1000)))
                    break
                except Exception as e:  # noqa: BLE001  (a timeout: checked against the limit below)
                    error = e
                if time.monotonic() - start - waited < slice_s / 2:
                    time.sleep(slice_s / 2)     # failed at once (service trouble): no busy loop
                waited = time.monotonic() - start
                if waited >= limit:
                    raise DistributedError(
                        f"{me}: waited {waited:.0f} s at {name!r} for process {peer} ({waiting_for}); it has not "
                        f"got there (raise --distributed_timeout_s if it is only slow): "
                        f"{str(error).splitlines()[0][:200] if str(error) else type(error).__name__}")
                sys.stderr.write(f"note: {me}: still waiting at {name!r} for process {peer} ({waiting_for}) "
                                 f"after {waited:.0f} s\n")
                sys.stderr.flush()
        return time.monotonic() - start

    def done(self) -> None:
        if _PEER_WATCHDOG is not None:
            _PEER_WATCHDOG.done()

    def check_same_config(self, config: Mapping[str, Any]) -> None:
        """Every process publishes its config's digest and flat form (`<prefix>/config/<id>/...`) and compares with
        every other's (digests first, the flat form only on a difference), so every process of a mismatched run
        fails at once, naming the keys."""
        flat = flat_config(config)
        text = json.dumps(flat, sort_keys=True, separators=(",", ":"), default=repr)
        digest = hashlib.sha256(text.encode()).hexdigest()
        base = f"{self.prefix}/config"
        try:
            self.client.key_value_set(f"{base}/{self.process_id}/flat", text)
            self.client.key_value_set(f"{base}/{self.process_id}/digest", digest)
        except Exception as e:
            raise self._fail("publishing the config", e) from e
        me = f"process {self.process_id} of {self.num_processes}"
        for peer in (p for p in range(self.num_processes) if p != self.process_id):
            try:
                if self.client.blocking_key_value_get(f"{base}/{peer}/digest", self.timeout_ms) == digest:
                    continue
                theirs = json.loads(self.client.blocking_key_value_get(f"{base}/{peer}/flat", self.timeout_ms))
            except Exception as e:
                raise self._fail(f"waiting for process {peer}'s config", e) from e
            raise ConfigMismatchError(_config_mismatch_message(me, peer, json.loads(text), theirs))

    def barrier(self, name: str) -> None:
        n = self._barriers.get(name, 0)
        self._barriers[name] = n + 1
        try:
            self.client.wait_at_barrier(f"{self.prefix}/barrier/{name}/{n}", self.timeout_ms)
        except Exception as e:
            raise self._fail(f"barrier {name!r}", e) from e


def make_coordinator(settings: Optional[DistributedSettings] = None, record_digest: bool = False) -> Coordinator:
    """The coordinator of `settings` (None or one process: the no-op Coordinator)."""
    if settings is None or not settings.multi:
        return Coordinator(record_digest)
    return DistributedCoordinator(settings, record_digest=record_digest)
