"""The SLO-tied trigger of online XpYd rebalancing (pdjax.scheduler.rebalance, `deployment.rebalance_trigger='slo'`):
a side is over when the latency it is responsible for is at risk against the run's SLO, not when its queue or its
KV pages fill. No JAX; the real engine and the simulator feed it the same observations.

What each side answers for, and how the pool observes it (only what both backends stamp on the scheduler's
Requests, at the pool's own calls):
- prefill: TTFT (`slo.ttft`). A request enters the side at `pick_prefill` and leaves at `pick_decode` (the handoff,
  right after the prefill sampled its first token): its TTFT = first_token_time - arrival_time.
- decode: TPOT (`slo.tpot`), the per-request mean gap (last - first token time) / (output tokens - 1). A request
  enters at the handoff and leaves when it finishes; a one-token request has no TPOT and is not counted.
- The side's latency now is the nearest-rank `quantile` (deployment.rebalance_slo_quantile, default 0.9: the
  attainment target / DistServe's P90) of its samples against a threshold th (its SLO): the final value of every
  request that left the side in the last `window_s` seconds, and every request still in it that has already missed
  th for certain: TTFT >= now - arrival; TPOT >= (now - first token) / (max_tokens - 1) (its remaining tokens take
  time >= 0 and it cannot produce more than max_tokens, so its final TPOT is at least that). A request in flight
  whose lower bound is within th is left out (its outcome is open: counting its bound as a sample would pull the
  quantile down). Why this over the alternatives: finished requests alone lag (a TPOT is known only at the end of
  a long output, and a stalled prefill queue finishes nothing), and a predicted queue wait needs a cost model the
  engine does not have; the certain misses make a stall count as soon as it costs the SLO, and nothing counts as
  a miss that is not one. (pdjax.scheduler.rebalance_predict, 'slo_predicted', predicts the decode side's wait
  from the observed step time instead.)
- Over: that quantile exceeds the side's bound. The pool's window rule is unchanged (over continuously for
  `window_s`, no flip in progress, the other side not over).
- Hysteresis (can the other side spare one of its n serving instances?): its quantile scaled by n / (n - 1) (its
  work spread over one instance less: TPOT grows at most so, a decode step's time rising less than in proportion to
  its batch; TTFT's queueing part may grow faster, so this is a first-order estimate) must stay within its bound,
  so a flip does not put the donor side at risk. A side with no samples (idle) can spare one.
- Cost: `assess(now)` (once per return_idle) sweeps the requests in flight, O(their number), as the load
  rule's prefill_load walks the queues; quantiles are counts against a threshold (no sort) except in a flip's
  reason.
"""
from __future__ import annotations

import collections
import math
from typing import Deque, Dict, List, Optional, Tuple

__all__ = ["SLOTrigger", "nearest_rank", "quantile_over"]

SIDES = ("prefill", "decode")
NOT_SERVED = ("rejected", "aborted")


def nearest_rank(n: int, quantile: float) -> int:
    """The 1-based rank of the nearest-rank `quantile` among n samples (n >= 1): ceil(quantile * n), at least 1
    (rounded first, so 0.9 * 10 is rank 9, not 10)."""
    return max(1, math.ceil(round(quantile * n, 9)))


def quantile_over(samples: List[float], quantile: float, bound: float) -> bool:
    """Whether the nearest-rank `quantile` of `samples` exceeds `bound` (False for no samples): fewer than its rank
    are within the bound."""
    if not samples:
        return False
    return sum(1 for s in samples if s <= bound) < nearest_rank(len(samples), quantile)


def _in_transfer(side: str, req) -> bool:
    """A handed-off request keeps its prefill's finish ('handoff') until the decode side takes it: not finished."""
    return side == "decode" and req.finish_reason == "handoff"


