"""Instances: one vocabulary for the real engines and the simulator (no JAX).

An instance is a named scheduler in a role of the deployment (pdjax.config.deployment):
- roles 'colocated' (a replica running the scheduler block's policy), 'prefill' (a 'prefill_only' scheduler),
  'decode' (a 'decode_only' scheduler) and 'mixed' (Splitwise's mixed pool: a pdjax.scheduler.mixed.MixedScheduler,
  idle or acting as a prefill_only / decode_only instance by phase);
- names 'replica0', 'replica1', ... (colocated), 'prefill0', ..., 'decode0', ..., 'mixed0', ... (`instance_name`),
  so results, device assignments and iteration records of both backends name instances alike.
`make_role_scheduler(role, config)` builds an instance's scheduler from its SchedulerConfig
(pdjax.config.deployment.instance_scheduler_config): `make_scheduler` for every role but 'mixed'.
`check_instance` is the role check both sides run; `Instance` is the one instance type (name, role, scheduler,
steps taken): the engine's instances (pdjax.serving.cluster.Instance: plus a runner) and the simulator's
(pdjax.sim.simulator.SimInstance: plus a step-time source and its stage pipeline) extend it. `TransferRecord` is
the one record of a KV transfer, written by the engine (pdjax.serving.cluster) and the simulator
(pdjax.sim.disagg) alike. Routing across the instances of a role: pdjax.scheduler.routing.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from pdjax.config.deployment import ROLE_POLICIES, ROLES, check_role, instance_name
from pdjax.config.registry import POLICIES
from pdjax.scheduler.mixed import MixedScheduler
from pdjax.scheduler.policies import make_scheduler

__all__ = ["ROLES", "ROLE_POLICIES", "MIXED_SCHEDULER", "Instance", "TransferRecord", "check_instance", "check_role",
           "instance_name", "make_role_scheduler", "role_of"]

MIXED_SCHEDULER = "mixed"   # pdjax.scheduler.mixed.MixedScheduler.name


def make_role_scheduler(role: str, config):
    """The scheduler of an instance of `role` (config: its SchedulerConfig, from instance_scheduler_config)."""
    check_role(role)
    if role == "mixed":
        return MixedScheduler(config)
    return make_scheduler(config)


def check_instance(name: str, role: str, scheduler) -> None:
    """ValueError unless `role` is a role and `scheduler` runs a policy of it (prefill: 'prefill_only', decode:
    'decode_only', mixed: a MixedScheduler; colocated: any other, a whole-request policy)."""
    if role not in ROLES:
        raise ValueError(f"instance {name!r}: role={role!r}, expected one of {ROLES}")
    policy = getattr(scheduler, "name", scheduler)
    if (role == "mixed") != (policy == MIXED_SCHEDULER):
        raise ValueError(f"instance {name!r} ({role}) " + ("needs a 'mixed' scheduler (pdjax.scheduler.mixed."
                         f"MixedScheduler), got {policy!r}" if role == "mixed" else
                         "cannot run a 'mixed' scheduler (that is the mixed pool's)"))
    if role == "mixed":
        return
    want = ROLE_POLICIES.get(role)
    if want is not None and policy != want:
        raise ValueError(f"instance {name!r} ({role}) needs a {want!r} scheduler, got {policy!r}")
    if want is None and policy in POLICIES and not POLICIES[policy].colocated:
        raise ValueError(f"instance {name!r} ({role}) needs a colocated policy, got {policy!r} (the policy of a "
                         f"disaggregated deployment's role)")


def role_of(scheduler) -> str:
    """The role a scheduler's policy plays on its own: 'prefill' / 'decode' for 'prefill_only' / 'decode_only',
    'mixed' for a MixedScheduler, else 'colocated'."""
    policy = getattr(scheduler, "name", scheduler)
    if policy == MIXED_SCHEDULER:
        return "mixed"
    for role, want in ROLE_POLICIES.items():
        if policy == want:
            return role
    return "colocated"


class Instance:
    """A named scheduler in a role (checked by `check_instance`; None: the scheduler's own, `role_of`);
    num_steps counts its iterations."""

    def __init__(self, name: str, role: Optional[str], scheduler):
        role = role_of(scheduler) if role is None else role
        check_instance(name, role, scheduler)
        self.name, self.role, self.scheduler = name, role, scheduler
        self.num_steps = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.role!r})"


@dataclasses.dataclass
class TransferRecord:
    """One request's KV transfer between two instances (seconds on the run's clock: the engine's, relative to the
    run start, or the simulated one). ready_time: the handoff (the prefill step's end; the engine: the dispatch);
    start_time: when the link took it (later than ready_time when the link was busy); end_time: when the KV was
    on the decode side (the engine: the loop round that saw it ready, a poll-granular upper bound). kv_bytes: the
    request's KV; moved_bytes: the bytes moved (whole pages; the simulator: the KV bytes); num_pages: pages moved
    (the engine's); host_s: host time the engine spent in the transfer call (sync: the whole copy; async: the
    dispatch)."""
    request_id: str
    src: str
    dst: str
    num_tokens: int
    kv_bytes: int
    ready_time: float
    start_time: float
    end_time: float = 0.0
    moved_bytes: int = 0
    num_pages: int = 0
    host_s: float = 0.0

    @property
    def seconds(self) -> float:
        """Seconds on the link: end_time - start_time."""
        return self.end_time - self.start_time

    @property
    def queue_s(self) -> float:
        """Seconds waiting for the link: start_time - ready_time."""
        return self.start_time - self.ready_time

    @property
    def landed_time(self) -> float:
        """The engine's name of end_time."""
        return self.end_time
