"""Splitwise's mixed pool (Patel et al., ISCA 2024): the mixed machine's scheduler and the cluster-level routing over
the prompt (prefill), token (decode) and mixed pools, shared by the real engine and the simulator (no JAX).

Reading of Splitwise (the paper's cluster-level scheduler and its artifact's `MixedPoolScheduler`,
splitwise-sim/scheduler.py, configs/orchestrator_repo/schedulers/mixed_pool.yml):
- Three pools. The prompt pool runs prompts, the token pool runs token generation, each request's KV moves once
  from its prompt machine to its token machine. The mixed pool takes machines of either pool when the other is
  overloaded: a machine moved there keeps its identity and, once it has finished its work, returns to its own
  pool (`notify_free_instance`).
- At an arrival the cluster scheduler picks a prompt machine and a token machine, join-the-shortest-queue: the
  prompt pool's machine with the fewest pending tokens, unless its queue is "long" (it has pending work and its
  pending tokens + this prompt exceed `prompt_max_pending_batch_tokens`, 8192 in the shipped config); then the
  mixed pool's machine by the same test; if that fails too, a token machine (fewest pending tokens) is moved to the
  mixed pool and takes the prompt. Token side alike: the token pool's machine with the least memory in use,
  unless it is "memory loaded" (memory in use + this request's would reach its capacity); then the mixed pool's;
  else a prompt machine is moved to the mixed pool. If both searches fail, the request runs on one machine (mixed
  batching, no KV transfer).
- So a mixed machine that ran a request's prompt keeps its tokens only when the token search picked that same
  machine (the mixed pool's least-loaded, or the both-fail fallback); normally the request's KV goes to a token
  machine like any other prompt's. Machines of the mixed pool batch prompts and tokens together (the paper's
  "mixed batching").

pdjax has both readings, chosen by `deployment.mixed_pool`:
- 'borrow' (Splitwise's preset, `BorrowingPool` + `BorrowingScheduler`): the mixed pool has no machines of its
  own; prefill and decode machines move into it and back, exactly as above. Below.
- 'dedicated' (`MixedPool` + `MixedScheduler`): the mixed pool is an extra group of machines that work one phase
  at a time. Further below.

Borrowing (mixed_pool='borrow'). Every prefill and decode machine runs a `BorrowingScheduler`: its home pool
('prefill' / 'decode', its role and instance name, which it keeps) and its current pool ('prefill', 'decode' or
'mixed'). In its home pool it is exactly that pool's policy ('prefill_only' / 'decode_only': same passes, same
protocol); in the mixed pool it takes arrivals (`add_request`) and handoffs (`add_handoff`) and runs Sarathi mixed
batches (decodes first, then prefill chunks, in its own token budget). Sarathi because the role policies already
are its passes (prefill_only / decode_only are Sarathi without decodes / without fresh prompts), so one scheduler,
one block manager and one prefix cache serve the machine whichever pool it is in and a move never converts state;
and because a borrowed token machine that takes prompts in budget-sized chunks keeps its running decodes going
(stall-free), where the artifact's machines batch whole prompts ahead of tokens (prompt priority, `max_batch_tokens`).
Routing (`BorrowingPool`; the loads of pdjax.scheduler.routing, tests as above):
- Arrival (`pick_prefill`): the prefill pool (the machines in it now) by the deployment's router unless every one
  is overloaded (`prefill_overloaded`, threshold `mixed_prefill_queue_tokens`); else the mixed pool's machine with
  the fewest queued prompt tokens that is not overloaded; else the decode-pool machine with the fewest pending
  tokens (prompt tokens to prefill + one per live request, the artifact's `sched_pending_tokens`) moves into the
  mixed pool and takes it; else (no decode machine left in its pool) the machine with the fewest pending tokens of
  the prefill and mixed pools takes it (moving into the mixed pool if it was in the prefill pool) and the request
  is marked to run there whole (the artifact's "both fail" fallback: mixed batching, no KV transfer).
- Handoff (`pick_decode(req, now, src)`, when src, the machine that prefilled, sampled the first token): a
  request marked to run whole stays on src; else the decode pool by the router unless every one is overloaded
  (`decode_overloaded`, threshold `mixed_decode_load`); else the mixed pool's least-loaded machine not overloaded;
  else the prefill-pool machine with the least decode load moves into the mixed pool and takes it; else (no prefill
  machine left in its pool) it stays on src, which is then in the mixed pool. A pick equal to src keeps the KV
  where it is: the engines call `src.scheduler.keep_local(request_id, now)` (its held pages become its running
  pages again, no transfer) instead of a handoff. Picking the token machine at the handoff rather than at the
  arrival (the artifact picks both at once, from reserved memory) keeps the deployment's router and its decode
  loads as they are without a mixed pool, so a run that never overloads a pool is the plain one, record for record.
- A machine moves into the mixed pool busy or idle (its work carries on: a prefill machine's requests still prefill
  and are then handed off or kept, a decode machine's decodes continue) and returns to its home pool as soon as it
  is idle (`Scheduler.is_idle`: nothing waiting, running, awaiting KV, and no pages held for a transfer;
  the artifact's `notify_free_instance`). `return_idle(now)` is called by the engines after steps and KV landings
  and before every pick. Every move is logged (`BorrowingPool.moves`: time, instance, from pool, to pool, why).
- Machines: P prompt + T token machines are P + T machines; the mixed pool is a state of theirs, never a group.

Dedicated (mixed_pool='dedicated', issue 13): the mixed pool is a group of its own, `deployment.mixed` (instances
'mixed0', ...), rather than machines borrowed from the two other pools, so the prefill and decode pools keep their
size and layout and the mixed machines are a reserve that either phase can draw on:
- A mixed instance is idle (phase None) in the mixed pool. When an arrival finds the prefill pool overloaded
  (`prefill_overloaded`: every prefill instance has prompt tokens queued and queued + the new prompt exceeds
  `deployment.mixed_prefill_queue_tokens`, the artifact's test with its threshold), it goes to a mixed instance
  already in the prefill phase that is not overloaded by the same test (least queued first), else an idle mixed
  instance (lowest index) takes the prefill phase. A handoff that finds the decode pool overloaded
  (`decode_overloaded`: on every decode instance max(KV pages in use or owed to queued requests plus the
  request's, over num_pages; live sequences + 1, over max_num_seqs) exceeds `deployment.mixed_decode_load`; at
  1.0 this is the artifact's "memory full", extended to sequence slots) goes to a decode-phase mixed instance
  likewise, else an idle one takes the decode phase. When nothing is free anywhere the request queues on the least
  loaded instance of its phase (pool and mixed instances in that phase): backpressure, where the artifact falls
  back to mixed batching. Below the thresholds nothing changes: the deployment's router picks in the pool.
- A mixed instance in a phase runs exactly that phase's policy: `MixedScheduler` behaves as 'prefill_only' in the
  prefill phase (its requests finish with 'handoff' after their first token, pages held until `release`) and as
  'decode_only' in the decode phase (`add_handoff`, `mark_kv_arrived`, admission under backpressure). The
  handoff protocol stays the one protocol of pdjax/scheduler/policies.py, KV transfer included: a request that a
  mixed instance prefilled is handed off like any prefilled request (to the decode pool, or to a decode-phase
  mixed instance, never to itself: it is in the prefill phase until it is idle). It never keeps a request's
  tokens locally: pdjax does not mix the phases on one machine (the artifact does that only as a last resort).
- It returns to the mixed pool (phase None) as soon as it is idle: nothing waiting or running and no pages held
  for a transfer in flight (`Scheduler.is_idle`). The phase changes only while idle, so one scheduler and one
  KV cache serve both phases (the block manager and its prefix cache are the machine's, whatever the phase).
  `MixedPool.return_idle(now)` is called by the engines after steps and KV landings, and before every pick.
- Every change of phase is logged (`MixedPool.switches`: (time, instance name, new phase or None)).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import List, Optional, Sequence, Tuple

from pdjax.config.deployment import MIXED_POOL_MODES, ROLE_POLICIES
from pdjax.scheduler.base import RUNNING, Scheduler
from pdjax.scheduler.policies import DecodeOnlyScheduler
from pdjax.scheduler.request import Request
from pdjax.scheduler.routing import InstanceRouter

PHASES = ("prefill", "decode")
POOLS = ("prefill", "decode", "mixed")     # a borrowing machine's pools: its home ('prefill' / 'decode') or 'mixed'

__all__ = ["MIXED_POOL_MODES", "PHASES", "POOLS", "BorrowingPool", "BorrowingScheduler", "MixedPool",
           "MixedScheduler", "Move", "decode_load", "decode_overloaded", "make_pool", "pool_intervals",
           "prefill_overloaded"]


class MixedScheduler(DecodeOnlyScheduler):
    """The scheduler of a mixed-pool instance: idle (phase None), or 'prefill_only' / 'decode_only' behaviour in
    the 'prefill' / 'decode' phase (module docstring). Both behaviours are the Sarathi passes of the role
    policies: in the prefill phase only fresh requests are held (no decodes run: each finishes with 'handoff'), in
    the decode phase only handed-off ones."""
    name = "mixed"

    def __init__(self, config):
        super().__init__(config)
        self.phase: Optional[str] = None

    @property
    def handoff_after_prefill(self) -> bool:   # read by Scheduler.update
        return self.phase == "prefill"

    def take_phase(self, phase: str) -> bool:
        """Act as the `phase` pool's instance; True if that changed the phase. Only an idle instance changes."""
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r}, expected one of {PHASES}")
        if self.phase == phase:
            return False
        if not self.is_idle:
            raise RuntimeError(f"a mixed instance in phase {self.phase!r} takes phase {phase!r} only when idle")
        self.phase = phase
        return True

    def return_if_idle(self) -> bool:
        """Back to the mixed pool (phase None) if in a phase and idle; True if it returned."""
        if self.phase is not None and self.is_idle:
            self.phase = None
            return True
        return False

    def add_request(self, req: Request) -> bool:
        if self.phase != "prefill":
            raise RuntimeError(f"add_request on a mixed instance in phase {self.phase!r}: arrivals go to a mixed "
                               "instance in the 'prefill' phase (MixedPool.pick_prefill)")
        return Scheduler.add_request(self, req)

    def add_handoff(self, req: Request, now: float) -> bool:
        if self.phase != "decode":
            raise RuntimeError(f"add_handoff on a mixed instance in phase {self.phase!r}: handoffs go to a mixed "
                               "instance in the 'decode' phase (MixedPool.pick_decode)")
        return super().add_handoff(req, now)


