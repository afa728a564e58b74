"""The host KV tier and cache-aware routing on the real engines (issue 30; the scheduler side is
pdjax.scheduler.kv_tier and pdjax.scheduler.routing, the simulator's pdjax.sim.kv_tier).

- Copies: a page the block manager evicts to its host tier and a host page loaded back are the scheduler's
  `swap_out` / `swap_in` copies, made by the runner's swap path before the step (ModelRunner.swap: all reads
  before any write, so a page offloaded and reused in one step is safe). Host-tier slots are `(owner, index)`
  tuples, so they never collide with swap preemption's int slots in the runner's host store.
- Shared pool (`deployment.host_kv_pool='shared'`): every runner's host store keeps its tier pages in one dict
  (`SharedHostPages`), so instance B loads a page instance A offloaded: the cross-instance fetch is a copy from
  that host memory onto B's devices (one process on one host here; across hosts it would cross the network).
- Routers: the cache-aware routers get the deployment's thresholds; their prefill cost is `router_cost` when
  given (e.g. the simulator's cost model), else tokens (a ranking by uncached tokens plus queued tokens).
No scheduling decision is made here.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

from pdjax.config.deployment import uses_host_kv
from pdjax.scheduler.kv_tier import attach_host_tiers

__all__ = ["SharedHostPages", "attach_engine_kv", "router_options"]


class SharedHostPages:
    """A runner's host store: int slots (swap preemption) in its own dict, tuple slots (host KV tier pages) in a
    dict shared by every runner of the deployment."""

    def __init__(self, own: dict, shared: dict):
        self.own, self.shared = own, shared

    def _store(self, slot) -> dict:
        return self.shared if slot.__class__ is tuple else self.own

    def __contains__(self, slot) -> bool:
        return slot in self._store(slot)

    def __getitem__(self, slot):
        return self._store(slot)[slot]

    def __setitem__(self, slot, data) -> None:
        self._store(slot)[slot] = data

    def __len__(self) -> int:
        return len(self.own) + len(self.shared)


def attach_engine_kv(instances: Sequence, dep, spec) -> None:
    """Attach cfg.deployment's host KV tiers to the engine's `instances` (pdjax.serving.cluster.Instance, each with
    a runner; `spec` the ModelSpec, for a tier given in GiB) and, for a shared pool, give their runners one host
    store for tier pages."""
    if not uses_host_kv(dep) and not dep.partial_transfer:
        return
    page_size = instances[0].scheduler.config.page_size
    groups: Dict[str, list] = {}
    for inst in instances:
        groups.setdefault(inst.role, []).append(inst)
    attach_host_tiers(groups, dep, spec.kv_bytes_per_token() * page_size)
    if dep.host_kv_pool == "shared":
        shared: dict = {}
        for inst in instances:
            inst.runner.host_pages = SharedHostPages(inst.runner.host_pages, shared)


def router_options(dep, cost: Optional[Callable[[int, int], float]] = None) -> dict:
    """InstanceRouter keyword arguments of the cache-aware routers for the engine (module docstring)."""
    options = {"balance_abs": dep.router_balance_abs, "balance_rel": dep.router_balance_rel,
               "cache_threshold": dep.router_cache_threshold}
    if cost is not None:       # else the router's own default (tokens)
        options["cost"] = cost
    return options
