"""Instances: one vocabulary for the real engines and the simulator (no JAX).

An instance is a named scheduler in a role of the deployment (pdjax.config.deployment):
- roles 'colocated' (a replica running the scheduler block's policy), 'prefill' (a 'prefill_only' scheduler),
  'decode' (a 'decode_only' scheduler) and 'mixed' (Splitwise's mixed pool: a pdjax.scheduler.mixed.MixedScheduler,
  idle or acting as a prefill_only / decode_only instance by phase);
- names 'replica0', 'replica1', ... (colocated), 'prefill0', ..., 'decode0', ..., 'mixed0', ... (`instance_name`),
  so results, device assignments and iteration records of both backends name instances alike.
`make_role_scheduler(role, config)` builds an instance's scheduler from its SchedulerConfig
(pdjax.config.deployment.instance_scheduler_config): `make_scheduler` for every role but 'mixed'.
`check_instance` is the role check both sides run; `Instance` is the plain base (name, role, scheduler, steps
taken) that the simulator's disaggregated instances extend and the serving engines can adopt. Routing across the
instances of a role: pdjax.scheduler.routing.
"""
from __future__ import annotations

from pdjax.config.deployment import ROLE_POLICIES, ROLES, check_role, instance_name
from pdjax.config.registry import POLICIES
from pdjax.scheduler.mixed import MixedScheduler
from pdjax.scheduler.policies import make_scheduler

__all__ = ["ROLES", "ROLE_POLICIES", "MIXED_SCHEDULER", "Instance", "check_instance", "check_role", "instance_name",
           "make_role_scheduler"]

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


class Instance:
    """A named scheduler in a role (checked by `check_instance`); num_steps counts its iterations."""

    def __init__(self, name: str, role: str, scheduler):
        check_instance(name, role, scheduler)
        self.name, self.role, self.scheduler = name, role, scheduler
        self.num_steps = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.role!r})"