class BorrowingScheduler(DecodeOnlyScheduler):
    """A prefill or decode machine's scheduler under mixed_pool='borrow' (module docstring): `home` is its pool
    ('prefill' / 'decode'), `pool` where it is now ('prefill', 'decode' or 'mixed'; only `BorrowingPool` moves
    it). At home it is its role's policy exactly ('prefill_only': requests finish with 'handoff' after their first
    token; 'decode_only': handoffs only); in the mixed pool it takes both and runs Sarathi mixed batches, and every
    request it prefilled there finishes with 'handoff' after its first token, so that the cluster picks its token
    machine (`keep_local` when that is this machine). `name` is the home policy's, so the role checks of
    pdjax.scheduler.instances hold."""

    def __init__(self, config, home: str):
        if home not in PHASES:
            raise ValueError(f"home={home!r}, expected one of {PHASES}")
        super().__init__(config)
        self.home = home
        self.pool = home

    @property
    def name(self) -> str:
        return ROLE_POLICIES[self.home]

    @property
    def handoff_after_prefill(self) -> bool:   # read by Scheduler.update
        return self.pool == "prefill"

    def add_request(self, req: Request) -> bool:
        if self.pool == "decode":
            raise RuntimeError("add_request on a decode-pool machine: arrivals go to the prefill or mixed pool "
                               "(BorrowingPool.pick_prefill)")
        return Scheduler.add_request(self, req)

    def add_handoff(self, req: Request, now: float) -> bool:
        if self.pool == "prefill":
            raise RuntimeError("add_handoff on a prefill-pool machine: handoffs go to the decode or mixed pool "
                               "(BorrowingPool.pick_decode)")
        return super().add_handoff(req, now)

    def update(self, output, sampled_token_ids, now: float) -> List[Request]:
        """Scheduler.update; in the mixed pool, a request whose prefill ran here and that just sampled its first
        token (and goes on) finishes with 'handoff' as in the prefill pool (its pages held until `release` or
        `keep_local`), while the decodes of the batch go on as in the decode pool."""
        finished = super().update(output, sampled_token_ids, now)
        if self.pool != "mixed":
            return finished
        handed = False
        for req, is_prefill, sample in zip(output.reqs, output.is_prefill, output.do_sample):
            if is_prefill and sample and req.status is RUNNING and len(req.output_token_ids) == 1:
                rid = req.request_id
                self._held[rid] = req
                self._held_tables[rid] = req.page_table
                req.page_table = []
                self._finish(req, "handoff", now)
                finished.append(req)
                handed = True
        if handed:
            self.running = [r for r in self.running if r.status is RUNNING]
        return finished

    def keep_local(self, request_id: str, now: float) -> Request:
        """The token machine of handed-off `request_id` is this machine: its held pages become its page table
        again and it runs on here (decodes), with no KV transfer. Only in the mixed pool."""
        if self.pool != "mixed":
            raise RuntimeError(f"keep_local({request_id!r}) on a machine in the {self.pool!r} pool: only a mixed-pool "
                               "machine runs a request's prompt and tokens")
        req = self._held.pop(request_id, None)
        if req is None:
            raise KeyError(f"keep_local({request_id!r}): no handed-off request holds pages here")
        req.page_table = self._held_tables.pop(request_id)
        req.status = RUNNING
        req.finish_reason = None
        req.finish_time = None
        req.prefill_end = req.num_computed_tokens   # the next token fed is a decode
        self._live[request_id] = req
        if req in self.finished:
            self.finished.remove(req)
        self._start_running(req, now)
        return req


