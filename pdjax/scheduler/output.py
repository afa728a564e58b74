"""SchedulerOutput: what one iteration runs (the scheduler <-> runner contract of DESIGN.md §3).

Struct of lists, one entry per scheduled request in batch order, so a step allocates no per-request objects.
Lists named `page_tables` and `sampling` hold references to the requests' own objects: the runner must not
mutate them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, List, Sequence, Tuple

from pdjax.config.sampling import SamplingParams

# What a runner returns for a scheduled sequence instead of a token id (a sampled id is >= 0):
NOT_SAMPLED = -1          # do_sample was False for it
NONFINITE_LOGITS = -2     # its logits held NaN or inf: no token can be drawn (the engine fails the request)


@dataclasses.dataclass
class SchedulerOutput:
    step: int                                   # iteration index of this scheduler
    req_ids: List[str] = dataclasses.field(default_factory=list)
    token_ids: List[Sequence[int]] = dataclasses.field(default_factory=list)   # tokens to feed, len == num_new_tokens
    num_computed_tokens: List[int] = dataclasses.field(default_factory=list)  # start position of these tokens
    num_new_tokens: List[int] = dataclasses.field(default_factory=list)
    page_tables: List[Sequence[int]] = dataclasses.field(default_factory=list)  # covers start + num_new tokens
    do_sample: List[bool] = dataclasses.field(default_factory=list)   # sample after the last token fed
    sampling: List[SamplingParams] = dataclasses.field(default_factory=list)
    is_prefill: List[bool] = dataclasses.field(default_factory=list)  # tokens come from the prompt (incl. recompute)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # Swap preemption: (host_slot, device_page) copies the runner makes before the step.
    swap_out: List[Tuple[int, int]] = dataclasses.field(default_factory=list)
    swap_in: List[Tuple[int, int]] = dataclasses.field(default_factory=list)
    preempted_req_ids: List[str] = dataclasses.field(default_factory=list)
    # decode_only: handed-off requests admitted in this step; before the step the runner writes each one's
    # received KV (its first num_computed_tokens tokens) into its page table (same batch index as req_ids).
    kv_handoff_req_ids: List[str] = dataclasses.field(default_factory=list)
    # The scheduled Request objects, aligned with req_ids (scheduler-internal: lets update() skip a lookup).
    reqs: List[Any] = dataclasses.field(default_factory=list, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.req_ids)

    @property
    def total_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.req_ids
