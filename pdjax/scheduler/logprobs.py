"""Per-token logprobs of the requests that ask for them (SamplingParams.logprobs), host side, no JAX.

A runner returns, for a step whose batch had a request asking, `rows` = (logprob float32[n] of each sequence's
sampled token, top ids int32[n, K], top logprobs float32[n, K]) for the step's n scheduled sequences
(pdjax.runtime.runner.ModelRunner.collect_logprobs; K = 20, most likely first). The engine hands them here after
applying the step: each request that asked and got a token from it gets one `TokenLogprobs` in
`Request.output_logprobs` (None until the first) at that token's output index, so entry i always belongs to
`output_token_ids[i]` (across preemptions, a prefill -> decode handoff, which moves the Request object itself, and
async scheduling's placeholders). Requests that did not ask get nothing, and a step in which none asked costs
nothing here.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

Rows = Tuple[object, object, object]    # (logprob [n], top ids [n, K], top logprobs [n, K]), numpy arrays


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """One output token's logprobs: its id, its logprob under the raw logits, and the request's
    `sampling.logprobs` most likely (id, logprob) pairs, most likely first."""
    token_id: int
    logprob: float
    top: Tuple[Tuple[int, float], ...]


def token_logprobs(rows: Rows, row: int, token_id: int, num_top: int) -> TokenLogprobs:
    """The TokenLogprobs of sequence `row` of a step's `rows`, keeping its first `num_top` top entries."""
    logprob, top_ids, top_logprobs = rows
    top = tuple((int(i), float(v)) for i, v in zip(top_ids[row][:num_top], top_logprobs[row][:num_top]))
    return TokenLogprobs(int(token_id), float(logprob[row]), top)


def _put(req, index: int, entry: TokenLogprobs) -> None:
    """Set req.output_logprobs[index] (a list aligned with output_token_ids, made at the first entry: a request
    that never asks holds None, no list; None where no entry)."""
    held = req.output_logprobs
    if held is None:
        held = req.output_logprobs = []
    if len(held) <= index:
        held.extend([None] * (index + 1 - len(held)))
    held[index] = entry


def output_counts(out) -> List[int]:
    """len(output_token_ids) of each request of SchedulerOutput `out` (call before scheduler.update)."""
    return [len(req.output_token_ids) for req in out.reqs]


def attach(out, counts: Sequence[int], sampled: Sequence[int], rows: Optional[Rows]) -> None:
    """After scheduler.update(out, sampled): each request of `out` that asked and got its token gets the
    TokenLogprobs of its row at output index counts[j] (output_counts before the update)."""
    if rows is None:
        return
    for j, req in enumerate(out.reqs):
        num_top = getattr(req.sampling, "logprobs", None)
        if num_top is not None and len(req.output_token_ids) > counts[j]:
            _put(req, counts[j], token_logprobs(rows, j, sampled[j], num_top))


def attach_pending(pending, sampled: Sequence[int], rows: Optional[Rows]) -> None:
    """Async scheduling: after scheduler.resolve_async(pending, sampled), the TokenLogprobs of each request
    of `pending.slots` ((batch index, request, output index, all-token index)) that asked."""
    if rows is None:
        return
    for j, req, n_out, _ in pending.slots:
        num_top = getattr(req.sampling, "logprobs", None)
        if num_top is not None:
            _put(req, n_out, token_logprobs(rows, j, sampled[j], num_top))
