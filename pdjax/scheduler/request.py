"""Request: one generation request and its lifecycle (host side, plain Python, no JAX).

Lifecycle: WAITING -> RUNNING (prefill chunks, then one decode token per step) -> FINISHED, with
RUNNING -> PREEMPTED (recompute: back to the waiting queue with no KV) or SWAPPED (KV on host slots) -> RUNNING,
REJECTED at `add_request` for a bad request, and WAITING_FOR_KV on a decode_only scheduler between
`add_handoff` and admission.

`num_computed_tokens` is the one progress variable: tokens of `all_token_ids` whose KV is in the cache (a
prefix-cache hit advances it). The tokens still to feed are always `all_token_ids[num_computed_tokens:]`:
the prompt (or, after a recompute preemption, prompt + outputs so far) while in the prefill phase, then the
last sampled token. `prefill_end` is the length of `all_token_ids` when the request was (re)admitted; a chunk
starting before it is a prefill chunk, anything after is a decode.
"""
from __future__ import annotations

import enum
import functools
from typing import List, Optional, Sequence, Tuple

from pdjax.config.sampling import SamplingParams


class RequestStatus(enum.IntEnum):
    """Where a request is in its lifecycle. Members are singletons, so `status is RequestStatus.RUNNING` is exact;
    the two finished states come last (as in vLLM's RequestStatus), so `status >= FINISHED` means finished.
    str() is the lower-case name ("running"), as messages and reprs print it."""
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()          # recompute preemption: waiting again, no KV kept
    SWAPPED = enum.auto()            # swap preemption: KV on host slots
    WAITING_FOR_KV = enum.auto()     # decode_only: handed off, KV transfer not yet marked arrived
    FINISHED = enum.auto()
    REJECTED = enum.auto()

    def __str__(self) -> str:
        return self.name.lower()


FINISH_REASONS = ("length", "stop", "aborted", "rejected", "handoff")
# The id update_async appends until the step's real id reaches the host; the simulator's sampled id
PLACEHOLDER_TOKEN = 0


def _caught_up_setter(slot: str):
    """The setter of Request's token list stored in `slot`: the request caught up with its chain of decode runs first
    (Request.settle_run: its other lists too), then the list replaced."""
    def set_list(req: "Request", value: list) -> None:
        if req.run_lag is not None:
            req.settle_run()
        setattr(req, slot, value)
    return set_list


