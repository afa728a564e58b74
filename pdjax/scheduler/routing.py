"""Routing requests across instances of one role (the disaggregated engine and its simulation share it).

An instance is anything with `.role` ('prefill' or 'decode') and `.scheduler` (a pdjax Scheduler). Policies:
'round_robin', or 'least_loaded' (prefill: fewest prompt tokens still to prefill; decode: fewest live requests);
ties go to the lowest index, so routing is deterministic.
"""
from __future__ import annotations

import itertools
from typing import Sequence

ROUTER_POLICIES = ("round_robin", "least_loaded")


class InstanceRouter:
    """Picks an instance for a new request (prefill) or a handed-off one (decode)."""

    def __init__(self, policy: str, instances: Sequence):
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"router={policy!r}, expected 'round_robin' or 'least_loaded'")
        if not instances:
            raise ValueError("a router needs at least one instance")
        self.policy = policy
        self.instances = list(instances)
        self._cycle = itertools.cycle(self.instances)

    @staticmethod
    def load(inst) -> int:
        s = inst.scheduler
        if inst.role == "prefill":
            return sum(len(r.all_token_ids) - r.num_computed_tokens for r in itertools.chain(s.running, s.waiting))
        return s.num_running + s.num_waiting

    def pick(self):
        if self.policy == "round_robin" or len(self.instances) == 1:
            return next(self._cycle)
        return min(self.instances, key=self.load)   # min keeps the first of equals: deterministic
