"""Counting XLA compiles as JAX itself reports them, so a run can prove it compiled nothing after warm-up.

A retrace counter (`ModelRunner.traces`) misses compiles that reuse a trace: a jit cache miss caused only by an
argument's sharding or commitment changes recompiles without retracing. JAX reports every executable it builds
(a backend compile, or a load from the persistent compilation cache) as the monitoring event
`/jax/core/compile/backend_compile_duration`; one listener, installed once per process, counts them all.

    mark = compiles.count()
    ...  # run steps
    new = compiles.since(mark)      # [CompileEvent(fun_name, seconds)] built since `mark`
"""
from __future__ import annotations

import dataclasses
import threading
from typing import List

from jax import monitoring

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@dataclasses.dataclass(frozen=True)
class CompileEvent:
    fun_name: str       # e.g. 'jit(traced)' for the step
    seconds: float      # compile (or persistent-cache load) time


_events: List[CompileEvent] = []
_lock = threading.Lock()
_installed = False


def _listener(event: str, duration: float, **kwargs) -> None:
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _events.append(CompileEvent(str(kwargs.get("fun_name", "?")), float(duration)))


def install() -> None:
    """Register the listener (idempotent). Compiles before the first call are not counted."""
    global _installed
    with _lock:
        if not _installed:
            monitoring.register_event_duration_secs_listener(_listener)
            _installed = True


def count() -> int:
    """Executables built in this process since `install()`."""
    install()
    return len(_events)


def since(mark: int) -> List[CompileEvent]:
    """The compiles after `count()` returned `mark`."""
    with _lock:
        return list(_events[mark:])


install()