class Request:
    """One request. Public attributes are read by the engine, simulator and metrics; those named `_x` or
    listed as internal below are the scheduler's own bookkeeping.

    Times are seconds on the caller's clock. token_times[i] is when output token i was produced;
    preemption_times holds every preemption.
    priority: lower value is served first under ordering='priority' and is preempted last.
    """
    __slots__ = (
        "request_id", "prompt_token_ids", "sampling", "arrival_time", "priority", "status",
        "num_computed_tokens", "_output_token_ids", "_all_token_ids", "first_scheduled_time", "first_token_time",
        "finish_time", "_token_times", "num_preemptions", "preemption_times", "finish_reason",
        "reject_reason", "num_cached_tokens", "output_logprobs",
        # internal
        "page_table", "prefill_end", "page_keys", "num_registered_pages", "host_slots", "admit_seq",
        "sched_step", "stop_ids", "max_tokens", "is_long_prefill", "token_bound", "num_kv_local_pages", "key_base",
        "content_key_pages", "run_lag",
    )

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams,
                 arrival_time: float, priority: int = 0, *, share_prompt: bool = False):
        """share_prompt: keep `prompt_token_ids` (a list nobody changes: a workload request's) instead of a copy."""
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids if share_prompt else list(prompt_token_ids)
        self.sampling = sampling
        self.arrival_time = arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self._output_token_ids: List[int] = []
        self._all_token_ids: List[int] = list(self.prompt_token_ids)
        self.first_scheduled_time: Optional[float] = None
        self.first_token_time: Optional[float] = None
        self.finish_time: Optional[float] = None
        self._token_times: List[float] = []
        self.num_preemptions = 0
        self.preemption_times: List[float] = []
        self.finish_reason: Optional[str] = None
        self.reject_reason: Optional[str] = None
        self.num_cached_tokens = 0           # prompt tokens served by the prefix cache at (last) admission
        self.output_logprobs: Optional[list] = None   # TokenLogprobs per output token once one came (logprobs.py)
        self.page_table: List[int] = []      # device pages, in token order
        self.prefill_end = len(self._all_token_ids)
        self.page_keys: list = []            # prefix-cache key of each full page of all_token_ids, computed lazily
        self.key_base: Optional[int] = None  # page keys numbered from it (block_manager.request_page_keys)
        self.content_key_pages = 0           # with a key base, its first pages keyed by content (numbered_keys)
        self.num_registered_pages = 0        # leading pages already offered to the prefix cache
        self.host_slots: List[int] = []      # swap slots holding this request's pages while SWAPPED
        self.admit_seq = -1                  # admission counter, tie-breaks victims
        self.sched_step = -1                 # last step this request was scheduled in
        self.stop_ids = frozenset(getattr(sampling, "stop_token_ids", ()) or ())
        self.max_tokens = getattr(sampling, "max_tokens", 0)
        self.is_long_prefill = False
        self.num_kv_local_pages = 0          # decode_only: leading pages its instance held already at the handoff
        self.token_bound: Optional[Tuple[int, int]] = None  # (lo, hi): every prompt id in [lo, hi] (see below)
        self.run_lag: Optional[Tuple[list, int]] = None    # (run clock, its tokens applied here): see settle_run

    # A decoder of a chain of decode runs (pdjax.scheduler.runs) takes one placeholder token per step the chain
    # applies, at the step's end time: the chain keeps those end times once (its clock), and the decoder's three
    # lists below catch up with it when read (settle_run), not at every run.
    def settle_run(self) -> None:
        """Append the tokens (placeholders) and token times of the decode-run steps applied since the last
        settling: run_lag = (the chain's clock of step end times, how many of them this request holds already)."""
        clock, held = self.run_lag
        n = len(clock) - held
        if n:
            tokens = [PLACEHOLDER_TOKEN] * n
            self._output_token_ids += tokens
            self._all_token_ids += tokens
            self._token_times += clock[held:]
            self.run_lag = (clock, held + n)

    def leave_run(self) -> None:
        """Catch up with its chain of decode runs (settle_run) and leave it: the chain goes on without it (it
        finished) or has ended (a schedule(), a pair run)."""
        self.settle_run()
        self.run_lag = None

    # Each list caught up when read (a property written out: this read is on the scheduler's paths)
    @property
    def output_token_ids(self) -> List[int]:
        if self.run_lag is not None:
            self.settle_run()
        return self._output_token_ids

    @property
    def all_token_ids(self) -> List[int]:
        if self.run_lag is not None:
            self.settle_run()
        return self._all_token_ids

    @property
    def token_times(self) -> List[float]:
        if self.run_lag is not None:
            self.settle_run()
        return self._token_times

    output_token_ids = output_token_ids.setter(_caught_up_setter("_output_token_ids"))
    all_token_ids = all_token_ids.setter(_caught_up_setter("_all_token_ids"))
    token_times = token_times.setter(_caught_up_setter("_token_times"))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED or self.status is RequestStatus.REJECTED

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status}, prompt={len(self.prompt_token_ids)}, "
                f"output={len(self.output_token_ids)}, computed={self.num_computed_tokens}, "
                f"finish_reason={self.finish_reason!r})")


def request_from_workload(wr, *, eos_token_id: int = -1, offline: bool = False, temperature: float = 0.0,
                          seed: int = 0, key_base: Optional[int] = None, content_key_pages: int = 0) -> Request:
    """A Request from a workload request (pdjax.workload.WorkloadRequest or anything with request_id,
    prompt_token_ids, max_tokens, arrival_time): greedy unless a temperature is given, stopping at
    `eos_token_id` when it is >= 0, arriving at 0 when offline, its page keys numbered from `key_base` if given,
    after its first `content_key_pages` (pdjax.scheduler.block_manager.numbered_keys). The engine and the simulator
    both use it."""
    sampling = _sampling(temperature, seed, int(wr.max_tokens), (eos_token_id,) if eos_token_id >= 0 else ())
    prompt = wr.prompt_token_ids
    req = Request(str(wr.request_id), prompt, sampling, 0.0 if offline else float(wr.arrival_time),
                  share_prompt=prompt.__class__ is list)
    # The workload's guarantee on its prompt ids (WorkloadRequest.token_bound): add_request then skips scanning them.
    req.token_bound = getattr(wr, "token_bound", None)
    req.key_base = key_base
    req.content_key_pages = content_key_pages
    return req


@functools.lru_cache(maxsize=4096, typed=True)
def _sampling(temperature, seed, max_tokens: int, stop_token_ids: tuple) -> SamplingParams:
    """One SamplingParams per distinct value (frozen, so requests may share it; checking its fields is most of
    what making a request from a workload request costs)."""
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, stop_token_ids=stop_token_ids)
