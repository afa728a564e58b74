"""Simulated prefill/decode disaggregation: N prefill instances and M decode instances on a virtual clock, with one
KV transfer per request between them (the simulator counterpart of pdjax/serving/disagg.py).

Per request (the protocol of pdjax/scheduler/policies.py, as the real DisaggregatedEngine drives it):
  arrival -> prefill router -> `add_request` on a prefill_only scheduler -> prefill chunks -> first token sampled
  at the end of the last chunk's step (TTFT stamped here) -> finished with 'handoff' -> decode router ->
  `add_handoff(req, now)` -> KV transfer on the link between the two instances -> at its end:
  `mark_kv_arrived` on the decode side and `release` on the prefill side (its pages are free again) ->
  the decode_only scheduler admits it once a slot, budget and pages fit (backpressure) -> decode steps stamp the
  later tokens. A request that ends on its first token ('length' with max_tokens=1) never reaches a decode
  instance; one the decode side rejects is released on the prefill side at once.

Choices (and why):
- Every instance runs its own engine loop (schedule -> step of `step_time(out)` seconds -> update -> schedule ...),
  independently of the others, as separate serving processes do in DistServe/Splitwise-style deployments. The
  real DisaggregatedEngine is one host thread that runs the instances in lock-step rounds (a round ends when its
  slowest step was collected); that coupling is an artefact of driving all groups from one Python loop on a
  single host, not of disaggregation, so the simulator does not copy it. Arrivals and handoffs reach a
  scheduler at their own time (the engine admits arrivals while steps run); an idle or blocked instance is woken
  by the events that can unblock it (an arrival, a KV arrival, a release of its held pages).
- Event order at one time t: step completions (update, handoffs start their transfers), then transfer
  completions (mark_kv_arrived + release), then arrivals; then every woken instance schedules, prefill
  instances first, each group in index order. Ties in the heaps go by insertion order: deterministic.
- Transfer time of a request with p prompt tokens: `p2p_time(kv_bytes(model, p) / streams, link)` of the cost
  model (comm_fixed_s + link latency + bytes / (bandwidth · comm_bandwidth_efficiency)). The KV is sharded over
  the tp·pp devices of each side; stream i moves device i's share to device i of the other side, so
  streams = min(tp·pp of prefill, tp·pp of decode) and the slowest stream's link sets the bandwidth
  (`kv_link`): both devices on one node -> the node's link (NVLink pair on a pairwise box, else the intra-node
  link: NVSwitch / PCIe), different nodes -> the inter-node network. Device placement comes from
  `deployment.device_assignment` (explicit `devices` put groups on other nodes).
- Transfers on one (prefill instance, decode instance) link are serialized by default (a FIFO transfer queue:
  a transfer starts when the link is free); `serialize_transfers=False` lets them overlap at full bandwidth.
- KV pages per instance: the group's `num_pages` override, else `sim.num_pages`, else (GPU/TPU) the cost model's
  capacity at that group's tp/pp, token budget and max_num_seqs, else `scheduler.num_pages`. Decode-side
  staging of arriving KV is not counted against pages (the real engine stages it outside the page pool too).
- Outputs: the same RequestRecord / IterationRecord lists as a real disaggregated run (instance names
  'prefill0', 'decode0', ..., per-instance step indices) plus one TransferRecord per transfer.
No JAX.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from pdjax.config.buckets import engine_buckets
from pdjax.config.deployment import instance_scheduler_config
from pdjax.metrics import IterationRecord, request_record, stats
from pdjax.scheduler import make_scheduler
from pdjax.scheduler.routing import InstanceRouter
from pdjax.sim.cost_model import CostParams, kv_bytes, kv_cache_capacity_tokens, p2p_time
from pdjax.sim.hardware import HardwareSpec, get_hardware_spec
from pdjax.sim.simulator import SimResult, placeholder_sample
from pdjax.sim.step_cost import EnginePadding, make_step_time

ROLES = ("prefill", "decode")
_POLICY_OF_ROLE = {"prefill": "prefill_only", "decode": "decode_only"}


# --------------------------------------------------------------------------------------------------- state
class DisaggSimInstance:
    """One simulated prefill or decode instance: its scheduler ('prefill_only' / 'decode_only') and step time
    (SchedulerOutput -> seconds)."""

    def __init__(self, name: str, role: str, scheduler, step_time: Callable[[Any], float]):
        if role not in _POLICY_OF_ROLE:
            raise ValueError(f"instance {name!r}: role={role!r}, expected 'prefill' or 'decode'")
        want = _POLICY_OF_ROLE[role]
        if getattr(scheduler, "name", None) != want:
            raise ValueError(f"instance {name!r} ({role}) needs a {want!r} scheduler, got "
                             f"{getattr(scheduler, 'name', scheduler)!r}")
        self.name, self.role, self.scheduler, self.step_time = name, role, scheduler, step_time
        self.in_flight: Optional[Tuple[Any, float]] = None   # (SchedulerOutput, start time) of the running step
        self.num_steps = 0

    @property
    def busy(self) -> bool:
        return self.in_flight is not None


@dataclasses.dataclass
class TransferRecord:
    """One request's KV transfer (seconds on the simulated clock). ready_time: the handoff (prefill step end);
    start_time: when the link took it (later than ready_time when the link was busy); end_time: KV arrived."""
    request_id: str
    src: str
    dst: str
    num_tokens: int
    kv_bytes: int
    ready_time: float
    start_time: float
    end_time: float

    @property
    def seconds(self) -> float:
        return self.end_time - self.start_time

    @property
    def queue_s(self) -> float:
        return self.start_time - self.ready_time


@dataclasses.dataclass
class DisaggSimResult(SimResult):
    transfers: List[TransferRecord] = dataclasses.field(default_factory=list)

    def transfer_summary(self) -> Dict[str, Any]:
        """count, total KV bytes, and stats ({'mean','p50','p90','p99'}) of transfer and link-queue seconds."""
        return {"num_transfers": len(self.transfers), "kv_bytes": sum(t.kv_bytes for t in self.transfers),
                "transfer_s": stats([t.seconds for t in self.transfers]),
                "queue_s": stats([t.queue_s for t in self.transfers])}


# --------------------------------------------------------------------------------------------------- links
def kv_link(hw: HardwareSpec, src_devices: Sequence[int], dst_devices: Sequence[int]) -> Tuple[float, float, int]:
    """(bandwidth per stream in bytes/s, latency in s, number of parallel streams) of a KV transfer between an
    instance on `src_devices` and one on `dst_devices` (device indices; node = index // devices_per_node).
    Stream i pairs src_devices[i] with dst_devices[i]; the slowest pair's link sets the bandwidth."""
    if not src_devices or not dst_devices:
        raise ValueError(f"kv_link: src_devices={list(src_devices)}, dst_devices={list(dst_devices)}, expected "
                         "at least one device on each side")
    streams = min(len(src_devices), len(dst_devices))
    links = []
    for a, b in zip(src_devices[:streams], dst_devices[:streams]):
        if a // hw.devices_per_node != b // hw.devices_per_node:
            links.append((hw.inter_node_bandwidth, hw.inter_node_latency))
        elif hw.intra_node_topology == "pairwise" and a // 2 == b // 2:
            links.append((hw.pairwise_bandwidth, hw.intra_node_latency))
        else:
            links.append((hw.intra_node_bandwidth, hw.intra_node_latency))
    bandwidth = min(bw for bw, _ in links)
    latency = max(lat for _, lat in links)
    return bandwidth, latency, streams


def make_transfer_time(model, bandwidth: float, latency: float, streams: int = 1,
                       params: Optional[CostParams] = None) -> Callable[[int], float]:
    """num_tokens -> seconds to move that many tokens' KV of `model` over `streams` parallel links of
    `bandwidth` bytes/s each (the cost model's p2p_time, see the module docstring)."""
    if bandwidth <= 0 or latency < 0 or streams < 1:
        raise ValueError(f"transfer link: bandwidth={bandwidth!r} (expected > 0), latency={latency!r} (expected "
                         f">= 0), streams={streams!r} (expected >= 1)")
    params = CostParams() if params is None else params

    def transfer_time(num_tokens: int) -> float:
        return p2p_time(kv_bytes(model, num_tokens) / streams, bandwidth, latency, params)
    return transfer_time


# --------------------------------------------------------------------------------------------------- simulation
def simulate_disaggregated(requests: Sequence, prefill: Sequence[DisaggSimInstance],
                           decode: Sequence[DisaggSimInstance],
                           transfer_time: Callable[[DisaggSimInstance, DisaggSimInstance, int], float], *,
                           kv_bytes_of: Callable[[int], int] = lambda n: 0, router: str = "round_robin",
                           serialize_transfers: bool = True, sample: Callable = placeholder_sample,
                           on_schedule: Optional[Callable] = None,
                           max_iterations: int = 50_000_000) -> DisaggSimResult:
    """Serve `requests` (scheduler Requests, arrival_time in seconds) on prefill and decode instances until all
    finish (module docstring).

    transfer_time(src, dst, num_tokens) -> seconds of one KV transfer; kv_bytes_of(num_tokens) -> bytes (for the
    records only). on_schedule(instance, out, now) is called after every non-empty schedule(). Raises
    RuntimeError when requests are left that no instance can schedule, or after `max_iterations` iterations.
    """
    prefill, decode = list(prefill), list(decode)
    for group, role in ((prefill, "prefill"), (decode, "decode")):
        if not group:
            raise ValueError(f"simulate_disaggregated: needs at least one {role} instance")
        for inst in group:
            if inst.role != role:
                raise ValueError(f"instance {inst.name!r} has role {inst.role!r} but was given as {role}")
    instances = prefill + decode
    names = [i.name for i in instances]
    if len(set(names)) != len(names):
        raise ValueError(f"instance names must be unique, got {names}")
    sizes = {i.name: i.scheduler.config.page_size for i in instances}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"all instances need the same page_size (pages move whole), got {sizes}")

    wall_start = time.perf_counter()
    prefill_router, decode_router = InstanceRouter(router, prefill), InstanceRouter(router, decode)
    index_of = {id(inst): i for i, inst in enumerate(instances)}
    pending = sorted(requests, key=lambda r: (r.arrival_time, r.request_id))
    iterations: List[IterationRecord] = []
    transfers: List[TransferRecord] = []
    completions: list = []        # heap of (end time, instance index)
    arrivals_of_kv: list = []     # heap of (end time, seq, TransferRecord, src index, dst index)
    link_free: Dict[Tuple[int, int], float] = {}
    seq = itertools.count()
    waking = [False] * len(instances)
    next_arrival, now, inf = 0, 0.0, float("inf")

    def handoff(src_idx: int, req, t: float) -> None:
        src = instances[src_idx]
        dst = decode_router.pick()
        if not dst.scheduler.add_handoff(req, t):
            src.scheduler.release(req.request_id)
            waking[src_idx] = True
            return
        dst_idx = index_of[id(dst)]
        tokens = req.num_computed_tokens
        start = max(t, link_free.get((src_idx, dst_idx), t)) if serialize_transfers else t
        end = start + transfer_time(src, dst, tokens)
        link_free[(src_idx, dst_idx)] = end
        record = TransferRecord(req.request_id, src.name, dst.name, tokens, kv_bytes_of(tokens), t, start, end)
        transfers.append(record)
        heapq.heappush(arrivals_of_kv, (end, next(seq), record, src_idx, dst_idx))

    def run_loop(idx: int, t: float) -> None:
        inst = instances[idx]
        sched = inst.scheduler
        if inst.busy or not sched.has_unfinished():
            return
        out = sched.schedule(t)
        if out.is_empty:
            return                     # blocked: woken by an arrival, a KV arrival or a release
        if on_schedule is not None:
            on_schedule(inst, out, t)
        inst.in_flight = (out, t)
        heapq.heappush(completions, (t + inst.step_time(out), next(seq), idx))

    while True:
        t_arrival = pending[next_arrival].arrival_time if next_arrival < len(pending) else inf
        t_done = completions[0][0] if completions else inf
        t_kv = arrivals_of_kv[0][0] if arrivals_of_kv else inf
        now = min(t_arrival, t_done, t_kv)
        if now == inf:
            break
        while (completions and completions[0][0] <= now) or (arrivals_of_kv and arrivals_of_kv[0][0] <= now):
            while completions and completions[0][0] <= now:
                _, _, idx = heapq.heappop(completions)
                inst = instances[idx]
                out, start = inst.in_flight
                inst.in_flight = None
                finished = inst.scheduler.update(out, sample(out), now)
                iterations.append(IterationRecord(
                    step=inst.num_steps, start_time=start, end_time=now, num_prefill_tokens=out.num_prefill_tokens,
                    num_decode_tokens=out.num_decode_tokens, num_seqs=len(out.req_ids), instance=inst.name))
                inst.num_steps += 1
                waking[idx] = True
                if len(iterations) > max_iterations:
                    raise RuntimeError(f"simulation exceeded max_iterations={max_iterations}")
                for req in finished:
                    if req.finish_reason == "handoff":
                        handoff(idx, req, now)
            if arrivals_of_kv and arrivals_of_kv[0][0] <= now:
                _, _, record, src_idx, dst_idx = heapq.heappop(arrivals_of_kv)
                instances[dst_idx].scheduler.mark_kv_arrived(record.request_id)
                instances[src_idx].scheduler.release(record.request_id)
                waking[src_idx] = waking[dst_idx] = True
        while next_arrival < len(pending) and pending[next_arrival].arrival_time <= now:
            req = pending[next_arrival]
            next_arrival += 1
            inst = prefill_router.pick()
            inst.scheduler.add_request(req)      # a rejection finishes req as 'rejected' (recorded as such)
            waking[index_of[id(inst)]] = True
        for idx in range(len(instances)):
            if waking[idx]:
                waking[idx] = False
                run_loop(idx, now)

    stuck = {i.name: (i.scheduler.num_waiting, i.scheduler.num_running)
             for i in instances if i.scheduler.has_unfinished()}
    if stuck:
        raise RuntimeError(f"disaggregated simulation cannot make progress at t={now}: (waiting, running) per "
                           f"instance {stuck}, no arrival or KV transfer left (a request larger than a decode "
                           "instance's KV pages?)")
    return DisaggSimResult(requests=[request_record(r) for r in pending], iterations=iterations,
                           duration_s=max((it.end_time for it in iterations), default=0.0),
                           wall_s=time.perf_counter() - wall_start, num_iterations=len(iterations),
                           transfers=transfers)


