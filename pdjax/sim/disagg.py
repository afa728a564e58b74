"""Simulated prefill/decode disaggregation: N prefill instances and M decode instances on a virtual clock, with one
KV transfer per request between them (the simulator counterpart of pdjax/serving/disagg.py), plus optionally
Splitwise's mixed pool: K mixed instances that take either phase while the prefill or the decode pool is overloaded
and return to the pool when idle (pdjax.scheduler.mixed: the reading of Splitwise, thresholds, the MixedScheduler).

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
  real DisaggregatedEngine is one host thread that runs the instances in lock-step rounds (a round ends when the
  oldest batch of every busy instance was collected); that coupling is an artefact of driving all groups from
  one Python loop on a single host, not of disaggregation, so the simulator does not copy it. Arrivals and
  handoffs reach a scheduler at their own time (the engine admits arrivals while steps run); an idle or blocked
  instance is woken by the events that can unblock it (an arrival, a KV arrival, a release of its held pages).
- Pipeline stages (an instance whose step-time function has `.pp` > 1, pdjax.sim.step_cost.PipelineStepTime):
  the instance keeps up to pp batches in flight with the colocated simulator's stage model, shared code in
  pdjax.sim.pipeline.StagePipeline: the engines' batch-queue loop (dispatch while the queue is not full and
  schedule() returns a non-empty batch of requests not in flight; then block collecting the oldest, apply in
  dispatch order), each stage a resource, so bubbles come out of the schedule. `DisaggSimResult.pipeline` has
  the per-instance stage occupancy and bubble fraction (pdjax.sim.pipeline.pipeline_summary). With pp == 1 the
  loop and its numbers are exactly the one-step-at-a-time loop. Step-time functions that take a StepContext
  get one, as in the colocated simulator (pdjax.sim.pipeline.StageTimer). A request
  is in at most one in-flight batch and a decode instance's running requests all fit one batch (stall-free
  budget), and an instance's loop blocks while it collects (as one engine process's would), so a decode
  instance rarely has two batches in flight: its pipeline bubbles show in the bubble fraction.
- Event order at one time t: step completions (update, handoffs start their transfers), then transfer
  completions (mark_kv_arrived + release), then arrivals; then every woken instance schedules, prefill
  instances first, each group in index order. Ties in the heaps go by insertion order: deterministic.
- Transfer time of a request with p prompt tokens: `p2p_time(kv_bytes(model, p) / streams, link)` of the cost
  model (comm_fixed_s + link latency + bytes / (bandwidth · comm_bandwidth_efficiency)). The KV is sharded over
  the tp·pp devices of each side; with equal pp each stage sends its layers' KV to the same stage of the
  other side (min(tp) streams per stage), otherwise stream i moves device i's share to device i of the other
  side (min(tp·pp) streams); the slowest stream's link sets the bandwidth (`kv_link`, also the placement
  search's): both devices on one node -> the node's link (NVLink pair on a pairwise box, else the intra-node
  link: NVSwitch / PCIe), different nodes -> the inter-node network. Device placement comes from
  `deployment.device_assignment` (explicit `devices` put groups on other nodes).
- Transfers on one (prefill instance, decode instance) link are serialized by default (a FIFO transfer queue:
  a transfer starts when the link is free); `serialize_transfers=False` lets them overlap at full bandwidth.
- Decode-side staging of arriving KV is not counted against pages (the real engine stages it outside the page
  pool too). Pages per instance, links, step and transfer times come built (pdjax.sim.build: config -> parts);
  this module knows nothing of configs.
- Mixed pool (`mixed=`, thresholds `mixed_prefill_queue_tokens` / `mixed_decode_load`): arrivals and handoffs
  are routed by pdjax.scheduler.mixed.MixedPool (without mixed instances: the deployment's two routers, exactly as
  before). A mixed instance in the prefill phase prefills and hands off like a prefill instance, one in the decode
  phase takes handoffs like a decode instance, and its KV transfers are timed on its links like any other
  (`transfer_time(src, dst, n)`). It returns to the pool at the first event time at which it is idle (after the
  steps and KV landings of that time, before its arrivals). `DisaggSimResult.mixed_pool` holds the switch log.
- Borrowing mixed pool (`mixed_pool='borrow'`, Splitwise's preset; pdjax.scheduler.mixed.BorrowingPool): no mixed
  instances; the prefill and decode instances run BorrowingSchedulers and are moved into the mixed pool (Sarathi
  mixed batches) and back by the same routing calls. A handoff whose pick is the prefilling machine itself keeps
  the request there (`keep_local`: no transfer record, its pages stay). Any two instances may then exchange KV (a
  prefill machine borrowed for tokens receives it, a decode machine borrowed for prompts sends it), each pair on
  its own link as above. `DisaggSimResult.mixed_pool` holds the move log (BorrowingPool.summary).
- Outputs: the same RequestRecord / IterationRecord lists as a real disaggregated run (instance names
  'prefill0', 'decode0', ..., per-instance step indices) plus one TransferRecord per transfer
  (pdjax.scheduler.instances: the engine's record too);
  `transfer_summary()` has the real engine's keys (DisaggregatedResult.transfer_summary: num_transfers,
  kv_bytes, moved_bytes, seconds, bandwidth_bytes_per_s; moved_bytes = the KV bytes the cost model moved),
  `transfer_stats()` the per-transfer time and link-queue percentiles.

The loop is the simulator's one event loop (pdjax.sim.simulator.Simulation, the colocated simulator's too), a
sequence of named steps at each event time t:
  finish_steps(t)      every step ending at t: update its scheduler, record the iteration, hand off finished
                       prefills (handoff: decode router -> add_handoff -> start_transfer on the link)
  land_transfer(t)     the next KV arrival at t: mark_kv_arrived on the decode side, release on the prefill side
                       (the two repeat until nothing more is due at t: a zero-time transfer can land at once)
  return_idle(t)       every idle mixed instance in a phase returns to the mixed pool (borrowing: every idle
                       machine of the mixed pool to its own pool; no-op without a mixed pool)
  route_arrivals(t)    every arrival at t: prefill router (MixedPool.pick_prefill) -> add_request
  start_steps(t)       every woken instance not blocked collecting fills its batch queue (schedule, dispatch onto
                       the stages) and blocks collecting its oldest batch (pp == 1: one step of step_time(out) s);
                       a decode instance first applies its decode runs (Simulation.decode_run: the steps that end
                       before any other event, in bulk, as for colocated instances, and, with one decode instance
                       or round robin, the step across that event too: the handoffs and KV landings meanwhile
                       touch only its KV queues; past the arrivals that come while every other instance is
                       blocked on a step: Simulation.cross_limit; its first step admits landed KV;
                       bit-identical records, tests/test_decode_runs.py;
                       `decode_runs=False` turns them off). With one decode instance and every instance one
                       stage with one batch in flight, its runs go on past the other instances' step ends and
                       the arrivals, up to the step that would admit the next KV landing
                       (Simulation.start_pending_run: a PendingRun applied when its last step ends, cut short
                       when a transfer to it starts, its records merged into the list in completion order)
Instances are pdjax.sim.simulator.SimInstance in their role (`DisaggSimInstance` builds one); transfers are
pdjax.scheduler.instances.TransferRecord, the engine's record too.
No JAX.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from pdjax.metrics import stats
from pdjax.scheduler.instances import TransferRecord
from pdjax.scheduler.mixed import make_pool
from pdjax.sim.cost_model import CostParams, kv_bytes, p2p_time
from pdjax.sim.hardware import HardwareSpec
from pdjax.sim.pipeline import pipeline_summary
from pdjax.sim.simulator import SimInstance, SimResult, Simulation, decode_run_ready, placeholder_sample

ROLES = ("prefill", "decode", "mixed")


# --------------------------------------------------------------------------------------------------- state
def DisaggSimInstance(name: str, role: str, scheduler, step_time: Optional[Callable[[Any], float]] = None, *,
                      stage_times: Optional[Callable] = None, max_in_flight: Optional[int] = None) -> SimInstance:
    """A simulated prefill, decode or mixed-pool instance: the one simulated instance type
    (pdjax.sim.simulator.SimInstance) in `role`, with its scheduler ('prefill_only' / 'decode_only' / a
    MixedScheduler) and step time (SchedulerOutput -> seconds; pipeline stages as SimInstance's)."""
    if role not in ROLES:
        raise ValueError(f"instance {name!r}: role={role!r}, expected one of {ROLES}")
    return SimInstance(name, scheduler, step_time, role=role, stage_times=stage_times, max_in_flight=max_in_flight)


@dataclasses.dataclass
class DisaggSimResult(SimResult):
    transfers: List[TransferRecord] = dataclasses.field(default_factory=list)
    mixed_pool: Optional[Dict[str, Any]] = None     # MixedPool / BorrowingPool.summary() when there was a mixed pool

    def transfer_summary(self) -> Dict[str, float]:
        """Totals over all transfers, with the real engine's keys (pdjax.serving.disagg.DisaggregatedResult):
        count, KV bytes, bytes moved (= the KV bytes the cost model moved), seconds on the links, and the achieved
        bandwidth (moved bytes / link seconds)."""
        total_s = sum(t.seconds for t in self.transfers)
        moved = sum(t.kv_bytes for t in self.transfers)
        return {"num_transfers": len(self.transfers), "kv_bytes": moved, "moved_bytes": moved, "seconds": total_s,
                "bandwidth_bytes_per_s": moved / total_s if total_s > 0 else 0.0}

    def transfer_stats(self) -> Dict[str, Any]:
        """Stats ({'mean', 'p50', 'p90', 'p99'}) of the per-transfer link seconds and link-queue seconds."""
        return {"transfer_s": stats([t.seconds for t in self.transfers]),
                "queue_s": stats([t.queue_s for t in self.transfers])}


# --------------------------------------------------------------------------------------------------- links
def kv_link(hw: HardwareSpec, src_devices: Sequence[int], dst_devices: Sequence[int], src_pp: int = 1,
            dst_pp: int = 1) -> Tuple[float, float, int]:
    """(bandwidth per stream in bytes/s, latency in s, number of parallel streams) of a KV transfer between an
    instance on `src_devices` and one on `dst_devices` (device indices in stage-major order, `src_pp` / `dst_pp`
    pipeline stages; node = index // devices_per_node). The one link model of the simulator and the placement
    search (pdjax.sim.placement). Device pairs: with equal pp, stage s of the source sends its layers' KV to
    stage s of the destination, min(tp_src, tp_dst) streams per stage (stage s's first devices); otherwise
    stream i pairs src_devices[i] with dst_devices[i], min(len) streams. The slowest pair's link sets the
    bandwidth, the slowest's latency the latency: both devices on one node -> the node's link (the NVLink pair on
    a pairwise box, else the intra-node link: NVSwitch / PCIe), different nodes -> the inter-node network."""
    if not src_devices or not dst_devices:
        raise ValueError(f"kv_link: src_devices={list(src_devices)}, dst_devices={list(dst_devices)}, expected "
                         "at least one device on each side")
    for devices, pp in ((src_devices, src_pp), (dst_devices, dst_pp)):
        if pp < 1 or len(devices) % pp:
            raise ValueError(f"kv_link: {len(devices)} devices in {pp} pipeline stages, expected pp >= 1 "
                             "dividing the device count")
    if src_pp == dst_pp:
        tp_src, tp_dst = len(src_devices) // src_pp, len(dst_devices) // dst_pp
        k = min(tp_src, tp_dst)
        pairs = [(src_devices[s * tp_src + i], dst_devices[s * tp_dst + i]) for s in range(src_pp) for i in range(k)]
    else:
        pairs = list(zip(src_devices, dst_devices))
    bandwidth, latency = float("inf"), 0.0
    for a, b in pairs:
        if a // hw.devices_per_node != b // hw.devices_per_node:
            bw, lat = hw.inter_node_bandwidth, hw.inter_node_latency
        elif hw.intra_node_topology == "pairwise" and a // 2 == b // 2:
            bw, lat = hw.pairwise_bandwidth, hw.intra_node_latency
        else:
            bw, lat = hw.intra_node_bandwidth, hw.intra_node_latency
        bandwidth, latency = min(bandwidth, bw), max(latency, lat)
    return bandwidth, latency, len(pairs)


def kv_link_between(src_hw: HardwareSpec, dst_hw: HardwareSpec, src_devices: Sequence[int],
                    dst_devices: Sequence[int], src_pp: int = 1, dst_pp: int = 1) -> Tuple[float, float, int]:
    """kv_link for instances that may run on different hardware: the same hardware -> kv_link; different
    machine types are different nodes, so every stream crosses the inter-node network, at the slower of the two
    machines' NICs and the larger latency (the stream count as kv_link pairs them)."""
    if src_hw.name == dst_hw.name:
        return kv_link(src_hw, src_devices, dst_devices, src_pp, dst_pp)
    _, _, streams = kv_link(src_hw, src_devices, dst_devices, src_pp, dst_pp)
    return (min(src_hw.inter_node_bandwidth, dst_hw.inter_node_bandwidth),
            max(src_hw.inter_node_latency, dst_hw.inter_node_latency), streams)


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
def _check_instances(prefill: List[SimInstance], decode: List[SimInstance],
                     mixed: List[SimInstance]) -> None:
    for group, role in ((prefill, "prefill"), (decode, "decode"), (mixed, "mixed")):
        if not group and role != "mixed":
            raise ValueError(f"simulate_disaggregated: needs at least one {role} instance")
        for inst in group:
            if inst.role != role:
                raise ValueError(f"instance {inst.name!r} has role {inst.role!r} but was given as {role}")
    names = [i.name for i in prefill + decode + mixed]
    if len(set(names)) != len(names):
        raise ValueError(f"instance names must be unique, got {names}")
    sizes = {i.name: i.scheduler.config.page_size for i in prefill + decode + mixed}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"all instances need the same page_size (pages move whole), got {sizes}")


