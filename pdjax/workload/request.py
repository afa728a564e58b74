"""The request a workload hands to an engine or the simulator (host side, plain Python)."""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple


@dataclasses.dataclass
class WorkloadRequest:
    """One request of a workload.

    arrival_time: seconds from the start of the run (the first request of a generated workload arrives at 0).
    prompt_token_ids: the prompt, len >= 1. max_tokens: output tokens to generate (the output length; an engine
    stops a request there unless a stop token comes first).
    session_id / turn: multi-turn sessions (turn 0 is the first); prompt of turn k extends turn k-1's prompt.
    prefix_group: requests with the same group share a leading run of `shared_prefix_len` prompt tokens.
    uncapped_prompt_len / uncapped_output_len: the lengths the source gave after scaling, before the caps
      (0 = not recorded); a request whose lengths are below them was cut (see `length_report`).
    """
    request_id: str
    arrival_time: float
    prompt_token_ids: List[int]
    max_tokens: int
    session_id: Optional[str] = None
    turn: int = 0
    prefix_group: Optional[str] = None
    shared_prefix_len: int = 0
    uncapped_prompt_len: int = 0
    uncapped_output_len: int = 0
    # (lo, hi): the generator's guarantee that every prompt id lies in [lo, hi] (it knows from how it made them),
    # so a scheduler can skip scanning the prompt; None: no claim. Not an __init__ argument, so replace() or a
    # hand-made request never carries a stale one.
    token_bound: Optional[Tuple[int, int]] = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids is empty, expected >= 1 token")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_tokens={self.max_tokens!r}, expected an int >= 1")
        if not self.arrival_time >= 0.0:
            raise ValueError(f"request {self.request_id!r}: arrival_time={self.arrival_time!r}, expected >= 0")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
