"""Multi-instance serving engine: one host loop driving many instances, each its own runner (on its own devices),
scheduler and KV cache, behind the router (pdjax.scheduler.routing.InstanceRouter).

Two configurations of the same loop:
- colocated replicas (data parallelism): instances of role 'colocated', each a full colocated scheduler
  (sarathi, vllm_v0, ...); a new request goes to one replica (router) and stays there until it finishes.
- disaggregated (prefill/decode): instances of roles 'prefill' (prefill_only scheduler) and 'decode'
  (decode_only); `DisaggregatedEngine` (disagg.py) is this configuration. Per request (protocol of
  pdjax/scheduler/policies.py):
  arrival -> router picks a prefill instance -> `add_request` -> prefill chunks -> first token sampled: finished
  with 'handoff' (TTFT is stamped here, on the prefill instance) -> router picks a decode instance ->
  `add_handoff(req)` -> `transfer_kv` dispatched (the one cross-group copy, staged on the decode devices, each
  layer on the decode stage that holds it; asynchronous, see below) -> ... the transfer lands (polled every
  round) -> `mark_kv_arrived` -> prefill side `release` (its pages are free again) -> decode_only scheduler
  admits it when a slot, budget and pages fit (backpressure) and lists it in
  `kv_handoff_req_ids` -> before that step the staged pages are scattered into its new page table, stage by
  stage -> decode steps stamp the later tokens.
  The Request object is shared by both sides (add_handoff mutates it), so its record holds the whole story.
A cluster is one or the other (colocated instances never share it with prefill/decode ones); a single colocated
instance runs here too, though pdjax.serving.engine.ColocatedEngine (sync or async scheduling) is its engine.
A disaggregated cluster may add Splitwise's mixed pool: instances of role 'mixed' (a MixedScheduler each, any pp x
tp layout like the other groups) that take the prefill or the decode phase while that pool is overloaded and return
to the pool when idle. Arrivals and handoffs are routed by pdjax.scheduler.mixed.MixedPool (`self.pool`; without
mixed instances it is the deployment's two routers, unchanged); a mixed instance in a phase runs that phase's
protocol exactly (a prefill-phase one hands its requests off through the same transfer path; a decode-phase one
receives handoffs), and idle ones are returned to the pool at the start of every round and before every pick.
`self.pool.switches` logs every change of phase on the local engine clock (seconds since the run started).
Or, with `mixed_pool='borrow'` (Splitwise's preset), the mixed pool has no instances of its own: the prefill and
decode instances (BorrowingSchedulers) move into it and back (pdjax.scheduler.mixed.BorrowingPool, `self.pool.moves`
on the same clock); in the mixed pool an instance runs Sarathi mixed batches, and a handoff whose pick is the
instance that prefilled the request keeps it there (`keep_local`: no transfer, its pages stay), so KV may move
between any two instances (warm-up compiles every pair).
Or, with `pool_factory` (pdjax.scheduler.overload: early rejection and online XpYd rebalancing, the simulator's very
pool), its pool routes: a None pick rejects the request at its arrival or after its prefill (its reason on the
request, its prefill pages freed), and a rebalancing pool flips instances between the roles (KV may then move between
any two instances too).

Loop (single host thread, mirroring ColocatedEngine's batch-queue loop per instance): every instance has its own
`pdjax.scheduler.BatchQueue` of up to `max_in_flight` dispatched, uncollected batches (default: its runner's pp,
so a PipelineRunner's stage s runs batch k+1 while stage s+1 runs batch k; 1 for a ModelRunner). Every round:
  1. in-flight KV transfers are polled (landings: mark_kv_arrived / release), idle mixed instances return to
     the mixed pool;
  2. fill: each instance with work, in instance order, schedules and dispatches while its queue is not full and
     `schedule(now)` returns a non-empty batch (the scheduler builds it from requests not in flight; an empty
     batch that carries swap copies goes to the runner for its copies). JAX dispatch is async and the
     instances' devices are disjoint, so every instance's batches run at the same time;
  3. arrivals are admitted while the steps run (`overlap`);
  4. collect: each instance with a batch in flight, in instance order: if its queue is not full, transfers are
     polled and it tops its queue up first (step 2 again: arrivals admitted in 3, handoffs and landings from the
     instances collected before it may have brought work, which then runs while its older batch is still in
     flight, as ColocatedEngine admits arrivals between dispatches); then it collects its oldest batch: its
     scheduler is updated (results applied in dispatch order), its tokens stamped with the time its ids reached
     the host, finished prefills handed off.
With max_in_flight == 1 (pp == 1) a queue with a batch is always full, so a round is: every busy instance
schedules and dispatches one step, then every one is collected in turn, exactly the one-step-per-instance round.
A request is in at most one in-flight batch, so a decode instance, whose running requests all fit one batch
(stall-free budget), has two batches in flight only after requests were admitted while one was in flight (the
top-up in 4); from then on its running requests alternate between the batches. Iteration records carry the
instance name ('replica0', 'prefill0', 'decode1', ...), a per-instance step index, and each batch's start
(scheduled) and end (collected and applied) times, so consecutive batches of a pipelined instance overlap.
`overlap=False` (the non-overlapped loop, kept for comparison) dispatches each step only when it is collected,
hence one batch per instance (max_in_flight is 1 there).

Asynchronous KV transfer (`async_transfer=True`, the default): a handoff only enqueues the transfer's gathers
and copy (`transfer(..., wait=False)`; JAX dispatch is asynchronous) and keeps a per-transfer record of its
staged arrays (`_in_flight`), so the prefill instance's next step is dispatched in the very next round while
the KV is still moving. At the start of every round the in-flight transfers are polled (`StagedKV.is_ready()`,
never blocking); one that has landed gets `mark_kv_arrived` on the decode side and `release` on the prefill
side (its pages stay held, and unwritten, until then), so the decode scheduler admits a request only once its
pages are on the decode devices. When no instance can run and transfers are in flight, the loop waits for a
landing (or the next arrival) instead. TransferRecord: `start_time` (dispatch), `landed_time` (the round
that saw it ready: a poll-granular upper bound), `seconds` = landed - start, `host_s` = host time the loop spent
in the transfer call (the prefill loop's blocked time). `async_transfer=False` is the synchronous form (the
handoff blocks until the KV landed, then marks and releases at once), kept for comparison
(experiments/bench_kv_transfer.py).

Choices and limits:
- Transfers are polled once per round (and before a top-up in step 4): a landing is noticed at the next round
  boundary (at most one collected batch of each busy instance late); each is measured per request
  (`transfers`). A handoff gathers the request's pages from the prefill instance's current caches while its
  later batches may still be in flight (they never write the handed-off request's pages: those stay held until
  the landing), and a decode instance scatters arriving KV into its caches behind its in-flight batches (JAX
  orders both by data dependency).
  `warmup_transfers` compiles every source stage's gather, every copy and every destination stage's scatter for
  every padded page count before serving, so no transfer compiles mid-run.
- Routing: 'round_robin', or 'least_loaded' (InstanceRouter.load of the instance's role); with a mixed pool, the
  thresholds `mixed_prefill_queue_tokens` / `mixed_decode_load` (pdjax.config.deployment) decide when it is used.
  A router cost with `observe_step` (kv_centric's measured cost, pdjax.serving.kv_tier) is told every collected
  step: the instance, its batch, its start and end on the engine clock, and its compiles.
- A request that finishes on its first token ('stop' / 'length') never reaches a decode instance.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from pdjax.metrics import IterationRecord, request_record
from pdjax.scheduler import BatchQueue, Request
from pdjax.scheduler.instances import ROLE_POLICIES, ROLES, TransferRecord
from pdjax.scheduler.instances import Instance as BaseInstance
from pdjax.scheduler.mixed import make_pool
from pdjax.scheduler.routing import InstanceRouter
from pdjax.serving.distributed import Coordinator
from pdjax.serving.engine import (ArrivalQueue, CompileTracker, EngineResult, TokenCallback, fail_nonfinite,
                                  scrub_pages)
from pdjax.serving.kv_transfer import StagedKV, scatter_kv_pages, transfer_kv
from pdjax.serving.logprobs import StepLogprobs

class Instance(BaseInstance):
    """One instance (pdjax.scheduler.instances.Instance, the engine's and the simulator's one instance type) with
    a runner (ModelRunner or PipelineRunner, with a `mesh` and `kv_stages`): the scheduler is 'prefill_only' for
    role 'prefill', 'decode_only' for 'decode', any colocated policy for 'colocated'; roles and names as
    pdjax.scheduler.instances: 'replica0', 'prefill0', 'decode0', ..."""

    def __init__(self, name: str, role: str, runner: Any, scheduler: Any):
        super().__init__(name, role, scheduler)
        self.runner = runner
        policy = getattr(scheduler, "name", scheduler)
        if role == "colocated" and policy in ROLE_POLICIES.values():
            raise ValueError(f"instance {name!r} (colocated) needs a colocated policy, got {policy!r}")


@dataclasses.dataclass
class ClusterResult(EngineResult):
    transfers: List[TransferRecord] = dataclasses.field(default_factory=list)

    def transfer_summary(self) -> Dict[str, float]:
        """Totals over all transfers: count, bytes, seconds, and achieved bandwidth (moved bytes / s)."""
        total_s = sum(t.seconds for t in self.transfers)
        moved = sum(t.moved_bytes for t in self.transfers)
        return {"num_transfers": len(self.transfers), "kv_bytes": sum(t.kv_bytes for t in self.transfers),
                "moved_bytes": moved, "seconds": total_s,
                "bandwidth_bytes_per_s": moved / total_s if total_s > 0 else 0.0,
                "host_blocked_s": sum(t.host_s for t in self.transfers)}


@dataclasses.dataclass(eq=False)     # compared by identity (its fields hold arrays)
class _InFlightTransfer:
    """A dispatched transfer whose KV has not landed yet: its staged arrays and its record."""
    src: Any                 # Instance
    dst: Any                 # Instance
    staged: StagedKV
    record: TransferRecord


class ClusterEngine:
    """Drives colocated replicas, or prefill and decode instances (see the module docstring). max_in_flight:
    batches each instance keeps in flight at most (None: its runner's pp; 1 everywhere without `overlap`);
    raises ValueError for a value that is not a positive int."""

    def __init__(self, instances: Sequence[Instance], *, router: str = "round_robin",
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
                 on_token: Optional[TokenCallback] = None, overlap: bool = True,
                 transfer: Callable[..., StagedKV] = transfer_kv, compile_counter: Optional[Callable[[], int]] = None,
                 fail_on_compile: bool = False, async_transfer: bool = True, coordinator=None,
                 mixed: Sequence[Instance] = (), mixed_prefill_queue_tokens: int = 8192,
                 mixed_decode_load: float = 1.0, max_in_flight: Optional[int] = None,
                 mixed_pool: str = "dedicated", pool_factory: Optional[Callable] = None,
                 router_options: Optional[dict] = None):
        if max_in_flight is not None and (isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int)
                                          or max_in_flight < 1):
            raise ValueError(f"max_in_flight={max_in_flight!r}, expected None (each runner's pp) or a positive int")
        instances = list(instances) + list(mixed)   # mixed: the mixed pool (role 'mixed'), also accepted in instances
        if not instances:
            raise ValueError("a cluster needs at least one instance")
        names = [i.name for i in instances]
        if len(set(names)) != len(names):
            raise ValueError(f"instance names must be unique, got {names}")
        by_role = {role: [i for i in instances if i.role == role] for role in ROLES}
        self.colocated, self.prefill, self.decode, self.mixed = (by_role[r] for r in ROLES)
        if self.colocated and (self.prefill or self.decode or self.mixed):
            raise ValueError(f"colocated instances {[i.name for i in self.colocated]} cannot share a cluster with "
                             "prefill/decode/mixed instances")
        for role, other in (("prefill", "decode"), ("decode", "prefill"), ("prefill", "mixed")):
            if by_role[other] and not by_role[role]:
                raise ValueError(f"a disaggregated engine needs at least one {role} instance")
        if self.prefill:
            sizes = {i.name: i.scheduler.config.page_size for i in self.prefill + self.decode + self.mixed}
            if len(set(sizes.values())) != 1:
                raise ValueError(f"all instances need the same page_size (pages move whole), got {sizes}")
        if self.colocated:
            if mixed_pool != "dedicated":
                raise ValueError(f"mixed_pool={mixed_pool!r} with colocated instances: the mixed pool is part of a "
                                 "disaggregated cluster; expected 'dedicated'")
            self.entry_router = InstanceRouter(router, self.colocated, **(router_options or {}))
            self.pool = self.decode_router = None
        elif pool_factory is not None:   # early rejection / rebalancing (pdjax.scheduler.overload)
            if self.mixed or mixed_pool != "dedicated":
                raise ValueError("pool_factory (early rejection / rebalancing) with a mixed pool: expected none")
            self.pool = pool_factory(self.prefill, self.decode)
            self.entry_router, self.decode_router = self.pool.prefill_router, self.pool.decode_router
        else:
            self.pool = make_pool(mixed_pool, router, self.prefill, self.decode, self.mixed,
                                  prefill_queue_tokens=mixed_prefill_queue_tokens, decode_load=mixed_decode_load)
            self.entry_router, self.decode_router = self.pool.prefill_router, self.pool.decode_router
        if not self.colocated:
            for r in (self.entry_router, self.decode_router):    # the cache-aware routers' options (issue 30)
                for key, value in (router_options or {}).items():
                    setattr(r, key, value)
        self.mixed_pool = mixed_pool
        self.any_pair = mixed_pool == "borrow" or getattr(self.pool, "flips", None) is not None  # KV between any two
        self._t0 = 0.0
        self.clock, self.sleep, self.on_token, self.overlap = clock, sleep, on_token, overlap
        self.max_in_flight = max_in_flight   # None: each instance's runner.pp (module docstring)
        self.transfer = transfer   # called as transfer(src_stages, pages, dst_meshes, num_tokens=n, wait=bool)
        self.async_transfer = async_transfer
        self._in_flight: List[_InFlightTransfer] = []
        self.coordinator = coordinator if coordinator is not None else Coordinator()   # distributed.py
        self.compiles = CompileTracker(compile_counter, fail_on_compile)
        self._staged: Dict[str, StagedKV] = {}

    @property
    def instances(self) -> List[Instance]:
        return self.colocated + self.prefill + self.decode + self.mixed

    def instance_max_in_flight(self, inst: Instance) -> int:
        """Batches `inst` keeps in flight at most: 1 without overlap, else max_in_flight, else its runner's pp."""
        if not self.overlap:
            return 1
        if self.max_in_flight is not None:
            return self.max_in_flight
        return int(getattr(inst.runner, "pp", 1) or 1)

    def _local_time(self) -> float:
        """Seconds since the run started on this process's clock (no collective: for the mixed pool's log)."""
        return self.clock() - self._t0

    def _route_arrival(self, req: Request) -> bool:
        """An arrival: a colocated replica (router), or a prefill / prefill-phase mixed instance (MixedPool)."""
        if self.pool is None:
            return self.entry_router.pick(req).scheduler.add_request(req)
        inst = self.pool.pick_prefill(req, self._local_time())
        return inst is not None and inst.scheduler.add_request(req)   # None: rejected at arrival (admission)

    def warmup_transfers(self, max_model_len: int) -> float:
        """Compile the transfer's per-stage gathers / cross-group copies / per-stage scatters for every padded
        page count a request of up to `max_model_len` tokens can need, on every (prefill, decode) pair; returns
        seconds taken (0 without such pairs).

        Writes junk into the leading pages of the decode caches: harmless before serving (a request only ever
        reads KV positions it wrote itself or received)."""
        start = time.perf_counter()
        # Every pair a handoff can use (mixed: either side, never itself; borrowing: any two machines).
        borrow = self.any_pair
        for src in (self.prefill + self.decode if borrow else self.prefill + self.mixed):
            for dst in (self.prefill + self.decode if borrow else self.decode + self.mixed):
                if src is dst:
                    continue
                src_stages = src.runner.kv_stages
                ps = src_stages[0].page_size
                most = min(-(-max_model_len // ps), src_stages[0].num_pages, dst.runner.kv_stages[0].num_pages)
                sizes, s = [], 1
                while True:
                    sizes.append(min(s, most))
                    if s >= most:
                        break
                    s *= 2
                for n in sizes:
                    staged = self.transfer(src.runner.kv_stages, list(range(n)), dst.runner.kv_stage_meshes,
                                           num_tokens=n * ps)
                    dst.runner.kv_stages = scatter_kv_pages(dst.runner.kv_stages, list(range(n)), staged)
        for inst in (self.prefill + self.decode if borrow else self.decode + self.mixed):
            for cache in inst.runner.kv_stages:
                cache.k[0].block_until_ready()
        return time.perf_counter() - start

    # ------------------------------------------------------------------------------------------------------
    def _handoff(self, src: Instance, req: Request, now: Callable[[], float],
                 transfers: List[TransferRecord]) -> bool:
        """Hand a prefilled request to a decode instance; False if the decode side rejected it (then it is
        finished: its pages on the prefill side are freed). A pick equal to `src` (borrowing mixed pool) keeps it
        there: no transfer, its held pages are its page table again (keep_local)."""
        rid = req.request_id
        dst = self.pool.pick_decode(req, self._local_time(), src)   # the decode router, or the mixed pool
        if dst is None:      # rejected after its prefill (admission): its prefill pages are freed at once
            src.scheduler.release(rid)
            return False
        if dst is src:
            src.scheduler.keep_local(rid, now())
            return True
        if not dst.scheduler.add_handoff(req, now()):
            src.scheduler.release(rid)
            return False
        start = now()
        local = req.num_kv_local_pages     # partial transfer: the leading pages dst holds already stay put
        if local and local * src.scheduler.config.page_size >= req.num_computed_tokens:
            self._staged[rid] = None       # nothing is missing: landed at once
            dst.scheduler.mark_kv_arrived(rid)
            src.scheduler.release(rid)
            transfers.append(TransferRecord(request_id=rid, src=src.name, dst=dst.name, num_tokens=0, kv_bytes=0,
                                            ready_time=start, start_time=start, end_time=start))
            return True
        staged = self.transfer(src.runner.kv_stages, src.scheduler.held_page_table(rid)[local:],
                               dst.runner.kv_stage_meshes,
                               num_tokens=req.num_computed_tokens - local * src.scheduler.config.page_size,
                               wait=not self.async_transfer)
        record = TransferRecord(
            request_id=rid, src=src.name, dst=dst.name, num_tokens=staged.num_tokens, num_pages=staged.num_pages,
            kv_bytes=staged.kv_bytes, moved_bytes=staged.moved_bytes, ready_time=start, start_time=start,
            end_time=start, host_s=now() - start)
        transfers.append(record)
        flight = _InFlightTransfer(src, dst, staged, record)
        if self.async_transfer:
            self._in_flight.append(flight)
        else:
            staged.wait()
            self._land(flight, now())
        return True

    def _land(self, flight: _InFlightTransfer, t: float) -> None:
        """The KV of flight's request is on the decode devices: the decode side may admit it, the prefill side
        frees its pages."""
        rid = flight.record.request_id
        self._staged[rid] = flight.staged
        flight.dst.scheduler.mark_kv_arrived(rid)
        flight.src.scheduler.release(rid)
        flight.record.end_time = t      # landed: record.seconds = t - start_time

    def _poll_transfers(self, now: Callable[[], float]) -> int:
        """Land every in-flight transfer whose arrays are ready (never blocks); returns how many landed."""
        if not self._in_flight:
            return 0
        # Readiness is per process: process 0's view decides for all (coordinator; identity for one process).
        ready_idx = self.coordinator.agree([i for i, f in enumerate(self._in_flight) if f.staged.is_ready()])
        ready = [self._in_flight[i] for i in ready_idx]
        if ready:
            t = now()
            for f in ready:
                self._land(f, t)
            self._in_flight = [f for f in self._in_flight if f not in ready]
        return len(ready)

    def _await_landing(self, arrivals: ArrivalQueue, now: Callable[[], float], wait_for_arrival) -> None:
        """Nothing can run but transfers are in flight: wait until one lands, or until the next arrival."""
        if arrivals.exhausted:
            self._in_flight[0].staged.wait()
            self._poll_transfers(now)
            return
        while not self._poll_transfers(now):
            left = arrivals.next_time - now()
            if left <= 0:
                wait_for_arrival()
                return
            self.sleep(min(left, 0.0005))

    @staticmethod
    def _copies_only(inst: Instance, out) -> None:
        """An empty batch that still carries swap copies (a request swapped itself out while every other one was
        in flight) goes to the runner for its copies (as ColocatedEngine): a later batch swaps those pages in."""
        if out.swap_out or out.swap_in:
            inst.runner.collect(inst.runner.dispatch(out))

    def _load_handoffs(self, inst: Instance, out):
        """Before a decode step: write each newly admitted request's staged KV into its page table. Returns the
        batch to dispatch: `out`, or, when it carries host KV tier copies (a page offloaded may be one the staged
        KV is written into), `out` without them, made here first (device pages read before the scatter)."""
        runner = inst.runner
        if out.swap_out or out.swap_in:
            runner.swap(out.swap_out, out.swap_in)
            out = dataclasses.replace(out, swap_out=[], swap_in=[])
        index = {rid: i for i, rid in enumerate(out.req_ids)}
        for rid in out.kv_handoff_req_ids:
            if rid in self._staged and self._staged[rid] is None:    # partial transfer with nothing missing
                del self._staged[rid]
                continue
            staged = self._staged.pop(rid, None)
            if staged is None:
                raise RuntimeError(f"{inst.name}: request {rid!r} was admitted with no staged KV")
            i = index[rid]
            local = out.reqs[i].num_kv_local_pages if out.reqs else 0   # pages it held already (partial transfer)
            runner.kv_stages = scatter_kv_pages(runner.kv_stages, out.page_tables[i][local:], staged)
        return out

    def _fill(self, inst: Instance, queue: BatchQueue, now: Callable[[], float]) -> None:
        """Schedule and dispatch `inst`'s batches while its queue is not full and schedule(now) is non-empty
        (an empty batch's swap copies still go to the runner)."""
        while not queue.full and inst.scheduler.has_unfinished():
            start = now()
            out = inst.scheduler.schedule(start)
            self.coordinator.digest(inst.name, out)
            if out.is_empty:
                self._copies_only(inst, out)
                return
            run = out
            if out.kv_handoff_req_ids:
                run = self._load_handoffs(inst, out)
            handle = inst.runner.dispatch(run) if self.overlap else run   # not overlapped: dispatched at collect
            queue.push(out, (start, handle))

    def abort(self, request_id: str, now: float) -> bool:
        """Finish `request_id` as 'aborted' wherever it is, freeing its pages at once: its in-flight KV transfer
        and staged KV are dropped, every instance holding it aborts it (a prefill side that handed it off frees
        its held pages). False if no instance held it. Call it from the loop's thread between steps."""
        self._in_flight = [f for f in self._in_flight if f.record.request_id != request_id]
        self._staged.pop(request_id, None)
        found = False
        for inst in self.instances:
            found = inst.scheduler.abort(request_id, now) is not None or found
        return found

    def run(self, requests: Sequence[Request], *, progress: Optional[Callable[[int], None]] = None,
            source=None) -> ClusterResult:
        """Serve `requests` (scheduler Requests, arrival times relative to the start) until all finish.
        source: an online request source (pdjax.serving.online.OnlineSource; as ColocatedEngine.run).
        Steps: `_round` (module docstring's 1-4) until it reports the run over; `_fill`, `_idle` and
        `_collect_step` are its parts."""
        arrivals = (ArrivalQueue(requests, self._route_arrival) if source is None
                    else source.arrivals(self._route_arrival, self.abort))
        self._iterations: List[IterationRecord] = []
        if hasattr(self.pool, "bind"):
            self.pool.bind(self._iterations)    # early rejection learns its step rates from the run's records
        self._transfers: List[TransferRecord] = []
        # kv_centric's measured cost (pdjax.scheduler.step_fit.MeasuredCost) learns from every collected step
        self._observe_step = getattr(getattr(self.entry_router, "cost", None), "observe_step", None)
        self._t0 = self.clock()
        self._overlap = 0.0
        self._progress = progress
        self._staged.clear()
        self._in_flight = []
        for inst in self.instances:
            inst.num_steps = 0
        self._queues = {inst.name: BatchQueue(self.instance_max_in_flight(inst)) for inst in self.instances}
        self.compiles.reset()
        self._admit(arrivals, self._now())
        while self._round(arrivals):
            pass
        return ClusterResult(
            requests=[request_record(r) for r in arrivals.pending], iterations=self._iterations,
            output_tokens={r.request_id: list(r.output_token_ids) for r in arrivals.pending},
            duration_s=self._now(), host_overlap_s=self._overlap, transfers=self._transfers)

    # ------------------------------------------------------------------------------------------------------
    def _now(self) -> float:
        """Seconds since the run started, on process 0's clock."""
        return self.coordinator.now(self.clock() - self._t0)

    def _done(self, n: int) -> None:
        if n and self._progress is not None:
            self._progress(n)

    def _admit(self, arrivals: ArrivalQueue, t: float) -> None:
        self._done(arrivals.admit(t))   # rejected at the door: done at once

    def _wait_for_arrival(self, arrivals: ArrivalQueue) -> None:
        self._done(arrivals.wait(self._now, self.sleep))

    def _round(self, arrivals: ArrivalQueue) -> bool:
        """One round of the loop (module docstring); False once every request finished and no arrival is left."""
        self._poll_transfers(self._now)
        if self.pool is not None and self.pool.active:
            self.pool.return_idle(self._local_time())   # idle mixed instances back to the mixed pool
        queues = self._queues
        busy = [inst for inst in self.instances if inst.scheduler.has_unfinished() or queues[inst.name]]
        if not busy and not self._in_flight:
            if arrivals.exhausted:
                return False
            self._wait_for_arrival(arrivals)
            return True
        launched = []    # instances with a batch in flight: each collects its oldest this round
        for inst in busy:
            self._fill(inst, queues[inst.name], self._now)
            if queues[inst.name]:
                launched.append(inst)
        if not launched:
            self._idle(arrivals, busy)
            return True
        if self.overlap:
            host_start = self._now()
            self._admit(arrivals, host_start)     # overlapped with the device steps
            self._overlap += self._now() - host_start
        for inst in launched:
            self._collect_step(inst, queues[inst.name])
        if not self.overlap:
            self._admit(arrivals, self._now())
        return True

    def _idle(self, arrivals: ArrivalQueue, busy: List[Instance]) -> None:
        """No instance launched a batch: wait for a transfer to land or for the next arrival; raise if neither
        can come."""
        if self._in_flight:
            self._await_landing(arrivals, self._now, lambda: self._wait_for_arrival(arrivals))
            return
        if not any(i.scheduler.has_unfinished() for i in busy):
            return       # an abort at admission ended the last requests: the next round sees whether more come
        if arrivals.exhausted:
            state = {i.name: (i.scheduler.num_waiting, i.scheduler.num_running) for i in busy}
            raise RuntimeError(f"no instance can make progress and no arrivals are left: (waiting, "
                               f"running) per instance {state}")
        self._wait_for_arrival(arrivals)

    def _collect_step(self, inst: Instance, queue: BatchQueue) -> None:
        """Top `inst`'s queue up if it has a free slot, then collect and apply its oldest batch: records, tokens,
        non-finite rows, handoffs of finished prefills."""
        if not queue.full:
            # Batches in flight (max_in_flight > 1) and a free slot: work that came since the fill
            # (arrivals, handoffs, landings) gets a batch before the host blocks on the oldest one.
            self._poll_transfers(self._now)
            self._fill(inst, queue, self._now)
        out, (start, handle) = queue.pop()     # the oldest batch: wait for it, apply it
        handle = handle if self.overlap else inst.runner.dispatch(handle)   # not overlapped: `handle` is the batch
        sampled = self.coordinator.collect(inst.runner, handle)
        end = self._now()
        sampled, aborted, pages = fail_nonfinite(inst.scheduler, out, sampled, end,
                                                 f"{inst.name} step {inst.num_steps}")
        step_lp = StepLogprobs.read(self.coordinator, inst.runner, handle, out)   # (a prefill's first token too)
        finished = inst.scheduler.update(out, sampled, end)
        if step_lp is not None:
            step_lp.attach(sampled)
        compiles = self.compiles.new(f"{inst.name} iteration {inst.num_steps}")
        self._iterations.append(IterationRecord(
            step=inst.num_steps, start_time=start, end_time=end, num_prefill_tokens=out.num_prefill_tokens,
            num_decode_tokens=out.num_decode_tokens, num_seqs=out.num_seqs, instance=inst.name,
            num_compiles=compiles))
        if self._observe_step is not None:
            self._observe_step(inst, out, start, end, compiles)
        inst.num_steps += 1
        if pages:
            scrub_pages(inst.runner, inst.scheduler, pages, self.compiles)
        if self.on_token is not None:
            for rid, tok in zip(out.req_ids, sampled):
                if tok >= 0:
                    self.on_token(rid, int(tok), end)
        n_done = len(aborted)
        for req in finished:
            if req.finish_reason == "handoff":
                n_done += not self._handoff(inst, req, self._now, self._transfers)
            else:
                n_done += 1
        self._done(n_done)
