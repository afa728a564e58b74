"""The host KV tier and cache-aware routing on the real engines (issue 30; the scheduler side is
pdjax.scheduler.kv_tier and pdjax.scheduler.routing, the simulator's pdjax.sim.kv_tier).

- Copies: a page the block manager evicts to its host tier and a host page loaded back are the scheduler's
  `swap_out` / `swap_in` copies, made by the runner's swap path before the step (ModelRunner.swap: all reads
  before any write, so a page offloaded and reused in one step is safe). Host-tier slots are `(owner, index)`
  tuples, so they never collide with swap preemption's int slots in the runner's host store.
- Shared pool (`deployment.host_kv_pool='shared'`): every runner's host store keeps its tier pages in one dict
  (`SharedHostPages`), so instance B loads a page instance A offloaded: the cross-instance fetch is a copy from
  that host memory onto B's devices (one process on one host here; across hosts it would cross the network).
- Routers: the cache-aware routers get the deployment's thresholds. kv_centric's cost is the `cost` given (e.g.
  the simulator's cost model); else, with `deployment.router_cost='seconds'` (the default), seconds measured on
  this engine: pdjax.scheduler.step_fit.MeasuredCost, each instance's step time fitted online from its own timed
  steps (the engine loop feeds it: ClusterEngine calls its `observe_step`), which prices the prefill of the
  uncached and queued tokens and the host-page loads (the runner's swap copies are inside the timed step, so the
  fit learns their seconds per page); with 'tokens', the router's tokens ranking (host loads free).
  The fit's prior (`roofline_prior`): the model's roofline on the simulator's default hardware (an A100-80GB SXM:
  the weights read once per step from HBM, 2 FLOPs per parameter per token, 4 x layers x heads x head_dim FLOPs
  per attention query-key pair, a KV page over a PCIe Gen4 host link), per tensor-parallel device: the roofline
  terms of the simulator's cost model there, without its fitted efficiencies and host terms, so that before any
  step a host load is weighed against recomputing as an accelerator would weigh them. It weighs 8 typical steps
  (step_fit.StepFit): after a few dozen steps of an instance its own times decide (on a CPU they are ~10^4 x the
  prior's), and a term its steps never exercised (an instance that loaded no host page yet) keeps a physical price
  rather than 0.
No scheduling decision is made here.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

from pdjax.config.deployment import uses_host_kv
from pdjax.scheduler.kv_tier import attach_host_tiers
from pdjax.scheduler.step_fit import MeasuredCost

__all__ = ["SharedHostPages", "attach_engine_kv", "roofline_prior", "router_options"]

# roofline_prior's hardware: the simulator's default (sim.hardware 'a100-80gb-sxm': pdjax.sim.hardware, and its host
# link in pdjax.sim.kv_tier.host_link_bandwidth; serving does not import sim, tests/test_step_fit.py checks these).
PRIOR_FLOPS = 312e12                  # FLOP/s, bf16 dense
PRIOR_HBM_BYTES_PER_S = 2039e9        # bytes/s
PRIOR_HOST_LINK_BYTES_PER_S = 32e9    # bytes/s per direction, PCIe Gen4 x16


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


def roofline_prior(spec) -> Callable[..., Tuple[float, ...]]:
    """(instance) -> the prior seconds per unit of each step_fit.FEATURES for `spec` (a ModelSpec) on the instance's
    tensor-parallel devices (module docstring)."""
    params = spec.num_params()

    def prior(inst) -> Tuple[float, ...]:
        mesh = getattr(getattr(inst, "runner", None), "mesh", None)
        tp = int(mesh.shape["tensor"]) if mesh is not None else 1
        page_s = spec.kv_bytes_per_token() * inst.scheduler.config.page_size / (tp * PRIOR_HOST_LINK_BYTES_PER_S)
        return (params * spec.dtype_bytes / (tp * PRIOR_HBM_BYTES_PER_S), 2 * params / (tp * PRIOR_FLOPS),
                4 * spec.num_layers * spec.num_heads * spec.head_dim / (tp * PRIOR_FLOPS), page_s, page_s)
    return prior


def router_options(dep, cost: Optional[Callable[[int, int], float]] = None, spec=None) -> dict:
    """InstanceRouter keyword arguments of the cache-aware routers for the engine (module docstring): kv_centric's
    cost `cost` when given, else (router_cost 'seconds' and the ModelSpec `spec` given) a MeasuredCost and its
    fetch, else the router's tokens default."""
    options = {"balance_abs": dep.router_balance_abs, "balance_rel": dep.router_balance_rel,
               "cache_threshold": dep.router_cache_threshold}
    if cost is not None:
        options["cost"] = cost
    elif dep.router == "kv_centric" and dep.router_cost == "seconds" and spec is not None:
        measured = MeasuredCost(roofline_prior(spec))
        options["cost"], options["fetch"] = measured, measured.fetch
    return options
