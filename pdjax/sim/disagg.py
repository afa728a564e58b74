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
  'prefill0', 'decode0', ..., per-instance step indices) plus one TransferRecord per transfer;
  `transfer_summary()` has the real engine's keys (DisaggregatedResult.transfer_summary: num_transfers,
  kv_bytes, moved_bytes, seconds, bandwidth_bytes_per_s; moved_bytes = the KV bytes the cost model moved),
  `transfer_stats()` the per-transfer time and link-queue percentiles.

The loop (`simulate_disaggregated`) is a sequence of named steps at each event time t:
  finish_steps(t)      every step ending at t: update its scheduler, record the iteration, hand off finished
                       prefills (handoff: decode router -> add_handoff -> start_transfer on the link)
  land_transfer(t)     the next KV arrival at t: mark_kv_arrived on the decode side, release on the prefill side
                       (the two repeat until nothing more is due at t: a zero-time transfer can land at once)
  return_idle(t)       every idle mixed instance in a phase returns to the mixed pool (borrowing: every idle
                       machine of the mixed pool to its own pool; no-op without a mixed pool)
  admit_arrivals(t)    every arrival at t: prefill router (MixedPool.pick_prefill) -> add_request
  start_steps(t)       every woken instance not blocked collecting fills its batch queue (schedule, dispatch onto
                       the stages) and blocks collecting its oldest batch (pp == 1: one step of step_time(out) s);
                       a decode instance first applies its decode run (decode_run: the steps that end before any
                       other event, in bulk, as pdjax.sim.simulator does for colocated instances; bit-identical
                       records, tests/test_decode_runs.py; `decode_runs=False` turns them off)
No JAX.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from pdjax.metrics import IterationRecord, stats
from pdjax.scheduler.instances import Instance
from pdjax.scheduler.mixed import make_pool
from pdjax.sim.cost_model import CostParams, kv_bytes, p2p_time
from pdjax.sim.hardware import HardwareSpec
from pdjax.sim.pipeline import StagePipeline, StageTimer, pipeline_summary
from pdjax.sim.simulator import (SimResult, SimRequests, apply_run, gc_paused, placeholder_sample,
                                 plan_decode_clock)

ROLES = ("prefill", "decode", "mixed")


# --------------------------------------------------------------------------------------------------- state
class DisaggSimInstance(Instance):
    """One simulated prefill, decode or mixed-pool instance (pdjax.scheduler.instances.Instance): its scheduler
    ('prefill_only' / 'decode_only' / a MixedScheduler) and step time (SchedulerOutput -> seconds).

    Pipeline stages (as pdjax.sim.simulator.SimInstance): `stage_times(out) -> (per-stage seconds, per-boundary
    send seconds)`, taken from `step_time.stage_times` when the step-time function has `.pp` > 1
    (pdjax.sim.step_cost.PipelineStepTime); None: one stage of step_time(out). max_in_flight: batches in flight at
    most (default: step_time's pp, else 1). `pipeline` (pdjax.sim.pipeline.StagePipeline) holds the batch queue
    and the stage resources."""

    def __init__(self, name: str, role: str, scheduler, step_time: Optional[Callable[[Any], float]] = None, *,
                 stage_times: Optional[Callable] = None, max_in_flight: Optional[int] = None):
        if role not in ROLES:
            raise ValueError(f"instance {name!r}: role={role!r}, expected one of {ROLES}")
        if step_time is None and stage_times is None:
            raise ValueError(f"instance {name!r}: give step_time or stage_times")
        super().__init__(name, role, scheduler)
        self.step_time = step_time
        self.timer = StageTimer(step_time, stage_times)
        self.pipeline = StagePipeline(self.timer.pp if max_in_flight is None else max_in_flight)
        self.in_flight: Optional[Tuple[Any, float]] = None   # (SchedulerOutput, start) of the batch being collected

    @property
    def max_in_flight(self) -> int:
        return self.pipeline.max_in_flight

    @property
    def busy(self) -> bool:
        """The instance's loop is blocked collecting its oldest batch in flight."""
        return self.in_flight is not None

    def stage_seconds(self, out, t: float) -> Tuple[Sequence[float], Sequence[float]]:
        """(per-stage seconds, per-boundary send seconds) of batch `out` dispatched at t (pdjax.sim.pipeline
        StageTimer: with its StepContext when the step-time function takes one)."""
        return self.timer(out, self.pipeline.device_free, t)


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
def _check_instances(prefill: List[DisaggSimInstance], decode: List[DisaggSimInstance],
                     mixed: List[DisaggSimInstance]) -> None:
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


