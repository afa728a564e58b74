"""The peer watchdog of multi-process runs (pdjax.serving.distributed.PeerWatchdog) on a fake coordination
service and a fake clock: a peer whose heartbeat key stops moving for timeout_s ends the run naming it, a peer
that marked itself done is never flagged, a peer that failed, was stopped or exited ends the others, a lost
service is reported as the coordinator, and process 0 (whose service every JAX client polls) leaves last. The
start-up config check (DistributedCoordinator.check_same_config) on the same fake service. (The real things, a
killed process, SIGTERM, configs that differ, are in test_multiprocess.)"""
from __future__ import annotations

import json
import threading
import time

import pytest

from pdjax.serving.distributed import (ConfigMismatchError, DistributedCoordinator, DistributedError,
                                       DistributedSettings, PeerWatchdog, config_differences, flat_config)


class FakeService:
    def __init__(self):
        self.kv = {}
        self.down = False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE")
        assert allow_overwrite or key not in self.kv
        self.kv[key] = value

    def key_value_try_get(self, key):
        if self.down:
            raise RuntimeError("UNAVAILABLE")
        if key not in self.kv:
            raise KeyError(key)
        return self.kv[key]

    def blocking_key_value_get(self, key, timeout_ms):
        deadline = time.monotonic() + timeout_ms / 1000
        while key not in self.kv and time.monotonic() < deadline:
            time.sleep(0.001)
        return self.key_value_try_get(key)


class Clock:
    t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, seconds):
        self.t += seconds


def _watchdogs(n=3, timeout=10.0):
    service, clock = FakeService(), Clock()
    dogs = [PeerWatchdog(DistributedSettings("127.0.0.1:1", n, i, timeout), service, clock=clock, sleep=clock.sleep,
                         on_dead=pytest.fail) for i in range(n)]
    return service, clock, dogs


def test_beating_peers_are_alive_and_a_stalled_one_is_named():
    service, clock, dogs = _watchdogs()
    for _ in range(30):                        # 30 s of everyone beating every second
        clock.t += 1.0
        assert [d.check() for d in dogs] == [None, None, None]
    # Process 2 stops after its beat at t=30; process 0 (which checked before it at t=30) sees that beat at t=31,
    # so through t=40 the key has moved within the last 10 s.
    for _ in range(10):
        clock.t += 1.0
        assert dogs[0].check() is None and dogs[1].check() is None
    clock.t += 1.0
    message = dogs[0].check()
    assert message == "process 0 of 3: process 2 sent no heartbeat for 10 s (it died or hangs); ending the run"
    assert "process 2 sent no heartbeat" in dogs[1].check()


def test_a_peer_that_is_done_is_not_watched():
    service, clock, dogs = _watchdogs(n=2)
    clock.t += 1.0
    assert dogs[0].check() is None and dogs[1].check() is None
    dogs[1].done()                              # past the end-of-serving barrier, then exits
    assert service.kv["pdjax/alive/1"] == "done"
    for _ in range(60):
        clock.t += 1.0
        assert dogs[0].check() is None


def test_a_peer_that_never_started_beating_is_named_too():
    service, clock, dogs = _watchdogs(n=2)
    for _ in range(10):                         # first looked at t=1: within the timeout through t=10
        clock.t += 1.0
        assert dogs[0].check() is None
    clock.t += 1.0
    message = dogs[0].check()
    assert message is not None and "process 1 sent no heartbeat" in message


def test_a_lost_service_is_the_coordinator():
    service, clock, dogs = _watchdogs(n=2)
    clock.t += 1.0
    assert dogs[1].check() is None
    service.down = True
    clock.t += 5.0
    assert dogs[1].check() is None               # the first failure starts the clock
    clock.t += 10.0
    assert dogs[1].check() == ("process 1 of 2: lost the coordinator at 127.0.0.1:1 (process 0) for 10 s")


def test_a_failed_peer_is_named_at_once_and_ended_peers_are_not_culprits():
    service, clock, dogs = _watchdogs(n=3)
    clock.t += 1.0
    assert [d.check() for d in dogs] == [None, None, None]
    # Process 2 failed locally (end_after_failure marks it): the others end at their next look, naming it ...
    dogs[2].done("failed (boom)")
    clock.t += 1.0
    assert dogs[0].check() == "process 0 of 3: process 2 failed (boom); ending the run"
    dogs[0].done("ended")
    dogs[1].done("ended")
    # ... and process 2, looking for a dead peer before it exits, finds none: both ended because of it.
    assert dogs[2].find_dead_peer() is None
    assert service.kv["pdjax/alive/2"] == "failed (boom)"     # find_dead_peer does not beat over its mark


@pytest.mark.parametrize("state", ["stopped by SIGTERM", "exited (status 2)", "ended: process 2 sent no heartbeat"])
def test_a_peer_that_ended_the_run_ends_the_others(state):
    """Regression (issue 16 item 10): a peer stopped by SIGTERM, or gone after a one-line user error (cli.fail),
    was a heartbeat that stopped: the others waited timeout_s (or aborted with JAX's C++ stack when it was
    process 0). Now they end at their next look, naming it."""
    service, clock, dogs = _watchdogs(n=3)
    clock.t += 1.0
    assert [d.check() for d in dogs] == [None, None, None]
    dogs[0].done(state)
    clock.t += 1.0
    assert dogs[1].check() == f"process 1 of 3: process 0 {state}; ending the run"
    assert dogs[2].check() == f"process 2 of 3: process 0 {state}; ending the run"
    # ... but a process that failed itself and looks for a cause does not blame one that ended after it
    dogs[1].done("failed (boom)")
    assert dogs[1].check(beat=False, culprits_only=True) is None


