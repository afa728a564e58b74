"""KV-cache-centric scheduling in the simulator (issue 30): what host KV loads cost, the cost callables the
cache-aware routers read, and how a built setup gets them (no JAX).

- Host link: a page loaded back from an instance's own host KV tier crosses the host <-> device link
  (`host_link_bandwidth`: PCIe Gen4 x16 for A100 / A40 / L4 machines, Gen5 x16 for H100 / H200, 32 / 64 GB/s per
  direction; TPU hosts: PCIe Gen4 too; host-cpu: its own memory copy bandwidth). A page of a shared pool that another
  instance offloaded is a remote fetch: it crosses that machine's host link and the network between the two, at the
  slower of the two (the KV link between different nodes, pdjax.sim.disagg.kv_link's inter-node figure).
- `HostLoadStepTime` wraps an instance's step time: a step whose SchedulerOutput carries host -> device copies
  (`swap_in`: host-tier hits loaded back at admission, and swap preemption's resumes) takes
  pages x page bytes / bandwidth longer (the load is on the step's critical path: the step's attention reads
  those pages; offloads, device -> host, go in the background as Mooncake's do and cost no step time). Decode runs
  (pdjax.sim.simulator) are unchanged: their steps admit nobody, so they load nothing (a run waits while a load
  is pending: Scheduler._caching_run_ok), and the offloads of the cached pages they evict cost nothing.
- `prefill_cost(step_time, budget)`: `(new_tokens, cached_tokens) -> seconds`, the kv_centric router's prefill
  time from the instance group's own step cost: ceil(new / budget) chunks, each a step of one `budget`-token chunk
  at the mean context (one composition call, memoized), as the chunked prefill runs it when alone.
- `apply_kv_centric(setup, instances)`: attach host tiers (pdjax.scheduler.kv_tier.attach_host_tiers), wrap the
  step times of instances with a tier, stop their block managers recording offload copies nothing reads here
  (BlockManager.record_offloads), and `router_options(setup, role)` the router's cost, fetch and thresholds.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Sequence

from pdjax.scheduler.kv_tier import attach_host_tiers
from pdjax.scheduler.output import SchedulerOutput
from pdjax.sim.cost_model import kv_bytes
from pdjax.sim.hardware import HardwareSpec
from pdjax.sim.pipeline import StageTimer
from pdjax.sim.step_time import StepTimeBase

GB = 1e9
_PCIE_GEN5 = ("h100", "h200")


def host_link_bandwidth(hw: HardwareSpec) -> float:
    """Bytes/s per direction between an accelerator and its host's memory (module docstring)."""
    if hw.kind == "cpu":
        return hw.hbm_bandwidth
    return 64 * GB if hw.name.startswith(_PCIE_GEN5) else 32 * GB


def remote_fetch_bandwidth(hw: HardwareSpec) -> float:
    """Bytes/s of a page fetched from another machine's host memory: its host link, then the network."""
    return min(host_link_bandwidth(hw), hw.inter_node_bandwidth)


class HostLoadStepTime(StepTimeBase):
    """`base`'s step time plus the step's host -> device page loads (module docstring). owner: this instance's name
    (a host-tier slot (owner, index) of another owner is a remote fetch); seconds per page local / remote."""

    def __init__(self, base, owner: str, local_s: float, remote_s: float):
        if getattr(base, "pp", 1) != 1:
            raise ValueError(f"instance {owner!r}: a host KV tier with pp={base.pp} pipeline stages is not "
                             "simulated; expected deployment.<group>.pp=1 or no host KV tier")
        self.base, self.owner, self.local_s, self.remote_s = base, owner, local_s, remote_s
        self.takes_context = bool(getattr(base, "takes_context", False))
        self.decode_only_exact = bool(getattr(base, "decode_only_exact", False))
        # base's own (no delegating frame: the run planner calls composition at every step with chunks)
        self.decode_fn = getattr(base, "decode_fn", self.decode_fn)
        self.composition = getattr(base, "composition", self.composition)

    def load_seconds(self, swap_in: Sequence) -> float:
        remote = sum(1 for slot, _ in swap_in if slot.__class__ is tuple and slot[0] != self.owner)
        return (len(swap_in) - remote) * self.local_s + remote * self.remote_s

    def __call__(self, out, ctx=None) -> float:
        t = self.base(out) if ctx is None else self.base(out, ctx)
        return t + self.load_seconds(out.swap_in) if out.swap_in else t