class _Cluster:
    """The state of one disaggregated simulation and its steps (the module docstring's loop)."""

    def __init__(self, requests, prefill, decode, transfer_time, kv_bytes_of, router, serialize_transfers,
                 sample, on_schedule, max_iterations, mixed=(), mixed_prefill_queue_tokens=8192,
                 mixed_decode_load=1.0, mixed_pool="dedicated", decode_runs=True):
        self.instances = prefill + decode + list(mixed)
        self.pool = make_pool(mixed_pool, router, prefill, decode, mixed,
                              prefill_queue_tokens=mixed_prefill_queue_tokens, decode_load=mixed_decode_load)
        self.index_of = {id(inst): i for i, inst in enumerate(self.instances)}
        self.transfer_time, self.kv_bytes_of = transfer_time, kv_bytes_of
        self.serialize_transfers, self.sample, self.on_schedule = serialize_transfers, sample, on_schedule
        self.max_iterations = max_iterations
        self.requests = SimRequests(requests)
        self.pending = self.requests.pending      # in arrival order; entries before next_arrival have arrived
        self.next_arrival = 0
        self.iterations: List[IterationRecord] = []
        self.transfers: List[TransferRecord] = []
        self.completions: list = []        # heap of (end time, seq, instance index)
        self.kv_arrivals: list = []        # heap of (end time, seq, TransferRecord, src index, dst index)
        self.link_free: Dict[Tuple[int, int], float] = {}
        self.seq = itertools.count()
        self.waking = [False] * len(self.instances)
        # Decode runs (decode_run): decode instances with one stage, one batch in flight and a step time exact for
        # decode-only steps, when nobody watches single steps (no on_schedule, no mixed pool) and the tokens are
        # the placeholder.
        plain = (decode_runs and on_schedule is None and sample is placeholder_sample and not mixed
                 and mixed_pool == "dedicated")
        self.decode_runs = [plain and inst.role == "decode" and inst.max_in_flight == 1
                            and inst.timer.stage_times is None
                            and inst.timer.decode_only_exact
                            for inst in self.instances]

    # ------------------------------------------------------------------------------------------- events
    def next_event_time(self) -> float:
        inf = float("inf")
        t_arrival = self.pending[self.next_arrival].arrival_time if self.next_arrival < len(self.pending) else inf
        t_done = self.completions[0][0] if self.completions else inf
        t_kv = self.kv_arrivals[0][0] if self.kv_arrivals else inf
        return min(t_arrival, t_done, t_kv)

    def _due(self, heap: list, t: float) -> bool:
        return bool(heap) and heap[0][0] <= t

    def step_or_transfer_due(self, t: float) -> bool:
        return self._due(self.completions, t) or self._due(self.kv_arrivals, t)

    # ------------------------------------------------------------------------------------------- steps
    def finish_steps(self, t: float) -> None:
        """Every step ending at t: update, record the iteration, hand off the prefills it finished."""
        while self._due(self.completions, t):
            _, _, idx = heapq.heappop(self.completions)
            inst = self.instances[idx]
            inst.in_flight = None
            out, start, _ = inst.pipeline.collect(t)     # the oldest batch in flight, applied in dispatch order
            finished = inst.scheduler.update(out, self.sample(out), t)
            self.iterations.append(IterationRecord(
                step=inst.num_steps, start_time=start, end_time=t, num_prefill_tokens=out.num_prefill_tokens,
                num_decode_tokens=out.num_decode_tokens, num_seqs=len(out.req_ids), instance=inst.name))
            inst.num_steps += 1
            self.waking[idx] = True
            if len(self.iterations) > self.max_iterations:
                raise RuntimeError(f"simulation exceeded max_iterations={self.max_iterations}")
            done = None
            for req in finished:
                if req.finish_reason == "handoff":
                    self.handoff(idx, req, t)
                else:
                    done = done or []
                    done.append(req)
            if finished:
                self.requests.finished(done or (), inst.scheduler)   # handed-off ones finish on the decode side

    def handoff(self, src_idx: int, req, t: float) -> None:
        """A finished prefill: the decode router (MixedPool / BorrowingPool.pick_decode) picks its instance; the
        prefilling machine itself (borrowing mixed pool) keeps it (keep_local, no transfer); a rejection releases
        it on the prefill side at once, else its KV transfer starts."""
        src = self.instances[src_idx]
        dst = self.pool.pick_decode(req, t, src)
        if dst is src:
            src.scheduler.keep_local(req.request_id, t)
            self.waking[src_idx] = True
            return
        if not dst.scheduler.add_handoff(req, t):
            self.instances[src_idx].scheduler.release(req.request_id)
            self.waking[src_idx] = True
            return
        self.start_transfer(src_idx, self.index_of[id(dst)], req, t)

    def start_transfer(self, src_idx: int, dst_idx: int, req, t: float) -> None:
        """Queue req's KV on the (src, dst) link (FIFO when serialized) and schedule its arrival."""
        src, dst = self.instances[src_idx], self.instances[dst_idx]
        tokens = req.num_computed_tokens
        link = (src_idx, dst_idx)
        start = max(t, self.link_free.get(link, t)) if self.serialize_transfers else t
        end = start + self.transfer_time(src, dst, tokens)
        self.link_free[link] = end
        record = TransferRecord(req.request_id, src.name, dst.name, tokens, self.kv_bytes_of(tokens), t, start, end)
        self.transfers.append(record)
        heapq.heappush(self.kv_arrivals, (end, next(self.seq), record, src_idx, dst_idx))

    def land_transfer(self, t: float) -> None:
        """The next KV arrival due at t: the decode side may admit it, the prefill side frees its pages."""
        if not self._due(self.kv_arrivals, t):
            return
        _, _, record, src_idx, dst_idx = heapq.heappop(self.kv_arrivals)
        self.instances[dst_idx].scheduler.mark_kv_arrived(record.request_id)
        self.instances[src_idx].scheduler.release(record.request_id)
        self.waking[src_idx] = self.waking[dst_idx] = True

    def return_idle(self, t: float) -> None:
        """Every mixed instance that is idle in a phase returns to the mixed pool (borrowing: every idle machine of
        the mixed pool returns to its own pool)."""
        if self.pool.active:
            self.pool.return_idle(t)

    def admit_arrivals(self, t: float) -> None:
        """Every arrival at t goes to the prefill instance the router (MixedPool.pick_prefill) picks (a rejection
        finishes it there)."""
        while self.next_arrival < len(self.pending) and self.pending[self.next_arrival].arrival_time <= t:
            req = self.requests.arrived(self.next_arrival)
            self.next_arrival += 1
            inst = self.pool.pick_prefill(req, t)
            inst.scheduler.add_request(req)
            self.waking[self.index_of[id(inst)]] = True

    def start_steps(self, t: float) -> None:
        """Every woken instance that is not blocked collecting runs the batch-queue loop: while fewer than
        max_in_flight batches are in flight and the scheduler returns a non-empty batch (of requests not in
        flight), dispatch it onto the stages (StagePipeline); then, with a batch in flight, block collecting the
        oldest (its completion event at max(its end, t)). Nothing in flight and an empty batch: blocked until an
        arrival, a KV arrival or a release wakes it. One stage: a non-empty output runs step_time(out) seconds."""
        now = t
        for idx, inst in enumerate(self.instances):
            t = now
            if not self.waking[idx]:
                continue
            self.waking[idx] = False
            if inst.busy:
                continue
            pipe, sched = inst.pipeline, inst.scheduler
            if self.decode_runs[idx] and not pipe and not any(
                    w and not self.instances[j].busy for j, w in enumerate(self.waking) if j > idx):
                t = self.decode_run(idx, t)   # the instance's loop goes on from the end of the run's last step
            while not pipe.full and sched.has_unfinished():
                out = sched.schedule(t)
                if out.is_empty:
                    break
                if self.on_schedule is not None:
                    self.on_schedule(inst, out, t)
                stages, sends = inst.stage_seconds(out, t)
                pipe.dispatch(out, t, stages, sends)
            if pipe:
                out, start, end = pipe.peek()
                inst.in_flight = (out, start)
                heapq.heappush(self.completions, (end if end > t else t, next(self.seq), idx))

    def decode_run(self, idx: int, t: float) -> float:
        """Run decode instance `idx`'s next steps at once while they are a decode run (pdjax.scheduler.runs) that
        no other event interleaves with: every step, scheduled at the end of the one before, ends before the next
        arrival, step completion or KV landing anywhere (none of which can then change what it does, or see its
        state). The same scheduler state (DecodeRun.apply), step times (`decode_fn`, planned by
        simulator.plan_decode_clock), pipeline accounting
        (StagePipeline.run_serial), iteration and request records as the loop's one-by-one steps, in the same
        order. Called from start_steps when no instance after this one still has to start a step at t. Returns
        the end of the run's last step (t when no step qualifies): the instance's loop goes on from there."""
        inst = self.instances[idx]
        sched = inst.scheduler
        run = sched.decode_run(self.max_iterations - len(self.iterations))
        if run is None or run.prefills:
            return t
        starts, ends, seconds, end = plan_decode_clock(run, inst.timer.step_time.decode_fn(run.count), t,
                                                       self.next_event_time(), ends_before=True)
        if not starts:
            return t
        apply_run(run, inst.pipeline, self.requests, starts, ends, seconds)
        k = len(starts)
        first, count = inst.num_steps, run.count
        self.iterations += map(IterationRecord, range(first, first + k), starts, ends, itertools.repeat(0, k),
                               itertools.repeat(count, k), itertools.repeat(count, k),
                               itertools.repeat(inst.name, k))
        inst.num_steps += k
        return end

    def check_done(self, t: float) -> None:
        stuck = {i.name: (i.scheduler.num_waiting, i.scheduler.num_running)
                 for i in self.instances if i.scheduler.has_unfinished()}
        if stuck:
            raise RuntimeError(f"disaggregated simulation cannot make progress at t={t}: (waiting, running) per "
                               f"instance {stuck}, no arrival or KV transfer left (a request larger than a decode "
                               "instance's KV pages?)")