# ------------------------------------------------------------------------------------------------ overload tests
def prefill_overloaded(inst, req: Request, threshold: int) -> bool:
    """`inst` (a prefill or prefill-phase instance) has prompt tokens queued and queued + req's prompt exceed
    `threshold` (splitwise-sim's `is_queue_long`)."""
    queued = InstanceRouter.prefill_load(inst)
    return queued > 0 and queued + len(req.prompt_token_ids) > threshold


def _pages(n_tokens: int, page_size: int) -> int:
    return -(-n_tokens // page_size)


def decode_load(inst, req: Optional[Request] = None, *, held: bool = False) -> float:
    """Load of a decode or decode-phase instance if it also took `req` (a handed-off request): the larger of its
    KV-page fraction (pages in use + pages of its queued requests' whole context + req's, over num_pages) and its
    sequence-slot fraction (live requests + 1, over max_num_seqs). held: req's pages are already in use there (the
    machine that prefilled it, which would keep it): they are not counted twice."""
    s = inst.scheduler
    ps = s.block_manager.page_size
    queued = itertools.chain(s.waiting, s.swapped, s._kv_pending.values(), s._kv_ready)
    pages = s.block_manager.num_used_pages + sum(_pages(len(r.all_token_ids), ps) for r in queued)
    seqs = s.num_running + s.num_waiting
    if req is not None:
        pages += 0 if held else _pages(len(req.all_token_ids), ps)
        seqs += 1
    return max(pages / s.block_manager.num_pages, seqs / s.config.max_num_seqs)


def decode_overloaded(inst, req: Request, threshold: float, *, held: bool = False) -> bool:
    """`decode_load(inst, req, held=held)` exceeds `threshold` (at 1.0: req would not fit in pages or sequence
    slots)."""
    return decode_load(inst, req, held=held) > threshold


def pending_tokens(inst) -> int:
    """Tokens a machine still owes (splitwise-sim's `sched_pending_tokens`): prompt tokens still to prefill plus
    one per live request (a decode step each)."""
    s = inst.scheduler
    return InstanceRouter.prefill_load(inst) + s.num_running + s.num_waiting


# ------------------------------------------------------------------------------------------------ the pools
@dataclasses.dataclass(frozen=True)
class Switch:
    """A mixed instance changed phase at `time`: to 'prefill' / 'decode', or back to the pool (None)."""
    time: float
    instance: str
    phase: Optional[str]


def _thresholds(prefill_queue_tokens: int, decode_load: float) -> Tuple[int, float]:
    """The pools' overload thresholds, checked (one-line errors naming the value)."""
    if not (isinstance(prefill_queue_tokens, int) and prefill_queue_tokens >= 1):
        raise ValueError(f"prefill_queue_tokens={prefill_queue_tokens!r}, expected an int >= 1")
    if not 0 < decode_load <= 1:
        raise ValueError(f"decode_load={decode_load!r}, expected a fraction in (0, 1]")
    return prefill_queue_tokens, decode_load


class MixedPool:
    """Cluster-level routing over prefill, decode and mixed instances (module docstring). `pick_prefill(req, now)`
    for an arrival, `pick_decode(req, now)` for a handoff, `return_idle(now)` after steps and KV landings. Without
    mixed instances it is the deployment's two routers, unchanged."""

    def __init__(self, router: str, prefill: Sequence, decode: Sequence, mixed: Sequence = (), *,
                 prefill_queue_tokens: int = 8192, decode_load: float = 1.0):
        self.prefill, self.decode, self.mixed = list(prefill), list(decode), list(mixed)
        self.prefill_router = InstanceRouter(router, self.prefill, role="prefill")
        self.decode_router = InstanceRouter(router, self.decode, role="decode")
        for inst in self.mixed:
            if getattr(inst.scheduler, "name", None) != MixedScheduler.name:
                raise ValueError(f"mixed instance {inst.name!r} needs a MixedScheduler, got "
                                 f"{getattr(inst.scheduler, 'name', inst.scheduler)!r}")
        self.prefill_queue_tokens, self.decode_load = _thresholds(prefill_queue_tokens, decode_load)
        self.switches: List[Switch] = []

    def phase_of(self, inst) -> Optional[str]:
        return inst.scheduler.phase

    def in_phase(self, phase: str) -> List:
        return [m for m in self.mixed if m.scheduler.phase == phase]

    def return_idle(self, now: float) -> List:
        """Every mixed instance in a phase that is idle returns to the mixed pool; returns them."""
        back = [m for m in self.mixed if m.scheduler.return_if_idle()]
        self.switches.extend(Switch(now, m.name, None) for m in back)
        return back

    def _take(self, phase: str, now: float):
        """The first idle mixed instance takes `phase`; None if there is none."""
        for m in self.mixed:
            if m.scheduler.phase is None:
                m.scheduler.take_phase(phase)
                self.switches.append(Switch(now, m.name, phase))
                return m
        return None

    def _pick(self, phase: str, req: Request, now: float, router: InstanceRouter, overloaded, load):
        if not self.mixed:
            return router.pick(req)
        self.return_idle(now)
        if not all(overloaded(inst, req) for inst in router.instances):
            return router.pick(req)
        active = [m for m in self.in_phase(phase) if not overloaded(m, req)]
        if active:
            return min(active, key=load)
        taken = self._take(phase, now)
        if taken is not None:
            return taken
        return min(router.instances + self.in_phase(phase), key=load)   # everything overloaded: queue there

    def pick_prefill(self, req: Request, now: float):
        """The instance for an arrival: the prefill router's pick unless the prefill pool is overloaded."""
        q = self.prefill_queue_tokens
        return self._pick("prefill", req, now, self.prefill_router, lambda i, r: prefill_overloaded(i, r, q),
                          InstanceRouter.prefill_load)

    @property
    def active(self) -> bool:
        """There is a mixed pool (the engines call return_idle and record summary() only then)."""
        return bool(self.mixed)

    def pick_decode(self, req: Request, now: float, src=None):
        """The instance for a handoff: the decode router's pick unless the decode pool is overloaded (`src`, the
        instance that prefilled it, is never the pick here: a dedicated mixed machine never keeps tokens)."""
        t = self.decode_load
        return self._pick("decode", req, now, self.decode_router, lambda i, r: decode_overloaded(i, r, t),
                          lambda i: decode_load(i, req))

    def switch_counts(self) -> dict:
        """Instance name -> {'prefill': times it took the prefill phase, 'decode': ..., 'returned': ...}."""
        out = {m.name: {"prefill": 0, "decode": 0, "returned": 0} for m in self.mixed}
        for s in self.switches:
            out[s.instance][s.phase or "returned"] += 1
        return out

    def summary(self) -> dict:
        """For results.json: thresholds, per-instance switch counts, and the switches as (time, name, phase)."""
        return {"prefill_queue_tokens": self.prefill_queue_tokens, "decode_load": self.decode_load,
                "switch_counts": self.switch_counts(),
                "switches": [(s.time, s.instance, s.phase) for s in self.switches]}


def phase_intervals(switches: Sequence[Switch], name: str, end: float) -> List[Tuple[float, float, str]]:
    """(start, stop, phase) intervals of instance `name` from a switch log (an open phase ends at `end`)."""
    out, open_ = [], None
    for s in switches:
        if s.instance != name:
            continue
        if open_ is not None:
            out.append((open_[0], s.time, open_[1]))
            open_ = None
        if s.phase is not None:
            open_ = (s.time, s.phase)
    if open_ is not None:
        out.append((open_[0], end, open_[1]))
    return out


# ------------------------------------------------------------------------------------------------ borrowing
@dataclasses.dataclass(frozen=True)
class Move:
    """Machine `instance` moved from pool `src` to pool `dst` at `time` (seconds), because of `reason`: 'prefill'
    (borrowed to take a prompt), 'decode' (to take a request's tokens), 'whole' (to run a request whole: every
    pool overloaded) or 'idle' (back to its home pool)."""
    time: float
    instance: str
    src: str
    dst: str
    reason: str


class BorrowingPool:
    """Cluster-level routing with Splitwise's borrowing mixed pool (module docstring, mixed_pool='borrow'): the
    prefill and decode instances (each a BorrowingScheduler at home) move into the mixed pool and back.
    `pick_prefill(req, now)` for an arrival, `pick_decode(req, now, src)` for a handoff (a pick equal to `src`:
    `src.scheduler.keep_local`), `return_idle(now)` after steps and KV landings. Same interface as MixedPool."""

    def __init__(self, router: str, prefill: Sequence, decode: Sequence, *, prefill_queue_tokens: int = 8192,
                 decode_load: float = 1.0):
        self.prefill, self.decode = list(prefill), list(decode)
        self.mixed: List = []          # a dedicated mixed group: never (the interface of MixedPool)
        self.machines = self.prefill + self.decode
        for home, group in (("prefill", self.prefill), ("decode", self.decode)):
            for inst in group:
                s = inst.scheduler
                if not isinstance(s, BorrowingScheduler) or s.home != home:
                    raise ValueError(f"instance {inst.name!r} of the {home} pool needs a BorrowingScheduler with "
                                     f"home={home!r} (mixed_pool='borrow'), got {type(s).__name__}"
                                     f"{'' if not isinstance(s, BorrowingScheduler) else f' home={s.home!r}'}")
        self.prefill_router = InstanceRouter(router, self.prefill, role="prefill")
        self.decode_router = InstanceRouter(router, self.decode, role="decode")
        self.prefill_queue_tokens, self.decode_load = _thresholds(prefill_queue_tokens, decode_load)
        self.moves: List[Move] = []
        self.num_kept = 0              # handoffs whose token machine was their prompt machine (no KV transfer)
        self._whole: set = set()       # request ids to run whole on their prompt machine (every pool overloaded)

    active = True

    def in_pool(self, pool: str) -> List:
        """The machines in `pool` now, in instance order (prefill machines first)."""
        return [m for m in self.machines if m.scheduler.pool == pool]

    def pool_of(self, name: str) -> str:
        return next(m.scheduler.pool for m in self.machines if m.name == name)

    def _move(self, inst, dst: str, now: float, reason: str) -> None:
        self.moves.append(Move(now, inst.name, inst.scheduler.pool, dst, reason))
        inst.scheduler.pool = dst

    def return_idle(self, now: float) -> List:
        """Every idle machine of the mixed pool returns to its home pool; returns them."""
        back = [m for m in self.machines if m.scheduler.pool == "mixed" and m.scheduler.is_idle]
        for m in back:
            self._move(m, m.scheduler.home, now, "idle")
        return back

    @staticmethod
    def _route(router: InstanceRouter, members: List):
        """The router's pick among `members` (the pool now): its own pick when the whole pool is home, else the
        same policy over the members (round robin: its cycle, skipping the machines that are away)."""
        if len(members) == len(router.instances):
            return router.pick()
        if router.policy == "least_loaded" or len(members) == 1:
            return min(members, key=router.load)
        while True:
            inst = next(router._cycle)
            if inst.scheduler.pool == router.role:
                return inst

    def pick_prefill(self, req: Request, now: float):
        """The machine for an arrival (module docstring): prefill pool, else mixed pool, else a borrowed decode
        machine, else the least-loaded machine runs it whole."""
        self.return_idle(now)
        q = self.prefill_queue_tokens
        pool = self.in_pool("prefill")
        if pool and not all(prefill_overloaded(m, req, q) for m in pool):
            return self._route(self.prefill_router, pool)
        mixed = self.in_pool("mixed")
        free = [m for m in mixed if not prefill_overloaded(m, req, q)]
        if free:
            return min(free, key=InstanceRouter.prefill_load)
        decode = self.in_pool("decode")
        if decode:
            m = min(decode, key=pending_tokens)
            self._move(m, "mixed", now, "prefill")
            return m
        m = min(pool + mixed, key=pending_tokens)
        if m.scheduler.pool != "mixed":
            self._move(m, "mixed", now, "whole")
        self._whole.add(req.request_id)
        return m

    def pick_decode(self, req: Request, now: float, src=None):
        """The machine for a handoff from `src` (module docstring): decode pool, else mixed pool, else a
        borrowed prefill machine, else `src` itself (then in the mixed pool). A pick equal to src: keep_local."""
        self.return_idle(now)
        if req.request_id in self._whole:
            self._whole.discard(req.request_id)
            self.num_kept += 1
            return src
        t = self.decode_load
        pool = self.in_pool("decode")
        if pool and not all(decode_overloaded(m, req, t) for m in pool):
            return self._route(self.decode_router, pool)
        mixed = self.in_pool("mixed")
        free = [m for m in mixed if not decode_overloaded(m, req, t, held=m is src)]
        if free:
            dst = min(free, key=lambda m: decode_load(m, req, held=m is src))
        else:
            prefill = self.in_pool("prefill")
            if prefill:
                dst = min(prefill, key=lambda m: decode_load(m, req, held=m is src))
                self._move(dst, "mixed", now, "decode")
            elif src is not None and src.scheduler.pool == "mixed":
                dst = src
            else:      # src in the prefill pool would be the prefill pool's machine above
                raise RuntimeError(f"no machine can take request {req.request_id!r}'s tokens")
        if dst is src:
            self.num_kept += 1
        return dst

    def move_counts(self) -> dict:
        """Instance name -> {'borrowed': times it moved into the mixed pool, 'returned': times it came home}."""
        out = {m.name: {"borrowed": 0, "returned": 0} for m in self.machines}
        for mv in self.moves:
            out[mv.instance]["borrowed" if mv.dst == "mixed" else "returned"] += 1
        return out

    def summary(self, end: Optional[float] = None) -> dict:
        """For results.json: mode, thresholds, machines per home pool, per-machine move counts and seconds in the
        mixed pool (open stints end at `end`, default the last move), requests kept on their prompt machine, and
        every move as (time, name, from pool, to pool, reason)."""
        if end is None:
            end = max((mv.time for mv in self.moves), default=0.0)
        mixed_s = {m.name: sum(b - a for a, b, pool in pool_intervals(self.moves, m.name, end) if pool == "mixed")
                   for m in self.machines}
        return {"mode": "borrow", "prefill_queue_tokens": self.prefill_queue_tokens, "decode_load": self.decode_load,
                "machines": {"prefill": [m.name for m in self.prefill], "decode": [m.name for m in self.decode]},
                "move_counts": self.move_counts(), "mixed_s": mixed_s, "num_kept_local": self.num_kept,
                "moves": [(mv.time, mv.instance, mv.src, mv.dst, mv.reason) for mv in self.moves]}


def pool_intervals(moves: Sequence, name: str, end: float) -> List[Tuple[float, float, str]]:
    """(start, stop, pool) intervals of machine `name` from a move log (Move or (time, name, src, dst, reason)
    tuples), from time 0 in its first move's source pool (its home) to `end`; [] if it never moved."""
    mine = [mv if isinstance(mv, Move) else Move(*mv) for mv in moves]
    mine = [mv for mv in mine if mv.instance == name]
    if not mine:
        return []
    out, start, pool = [], 0.0, mine[0].src
    for mv in mine:
        out.append((start, mv.time, pool))
        start, pool = mv.time, mv.dst
    out.append((start, max(end, start), pool))
    return out


def make_pool(mode: str, router: str, prefill: Sequence, decode: Sequence, mixed: Sequence = (), *,
              prefill_queue_tokens: int = 8192, decode_load: float = 1.0):
    """The cluster router of `deployment.mixed_pool` = mode: a MixedPool ('dedicated': over the `mixed` group, the
    two routers without one) or a BorrowingPool ('borrow': no mixed group)."""
    if mode not in MIXED_POOL_MODES:
        raise ValueError(f"mixed_pool={mode!r}, expected one of {MIXED_POOL_MODES}")
    if mode == "borrow":
        if mixed:
            raise ValueError(f"mixed_pool='borrow' with mixed instances {[m.name for m in mixed]}: a borrowing mixed "
                             "pool has no machines of its own")
        return BorrowingPool(router, prefill, decode, prefill_queue_tokens=prefill_queue_tokens,
                             decode_load=decode_load)
    return MixedPool(router, prefill, decode, mixed, prefill_queue_tokens=prefill_queue_tokens,
                     decode_load=decode_load)


def make_borrowing_scheduler(role: str, config) -> BorrowingScheduler:
    """The scheduler of a prefill or decode machine under mixed_pool='borrow' (config: its SchedulerConfig)."""
    if role not in PHASES:
        raise ValueError(f"role={role!r}: mixed_pool='borrow' borrows machines of the roles {PHASES}")
    return BorrowingScheduler(config, role)