def prefill_cost(step_time, budget: int) -> Callable[[int, int], float]:
    """(new_tokens, cached_tokens) -> seconds of a chunked prefill of `new_tokens` after `cached_tokens` on an
    instance with this step time and token budget (module docstring). Needs a step time with `composition`
    (decode_only_exact: the 'pdjax' stack without padding); else one step of the whole prefill, timed by a
    one-request SchedulerOutput."""
    if budget < 1:
        raise ValueError(f"prefill_cost: budget={budget}, expected >= 1")

    @functools.lru_cache(maxsize=65536)
    def chunk(n: int, context: int) -> float:
        if step_time.decode_only_exact:
            return step_time.composition(0, 0, [(n, context)])
        out = SchedulerOutput(step=0, req_ids=["route"], token_ids=[[]], num_computed_tokens=[context],
                              num_new_tokens=[n], page_tables=[[]], do_sample=[True], sampling=[None],
                              is_prefill=[True], num_prefill_tokens=n)
        return step_time(out)

    def cost(new_tokens: int, cached_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        chunks = -(-new_tokens // budget)
        size = min(budget, new_tokens)
        mean_context = cached_tokens + (new_tokens - size) // 2
        return chunks * chunk(size, mean_context - mean_context % 256)   # contexts in 256-token steps: memo hits
    return cost


def page_bytes(setup) -> int:
    """Bytes of one KV page of the setup's model (all layers, K and V)."""
    page_size = next(iter(setup.groups.values())).scheduler_config.page_size
    return kv_bytes(setup.model, page_size)


def hardware_of(setup, role: str) -> HardwareSpec:
    return setup.groups[role].hardware or setup.hardware


def apply_kv_centric(setup, instances: Dict[str, List[Any]]) -> None:
    """Attach the deployment's host KV tiers (setup.kv: its DeploymentConfig) to the built `instances` (role ->
    SimInstances) and price their host loads (HostLoadStepTime on each instance with a tier)."""
    dep = setup.kv
    pb = page_bytes(setup)
    attach_host_tiers({r: v for r, v in instances.items() if r in dep.roles}, dep, pb)
    for role, group in instances.items():
        hw = hardware_of(setup, role)
        local_s, remote_s = pb / host_link_bandwidth(hw), pb / remote_fetch_bandwidth(hw)
        for inst in group:
            if inst.scheduler.block_manager.host_tier is None:
                continue
            inst.scheduler.block_manager.record_offloads = False      # offloads cost no step time here
            inst.step_time = HostLoadStepTime(inst.timer.step_time, inst.name, local_s, remote_s)
            inst.timer = StageTimer(inst.step_time, None)


def router_options(setup, role: str, step_time) -> Dict[str, Any]:
    """InstanceRouter keyword arguments for `role`'s router under setup.kv: kv_centric's cost (the group's step
    cost, `prefill_cost`) and fetch (host-load seconds of local / remote pages; both the router's tokens default
    under deployment.router_cost='tokens'), prefix_affinity's thresholds."""
    dep = setup.kv
    thresholds = {"balance_abs": dep.router_balance_abs, "balance_rel": dep.router_balance_rel,
                  "cache_threshold": dep.router_cache_threshold}
    if dep.router_cost == "tokens":
        return thresholds
    pb = page_bytes(setup)
    hw = hardware_of(setup, role)
    local_s, remote_s = pb / host_link_bandwidth(hw), pb / remote_fetch_bandwidth(hw)
    base = step_time.base if isinstance(step_time, HostLoadStepTime) else step_time
    return {"cost": prefill_cost(base, setup.groups[role].scheduler_config.token_budget),
            "fetch": lambda local, remote: local * local_s + remote * remote_s, **thresholds}


def configure_router(router, options: Dict[str, Any]) -> None:
    """Set an InstanceRouter's kv options (router_options) after it was built (the disaggregated pool builds its
    own routers)."""
    for name, value in options.items():
        setattr(router, name, value)