def simulate_disaggregated(requests: Sequence, prefill: Sequence[DisaggSimInstance],
                           decode: Sequence[DisaggSimInstance],
                           transfer_time: Callable[[DisaggSimInstance, DisaggSimInstance, int], float], *,
                           kv_bytes_of: Callable[[int], int] = lambda n: 0, router: str = "round_robin",
                           serialize_transfers: bool = True, sample: Callable = placeholder_sample,
                           on_schedule: Optional[Callable] = None,
                           max_iterations: int = 50_000_000, mixed: Sequence[DisaggSimInstance] = (),
                           mixed_prefill_queue_tokens: int = 8192,
                           mixed_decode_load: float = 1.0, mixed_pool: str = "dedicated",
                           decode_runs: bool = True) -> DisaggSimResult:
    """Serve `requests` (scheduler Requests, arrival_time in seconds) on prefill and decode instances, and the
    mixed pool's instances (role 'mixed', MixedScheduler; thresholds as deployment.mixed_prefill_queue_tokens /
    mixed_decode_load), until all finish (module docstring). mixed_pool='borrow' (deployment.mixed_pool): no
    mixed instances; the prefill and decode instances (BorrowingSchedulers) are borrowed into the mixed pool.

    transfer_time(src, dst, num_tokens) -> seconds of one KV transfer; kv_bytes_of(num_tokens) -> bytes (for the
    records only); router: a pdjax.scheduler.routing policy, used for both roles. on_schedule(instance, out,
    now) is called after every non-empty schedule(). Raises RuntimeError when requests are left that no
    instance can schedule, or after `max_iterations` iterations. decode_runs=False runs every step of the decode
    instances through schedule() and update() (the same results, slower: _Cluster.decode_run).
    """
    prefill, decode, mixed = list(prefill), list(decode), list(mixed)
    _check_instances(prefill, decode, mixed)
    wall_start = time.perf_counter()
    c = _Cluster(requests, prefill, decode, transfer_time, kv_bytes_of, router, serialize_transfers, sample,
                 on_schedule, max_iterations, mixed, mixed_prefill_queue_tokens, mixed_decode_load, mixed_pool,
                 decode_runs)
    now = 0.0
    with gc_paused():
        while True:
            t = c.next_event_time()
            if t == float("inf"):
                break
            now = t
            while c.step_or_transfer_due(now):
                c.finish_steps(now)
                c.land_transfer(now)
            c.return_idle(now)
            c.admit_arrivals(now)
            c.start_steps(now)
    c.check_done(now)
    duration = max((it.end_time for it in c.iterations), default=0.0)
    summary = None
    if mixed_pool == "borrow":
        summary = c.pool.summary(end=max(duration, now))
    elif mixed:
        summary = c.pool.summary()
    return DisaggSimResult(requests=c.requests.records(), iterations=c.iterations, duration_s=duration,
                           wall_s=time.perf_counter() - wall_start, num_iterations=len(c.iterations),
                           transfers=c.transfers, mixed_pool=summary,
                           pipeline=pipeline_summary((i.name, i.pipeline) for i in c.instances))
