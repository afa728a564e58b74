"""The peer watchdog of multi-process runs (pdjax.serving.distributed.PeerWatchdog) on a fake coordination
service and a fake clock: a peer whose heartbeat key stops moving for timeout_s ends the run naming it, a peer
that marked itself done is never flagged, and a lost service is reported as the coordinator. (The real thing,
a killed process, is in test_multiprocess.)"""
from __future__ import annotations

import pytest

from pdjax.serving.distributed import DistributedSettings, PeerWatchdog


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


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def _watchdogs(n=3, timeout=10.0):
    service, clock = FakeService(), Clock()
    dogs = [PeerWatchdog(DistributedSettings("127.0.0.1:1", n, i, timeout), service, clock=clock,
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
