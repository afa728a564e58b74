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
  machine (both pools full: the artifact's last resort); normally the request's KV goes to a token machine like
  any other prompt's. Machines of the mixed pool batch prompts and tokens together (the paper's "mixed batching").

pdjax's form (issue 13): the mixed pool is a group of its own, `deployment.mixed` (instances 'mixed0', ...),
rather than machines borrowed from the two other pools, so the prefill and decode pools keep their size and
layout and the mixed machines are a reserve that either phase can draw on:
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
  for a transfer in flight (`MixedScheduler.is_idle`). The phase changes only while idle, so one scheduler and one
  KV cache serve both phases (the block manager and its prefix cache are the machine's, whatever the phase).
  `MixedPool.return_idle(now)` is called by the engines after steps and KV landings, and before every pick.
- Every change of phase is logged (`MixedPool.switches`: (time, instance name, new phase or None)).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import List, Optional, Sequence, Tuple

from pdjax.scheduler.base import Scheduler
from pdjax.scheduler.policies import DecodeOnlyScheduler
from pdjax.scheduler.request import Request
from pdjax.scheduler.routing import InstanceRouter

PHASES = ("prefill", "decode")

__all__ = ["PHASES", "MixedPool", "MixedScheduler", "decode_load", "decode_overloaded", "prefill_overloaded"]


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

    @property
    def is_idle(self) -> bool:
        """Nothing waiting, running or awaiting its KV, and no pages held for a transfer."""
        return not self.has_unfinished() and not self._held

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


# ------------------------------------------------------------------------------------------------ overload tests
def prefill_overloaded(inst, req: Request, threshold: int) -> bool:
    """`inst` (a prefill or prefill-phase instance) has prompt tokens queued and queued + req's prompt exceed
    `threshold` (splitwise-sim's `is_queue_long`)."""
    queued = InstanceRouter.prefill_load(inst)
    return queued > 0 and queued + len(req.prompt_token_ids) > threshold


def _pages(n_tokens: int, page_size: int) -> int:
    return -(-n_tokens // page_size)


def decode_load(inst, req: Optional[Request] = None) -> float:
    """Load of a decode or decode-phase instance if it also took `req` (a handed-off request): the larger of its
    KV-page fraction (pages in use + pages of its queued requests' whole context + req's, over num_pages) and its
    sequence-slot fraction (live requests + 1, over max_num_seqs)."""
    s = inst.scheduler
    ps = s.block_manager.page_size
    queued = itertools.chain(s.waiting, s.swapped, s._kv_pending.values(), s._kv_ready)
    pages = s.block_manager.num_used_pages + sum(_pages(len(r.all_token_ids), ps) for r in queued)
    seqs = s.num_running + s.num_waiting
    if req is not None:
        pages += _pages(len(req.all_token_ids), ps)
        seqs += 1
    return max(pages / s.block_manager.num_pages, seqs / s.config.max_num_seqs)


def decode_overloaded(inst, req: Request, threshold: float) -> bool:
    """`decode_load(inst, req)` exceeds `threshold` (at 1.0: req would not fit in pages or sequence slots)."""
    return decode_load(inst, req) > threshold


# ------------------------------------------------------------------------------------------------ the pools
@dataclasses.dataclass(frozen=True)
class Switch:
    """A mixed instance changed phase at `time`: to 'prefill' / 'decode', or back to the pool (None)."""
    time: float
    instance: str
    phase: Optional[str]


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
        if not (isinstance(prefill_queue_tokens, int) and prefill_queue_tokens >= 1):
            raise ValueError(f"prefill_queue_tokens={prefill_queue_tokens!r}, expected an int >= 1")
        if not 0 < decode_load <= 1:
            raise ValueError(f"decode_load={decode_load!r}, expected a fraction in (0, 1]")
        self.prefill_queue_tokens, self.decode_load = prefill_queue_tokens, decode_load
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
            return router.pick()
        self.return_idle(now)
        if not all(overloaded(inst, req) for inst in router.instances):
            return router.pick()
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

    def pick_decode(self, req: Request, now: float):
        """The instance for a handoff: the decode router's pick unless the decode pool is overloaded."""
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
