"""DeploymentConfig: where a run's instances sit, for both backends (no JAX). The real engine runs it and
`--config.backend=sim` simulates exactly it.

    kind = 'colocated'      deployment.colocated: num_instances replicas of (pp, tp), behind deployment.router
    kind = 'disaggregated'  deployment.prefill and deployment.decode groups on disjoint device sets, each request's
                            KV moved once from a prefill to a decode instance; the router picks a prefill instance
                            for an arrival and a decode instance for a handoff; optionally a deployment.mixed group
                            (Splitwise's mixed pool, default 0 instances): machines that take either phase while
                            the prefill (prompt) or the decode (token) pool is overloaded and return to the pool
                            when idle (thresholds `mixed_prefill_queue_tokens`, `mixed_decode_load`;
                            pdjax.scheduler.mixed); or, with `mixed_pool='borrow'`, Splitwise's own mixed pool:
                            no extra group, machines of the prefill and decode pools move into it and back

Choices:
- A group (InstanceGroupConfig) has `num_instances` identical instances (replicas: each its own scheduler and KV
  cache, behind the router). Each instance's mesh is (data=1, stage=pp, tensor=tp) over pp·tp devices: the word
  for replicas is `num_instances`, there is no `dp` (a config that sets `deployment.<group>.dp` fails naming
  `deployment.<group>.num_instances`).
- Roles and instance names (one vocabulary for engine and simulator; pdjax.scheduler.instances builds on it):
  roles 'colocated', 'prefill', 'decode', 'mixed'; instances 'replica0', 'replica1', ... (colocated), 'prefill0',
  ..., 'decode0', ..., 'mixed0', ... The group of the other kind is unused (a colocated run ignores
  deployment.prefill/decode, a disaggregated one deployment.colocated), so one config can switch kind from the
  command line. deployment.mixed is the exception: it is part of a disaggregated deployment only, and a colocated
  one with mixed instances fails (a colocated replica already runs both phases). `roles` lists 'mixed' only when it
  has instances (num_instances 0, the default, is the plain prefill/decode deployment); every other group needs
  num_instances >= 1. Placement order: prefill, decode, mixed.
- Mixed-pool thresholds (Splitwise's cluster-level scheduler; semantics in pdjax.scheduler.mixed):
  `mixed_prefill_queue_tokens` (int >= 1, default 8192 = splitwise-sim's prompt_max_pending_batch_tokens): the
  prefill pool is overloaded for an arrival when every prefill instance has prompt tokens queued (waiting or
  still to prefill) and queued + the new prompt exceeds it. `mixed_decode_load` (a fraction in (0, 1], default 1.0 =
  splitwise-sim's "token machine memory is full"): the decode pool is overloaded for a handoff when on every decode
  instance max(KV pages in use or owed to queued requests plus the request's / num_pages, live sequences + 1 /
  max_num_seqs) exceeds it. Both are read only when there is a mixed pool (deployment.mixed has instances, or
  mixed_pool='borrow').
- `mixed_pool` (pdjax.scheduler.mixed has both readings): 'dedicated' (default) is the deployment.mixed group above
  (0 instances: no mixed pool); 'borrow' is Splitwise's preset: deployment.mixed must have 0 instances, and the
  prefill (prompt) and decode (token) machines themselves move into the mixed pool when the other phase is
  overloaded, run mixed (Sarathi) batches there and return to their own pool when idle, so P prompt + T token
  machines are P + T machines. 'borrow' needs kind='disaggregated'.
- Devices are integer indices into the platform's device list. `devices` of a group lists the devices of all
  its instances in order (instance i takes the i-th run of pp·tp, stage-major: stage 0's tp devices first);
  empty = automatic: colocated instances take devices 0.., prefill instances the first devices, decode instances
  the next ones. Explicit and automatic groups can be mixed; automatic ones take the lowest indices no explicit
  group claimed.
- Per-group scheduler overrides (`num_pages`, `token_budget`, `max_num_seqs`; 0 = the `scheduler` block's
  value; `instance_scheduler_config`): e.g. a large budget on the prefill side, many sequences on the decode side.
- `validate_deployment` checks, at start-up, what needs the model and the machine, for every group the kind uses:
  pp <= the model's layers (pdjax.config.pipeline), tp dividing the model's heads, KV heads and MLP width, enough
  devices, explicit devices in range and groups disjoint. Every error names the key and the value.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

from pdjax.config.parse import (FieldError, check_fields, dataclass_from_dict, flag, nonneg_int, number, one_of,
                               positive_int, text)
from pdjax.config.overload import ADMISSION_POLICIES, REBALANCE_TRIGGERS, check_overload
from pdjax.config.pipeline import check_pipeline_parallel
from pdjax.config.registry import ROUTERS, STACKS, disaggregated_base, is_stack, role_policy

DEPLOYMENT_KINDS = ("colocated", "disaggregated")
ROLES = ("colocated", "prefill", "decode", "mixed")
ROLES_OF_KIND = {"colocated": ("colocated",), "disaggregated": ("prefill", "decode")}   # + 'mixed' when it has any
# The disaggregated roles' policies (the policy table's `role` trait); colocated: the scheduler block's policy.
ROLE_POLICIES = {role: role_policy(role) for role in ("prefill", "decode")}
# deployment.mixed_pool: 'dedicated' (the deployment.mixed group) or 'borrow' (Splitwise's preset: prefill and decode
# machines move into the mixed pool and back; pdjax.scheduler.mixed).
MIXED_POOL_MODES = ("dedicated", "borrow")
# A mixed instance runs pdjax.scheduler.mixed.MixedScheduler (prefill_only or decode_only behaviour by phase; both
# are Sarathi-style), built from the scheduler block with this policy recorded in its SchedulerConfig.
MIXED_BASE_POLICY = disaggregated_base()     # 'sarathi'
_NAME_PREFIX = {"colocated": "replica", "prefill": "prefill", "decode": "decode", "mixed": "mixed"}
# Keys a group no longer has -> what replaces them (deployment_from_dict names it).
REMOVED_GROUP_KEYS = {"dp": "num_instances"}
SCHEDULER_BLOCKS_VALUE = "(0 = the scheduler block's value)"
HOST_KV_POOLS = ("local", "shared")          # pdjax.scheduler.kv_tier (the scheduler layer imports config)
HOST_KV_EVICTIONS = ("lru", "lfu")
CACHE_AWARE_ROUTERS = ("prefix_affinity", "kv_centric")   # read the request's cached prefix per instance
ROUTER_COSTS = ("seconds", "tokens")          # kv_centric's predicted TTFT: in seconds, or by tokens (routing)


def check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role={role!r}, expected one of {ROLES}")
    return role


def instance_name(role: str, index: int) -> str:
    """The name of instance `index` of a role: 'replica0' (colocated), 'prefill0', 'decode0', ..."""
    return f"{_NAME_PREFIX[check_role(role)]}{index}"


@dataclasses.dataclass(frozen=True)
class InstanceGroupConfig:
    """One role's instances. num_instances: replicas (each its own scheduler and KV cache, behind the router);
    0 is allowed only for deployment.mixed (DeploymentConfig checks).
    pp/tp: pipeline stages and tensor-parallel degree of each instance (mesh data=1 x stage=pp x tensor=tp).
    num_pages / token_budget / max_num_seqs: scheduler overrides (0 = the scheduler block's value).
    devices: explicit device indices of all instances (len == num_instances·pp·tp) or () for automatic placement.
    stack: the serving stack whose speed the simulator gives these instances (pdjax.sim.stack): 'pdjax' (the cost
    model: hardware roofline x fitted efficiencies + host terms) or a stack fitted from published step times
    ('distserve': DistServe's engine, 'distserve-vllm': the vLLM it compared against; valid for the (model,
    hardware, tp) they were measured on), 'vllm-eager' (the cost model under an eager PyTorch engine's host-bound
    per-kernel floor, the vLLM Splitwise ran: pdjax.sim.eager), or a stack file fitted from your own measured steps
    (`experiments.fit_profile --stack_steps=CSV --out=S.json`). The real engine is the pdjax stack.
    hardware: the accelerator these instances run on ('' = sim.hardware), so a disaggregated deployment's groups
    may differ (Splitwise-HA: H100 prompt machines, A100 token machines; the KV then crosses the inter-node link
    between the two machine types). The real engine refuses a hardware it is not running on."""
    num_instances: int = nonneg_int(1, expected="a positive int (0 is allowed for the mixed pool only)")
    pp: int = positive_int(1)
    tp: int = positive_int(1)
    num_pages: int = nonneg_int(0, note=SCHEDULER_BLOCKS_VALUE)
    token_budget: int = nonneg_int(0, note=SCHEDULER_BLOCKS_VALUE)
    max_num_seqs: int = nonneg_int(0, note=SCHEDULER_BLOCKS_VALUE)
    devices: Tuple[int, ...] = ()
    stack: str = text("pdjax", expected=f"one of {STACKS} or a stack file (.json)")
    hardware: str = text("", expected="a hardware name ('' = sim.hardware)")
    host_kv_blocks: int = nonneg_int(0, note="(pages of the host-memory KV tier per instance; 0 = none)")
    host_kv_gib: float = number(0.0, low=0, expected="GiB >= 0 of the host-memory KV tier per instance (0 = none)")

    def __post_init__(self):
        check_fields(self)
        if self.host_kv_blocks and self.host_kv_gib:
            raise ValueError(f"host_kv_blocks={self.host_kv_blocks} and host_kv_gib={self.host_kv_gib}: give the "
                             "host KV tier's size one way, expected one of them 0")
        if not is_stack(self.stack):
            raise FieldError("stack", self.stack, f"one of {STACKS} or a stack file (.json, written by "
                             "pdjax.sim.stack.save_stack)")
        devices = tuple(self.devices)
        for d in devices:
            if not isinstance(d, int) or isinstance(d, bool) or d < 0:
                raise ValueError(f"devices={devices!r}: entry {d!r} is not a device index (int >= 0)")
        if len(set(devices)) != len(devices):
            raise ValueError(f"devices={devices!r} lists a device twice")
        if devices and len(devices) != self.num_devices:
            raise ValueError(f"devices={devices!r} has {len(devices)} entries, expected num_instances x pp x tp = "
                             f"{self.num_instances} x {self.pp} x {self.tp} = {self.num_devices}")
        object.__setattr__(self, "devices", devices)

    @property
    def devices_per_instance(self) -> int:
        return self.pp * self.tp

    @property
    def num_devices(self) -> int:
        return self.num_instances * self.devices_per_instance


@dataclasses.dataclass(frozen=True)
class DeploymentConfig:
    """kind: 'colocated' (the `colocated` group) or 'disaggregated' (the `prefill` and `decode` groups, plus the
    `mixed` group when it has instances).
    router: how an arrival picks a colocated or prefill instance, and a handed-off request a decode instance
    ('round_robin', or 'least_loaded': pdjax.scheduler.routing's load of the role).
    mixed: Splitwise's mixed pool (default 0 instances; disaggregated only).
    mixed_prefill_queue_tokens: the prefill pool is overloaded for an arrival when every prefill instance has
      queued prompt tokens and queued + the new prompt exceeds this (int >= 1).
    mixed_decode_load: the decode pool is overloaded for a handoff when every decode instance's load with it
      (max of its KV-page and sequence-slot fractions) exceeds this (a fraction in (0, 1]).
    mixed_pool: 'dedicated' (the `mixed` group is the mixed pool) or 'borrow' (Splitwise's: prefill and decode
      machines move into the mixed pool and back; needs mixed.num_instances=0 and kind='disaggregated').
    Module docstring and pdjax.scheduler.mixed: what a mixed machine then does.
    admission*, rebalance*: early rejection and online XpYd rebalancing (pdjax.config.overload; all off by default).
    KV-cache-centric keys (issue 30, Mooncake's; all off by default; `check_kv_centric` and, for what needs the
    scheduler block, pdjax.config.validate.check_kv_centric_blocks):
    router 'prefix_affinity' / 'kv_centric' (pdjax.scheduler.routing; not with a mixed pool or rebalancing);
    router_cache_threshold / router_balance_abs / router_balance_rel: prefix_affinity's thresholds (the SGLang
      router's rule);
    `<group>.host_kv_blocks` (pages) or `<group>.host_kv_gib`: a host-memory KV tier per instance
      (pdjax.scheduler.kv_tier; needs scheduler.enable_prefix_caching; not on the mixed group);
    host_kv_pool: 'local' (each instance its own tier) or 'shared' (one pool of all their pages, Mooncake's);
    host_kv_eviction: 'lru' or 'lfu';
    host_kv_replicate_after: N > 0 (shared pool only): the N-th remote fetch of a page by one instance gives it a
      copy in that instance's part of the pool (hot-block replication, pdjax.scheduler.kv_tier); 0 = off;
    partial_transfer: a decode instance that holds a prefix of a handed-off request's KV (device or host tier)
      receives only the rest (disaggregated only; needs prefix caching);
    router_cost: kv_centric's predicted TTFT in 'seconds' (the engine: fitted online from each instance's timed
      steps, pdjax.scheduler.step_fit; the simulator: its step cost model and host-link pricing) or 'tokens'
      (uncached plus queued tokens, host loads free: the ranking by tokens)."""
    kind: str = one_of("colocated", DEPLOYMENT_KINDS)
    router: str = one_of("round_robin", ROUTERS)
    colocated: InstanceGroupConfig = InstanceGroupConfig()
    prefill: InstanceGroupConfig = InstanceGroupConfig()
    decode: InstanceGroupConfig = InstanceGroupConfig()
    mixed: InstanceGroupConfig = InstanceGroupConfig(num_instances=0)
    mixed_prefill_queue_tokens: int = positive_int(8192, expected=(
        "an int >= 1 (prompt tokens queued on a prefill instance above which the prefill pool is overloaded)"))
    mixed_decode_load: float = number(1.0, low=0, high=1, low_open=True, expected=(
        "a fraction in (0, 1] (a decode instance's KV-page / sequence-slot load above which the decode pool is "
        "overloaded)"))
    mixed_pool: str = one_of("dedicated", MIXED_POOL_MODES, expected=(
        f"one of {MIXED_POOL_MODES} ('dedicated': the deployment.mixed group; 'borrow': Splitwise's mixed pool of "
        "borrowed prefill and decode machines)"))
    # Overload handling (pdjax.config.overload: early rejection and online XpYd rebalancing; all off by default).
    admission: str = one_of("none", ADMISSION_POLICIES)
    admission_threshold: float = number(1.0, low=0, low_open=True, expected="a decode load > 0 (1.0 = full)")
    admission_handoff_load: float = number(0.0, low=0, note="(0 = off: handoffs queue, never rejected)")
    admission_prefill_tokens_per_s: float = number(0.0, low=0, note="(0 = learned from the run's steps)")
    admission_decode_step_s: float = number(0.0, low=0, note="(0 = learned from the run's steps)")
    rebalance: bool = flag(False)
    rebalance_prefill_queue_tokens: int = positive_int(8192)
    rebalance_decode_load: float = number(0.9, low=0, low_open=True)
    rebalance_window_s: float = number(2.0, low=0)
    rebalance_flip_s: float = number(0.0, low=0)
    rebalance_trigger: str = one_of("load", REBALANCE_TRIGGERS, expected=(
        f"one of {REBALANCE_TRIGGERS} ('load': queued prompt tokens / decode load over their thresholds; 'slo': "
        "TTFT / TPOT over the serve config's slo block; 'slo_predicted': the same with the decode side's TPOT "
        "predicted from its queue)"))
    rebalance_slo_quantile: float = number(0.9, low=0, high=1, low_open=True, expected=(
        "a quantile in (0, 1] (of the observed TTFT / TPOT the 'slo' trigger compares with the SLO)"))
    # KV-cache-centric scheduling (issue 30; pdjax.scheduler.kv_tier, pdjax.scheduler.routing): check_kv_centric
    host_kv_pool: str = one_of("local", HOST_KV_POOLS, expected=(
        f"one of {HOST_KV_POOLS} ('local': each instance its own host KV tier; 'shared': one pool of every "
        "instance's host tiers, Mooncake's)"))
    host_kv_eviction: str = one_of("lru", HOST_KV_EVICTIONS)
    host_kv_replicate_after: int = nonneg_int(0, note=(
        "(remote fetches of a page by one instance after which a shared pool keeps a copy in that instance's "
        "part; 0 = no replication)"))
    partial_transfer: bool = flag(False)
    router_cache_threshold: float = number(0.5, low=0, high=1, expected="a fraction in [0, 1] (prefix_affinity)")
    router_balance_abs: int = nonneg_int(32, note="(prefix_affinity: live-request gap that counts as imbalance)")
    router_balance_rel: float = number(1.0001, low=1, expected="a ratio >= 1 (prefix_affinity)")
    router_cost: str = one_of("seconds", ROUTER_COSTS, expected=(
        f"one of {ROUTER_COSTS} (kv_centric's predicted TTFT: 'seconds' measured / modelled, or 'tokens')"))

    def __post_init__(self):
        if self.router == "least_outstanding_tokens":
            raise FieldError("deployment.router", self.router,
                             f"one of {ROUTERS} ('least_outstanding_tokens' is now 'least_loaded')")
        check_fields(self, "deployment")
        for role in ROLES:
            if not isinstance(getattr(self, role), InstanceGroupConfig):
                raise TypeError(f"deployment.{role}={getattr(self, role)!r}, expected an InstanceGroupConfig")
            if role != "mixed" and getattr(self, role).num_instances < 1:
                raise FieldError(f"deployment.{role}.num_instances", getattr(self, role).num_instances,
                                 "a positive int (only deployment.mixed may have 0 instances)")
        if self.mixed.num_instances and self.kind != "disaggregated":
            raise ValueError(f"deployment.mixed.num_instances={self.mixed.num_instances} with deployment.kind="
                             f"{self.kind!r}: the mixed pool is part of a disaggregated deployment; expected kind="
                             "'disaggregated' or deployment.mixed.num_instances=0")
        if self.mixed_pool == "borrow" and self.kind != "disaggregated":
            raise ValueError(f"deployment.mixed_pool='borrow' with deployment.kind={self.kind!r}: the mixed pool "
                             "borrows prefill and decode machines; expected kind='disaggregated' or "
                             "mixed_pool='dedicated'")
        check_kv_centric(self)
        if self.mixed_pool == "borrow" and self.mixed.num_instances:
            raise ValueError(f"deployment.mixed_pool='borrow' with deployment.mixed.num_instances="
                             f"{self.mixed.num_instances}: a borrowing mixed pool has no machines of its own; "
                             "expected deployment.mixed.num_instances=0 (or mixed_pool='dedicated')")
        check_overload(self)

    @property
    def roles(self) -> Tuple[str, ...]:
        """The groups this kind uses, in placement order: ('colocated',), ('prefill', 'decode') or, with mixed
        instances, ('prefill', 'decode', 'mixed')."""
        roles = ROLES_OF_KIND[self.kind]
        return roles + ("mixed",) if self.kind == "disaggregated" and self.mixed.num_instances else roles

    @property
    def has_mixed_pool(self) -> bool:
        """A dedicated mixed group (deployment.mixed has instances)."""
        return "mixed" in self.roles

    @property
    def borrows(self) -> bool:
        """Splitwise's borrowing mixed pool (mixed_pool='borrow' on a disaggregated deployment)."""
        return self.kind == "disaggregated" and self.mixed_pool == "borrow"

    @property
    def num_devices(self) -> int:
        return sum(self.group(role).num_devices for role in self.roles)

    def group(self, role: str) -> InstanceGroupConfig:
        return getattr(self, check_role(role))

    def instance_names(self, role: str) -> List[str]:
        return [instance_name(role, i) for i in range(self.group(role).num_instances)]

    def device_assignment(self, num_available: int) -> Dict[str, Tuple[int, ...]]:
        """Instance name -> its device indices (mesh order: stage-major), for a machine with `num_available`
        devices; the groups of this kind only.

        Raises ValueError naming the problem: too few devices, an index out of range, or groups sharing a
        device."""
        if self.num_devices > num_available:
            parts = " + ".join(f"{role} {self.group(role).num_instances} x pp {self.group(role).pp} x tp "
                               f"{self.group(role).tp}" for role in self.roles)
            raise ValueError(f"deployment needs {self.num_devices} devices ({parts}), only {num_available} "
                             f"available")
        claimed: Dict[int, str] = {}
        for role in self.roles:
            for d in self.group(role).devices:
                if d >= num_available:
                    raise ValueError(f"deployment.{role}.devices lists device {d}, only {num_available} "
                                     f"available (indices 0..{num_available - 1})")
                if d in claimed:
                    raise ValueError(f"device {d} is in both deployment.{claimed[d]}.devices and "
                                     f"deployment.{role}.devices: groups must be disjoint")
                claimed[d] = role
        free = [d for d in range(num_available) if d not in claimed]
        out: Dict[str, Tuple[int, ...]] = {}
        for role in self.roles:
            group = self.group(role)
            if group.devices:
                devices = list(group.devices)
            else:   # enough are free: the total was checked above and explicit groups are disjoint
                devices, free = free[:group.num_devices], free[group.num_devices:]
            k = group.devices_per_instance
            for i, name in enumerate(self.instance_names(role)):
                out[name] = tuple(devices[i * k:(i + 1) * k])
        return out


def check_kv_centric(dep: "DeploymentConfig") -> None:
    """The KV-cache-centric keys where they apply: cache-aware routers without a mixed pool (which routes by its
    own thresholds), no host KV tier on the mixed group, partial transfer on a disaggregated deployment. The
    scheduler block's side (prefix caching on) is pdjax.config.validate.check_cross_block's."""
    if dep.router in CACHE_AWARE_ROUTERS and (dep.has_mixed_pool or dep.borrows):
        raise ValueError(f"deployment.router={dep.router!r} with a mixed pool: the mixed pool routes by its own "
                         "load thresholds; expected 'round_robin' or 'least_loaded' (or no mixed pool)")
    if (dep.has_mixed_pool or dep.borrows) and (uses_host_kv(dep) or dep.partial_transfer):
        raise ValueError("deployment.<group>.host_kv_blocks / host_kv_gib / partial_transfer with a mixed pool: its "
                         "machines change role, their KV tiers are not modelled; expected no mixed pool or none of "
                         "these keys")
    if dep.mixed.host_kv_blocks or dep.mixed.host_kv_gib:
        raise ValueError("deployment.mixed.host_kv_blocks / host_kv_gib: a mixed instance changes role, its host KV "
                         "tier is not modelled; expected 0")
    if getattr(dep, "rebalance", False) and (dep.router in CACHE_AWARE_ROUTERS or uses_host_kv(dep)
                                             or dep.partial_transfer):
        raise ValueError(f"deployment.rebalance=True with router={dep.router!r} / host KV tiers / partial_transfer: "
                         "a rebalanced instance changes role, which the KV-cache-centric features do not follow; "
                         "expected rebalance=False or none of them")
    if dep.router_cost != "seconds" and dep.router != "kv_centric":
        raise ValueError(f"deployment.router_cost={dep.router_cost!r} with router={dep.router!r}: only kv_centric "
                         "predicts a TTFT; expected router='kv_centric' or router_cost='seconds'")
    if dep.host_kv_replicate_after and (dep.host_kv_pool != "shared" or not uses_host_kv(dep)):
        raise ValueError(f"deployment.host_kv_replicate_after={dep.host_kv_replicate_after} with host_kv_pool="
                         f"{dep.host_kv_pool!r}{'' if uses_host_kv(dep) else ' and no host KV tier'}: copies are "
                         "made in a shared pool; expected host_kv_pool='shared' with host_kv_blocks / host_kv_gib, "
                         "or 0")
    if dep.partial_transfer and dep.kind != "disaggregated":
        raise ValueError(f"deployment.partial_transfer=True with deployment.kind={dep.kind!r}: only a "
                         "disaggregated deployment transfers KV; expected kind='disaggregated' or False")


def uses_host_kv(dep: "DeploymentConfig") -> bool:
    """Some group of this kind has a host KV tier."""
    return any(dep.group(r).host_kv_blocks or dep.group(r).host_kv_gib for r in dep.roles)


def uses_kv_centric(dep: "DeploymentConfig") -> bool:
    """A cache-aware router, a host KV tier or partial transfer is on (the builders then attach them)."""
    return dep.router in CACHE_AWARE_ROUTERS or uses_host_kv(dep) or dep.partial_transfer


def check_group_against_model(role: str, group: InstanceGroupConfig, spec) -> None:
    """pp <= the model's layers and tp dividing its heads, KV heads and MLP width; ValueError naming the key."""
    try:
        check_pipeline_parallel(spec.num_layers, group.pp, group.tp)
    except ValueError as e:
        raise ValueError(f"deployment.{role}.{e} (model {spec.name!r})") from None
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        value = getattr(spec, name)
        if value % group.tp:
            raise ValueError(f"deployment.{role}.tp={group.tp} does not divide {name}={value} of model "
                             f"{spec.name!r}")


def validate_deployment(deployment: DeploymentConfig, spec, num_available: int) -> Dict[str, Tuple[int, ...]]:
    """Check `deployment` against the model `spec` (a ModelSpec) and the machine (`num_available` devices);
    returns the device assignment. Raises ValueError naming the bad value and what was expected."""
    for role in deployment.roles:
        check_group_against_model(role, deployment.group(role), spec)
    return deployment.device_assignment(num_available)


def instance_scheduler_config(base, group: InstanceGroupConfig, role: str):
    """The SchedulerConfig of one instance: `base` with the role's policy ('prefill_only' / 'decode_only'; a
    colocated instance keeps the scheduler block's; a mixed one records MIXED_BASE_POLICY, the base of both role
    policies: its scheduler is pdjax.scheduler.mixed.MixedScheduler) and the group's non-zero overrides; a decode
    group with pp > 1 splits its decodes over pp batches in flight (SchedulerConfig.decode_batches)."""
    check_role(role)
    changes = {}
    if role in ROLE_POLICIES:
        changes["policy"] = ROLE_POLICIES[role]
    elif role == "mixed" and base.policy != MIXED_BASE_POLICY:
        changes["policy"] = MIXED_BASE_POLICY
    for name in ("num_pages", "token_budget", "max_num_seqs"):
        if getattr(group, name):
            changes[name] = getattr(group, name)
    if role == "decode" and group.pp > 1:   # pipelined decode: its running decodes split over pp batches in flight
        changes["decode_batches"] = group.pp
    return dataclasses.replace(base, **changes) if changes else base


def check_removed_group_keys(d) -> None:
    """Fail naming the replacement when a group block of the `deployment` dict sets a removed key (`dp`)."""
    for role in ROLES:
        block = (d or {}).get(role)
        if not isinstance(block, dict):
            continue
        for key, new in REMOVED_GROUP_KEYS.items():
            if key in block:
                raise ValueError(
                    f"deployment.{role}.{key} is not a key any more: replicas are deployment.{role}.{new} (each "
                    f"its own scheduler and KV cache, behind deployment.router); each instance's mesh is "
                    f"(data=1, stage=pp, tensor=tp)")


def deployment_from_dict(d) -> DeploymentConfig:
    """DeploymentConfig from the nested dict of a config file's `deployment` block (unknown keys fail; removed
    keys fail naming their replacement). A `mixed` block without num_instances has 0 (the field's default), as
    when the block is absent."""
    check_removed_group_keys(d)
    mixed = (d or {}).get("mixed")
    if isinstance(mixed, dict) and "num_instances" not in mixed:
        d = {**d, "mixed": {**mixed, "num_instances": 0}}
    return dataclass_from_dict(DeploymentConfig, d, "deployment")
