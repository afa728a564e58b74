"""Record types an engine (real or simulated) fills in while it runs: one per request, one per iteration.

All times are seconds on one clock (the run's clock, arrival of the first request usually 0).
A request is *completed* when it produced at least one token and its finish_reason is not in
NOT_SERVED_REASONS ('rejected': never admitted, e.g. prompt longer than the model allows; 'aborted': dropped
mid-run; 'unfinished': still running when the run stopped). Only completed requests enter latency statistics;
every request counts in the SLO-attainment denominator (a request that was not served does not meet an SLO).
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

NOT_SERVED_REASONS = ("rejected", "aborted", "unfinished")


@dataclasses.dataclass
class RequestRecord:
    """Timeline of one request. token_times[i] is when output token i became available (len = num_output_tokens
    for a completed request); first_token_time == token_times[0] and finish_time == token_times[-1] then."""
    request_id: str
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str = "length"
    token_times: List[float] = dataclasses.field(default_factory=list)
    reject_reason: str = ""            # why a 'rejected' request was refused ('' otherwise)

    @property
    def completed(self) -> bool:
        return self.finish_reason not in NOT_SERVED_REASONS and len(self.token_times) > 0

    def validate(self) -> None:
        """Raise ValueError naming the request and the inconsistent field."""
        def bad(msg):
            raise ValueError(f"request {self.request_id!r}: {msg}")
        if any(b < a for a, b in zip(self.token_times, self.token_times[1:])):
            bad("token_times are not non-decreasing")
        if self.token_times and self.token_times[0] < self.arrival_time:
            bad(f"first token at {self.token_times[0]!r} before arrival {self.arrival_time!r}")
        if self.first_scheduled_time is not None and self.first_scheduled_time < self.arrival_time:
            bad(f"first_scheduled_time={self.first_scheduled_time!r} before arrival_time={self.arrival_time!r}")
        if self.completed:
            if self.num_output_tokens != len(self.token_times):
                bad(f"num_output_tokens={self.num_output_tokens}, expected len(token_times)={len(self.token_times)}")
            if self.first_token_time != self.token_times[0]:
                bad(f"first_token_time={self.first_token_time!r}, expected token_times[0]={self.token_times[0]!r}")
            if self.first_scheduled_time is None:
                bad("completed but first_scheduled_time is None")


@dataclasses.dataclass(slots=True)
class IterationRecord:
    """One engine iteration (one jitted step): wall-clock start/end, what it ran, and on which instance.
    Slotted: a long simulation keeps hundreds of thousands of them."""
    step: int
    start_time: float
    end_time: float
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_seqs: int = 0
    instance: str = ""
    num_compiles: int = 0      # XLA compiles JAX reported during this iteration (its time includes them)

    @property
    def step_time(self) -> float:
        return self.end_time - self.start_time

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


def request_record(req: Any, float_times: bool = False) -> RequestRecord:
    """A RequestRecord from any object with a scheduler Request's attributes (duck-typed, so metrics imports no
    scheduler code). A finish_reason of None (still running) becomes 'unfinished'. float_times: its token_times
    are Python floats already (the simulator's clock), copied as they are."""
    times = req.token_times[:] if float_times else list(map(float, req.token_times))
    return RequestRecord(
        request_id=str(req.request_id), arrival_time=float(req.arrival_time),
        first_scheduled_time=req.first_scheduled_time, first_token_time=req.first_token_time,
        finish_time=req.finish_time, num_prompt_tokens=int(req.num_prompt_tokens),
        num_output_tokens=int(req.num_output_tokens), num_preemptions=int(req.num_preemptions),
        finish_reason=req.finish_reason if req.finish_reason is not None else "unfinished",
        token_times=times, reject_reason=getattr(req, "reject_reason", None) or "")