def _enable_crossing_runs(c: Simulation, num_prefill: int, num_decode: int, router: str,
                          partial_transfer: bool) -> None:
    """Which decode runs may go past the next event. A decode instance's run may end with a step across the next
    event (Simulation.decode_run) when nothing else reads its state before that step ends: the decode router picks
    it without reading loads (one decode instance, or round robin); the handoffs and KV landings in between touch
    only its KV queues (not so with partial transfer: a handoff takes the prefix the instance holds; nor with a host
    KV tier it shares with other instances: its runs offload their evictions into it, which the others read).
    One decode instance, every instance one stage with one batch in flight: its runs go on past the other
    instances' steps and the arrivals, up to the next KV landing (Simulation.start_pending_run)."""
    blind = (num_decode == 1 or router == "round_robin") and not partial_transfer
    tiers = [inst.scheduler.block_manager.host_tier for inst in c.instances]
    shared = [t is not None and sum(1 for u in tiers if u is t) > 1 for t in tiers]
    c.cross = [runs and blind and not shared[i] and c.run_schedules[i] == 0 for i, runs in enumerate(c.decode_runs)]
    if num_decode == 1 and c.cross[num_prefill] and all(r == 0 for r in c.run_schedules):
        c.pass_idx = num_prefill


def simulate_disaggregated(requests: Sequence, prefill: Sequence[SimInstance],
                           decode: Sequence[SimInstance],
                           transfer_time: Callable[[SimInstance, SimInstance, int], float], *,
                           kv_bytes_of: Callable[[int], int] = lambda n: 0, router: str = "round_robin",
                           serialize_transfers: bool = True, sample: Callable = placeholder_sample,
                           on_schedule: Optional[Callable] = None,
                           max_iterations: int = 50_000_000, mixed: Sequence[SimInstance] = (),
                           mixed_prefill_queue_tokens: int = 8192,
                           mixed_decode_load: float = 1.0, mixed_pool: str = "dedicated",
                           decode_runs: bool = True, pool_factory: Optional[Callable] = None,
                           configure: Optional[Callable] = None, partial_transfer: bool = False) -> DisaggSimResult:
    """Serve `requests` (scheduler Requests, arrival_time in seconds) on prefill and decode instances, and the
    mixed pool's instances (role 'mixed', MixedScheduler; thresholds as deployment.mixed_prefill_queue_tokens /
    mixed_decode_load), until all finish (module docstring). mixed_pool='borrow' (deployment.mixed_pool): no
    mixed instances; the prefill and decode instances (BorrowingSchedulers) are borrowed into the mixed pool.

    transfer_time(src, dst, num_tokens) -> seconds of one KV transfer; kv_bytes_of(num_tokens) -> bytes (for the
    records only); router: a pdjax.scheduler.routing policy, used for both roles. on_schedule(instance, out,
    now) is called after every non-empty schedule(). Raises RuntimeError when requests are left that no
    instance can schedule, or after `max_iterations` iterations. decode_runs=False runs every step of the decode
    instances through schedule() and update() (the same results, slower: pdjax.sim.simulator.Simulation.decode_run).
    pool_factory(prefill, decode) -> cluster pool: overload handling (pdjax.scheduler.overload: early rejection,
    online rebalancing) instead of make_pool; it reads loads at every event, so decode runs are off with it.
    configure(pool): called once the pool is built (pdjax.sim.kv_tier: the cache-aware routers' options).
    partial_transfer: decode instances take the KV prefix they hold, transfers move the rest (no run crosses events).
    """
    prefill, decode, mixed = list(prefill), list(decode), list(mixed)
    _check_instances(prefill, decode, mixed)
    wall_start = time.perf_counter()
    # Decode runs: decode instances (one stage, one batch in flight, a step time exact for decode-only steps),
    # when nobody watches single steps (no on_schedule, no mixed pool) and the tokens are the placeholder.
    plain = (decode_runs and on_schedule is None and sample is placeholder_sample and not mixed
             and mixed_pool == "dedicated" and pool_factory is None)
    pool = (make_pool(mixed_pool, router, prefill, decode, mixed, prefill_queue_tokens=mixed_prefill_queue_tokens,
                      decode_load=mixed_decode_load) if pool_factory is None else pool_factory(prefill, decode))
    if configure is not None:
        configure(pool)
    instances = prefill + decode + mixed
    c = Simulation(requests, instances, pool.pick_prefill, direct=True, sample=sample, on_schedule=on_schedule,
                   max_iterations=max_iterations, pool=pool,
                   decode_runs=[plain and inst.role == "decode" and decode_run_ready(inst) for inst in instances])
    c.transfer_time, c.kv_bytes_of, c.serialize_transfers = transfer_time, kv_bytes_of, serialize_transfers
    if hasattr(pool, "bind"):
        pool.bind(c.iterations)     # early rejection learns its step rates from the run's records
    _enable_crossing_runs(c, len(prefill), len(decode), router, partial_transfer)
    now = c.run()
    duration = max((it.end_time for it in c.iterations), default=0.0)
    summary = None
    if mixed_pool == "borrow":
        summary = c.pool.summary(end=max(duration, now))
    elif mixed or pool_factory is not None:
        summary = c.pool.summary()
    return DisaggSimResult(requests=c.requests.records(), iterations=c.iterations, duration_s=duration,
                           wall_s=time.perf_counter() - wall_start, num_iterations=len(c.iterations),
                           transfers=c.transfers, mixed_pool=summary,
                           pipeline=pipeline_summary((i.name, i.pipeline) for i in c.instances))