class SLOTrigger:
    """The latency each side of a RebalancingPool answers for, observed online (module docstring). ttft_s, tpot_s:
    the SLO bounds in seconds (> 0); quantile in (0, 1]; window_s: how far back finished requests count."""
    name = "slo"        # deployment.rebalance_trigger (pdjax.scheduler.rebalance_predict's subclass: 'slo_predicted')

    def __init__(self, ttft_s: float, tpot_s: float, *, quantile: float = 0.9, window_s: float = 2.0):
        if not (ttft_s > 0 and tpot_s > 0 and 0 < quantile <= 1 and window_s >= 0):
            raise ValueError(f"SLO trigger ttft_s={ttft_s!r}, tpot_s={tpot_s!r} (expected seconds > 0), "
                             f"quantile={quantile!r} (in (0, 1]), window_s={window_s!r} (>= 0)")
        self.bound = {"prefill": float(ttft_s), "decode": float(tpot_s)}
        self.quantile, self.window_s = quantile, window_s
        self._in = {side: {} for side in SIDES}           # request id -> Request, still in that side
        self._left: Dict[str, Deque[Tuple[float, float]]] = {side: collections.deque() for side in SIDES}
        self._finals: Dict[str, List[float]] = {side: [] for side in SIDES}     # at the last assess
        self._bounds: Dict[str, List[float]] = {side: [] for side in SIDES}

    # ------------------------------------------------------------------ observations (the pool's calls)
    def on_prefill(self, req, now: float) -> None:
        """`req` was routed to a prefill instance."""
        self._in["prefill"][req.request_id] = req

    def on_handoff(self, req, now: float) -> None:
        """`req` finished its prefill and is handed to the decode side (its TTFT is final)."""
        if self._in["prefill"].pop(req.request_id, None) is not None and req.first_token_time is not None:
            self._left["prefill"].append((now, req.first_token_time - req.arrival_time))
        if req.max_tokens > 1:
            self._in["decode"][req.request_id] = req

    def on_decode_routed(self, req, inst, now: float) -> None:
        """The pool routed the handed-off `req` to decode instance `inst` (read by the predicting subclass)."""

    def assess(self, now: float) -> Dict[str, bool]:
        """Observe at `now`: move finished requests out of the sides (their final latency into the window), drop
        what left before the window, take every side's samples; returns {side: its latency quantile exceeds its
        SLO}. `can_spare`, `latency` and `reason` read these samples."""
        for side in SIDES:
            live = self._in[side]
            for rid in [rid for rid, r in live.items() if r.is_finished and not _in_transfer(side, r)]:
                req = live.pop(rid)
                final = None if req.finish_reason in NOT_SERVED else self._final(side, req)
                if final is not None:
                    self._left[side].append((req.finish_time, final))
            left = self._left[side]
            while left and left[0][0] < now - self.window_s:
                left.popleft()
            bounds = [self._lower_bound(side, r, now) for r in live.values()]
            self._finals[side] = [v for _, v in left]
            self._bounds[side] = [b for b in bounds if b is not None]
        self._predict(now)
        return {side: self._over(side, self.bound[side]) for side in SIDES}

    def _predict(self, now: float) -> None:
        """The observed trigger predicts nothing (pdjax.scheduler.rebalance_predict's does, from these samples)."""

    @staticmethod
    def _final(side: str, req) -> Optional[float]:
        if side == "prefill":
            return None if req.first_token_time is None else req.first_token_time - req.arrival_time
        n = len(req.token_times)
        return (req.token_times[-1] - req.token_times[0]) / (n - 1) if n > 1 else None

    @staticmethod
    def _lower_bound(side: str, req, now: float) -> Optional[float]:
        if side == "prefill":
            return now - req.arrival_time
        if req.first_token_time is None or req.max_tokens < 2:
            return None
        return (now - req.first_token_time) / (req.max_tokens - 1)

    # ------------------------------------------------------------------ the pool's questions
    def samples(self, side: str, threshold: float) -> List[float]:
        """The side's latency samples (seconds) at the last `assess` against `threshold`: the window's final values
        and the lower bounds of requests in flight that exceed it (module docstring)."""
        return self._finals[side] + [b for b in self._bounds[side] if b > threshold]

    def _over(self, side: str, threshold: float) -> bool:
        return quantile_over(self.samples(side, threshold), self.quantile, threshold)

    def can_spare(self, side: str, n: int) -> bool:
        """Whether `side`, serving with n instances, stays within its SLO with n - 1 (module docstring)."""
        return n >= 2 and not self._over(side, self.bound[side] * (n - 1) / n)

    def latency(self, side: str) -> float:
        """The side's nearest-rank quantile latency in seconds at the last `assess` against its SLO (0.0 without
        samples)."""
        samples = sorted(self.samples(side, self.bound[side]))
        return samples[nearest_rank(len(samples), self.quantile) - 1] if samples else 0.0

    def reason(self, side: str, over_for: float) -> str:
        q = f"p{100 * self.quantile:g}"
        return (f"{side} over for {over_for:.3f}s: TTFT {q} {self.latency('prefill'):.3f}s (SLO "
                f"{self.bound['prefill']:g}s), TPOT {q} {self.latency('decode'):.4f}s (SLO "
                f"{self.bound['decode']:g}s)")

    def summary(self) -> dict:
        return {"trigger": self.name, "ttft_s": self.bound["prefill"], "tpot_s": self.bound["decode"],
                "quantile": self.quantile}
