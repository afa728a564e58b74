"""Routing requests across the instances of one role (the engines and the simulator share it).

An instance is anything with `.scheduler` (a pdjax Scheduler) and, unless the router is given its role, `.role`
('colocated', 'prefill' or 'decode'; pdjax.scheduler.instances). Policies (`deployment.router`):
- 'round_robin': instances in turn.
- 'least_loaded': the instance with the least load, ties to the lowest index (deterministic). Load per role:
    prefill    prompt tokens still to prefill (waiting and running requests);
    decode     live requests (running plus waiting, incl. handed-off ones whose KV is on its way);
    colocated  tokens still to compute: for every request it holds (running, waiting, swapped, and routed but
               not yet admitted: an `inbox` when the instance has one, as the simulator's do), the prompt tokens
               still to prefill plus the decode steps still to run, i.e. prompt + max_tokens - 1 minus the tokens
               already computed (a recompute preemption adds its lost tokens back). This is the work queued on the
               replica, which sets when a new request's prefill completes.
  Loads are recomputed at each pick (O(requests held) per pick).
Each router is a row of the router table (pdjax.config.registry.ROUTERS, which `deployment.router` is checked
against) with its pick function, `(InstanceRouter) -> instance`: `register_router(name, pick)` adds one.
A router is callable as `router(request, instances)` too, the simulator's routing protocol (the request does not
change the pick).
A router serves one of the roles 'colocated', 'prefill', 'decode'. Mixed-pool instances (role 'mixed', Splitwise)
are routed to by pdjax.scheduler.mixed.MixedPool, which wraps the prefill and decode routers and uses the loads
above (prefill_load for the prefill pool's overload test).
"""
from __future__ import annotations

import itertools
from typing import Optional, Sequence

from pdjax.config.deployment import ROLES
from pdjax.config.registry import ROUTERS, RouterInfo

__all__ = ["ROUTERS", "InstanceRouter", "register_router"]


def _remaining_tokens(req) -> int:
    return len(req.prompt_token_ids) + req.max_tokens - 1 - req.num_computed_tokens


class InstanceRouter:
    """Picks an instance of one role for a new request (colocated, prefill) or a handed-off one (decode)."""

    def __init__(self, policy: str, instances: Sequence, role: Optional[str] = None):
        if policy not in ROUTERS:
            raise ValueError(f"router={policy!r}, expected one of {ROUTERS}")
        if not instances:
            raise ValueError("a router needs at least one instance")
        roles = {role} if role is not None else {getattr(inst, "role", None) for inst in instances}
        routed = tuple(r for r in ROLES if r != "mixed")
        if len(roles) != 1 or not roles <= set(routed):
            raise ValueError(f"router over instances of roles {sorted(map(str, roles))}: expected one role of "
                             f"{routed} (pass role= for instances without a .role; mixed-pool instances are "
                             "routed by pdjax.scheduler.mixed.MixedPool)")
        self.policy = policy
        self._pick = ROUTERS[policy].pick
        self.role = roles.pop()
        self.instances = list(instances)
        self._cycle = itertools.cycle(self.instances)
        self._load = {"prefill": self.prefill_load, "decode": self.decode_load,
                      "colocated": self.colocated_load}[self.role]

    @staticmethod
    def prefill_load(inst) -> int:
        s = inst.scheduler
        return sum(len(r.all_token_ids) - r.num_computed_tokens for r in itertools.chain(s.running, s.waiting))

    @staticmethod
    def decode_load(inst) -> int:
        s = inst.scheduler
        return s.num_running + s.num_waiting

    @staticmethod
    def colocated_load(inst) -> int:
        s = inst.scheduler
        held = itertools.chain(s.running, s.waiting, getattr(s, "swapped", ()), getattr(inst, "inbox", ()))
        return sum(_remaining_tokens(r) for r in held)

    def load(self, inst) -> int:
        return self._load(inst)

    def pick(self):
        return self._pick(self)

    def __call__(self, request=None, instances=None):
        return self.pick()


def _round_robin(router: InstanceRouter):
    return next(router._cycle)


def _least_loaded(router: InstanceRouter):
    if len(router.instances) == 1:
        return next(router._cycle)
    return min(router.instances, key=router._load)   # min keeps the first of equals: deterministic


def register_router(name: str, pick, *, replace: bool = False) -> None:
    """Add router `name` (a valid deployment.router from now on): `pick(router) -> instance`, given the
    InstanceRouter (its `instances`, `role` and `load(inst)`). A built-in row takes its pick function alone."""
    if name in ROUTERS and ROUTERS[name].pick is None:
        ROUTERS[name].pick = pick
    else:
        ROUTERS.add(name, RouterInfo(name, pick), replace=replace)


register_router("round_robin", _round_robin)
register_router("least_loaded", _least_loaded)
ROUTERS.check_complete("pick", {"round_robin": _round_robin, "least_loaded": _least_loaded},
                       "pdjax.scheduler.routing's pick functions")


class RoundRobinRouter:
    """Test-only: instances in turn (as InstanceRouter's 'round_robin', over whatever instances it is called
    with), counting the requests routed to each (`num_routed`, by instance name)."""

    def __init__(self):
        self._count = 0
        self.num_routed = {}

    def __call__(self, request, instances: Sequence):
        inst = instances[self._count % len(instances)]
        self._count += 1
        self.num_routed[inst.name] = self.num_routed.get(inst.name, 0) + 1
        return inst


class LeastOutstandingTokensRouter(RoundRobinRouter):
    """Test-only: the instance with the fewest outstanding tokens (ties to the lowest index), where an
    instance's outstanding tokens are the tokens its routed requests will feed (prompt + max_tokens - 1 each)
    minus the tokens its steps ran. The simulator tells it every completed step (`observe_step`); the
    bookkeeping lives here, not in the simulator's loop."""

    def __init__(self):
        super().__init__()
        self.outstanding = {}

    def __call__(self, request, instances: Sequence):
        outstanding = self.outstanding
        best = instances[0]
        for inst in instances[1:]:
            if outstanding.get(inst.name, 0) < outstanding.get(best.name, 0):
                best = inst
        outstanding[best.name] = outstanding.get(best.name, 0) + request.num_prompt_tokens + request.max_tokens - 1
        self.num_routed[best.name] = self.num_routed.get(best.name, 0) + 1
        return best

    def observe_step(self, inst, out) -> None:
        self.outstanding[inst.name] = self.outstanding.get(inst.name, 0) - out.num_prefill_tokens \
            - out.num_decode_tokens
