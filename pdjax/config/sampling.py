"""Per-request sampling parameters (host side, no JAX)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from pdjax.config.parse import FieldError, check_fields, is_int, nonneg_int, number, positive_int

MAX_LOGPROBS = 20     # the most top logprobs a request may ask for (OpenAI's cap; the step returns this many)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are sampled and when it stops.

    temperature: 0 means greedy. top_k: 0 means off. top_p: 1.0 means off. seed: the request's own seed; the
    token at position p is drawn with key fold_in(PRNGKey(seed), p), so a request samples the same tokens
    whatever batch it runs in. max_tokens: output tokens to generate at most. stop_token_ids: finish on any.
    logprobs: None = none; n in [0, MAX_LOGPROBS] = each output token's logprob and the n most likely tokens with
    theirs (log_softmax of the raw logits, before temperature / top-k / top-p, as vLLM's default).
    """
    temperature: float = number(0.0, low=0)
    top_k: int = nonneg_int(0, note="(0 = off)")
    top_p: float = number(1.0, low=0, high=1, low_open=True)
    seed: int = 0
    max_tokens: int = positive_int(16)
    stop_token_ids: Tuple[int, ...] = ()
    logprobs: Optional[int] = None

    def __post_init__(self):
        check_fields(self)
        lp = self.logprobs
        if lp is not None and not (is_int(lp) and 0 <= lp <= MAX_LOGPROBS):
            raise FieldError("logprobs", lp, f"None or an int in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
