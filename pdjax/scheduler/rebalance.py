"""Online XpYd rebalancing: instances flip between the prefill and the decode role when one side stays overloaded,
the alternative to Splitwise's mixed pool (pdjax.scheduler.mixed). Shared by the real engine
(pdjax.serving.cluster) and the simulator (pdjax.sim.disagg); no JAX.

The issue's rule ("the prefill:decode ratio adjusted online from queue lengths"), read as:
- Every prefill and decode instance runs a BorrowingScheduler (pdjax.scheduler.mixed) kept in its current role's
  pool ('prefill' / 'decode', never 'mixed'): in a pool it is exactly that role's policy, so a flip changes no
  scheduler state, only which requests it is given. The prefill and decode groups must be the same machine (pp,
  tp, hardware, stack, scheduler overrides: pdjax.config.overload), so a flipped instance keeps its pages and
  limits.
- Trigger `deployment.rebalance_trigger`: 'load' (default, below) or 'slo' (pdjax.scheduler.rebalance_slo: a side
  is over when the latency it answers for, TTFT for prefill and TPOT for decode, observed online over the window,
  is over the run's SLO at the quantile `rebalance_slo_quantile`; the donor must stay within its SLO with one
  instance less); or 'slo_predicted' (pdjax.scheduler.rebalance_predict: 'slo' with the decode side's TPOT
  predicted from its queue, the remaining tokens and the observed step time). The window, drain and flip below
  are the same for all.
- Pressure ('load'), checked at every `return_idle(now)` (the engines call it after steps and KV landings and before
  every pick): the prefill side is over when the mean prompt tokens still to prefill per serving prefill instance
  (routing.InstanceRouter.prefill_load) exceed `prefill_queue_tokens`; the decode side when the mean
  pdjax.scheduler.mixed.decode_load (KV pages in use or owed / pages, live sequences / slots) of its serving
  instances exceeds `decode_load`.
- A side over its threshold continuously for `window_s` seconds, with no flip in progress, takes one instance of
  the other side if that side can spare one: at least two serving instances, and its pressure spread over one
  instance less (x n / (n - 1)) still within its threshold (hysteresis: a flip must not make the donor side over,
  or the two sides would trade an instance back and forth). The other side's least-loaded serving
  instance starts draining (it gets no new work), and once idle (Scheduler.is_idle: nothing queued, running or
  held for a transfer) it is unavailable for `flip_s` seconds (the flip's cost: reconfiguring the instance), then
  serves the new role. The pressure windows restart after a flip is decided, so flips are at least `window_s`
  apart. Every flip is recorded (`Flip`: when draining began, when it was drained, when it served the new role,
  the pressures that caused it).
- Time granularity: the state advances at return_idle calls, so a flip's end takes effect at the first event at
  or after it (the simulator's next step end, KV landing or arrival; the engine's next round).
- Routing among the serving instances of a role: the deployment's router (least_loaded: that role's load;
  round_robin: in turn, skipping the instances not serving that role).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, List, Optional, Sequence

from pdjax.config.overload import SLO_TRIGGERS, check_rebalance_slos
from pdjax.scheduler.mixed import BorrowingScheduler, decode_load
from pdjax.scheduler.rebalance_predict import PredictedSLOTrigger
from pdjax.scheduler.rebalance_slo import SLOTrigger
from pdjax.scheduler.routing import InstanceRouter

__all__ = ["Flip", "RebalancingPool", "rebalancing_pool"]

ROLES = ("prefill", "decode")


@dataclasses.dataclass(frozen=True)
class Flip:
    """Instance `instance` went from role `src` to `dst`: draining from `drain_start`, idle at `drained`, serving
    `dst` from `served` (seconds); `reason` names the pressures (prefill queue tokens per instance, decode load)."""
    drain_start: float
    drained: float
    served: float
    instance: str
    src: str
    dst: str
    reason: str


class RebalancingPool:
    """Cluster routing with online role flips (module docstring). Same interface as pdjax.scheduler.mixed.MixedPool:
    `pick_prefill(req, now)`, `pick_decode(req, now, src)`, `return_idle(now)`, `active`, `summary()`."""
    active = True

    def __init__(self, router: str, prefill: Sequence, decode: Sequence, *, prefill_queue_tokens: int = 8192,
                 decode_load: float = 0.9, window_s: float = 2.0, flip_s: float = 0.0,
                 trigger: Optional[SLOTrigger] = None):
        self.prefill, self.decode = list(prefill), list(decode)
        self.mixed: List = []
        self.machines = self.prefill + self.decode
        for home, group in (("prefill", self.prefill), ("decode", self.decode)):
            for inst in group:
                if not isinstance(inst.scheduler, BorrowingScheduler) or inst.scheduler.pool != home:
                    raise ValueError(f"instance {inst.name!r}: rebalancing needs a BorrowingScheduler in the {home!r} "
                                     f"pool, got {type(inst.scheduler).__name__}")
        if not (prefill_queue_tokens >= 1 and decode_load > 0 and window_s >= 0 and flip_s >= 0):
            raise ValueError(f"rebalancing thresholds prefill_queue_tokens={prefill_queue_tokens!r} (expected >= 1), "
                             f"decode_load={decode_load!r} (> 0), window_s={window_s!r} (>= 0), flip_s={flip_s!r} "
                             "(>= 0)")
        self.prefill_queue_tokens, self.decode_load = prefill_queue_tokens, decode_load
        self.window_s, self.flip_s = window_s, flip_s
        self.trigger = trigger         # None: the load rule; an SLOTrigger: the SLO-tied one (module docstring)
        self._pressure: Dict[str, float] = {}     # the load rule's pressures at the last _assess
        self.prefill_router = InstanceRouter(router, self.machines, role="prefill")
        self.decode_router = InstanceRouter(router, self.machines, role="decode")
        self.state: Dict[str, str] = {m.name: "serving" for m in self.machines}   # serving | draining | flipping
        self._since: Dict[str, Optional[float]] = {"prefill": None, "decode": None}
        self._pending: Optional[dict] = None       # the flip in progress
        self.flips: List[Flip] = []

    # ------------------------------------------------------------------ membership
    def role(self, inst) -> str:
        return inst.scheduler.pool

    def members(self, role: str) -> List:
        """The instances serving `role` now (draining and flipping ones excluded), in instance order."""
        return [m for m in self.machines if m.scheduler.pool == role and self.state[m.name] == "serving"]

    def pressures(self) -> Dict[str, float]:
        """{'prefill': mean prompt tokens to prefill per serving prefill instance, 'decode': mean decode load}."""
        p, d = self.members("prefill"), self.members("decode")
        return {"prefill": sum(map(InstanceRouter.prefill_load, p)) / len(p) if p else 0.0,
                "decode": sum(decode_load(m) for m in d) / len(d) if d else 0.0}

    # ------------------------------------------------------------------ the flip rule
    def return_idle(self, now: float) -> List:
        """Advance the flip in progress and the pressure windows to `now` (module docstring); returns the
        instances that started serving a new role."""
        done = self._advance_flip(now)
        if self._pending is not None:
            return done
        over = self._assess(now)
        for side in ROLES:
            if not over[side]:
                self._since[side] = None
            elif self._since[side] is None:
                self._since[side] = now
        for side, other in (("prefill", "decode"), ("decode", "prefill")):
            since = self._since[side]
            if since is None or over[other] or now - since < self.window_s:
                continue
            donors = self.members(other)
            if not self._can_spare(other, donors):
                continue      # the other side cannot spare one: with one instance less it would be over
            load = InstanceRouter.prefill_load if other == "prefill" else decode_load
            donor = min(donors, key=load)
            self.state[donor.name] = "draining"
            self._pending = {"inst": donor, "dst": side, "start": now, "drained": None,
                             "reason": self._reason(side, now - since)}
            self._since = {"prefill": None, "decode": None}
            done += self._advance_flip(now)
            break
        return done

    @property
    def _limit(self) -> Dict[str, float]:
        return {"prefill": self.prefill_queue_tokens, "decode": self.decode_load}

    def _assess(self, now: float) -> Dict[str, bool]:
        """{side: over its threshold} at `now`: the load rule (module docstring) or the SLO trigger's
        (`self.trigger`); `_can_spare` and `_reason` read what it observed."""
        if self.trigger is not None:
            return self.trigger.assess(now)
        self._pressure = pressure = self.pressures()
        return {side: pressure[side] > self._limit[side] for side in ROLES}

    def _can_spare(self, side: str, donors: List) -> bool:
        """Whether `side` can give one of its serving instances `donors` and stay within its threshold."""
        n = len(donors)
        if self.trigger is not None:
            return self.trigger.can_spare(side, n)
        return n >= 2 and self._pressure[side] * n / (n - 1) <= self._limit[side]

    def _reason(self, side: str, over_for: float) -> str:
        if self.trigger is not None:
            return self.trigger.reason(side, over_for)
        return (f"{side} over for {over_for:.3f}s: prefill queue {self._pressure['prefill']:.0f} tokens/instance, "
                f"decode load {self._pressure['decode']:.3f}")

    def _advance_flip(self, now: float) -> List:
        f = self._pending
        if f is None:
            return []
        inst = f["inst"]
        if f["drained"] is None:
            if not inst.scheduler.is_idle:
                return []
            f["drained"] = now
            self.state[inst.name] = "flipping"
        if now < f["drained"] + self.flip_s:
            return []
        src = inst.scheduler.pool
        inst.scheduler.pool = f["dst"]
        self.state[inst.name] = "serving"
        self.flips.append(Flip(f["start"], f["drained"], now, inst.name, src, f["dst"], f["reason"]))
        self._pending = None
        return [inst]

    # ------------------------------------------------------------------ routing
    @staticmethod
    def _route(router: InstanceRouter, members: List):
        if router.policy == "least_loaded" or len(members) == 1:
            return min(members, key=router.load)
        ok = set(map(id, members))
        for inst in itertools.islice(router._cycle, 2 * len(router.instances)):
            if id(inst) in ok:
                return inst
        raise AssertionError("unreachable: members are among the router's instances")

    def pick_prefill(self, req, now: float):
        """The serving prefill instance for an arrival (the deployment's router among them)."""
        self.return_idle(now)
        inst = self._route(self.prefill_router, self.members("prefill"))
        if self.trigger is not None:
            self.trigger.on_prefill(req, now)
        return inst

    def pick_decode(self, req, now: float, src=None):
        """The serving decode instance for a handoff (never `src`: a prefill-role instance)."""
        if self.trigger is not None:
            self.trigger.on_handoff(req, now)      # its TTFT is final: it counts from this decision on
        self.return_idle(now)
        inst = self._route(self.decode_router, self.members("decode"))
        if self.trigger is not None:
            self.trigger.on_decode_routed(req, inst, now)
        return inst

    def summary(self) -> dict:
        """For results.json: thresholds (the SLO trigger's, when it is on), the roles at the end, and every flip."""
        trigger = {} if self.trigger is None else self.trigger.summary()
        return {"mode": "rebalance", "prefill_queue_tokens": self.prefill_queue_tokens,
                "decode_load": self.decode_load, "window_s": self.window_s, "flip_s": self.flip_s, **trigger,
                "num_flips": len(self.flips),
                "roles": {m.name: m.scheduler.pool for m in self.machines},
                "flips": [dataclasses.asdict(f) for f in self.flips]}


def rebalancing_pool(dep, prefill: Sequence, decode: Sequence, slo=None) -> RebalancingPool:
    """The RebalancingPool of a DeploymentConfig's keys (pdjax.config.overload) over built instances; `slo` (the
    serve config's SLOConfig) sets the bounds of `rebalance_trigger='slo'` / 'slo_predicted' (ValueError in one line
    without them)."""
    trigger, kind = None, getattr(dep, "rebalance_trigger", "load")
    if kind in SLO_TRIGGERS:
        check_rebalance_slos(dep, slo)
        make = PredictedSLOTrigger if kind == "slo_predicted" else SLOTrigger
        trigger = make(slo.ttft, slo.tpot, quantile=float(dep.rebalance_slo_quantile),
                       window_s=float(dep.rebalance_window_s))
    return RebalancingPool(dep.router, prefill, decode, prefill_queue_tokens=dep.rebalance_prefill_queue_tokens,
                           decode_load=float(dep.rebalance_decode_load), window_s=float(dep.rebalance_window_s),
                           flip_s=float(dep.rebalance_flip_s), trigger=trigger)
