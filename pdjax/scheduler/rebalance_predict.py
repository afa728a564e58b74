"""The SLO-tied rebalancing trigger with a predicted decode queue wait (`deployment.rebalance_trigger='slo_predicted'`):
pdjax.scheduler.rebalance_slo's trigger, whose decode side counts every request in flight at its predicted final
TPOT instead of only the ones whose miss is already certain. No JAX; the real engine and the simulator feed it the
same observations.

Why: a TPOT is a mean over the whole output, so a wait in the decode queue shows in it only divided by the output
length (with ~900 tokens a 20 s wait adds 0.02 s); the observed trigger counts such a request only once its lower
bound (now - first token) / (max_tokens - 1) is over the SLO, tens of seconds after the backlog formed. The wait
ahead of it is already decided by what is queued and running, so it is predicted from that.

The prediction, per decode instance, at every `assess(now)` (what both backends show the pool: the requests it
routed there, their token times and status, the instance's sequence limit):
- step time s: the instance's observed decode step, the median over its running requests (three or more token
  times) of their last gap token_times[-1] - token_times[-2]; an instance with none takes the median over the
  side's instances that have one; with none anywhere nothing is predicted (the observed rule's lower bounds).
- A running request with r tokens still to produce (max_tokens - output tokens so far: its output length taken as
  max_tokens, an upper bound for one that stops early) finishes at now + r * s.
- The queue (requests routed there and not running: KV in transfer, waiting for a slot, preempted), in the order
  they were handed off, takes the instance's `max_num_seqs` slots as they free (list scheduling: each takes the
  earliest-free slot, at now at the earliest, and holds it for its r * s).
- Its predicted TPOT = (predicted finish - first token time) / (max_tokens - 1), at least its observed lower bound.
First-order on purpose: s is the step at the current batch (a queue means a full batch, so s is the step the queue
will see), KV pages are not modelled as a limit (only sequence slots), and a flip does not move queued requests
(a new decode instance takes new handoffs only), so the prediction is of the wait the side has now.

The decode side's samples are then the window's final TPOTs plus every prediction (a point estimate, not a bound,
so all of them count, within the SLO or not), and the lower bound over the SLO of a request without a prediction.
The prefill side, the quantile, the window rule and the hysteresis (`can_spare`: the quantile x n / (n - 1) within
the bound) are rebalance_slo's unchanged.
"""
from __future__ import annotations

import heapq
import statistics
from typing import Dict, List, Optional

from pdjax.scheduler.rebalance_slo import SLOTrigger
from pdjax.scheduler.request import RequestStatus

__all__ = ["PredictedSLOTrigger", "predicted_tpots", "observed_step"]


def observed_step(reqs) -> Optional[float]:
    """Median last decode gap (seconds) of the running requests among `reqs` with three or more token times (the
    first gap holds the transfer and the queue wait); None without one."""
    gaps = [r.token_times[-1] - r.token_times[-2] for r in reqs
            if r.status is RequestStatus.RUNNING and len(r.token_times) >= 3]
    return statistics.median(gaps) if gaps else None


def predicted_tpots(reqs: List, slots: int, step: float, now: float) -> Dict[str, float]:
    """{request id: predicted final TPOT (seconds)} of one decode instance's requests `reqs` (handoff order) with
    `slots` sequence slots and decode step `step` seconds, at `now` (module docstring: running ones finish after
    their remaining tokens, the queue takes slots as they free)."""
    ends: Dict[str, float] = {}       # predicted last-token time (>= now)
    queued = []
    for r in reqs:
        if r.status is RequestStatus.RUNNING:
            ends[r.request_id] = now + (r.max_tokens - len(r.output_token_ids)) * step
        else:
            queued.append(r)
    if queued:
        free = list(ends.values()) + [now] * max(0, slots - len(ends))
        heapq.heapify(free)
        for r in queued:      # the earliest-free slot, for its remaining tokens
            end = ends[r.request_id] = max(free[0], now) + (r.max_tokens - len(r.output_token_ids)) * step
            heapq.heapreplace(free, end)
    return {r.request_id: (ends[r.request_id] - r.first_token_time) / (r.max_tokens - 1) for r in reqs}


class PredictedSLOTrigger(SLOTrigger):
    """SLOTrigger whose decode side counts the predicted final TPOT of every request in flight (module docstring).
    Same arguments and questions as SLOTrigger; the pool also reports each handoff's decode instance
    (`on_decode_routed`)."""
    name = "slo_predicted"

    def __init__(self, ttft_s: float, tpot_s: float, *, quantile: float = 0.9, window_s: float = 2.0):
        super().__init__(ttft_s, tpot_s, quantile=quantile, window_s=window_s)
        self._routed: Dict[str, object] = {}       # request id -> the decode instance it was routed to
        self._predicted: List[float] = []          # at the last assess

    def on_decode_routed(self, req, inst, now: float) -> None:
        if req.request_id in self._in["decode"]:
            self._routed[req.request_id] = inst

    def _predict(self, now: float) -> None:
        """Predict the decode side's requests in flight per instance; the ones without a prediction keep their
        lower bound (rebalance_slo's rule)."""
        live, routed = self._in["decode"], self._routed
        if len(routed) > 2 * len(live):       # forget the requests that left (amortized)
            self._routed = routed = {rid: inst for rid, inst in routed.items() if rid in live}
        by_inst: Dict[str, tuple] = {}
        for rid, req in live.items():         # handoff order
            inst = routed.get(rid)
            if inst is not None:
                by_inst.setdefault(inst.name, (inst, []))[1].append(req)
        steps = {name: observed_step(reqs) for name, (_, reqs) in by_inst.items()}
        known = [s for s in steps.values() if s is not None]
        side_step = statistics.median(known) if known else None
        predicted: Dict[str, float] = {}
        for name, (inst, reqs) in by_inst.items():
            step = steps[name] if steps[name] is not None else side_step
            if step is not None:
                predicted.update(predicted_tpots(reqs, inst.scheduler.config.max_num_seqs, step, now))
        self._predicted = list(predicted.values())
        bounds = [self._lower_bound("decode", r, now) for rid, r in live.items() if rid not in predicted]
        self._bounds["decode"] = [b for b in bounds if b is not None]

    def samples(self, side: str, threshold: float) -> List[float]:
        """rebalance_slo's samples; the decode side's also every predicted TPOT (module docstring)."""
        extra = self._predicted if side == "decode" else []
        return super().samples(side, threshold) + extra
