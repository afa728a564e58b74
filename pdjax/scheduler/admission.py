"""Early rejection (Mooncake FAST'25, section 7): an admission policy of a disaggregated deployment, shared by the real
engine (pdjax.serving.cluster) and the simulator (pdjax.sim.disagg). No JAX.

Mooncake rejects a request at its arrival when the decode instances will be overloaded; the rule on the decode load
*now* (`current_load`) oscillates: while decode is full it rejects everything, the prefills already admitted keep
feeding decode, decode drains, everything is admitted again and reaches decode together. Its fix predicts the
decode load at the time the request would reach decode (`predicted_load`). pdjax's reading, `Admission`:
- Decode load of a set of requests: max(their KV pages / the decode instances' pages, their count / the decode
  instances' sequence slots), summed over the decode instances (the cluster-wide form of
  pdjax.scheduler.mixed.decode_load).
- `current_load`: the requests on the decode instances now (running, waiting, swapped, awaiting or holding KV)
  plus the new one.
- `predicted_load` at horizon T = now + (prompt tokens queued on the least-loaded prefill instance + this prompt)
  x seconds per prefill token: a request on the decode side is still there at T if its remaining decode steps
  (max_tokens - outputs: an upper bound when a model may stop early) times the decode step time exceed T - now,
  with its context grown by the steps until T; a request queued on a prefill instance reaches decode when the
  prompt tokens ahead of it and its own are prefilled, and counts if that is before T and its decode lasts past T;
  plus the new request (prompt + 1 token). Prefill seconds per token and decode step seconds are learned from the
  run's own iteration records (`StepRates`: exponential moving averages of prefill-only steps' seconds per token
  and decode-only steps' seconds; optional priors), so both backends learn them alike; before any step and with no
  prior, T = now (the prediction is the current load plus nothing queued).
- An arrival is rejected when its load exceeds `threshold` ('rejected', reject_reason naming the policy and the
  load: before its prefill). `handoff_load` > 0: a handed-off request whose decode instance's load with it
  (pdjax.scheduler.mixed.decode_load) exceeds it is rejected after its prefill (prefill wasted; its prefill pages
  are released at once). Each decision is logged (`decisions`) for results.json (`summary`).
"""
from __future__ import annotations

import itertools
from typing import List, Optional, Sequence

from pdjax.config.overload import ADMISSION_POLICIES
from pdjax.scheduler.request import RequestStatus

__all__ = ["ADMISSION_POLICIES", "Admission", "StepRates", "admission_from_deployment", "admission_report",
           "decode_side_requests", "reject_request"]

LATE_PREFIX = "after prefill:"    # reject_reason of a request rejected at its handoff (its prefill was wasted)


class StepRates:
    """Seconds per prefill token and per decode step, learned from iteration records (IterationRecord: start_time,
    end_time, num_prefill_tokens, num_decode_tokens) appended to a list the engine or simulator owns (`bind`):
    an exponential moving average (weight `alpha` on the newest) over prefill-only and decode-only steps. Priors
    (> 0) are the starting values."""

    def __init__(self, prefill_s_per_token: float = 0.0, decode_step_s: float = 0.0, alpha: float = 0.2):
        self.prefill_s_per_token, self.decode_step_s, self.alpha = prefill_s_per_token, decode_step_s, alpha
        self._records: Sequence = ()
        self._seen = 0

    def bind(self, records: Sequence) -> None:
        self._records, self._seen = records, 0

    def update(self) -> None:
        """Take in the records appended since the last call."""
        records, a = self._records, self.alpha
        for rec in itertools.islice(records, self._seen, None):
            seconds = rec.end_time - rec.start_time
            if rec.num_prefill_tokens and not rec.num_decode_tokens:
                self.prefill_s_per_token = _ewma(self.prefill_s_per_token, seconds / rec.num_prefill_tokens, a)
            elif rec.num_decode_tokens and not rec.num_prefill_tokens:
                self.decode_step_s = _ewma(self.decode_step_s, seconds, a)
        self._seen = len(records)