def test_process_0_leaves_after_its_live_peers_and_the_others_mark_their_exit():
    """Regression (issue 16 item 3): process 0 hosts the coordination service; when it ended first, a peer still
    printing its line aborted inside JAX's client with a ~60-line C++ stack. Peers mark their exit and go;
    process 0 waits for every peer not known dead (at most linger_s)."""
    service, clock, dogs = _watchdogs(n=3)
    clock.t += 1.0
    assert [d.check() for d in dogs] == [None, None, None]
    dogs[1].leave()
    assert service.kv["pdjax/exited/1"] == "1"
    start = clock.t
    dogs[0].leave()                  # process 2 never leaves: process 0 waits its longest, then goes
    assert clock.t - start >= dogs[0].linger_s
    # A peer known dead (no heartbeat) is not waited for; one that exits is, until its mark.
    service, clock, dogs = _watchdogs(n=3)
    for _ in range(12):
        clock.t += 1.0
        dogs[1].check()
        message = dogs[0].check()
    assert "process 2 sent no heartbeat" in message and dogs[0].dead_peers == {2}
    dogs[1].leave()
    start = clock.t
    dogs[0].leave()
    assert clock.t - start < 1.0


def _check_configs(configs):
    """Each process's check_same_config (a thread each, on one fake service): the error each raised, or None."""
    service, errors = FakeService(), [None] * len(configs)

    def check(i):
        c = DistributedCoordinator(DistributedSettings("127.0.0.1:1", len(configs), i, 10.0), client=service)
        try:
            c.check_same_config(configs[i])
        except Exception as e:  # noqa: BLE001  (the thread hands back whatever it raised)
            errors[i] = e
    threads = [threading.Thread(target=check, args=(i,)) for i in range(len(configs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_same_configs_pass_and_different_ones_name_the_keys():
    """Regression (issue 16 item 6): only the request lists were compared, so processes given different budgets
    failed 13 s in with an unrelated message. Every process compares its resolved config with every other's."""
    base = {"scheduler": {"token_budget": 32, "policy": "sarathi"}, "seed": 0, "deployment": {"devices": [3, 4]}}
    other = json.loads(json.dumps(base))
    other["scheduler"]["token_budget"] = 64
    e0, e1, e2 = _check_configs([base, other, base])
    assert isinstance(e0, ConfigMismatchError) and isinstance(e0, ValueError)   # a user error: exit 2
    assert str(e0) == ("process 0 of 3: config differs from process 1's at scheduler.token_budget (process 1: 64, "
                       "this process: 32); every process of a run needs the same config")
    assert "process 1 of 3: config differs from process 0's at scheduler.token_budget (process 0: 32" in str(e1)
    assert "process 2 of 3: config differs from process 1's at scheduler.token_budget" in str(e2)
    assert _check_configs([base, json.loads(json.dumps(base))]) == [None, None]


def test_config_differences_name_changed_added_and_removed_keys():
    a = flat_config({"a": {"b": 1, "c": [1, 2]}, "d": None})
    assert a == {"a.b": 1, "a.c": [1, 2], "d": None}
    assert config_differences(a, {"a.b": 1, "a.c": [1, 3], "e": 0}) == ["a.c", "d", "e"]


def test_wait_for_peers_outlasts_timeout_s_with_a_note_naming_the_late_process(capsys):
    """Regression (issue 27): process 1 compiled its warm-up ~90 s longer than process 0 (JAX's persistent cache
    serves process 0 only on CPU), and process 0's first decode step absorbed the lag (72-293 s). The processes
    now meet after warm-up; a late peer is waited for past timeout_s, named in a note, not failed."""
    service = FakeService()
    coords = [DistributedCoordinator(DistributedSettings("127.0.0.1:1", 2, i, 0.05), client=service)
              for i in range(2)]
    late = threading.Timer(0.3, lambda: coords[1].wait_for_peers("warmed-up", "its warm-up compiles"))
    late.start()
    waited = coords[0].wait_for_peers("warmed-up", "its warm-up compiles")
    late.join()
    assert waited >= 0.25
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) >= 2 and notes[0].startswith(
        "note: process 0 of 2: still waiting at 'warmed-up' for process 1 (its warm-up compiles) after ")


def test_wait_for_peers_gives_up_at_its_limit_naming_the_process():
    service = FakeService()
    coord = DistributedCoordinator(DistributedSettings("127.0.0.1:1", 3, 1, 0.05), client=service)
    service.key_value_set("pdjax/reached/warmed-up/0", "1")
    with pytest.raises(DistributedError, match=r"^process 1 of 3: waited 0 s at 'warmed-up' for process 2 "
                                               r"\(its warm-up compiles\); it has not got there"):
        coord.wait_for_peers("warmed-up", "its warm-up compiles", limit_s=0.2)
