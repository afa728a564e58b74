"""Per-request sampling parameters (host side, no JAX)."""
from __future__ import annotations

import dataclasses
from typing import Tuple


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are sampled and when it stops.

    temperature: 0 means greedy. top_k: 0 means off. top_p: 1.0 means off. seed: the request's own seed; the
    token at position p is drawn with key fold_in(PRNGKey(seed), p), so a request samples the same tokens
    whatever batch it runs in. max_tokens: output tokens to generate at most. stop_token_ids: finish on any.
    """
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 16
    stop_token_ids: Tuple[int, ...] = ()

    def __post_init__(self):
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature={self.temperature!r}, expected >= 0")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}, expected an int >= 0 (0 = off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r}, expected 0 < top_p <= 1")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r}, expected an int >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
