"""The engines' side of per-token logprobs: read a collected step's logprobs and hand them to the requests
(pdjax.scheduler.logprobs), in two calls around `scheduler.update`:

    step_lp = StepLogprobs.read(coordinator, runner, handle, out)   # None unless some sequence asked
    finished = scheduler.update(out, sampled, now)
    if step_lp: step_lp.attach(sampled)

A runner without `collect_logprobs` (a test double) or a step where nobody asked gives None: no device read, no
host work. Multi-controller runs: the logprobs live on the runner's output devices, like the sampled ids, so the
lowest process holding them reads them and the others get its values (`Coordinator.agree`), as
`Coordinator.collect` does for the ids.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from pdjax.scheduler.logprobs import attach, attach_pending, output_counts


def collect_logprobs(coordinator, runner, handle):
    """runner.collect_logprobs(handle) on every process ((logprob [n], top ids [n, K], top logprobs [n, K]) or
    None when no sequence of the step asked)."""
    read = getattr(runner, "collect_logprobs", None)
    if read is None or handle is None or not runner.logprobs_asked(handle):
        return None     # (every process knows it: no agreement needed)
    if coordinator.num_processes == 1:
        return read(handle)
    procs = sorted({d.process_index for d in getattr(runner, "output_devices", ())})
    if not procs or len(procs) == coordinator.num_processes:
        return read(handle)
    local = read(handle) if coordinator.process_id == procs[0] else None
    agreed = coordinator.agree(None if local is None else [a.tolist() for a in local], source=procs[0])
    if agreed is None:
        return None
    return (np.asarray(agreed[0], np.float32), np.asarray(agreed[1], np.int32), np.asarray(agreed[2], np.float32))


class StepLogprobs:
    """One collected step's logprobs, between reading them (before scheduler.update) and attaching them."""

    def __init__(self, out, rows):
        self.out, self.rows = out, rows
        self.counts = output_counts(out)

    @classmethod
    def read(cls, coordinator, runner, handle, out) -> Optional["StepLogprobs"]:
        rows = collect_logprobs(coordinator, runner, handle)
        return None if rows is None else cls(out, rows)

    def attach(self, sampled) -> None:
        """After scheduler.update(out, sampled, ...)."""
        attach(self.out, self.counts, sampled, self.rows)

    def attach_pending(self, pending, sampled) -> None:
        """After scheduler.resolve_async(pending, sampled, ...) (async scheduling)."""
        attach_pending(pending, sampled, self.rows)
