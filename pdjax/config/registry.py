"""The plug-in registries: one table per kind of plug-in, the single source of its names and traits (no JAX, no
imports from above pdjax.config).

    POLICIES  batching policy name -> PolicyInfo (its traits; its Scheduler class once pdjax.scheduler.policies
              has registered it: `register_policy` there adds a class and its row in one call)
    ROUTERS   router name -> RouterInfo (its pick function once pdjax.scheduler.routing has registered it)
    STACKS    serving stack name -> StackInfo (its factory once pdjax.sim.step_time has registered it)

Config validation reads these tables (a field `one_of(default, POLICIES)` accepts every name registered so far, and
its error lists them), so a plug-in registered in a test or a user module is a valid config value at once. The
implementation layer registers its classes and checks at import that every row has one and every class a row
(`Registry.check_complete`). Hardware specs and machine SKUs have their own registries (pdjax.sim.hardware,
pdjax.sim.machines).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Iterator, Mapping, Optional, Sequence, Tuple


class Registry(Mapping):
    """An ordered name -> row table. `name in registry`, iteration (names in registration order) and its repr (the
    names as a tuple, as the old constant tuples printed) make it usable wherever a tuple of names was."""

    def __init__(self, kind: str):
        self.kind = kind
        self._rows: Dict[str, Any] = {}

    def add(self, name: str, row: Any, *, replace: bool = False) -> Any:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name {name!r}: expected a non-empty string")
        if name in self._rows and not replace:
            raise ValueError(f"{self.kind} {name!r} is registered already")
        self._rows[name] = row
        return row

    def remove(self, name: str) -> None:
        """Drop a row (tests registering a toy plug-in clean up with it)."""
        del self._rows[name]

    def __getitem__(self, name: str) -> Any:
        return self._rows[name]

    def __contains__(self, name: object) -> bool:
        return name in self._rows

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._rows))

    def __len__(self) -> int:
        return len(self._rows)

    def names(self, **traits: Any) -> Tuple[str, ...]:
        """The names (registration order) whose rows have every given trait value, e.g. names(chunking=True)."""
        return tuple(n for n, row in self._rows.items()
                     if all(getattr(row, k) == v for k, v in traits.items()))

    def check_complete(self, attr: str, implemented: Mapping[str, Any], what: str) -> None:
        """Every row's `attr` is set and the implementations `implemented` (name -> object) are exactly the rows:
        the import-time check that the table and the classes agree."""
        missing = [n for n, row in self._rows.items() if getattr(row, attr) is None]
        extra = sorted(set(implemented) - set(self._rows))
        if missing or extra:
            raise RuntimeError(f"{self.kind} registry and {what} disagree: rows without one {missing}, "
                               f"ones without a row {extra}")

    def __repr__(self) -> str:
        return repr(tuple(self._rows))

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:    # one table is one object (a Mapping would compare rows)
        return self is other

    __hash__ = object.__hash__


# --------------------------------------------------------------------------------------------------- policies
@dataclasses.dataclass
class PolicyInfo:
    """One batching policy. chunking: may split a prompt into chunks (`enable_chunking` applies); stall_free:
    schedules every running decode each step (so token_budget >= max_num_seqs); decode_run: Scheduler.decode_run
    may apply its steady steps in bulk (the exact class; pdjax.scheduler.runs); colocated: a colocated
    deployment may run it (every policy but a disaggregated role's); baseline: 0, or k >= 1 for the k-th colocated
    baseline the placement / provision / regime searches offer (`baseline_policies()`, in that order: the
    searches' candidates and their defaults); role_base: a disaggregated
    deployment's scheduler block may name it (the roles' policies are derived from it); role: 'prefill' / 'decode'
    when it is that disaggregated role's policy; decode_batches / min_prefill_tokens: it reads that knob of
    SchedulerConfig. cls: the Scheduler class (set by pdjax.scheduler.policies.register_policy)."""
    name: str
    chunking: bool = False
    stall_free: bool = False
    decode_run: bool = False
    colocated: bool = True
    baseline: int = 0
    role_base: bool = False
    role: str = ""
    decode_batches: bool = False
    min_prefill_tokens: bool = False
    cls: Optional[type] = None


POLICIES = Registry("policy")


def add_policy(info: PolicyInfo, *, replace: bool = False) -> PolicyInfo:
    """Add a policy's row (pdjax.scheduler.policies.register_policy adds the row and its class together)."""
    if info.role not in ("", "prefill", "decode"):
        raise ValueError(f"policy {info.name!r}: role={info.role!r}, expected '', 'prefill' or 'decode'")
    if info.role and info.colocated:
        raise ValueError(f"policy {info.name!r}: the {info.role} role's policy cannot run colocated")
    return POLICIES.add(info.name, info, replace=replace)


for _info in (
        PolicyInfo("vllm_v0", decode_run=True, baseline=2),
        PolicyInfo("orca", decode_run=True),
        PolicyInfo("decode_first", decode_run=True),
        PolicyInfo("sarathi", chunking=True, stall_free=True, decode_run=True, baseline=1, role_base=True,
                   decode_batches=True, min_prefill_tokens=True),
        PolicyInfo("chunked_only", chunking=True, decode_run=True),
        PolicyInfo("chunked_prefill_first", chunking=True, decode_run=True),
        PolicyInfo("vllm_v1", chunking=True, stall_free=True, decode_run=True, min_prefill_tokens=True),
        PolicyInfo("prefill_only", chunking=True, colocated=False, role_base=True, role="prefill",
                   decode_batches=True),
        # decode_only qualifies for decode runs: its schedule() is Sarathi's plus the admission of landed KV, which
        # a run's first step takes (_run_kv_admissions); the disaggregated simulator bounds a run by the next landing.
        PolicyInfo("decode_only", chunking=True, stall_free=True, decode_run=True, colocated=False, role_base=True,
                   role="decode", decode_batches=True)):
    add_policy(_info)


def baseline_policies() -> Tuple[str, ...]:
    """The colocated baselines of the placement / provision / regime searches, in their `baseline` order."""
    return tuple(sorted((n for n in POLICIES if POLICIES[n].baseline), key=lambda n: POLICIES[n].baseline))


class LiveNames(Sequence):
    """An ordered, read-only view of names that `select()` computes from a registry at each use (so a plug-in
    registered after import is in it); it prints as the tuple of names, as the constant tuples it replaces did."""

    def __init__(self, select: Callable[[], Tuple[str, ...]]):
        self._select = select

    def __getitem__(self, i):
        return self._select()[i]

    def __len__(self) -> int:
        return len(self._select())

    def __iter__(self) -> Iterator[str]:
        return iter(self._select())

    def __contains__(self, name: object) -> bool:
        return name in self._select()

    def __repr__(self) -> str:
        return repr(self._select())

    __str__ = __repr__


BASELINE_POLICIES = LiveNames(baseline_policies)   # the searches' colocated baselines: ('sarathi', 'vllm_v0')


def disaggregated_base() -> str:
    """The scheduler-block policy a disaggregated deployment's roles derive from (the colocated role base:
    'sarathi'); the searches write it into the serve configs of their disaggregated candidates."""
    return next(n for n in POLICIES if POLICIES[n].role_base and POLICIES[n].colocated)


def role_policy(role: str) -> Optional[str]:
    """The policy of disaggregated role `role` ('prefill' / 'decode'), None for any other role."""
    names = POLICIES.names(role=role) if role else ()
    return names[0] if names else None


# --------------------------------------------------------------------------------------------------- routers
@dataclasses.dataclass
class RouterInfo:
    """One router (deployment.router). pick: `(InstanceRouter) -> instance` (set by pdjax.scheduler.routing).
    stale_ok: `(InstanceRouter, instance, request, prefill_tokens) -> bool`, or None (never): True when pick(request)
    reads nothing of the instance that its steps run but not yet applied change, but the `prefill_tokens` prompt
    tokens they compute and the pages they allocate (InstanceRouter.unapplied), so the simulator may route without
    applying them first (pdjax.sim.simulator.LazyRun)."""
    name: str
    pick: Optional[Callable] = None
    stale_ok: Optional[Callable] = None


ROUTERS = Registry("router")
for _name in ("round_robin", "least_loaded", "prefix_affinity", "kv_centric"):
    ROUTERS.add(_name, RouterInfo(_name))


# --------------------------------------------------------------------------------------------------- stacks
@dataclasses.dataclass
class StackInfo:
    """One serving stack (deployment.<group>.stack): what times a step of the simulator's instances. factory:
    `() -> Stack` (pdjax.sim.step_time; set by pdjax.sim.step_time.register_stack)."""
    name: str
    factory: Optional[Callable] = None


STACKS = Registry("stack")
for _name in ("pdjax", "distserve", "distserve-vllm", "vllm-eager"):
    STACKS.add(_name, StackInfo(_name))


def is_stack(name: str) -> bool:
    """A registered stack name or a stack file (a path ending in .json, pdjax.sim.stack.save_stack)."""
    return name in STACKS or name.endswith(".json")