# --------------------------------------------------------------------------------------------------- configs
@dataclasses.dataclass(frozen=True)
class GroupSetup:
    """One role's resolved instances: scheduler config (num_pages resolved), tp/pp, KV capacity (tokens, None
    when num_pages was given), device indices per instance."""
    role: str
    scheduler_config: Any
    tp: int
    pp: int
    kv_capacity_tokens: Optional[int]
    devices: Tuple[Tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class DisaggSetup:
    model: Any
    hardware: HardwareSpec
    params: CostParams
    profile: str
    padding_profile: bool            # the profile costs steps at the engine's padded shapes
    dense_attention: bool
    groups: Dict[str, GroupSetup]
    serialize_transfers: bool = True


def _group_pages(cfg, group, sched_cfg, model, hw) -> Tuple[int, Optional[int]]:
    if group.num_pages > 0:
        return group.num_pages, None
    if cfg.sim.num_pages > 0:
        return cfg.sim.num_pages, None
    if hw.kind == "cpu":
        return cfg.scheduler.num_pages, None
    capacity = kv_cache_capacity_tokens(model, hw, group.tp, group.pp, cfg.sim.gpu_memory_utilization,
                                        max_num_batched_tokens=sched_cfg.token_budget,
                                        max_num_seqs=sched_cfg.max_num_seqs)
    return capacity // sched_cfg.page_size, capacity


def check_disaggregated_config(cfg) -> None:
    """Config errors of a disaggregated simulation, each naming the bad value and what was expected."""
    dep = cfg.deployment
    if dep.kind != "disaggregated":
        raise ValueError(f"deployment.kind={dep.kind!r}: the disaggregated simulator needs 'disaggregated'")
    if cfg.scheduler.policy not in ("sarathi", "prefill_only", "decode_only"):
        raise ValueError(f"scheduler.policy={cfg.scheduler.policy!r} with deployment.kind='disaggregated': "
                         "instances run 'prefill_only' / 'decode_only' (Sarathi-style chunking per role); "
                         "expected 'sarathi' (the base the roles' policies are derived from)")
    if cfg.sim.num_replicas != 1:
        raise ValueError(f"sim.num_replicas={cfg.sim.num_replicas} with deployment.kind='disaggregated': "
                         "instance counts come from deployment.prefill/decode.num_instances; expected 1")
    if cfg.sim.tp != 1 or cfg.sim.pp != 1:
        raise ValueError(f"sim.tp={cfg.sim.tp}, sim.pp={cfg.sim.pp} with deployment.kind='disaggregated': each "
                         "group's layout is deployment.prefill/decode.tp/pp; expected sim.tp = sim.pp = 1")
    if getattr(cfg.engine, "async_scheduling", False):
        raise ValueError("engine.async_scheduling=True with deployment.kind='disaggregated': the disaggregated "
                         "engine has a synchronous loop only; expected False")


def build_disagg_setup(cfg) -> DisaggSetup:
    """Resolve model, hardware, cost profile and each group's scheduler config / pages / devices."""
    from pdjax.config.deployment import validate_deployment  # noqa: PLC0415
    from pdjax.sim.run import resolve_model, resolve_profile  # noqa: PLC0415  (run.py imports this module lazily)

    check_disaggregated_config(cfg)
    dep = cfg.deployment
    model = resolve_model(cfg)
    profile, profile_name = resolve_profile(cfg)
    hw = profile.hardware_spec if profile is not None and profile.hardware_spec is not None \
        else get_hardware_spec(cfg.sim.hardware)
    params = profile.machine.params if profile is not None else CostParams()
    # Devices: as many as the deployment asks for, plus any explicit index beyond that (other nodes).
    explicit = [d for role in ROLES for d in getattr(dep, role).devices]
    assignment = validate_deployment(dep, model, max([dep.num_devices] + [d + 1 for d in explicit]))
    base = cfg.scheduler
    if not base.vocab_size:
        base = dataclasses.replace(base, vocab_size=model.vocab_size)
    groups = {}
    for role in ROLES:
        group = getattr(dep, role)
        sched_cfg = instance_scheduler_config(base, group, role)
        pages, capacity = _group_pages(cfg, group, sched_cfg, model, hw)
        if pages != sched_cfg.num_pages:
            sched_cfg = dataclasses.replace(sched_cfg, num_pages=pages)
        groups[role] = GroupSetup(role, sched_cfg, group.tp, group.pp, capacity,
                                  tuple(assignment[n] for n in dep.instance_names(role)))
    padding = profile.padding if profile is not None else None
    return DisaggSetup(model=model, hardware=hw, params=params, profile=profile_name,
                       padding_profile=padding is not None,
                       dense_attention=bool((padding or {}).get("dense_attention", True)), groups=groups)


def build_disagg_instances(cfg, setup: DisaggSetup) -> Tuple[List[DisaggSimInstance], List[DisaggSimInstance]]:
    out = {}
    for role in ROLES:
        g = setup.groups[role]
        s = g.scheduler_config
        padding = None
        if setup.padding_profile:
            buckets = engine_buckets(s.token_budget, s.max_num_seqs, s.max_model_len, s.page_size,
                                     cfg.engine.token_buckets, cfg.engine.seq_buckets, cfg.engine.page_buckets)
            padding = EnginePadding(buckets, s.page_size, setup.dense_attention)
        step_time = make_step_time(setup.model, setup.hardware, g.tp, g.pp, setup.params, padding,
                                   cfg.sim.num_microbatches)
        out[role] = [DisaggSimInstance(f"{role}{i}", role, make_scheduler(s), step_time)
                     for i in range(len(g.devices))]
    return out["prefill"], out["decode"]


def setup_transfer_time(setup: DisaggSetup) -> Callable[[DisaggSimInstance, DisaggSimInstance, int], float]:
    """transfer_time(src, dst, num_tokens) for the instances of `setup` (links from their device placement)."""
    devices = {f"{role}{i}": devs for role in ROLES for i, devs in enumerate(setup.groups[role].devices)}
    layout = {role: setup.groups[role].tp * setup.groups[role].pp for role in ROLES}
    cache: Dict[Tuple[str, str], Callable[[int], float]] = {}

    def transfer_time(src: DisaggSimInstance, dst: DisaggSimInstance, num_tokens: int) -> float:
        key = (src.name, dst.name)
        fn = cache.get(key)
        if fn is None:
            # the KV lives on the tp·pp devices of one replica (dp copies hold the same pages)
            bw, lat, streams = kv_link(setup.hardware, devices[src.name][:layout["prefill"]],
                                       devices[dst.name][:layout["decode"]])
            fn = cache[key] = make_transfer_time(setup.model, bw, lat, streams, setup.params)
        return fn(num_tokens)
    return transfer_time


def simulate_disaggregated_config(cfg, workload=None) -> Tuple[DisaggSimResult, DisaggSetup]:
    """Simulate a disaggregated ServeConfig (workload: WorkloadRequests, default make_workload(cfg.workload,
    cfg.seed)); requests run to max_tokens, offline mode puts every arrival at 0 (as run_sim)."""
    from pdjax.scheduler import request_from_workload  # noqa: PLC0415
    from pdjax.workload import make_workload  # noqa: PLC0415

    setup = build_disagg_setup(cfg)
    if workload is None:
        workload = make_workload(cfg.workload, cfg.seed)
    offline = cfg.engine.mode == "offline"
    requests = [request_from_workload(wr, offline=offline) for wr in workload]
    prefill, decode = build_disagg_instances(cfg, setup)
    result = simulate_disaggregated(requests, prefill, decode, setup_transfer_time(setup),
                                    kv_bytes_of=lambda n: kv_bytes(setup.model, n), router=cfg.deployment.router,
                                    serialize_transfers=setup.serialize_transfers)
    return result, setup


def disagg_sim_info(result: DisaggSimResult, setup: DisaggSetup, cfg) -> dict:
    """The "sim" block of results.json for a disaggregated run."""
    info = {
        "iterations_per_s": result.iterations_per_s, "wall_s": result.wall_s,
        "num_iterations": result.num_iterations, "simulated_duration_s": result.duration_s,
        "model": setup.model.name, "hardware": setup.hardware.name, "profile": setup.profile,
        "deployment": "disaggregated", "router": cfg.deployment.router,
        "serialize_transfers": setup.serialize_transfers,
        "groups": {role: {"num_instances": len(g.devices), "tp": g.tp, "pp": g.pp,
                          "devices": [list(d) for d in g.devices], "num_pages": g.scheduler_config.num_pages,
                          "kv_capacity_tokens": g.kv_capacity_tokens,
                          "token_budget": g.scheduler_config.token_budget,
                          "max_num_seqs": g.scheduler_config.max_num_seqs}
                   for role, g in setup.groups.items()},
        "kv_transfer": result.transfer_summary(),
    }
    steps: Dict[str, int] = {}
    for it in result.iterations:
        steps[it.instance] = steps.get(it.instance, 0) + 1
    info["iterations_per_instance"] = steps
    return info
