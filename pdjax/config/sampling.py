"""Per-request sampling parameters (host side, no JAX)."""
from __future__ import annotations

import dataclasses
from typing import Tuple

from pdjax.config.parse import check_fields, nonneg_int, number, positive_int


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are sampled and when it stops.

    temperature: 0 means greedy. top_k: 0 means off. top_p: 1.0 means off. seed: the request's own seed; the
    token at position p is drawn with key fold_in(PRNGKey(seed), p), so a request samples the same tokens
    whatever batch it runs in. max_tokens: output tokens to generate at most. stop_token_ids: finish on any.
    """
    temperature: float = number(0.0, low=0)
    top_k: int = nonneg_int(0, note="(0 = off)")
    top_p: float = number(1.0, low=0, high=1, low_open=True)
    seed: int = 0
    max_tokens: int = positive_int(16)
    stop_token_ids: Tuple[int, ...] = ()

    def __post_init__(self):
        check_fields(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