def _ewma(old: float, x: float, alpha: float) -> float:
    """The moving average after sample x (the first sample, or a prior, when old is 0)."""
    return x if not old else (1 - alpha) * old + alpha * x


def reject_request(req, reason: str, now: Optional[float] = None) -> None:
    """Finish `req` as 'rejected' with `reason` (now None: at its arrival, as Scheduler._reject)."""
    req.status = RequestStatus.REJECTED
    req.finish_reason = "rejected"
    req.reject_reason = reason
    req.finish_time = req.arrival_time if now is None else now


def decode_side_requests(sched) -> itertools.chain:
    """Every request a decode (or decode-role) scheduler holds: running, waiting, swapped, awaiting its KV."""
    return itertools.chain(sched.running, sched.waiting, sched.swapped, sched._kv_pending.values(), sched._kv_ready)


def _pages(tokens: float, page_size: int) -> int:
    return -(-int(tokens) // page_size)


class Admission:
    """The admission policy of a disaggregated deployment (module docstring). `admit_arrival(req, now, prefill,
    decode)` -> None or the rejection reason (the caller rejects: `reject_request`); `admit_handoff(req, now,
    dst)` likewise for a handoff to decode instance `dst`."""

    def __init__(self, policy: str = "none", threshold: float = 1.0, handoff_load: float = 0.0,
                 rates: Optional[StepRates] = None):
        if policy not in ADMISSION_POLICIES:
            raise ValueError(f"admission={policy!r}, expected one of {ADMISSION_POLICIES}")
        if not threshold > 0 or handoff_load < 0:
            raise ValueError(f"admission threshold={threshold!r} (expected > 0), handoff_load={handoff_load!r} "
                             "(expected >= 0)")
        self.policy, self.threshold, self.handoff_load = policy, threshold, handoff_load
        self.rates = rates if rates is not None else StepRates()
        self.decisions: List[tuple] = []      # (time, request id, 'arrival' | 'handoff', load, admitted)

    @property
    def active(self) -> bool:
        return self.policy != "none" or self.handoff_load > 0

    def bind(self, iterations: Sequence) -> None:
        """The run's iteration-record list (the rates learn from it)."""
        self.rates.bind(iterations)

    def load(self, req, now: float, prefill: Sequence, decode: Sequence, *, predicted: bool) -> float:
        """The cluster decode load with `req` at its arrival: now, or predicted for when it reaches decode."""
        rates = self.rates
        rates.update()
        s_tok, d = rates.prefill_s_per_token, rates.decode_step_s
        horizon = 0.0
        if predicted and prefill:
            ahead = min(sum(len(r.all_token_ids) - r.num_computed_tokens for r in _prefill_queue(p)) for p in prefill)
            horizon = (ahead + len(req.prompt_token_ids)) * s_tok
        ps = decode[0].scheduler.block_manager.page_size
        pages = _pages(len(req.prompt_token_ids) + 1, ps)
        seqs = 1
        for inst in decode:
            for r in decode_side_requests(inst.scheduler):
                n, left = _at_horizon(len(r.all_token_ids), r.max_tokens - len(r.output_token_ids), horizon, d)
                if n:
                    pages += _pages(n, ps)
                    seqs += 1
        if predicted and horizon > 0:
            for inst in prefill:
                done = 0.0
                for r in _prefill_queue(inst):
                    done += (len(r.all_token_ids) - r.num_computed_tokens) * s_tok
                    if done >= horizon:
                        break
                    n, _ = _at_horizon(len(r.all_token_ids) + 1, r.max_tokens - 1, horizon - done, d)
                    if n:
                        pages += _pages(n, ps)
                        seqs += 1
        total_pages = sum(i.scheduler.block_manager.num_pages for i in decode)
        total_seqs = sum(i.scheduler.config.max_num_seqs for i in decode)
        return max(pages / total_pages, seqs / total_seqs)

    def admit_arrival(self, req, now: float, prefill: Sequence, decode: Sequence) -> Optional[str]:
        """None to admit `req`, else why it is rejected (before its prefill)."""
        if self.policy == "none":
            return None
        load = self.load(req, now, prefill, decode, predicted=self.policy == "predicted_load")
        ok = load <= self.threshold
        self.decisions.append((now, req.request_id, "arrival", load, ok))
        if ok:
            return None
        return (f"early rejection ({self.policy}): decode load {load:.3f} > admission_threshold "
                f"{self.threshold}")

    def admit_handoff(self, req, now: float, dst) -> Optional[str]:
        """None to hand `req` to decode instance `dst`, else why it is rejected (after its prefill)."""
        if not self.handoff_load:
            return None
        from pdjax.scheduler.mixed import decode_load   # noqa: PLC0415 (mixed imports routing; keep this leaf light)
        load = decode_load(dst, req)
        ok = load <= self.handoff_load
        self.decisions.append((now, req.request_id, "handoff", load, ok))
        if ok:
            return None
        return f"{LATE_PREFIX} decode instance {dst.name} load {load:.3f} > admission_handoff_load {self.handoff_load}"

    def summary(self) -> dict:
        """For results.json: the policy, thresholds, the learned rates and the decisions' counts (decision_switches:
        how often consecutive arrivals' decisions changed between admit and reject, the rule's oscillation)."""
        arrivals = [x for x in self.decisions if x[2] == "arrival"]
        handoffs = [x for x in self.decisions if x[2] == "handoff"]
        return {"policy": self.policy, "threshold": self.threshold, "handoff_load": self.handoff_load,
                "prefill_s_per_token": self.rates.prefill_s_per_token, "decode_step_s": self.rates.decode_step_s,
                "arrivals_rejected": sum(not x[4] for x in arrivals), "arrivals_checked": len(arrivals),
                "decision_switches": sum(a[4] != b[4] for a, b in zip(arrivals, arrivals[1:])),
                "handoffs_rejected": sum(not x[4] for x in handoffs), "handoffs_checked": len(handoffs)}


def _prefill_queue(inst):
    s = inst.scheduler
    return itertools.chain(s.running, s.waiting)


def _at_horizon(tokens: int, steps_left: int, horizon: float, step_s: float):
    """(context tokens at `horizon` seconds from now, or 0 when gone by then; steps left then) of a request with
    `tokens` now and `steps_left` decode steps to go at `step_s` seconds each."""
    if steps_left <= 0:
        return 0, 0
    if horizon <= 0:
        return tokens, steps_left
    if step_s <= 0:
        return tokens, steps_left
    steps = horizon / step_s
    if steps >= steps_left:
        return 0, 0
    return tokens + int(steps), steps_left - int(steps)


def admission_from_deployment(dep) -> Admission:
    """The Admission of a DeploymentConfig's keys (pdjax.config.overload)."""
    return Admission(dep.admission, float(dep.admission_threshold), float(dep.admission_handoff_load),
                     StepRates(float(dep.admission_prefill_tokens_per_s and 1.0 / dep.admission_prefill_tokens_per_s),
                               float(dep.admission_decode_step_s)))


def admission_report(records: Sequence, iterations: Sequence = (), decode_names: Sequence[str] = ()) -> dict:
    """results.json's overload counts from the request records (either backend): requests rejected before their
    prefill, requests whose prefill was wasted (not completed though scheduled: rejected after their prefill or
    aborted) and their prompt tokens, and the decode instances' batch size over their steps (mean, std, and the
    coefficient of variation: the oscillation of the decode load)."""
    before = [r for r in records if r.finish_reason == "rejected" and r.first_scheduled_time is None]
    wasted = [r for r in records if not r.completed and r.first_scheduled_time is not None]
    names = set(decode_names)
    seqs = [it.num_seqs for it in iterations if it.instance in names]
    mean = sum(seqs) / len(seqs) if seqs else 0.0
    std = (sum((x - mean) ** 2 for x in seqs) / len(seqs)) ** 0.5 if seqs else 0.0
    return {"rejected_before_prefill": len(before), "prefill_wasted": len(wasted),
            "wasted_prefill_tokens": sum(r.num_prompt_tokens for r in wasted),
            "decode_batch": {"mean": mean, "std": std, "cv": std / mean if mean else 0.0}}
