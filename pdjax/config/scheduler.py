"""SchedulerConfig: every knob of the batching policies, validated once at construction (no JAX).

Choices:
- Policies that never split a prompt (`vllm_v0`, `orca`, `decode_first`) ignore `enable_chunking`; for them,
  and for chunking policies with `enable_chunking=False`, the token budget must hold a max-length prompt.
- Stall-free policies (`sarathi`, `vllm_v1`, `decode_only`) schedule every running decode each step, so the
  budget must be at least `max_num_seqs`.
- `watermark` defaults per policy (None): 0.0 under `vllm_v1` (vLLM's default), 0.01 under the others (their
  behaviour before the knob became policy-dependent). `scheduler_reserve_full_isl` (vLLM's name and default,
  True) is read by `vllm_v1` only: the other policies admit on their first chunk's pages.
- Zero means "off" for the optional integer knobs (`tile_size`, `long_prefill_token_threshold`,
  `max_num_partial_prefills`, `max_long_partial_prefills`, `min_prefill_tokens`).
- Dynamic chunking caps a prefill chunk at `token_budget * ref / (ref + context)` tokens (context = tokens
  already computed for the request, ref = `dynamic_chunk_ref_context`), floored at `dynamic_chunk_min_tokens`:
  attention cost grows with context, so the chunk shrinks to keep the iteration time roughly flat (the
  chunk halves when the context reaches `ref`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from pdjax.config.parse import check_fields, flag, nonneg_int, number, one_of, positive_int
from pdjax.config.registry import POLICIES     # the one policy table: names and traits (chunking, stall_free, ...)

DEFAULT_WATERMARK = 0.01            # every policy but vllm_v1, when `watermark` is None
VLLM_V1_DEFAULT_WATERMARK = 0.0     # vLLM's SchedulerConfig.watermark default
PREEMPTION_MODES = ("recompute", "swap")
ORDERINGS = ("fcfs", "priority")
OFF = "(0 = off)"


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Knobs of one scheduler instance. Sizes in tokens or pages; `watermark` is a fraction of `num_pages`.

    policy: a name in POLICIES (pdjax.config.registry). token_budget: max tokens in one iteration (vLLM
    max_num_batched_tokens).
    max_num_seqs: max requests running (and so per iteration). max_model_len: max prompt + output tokens.
    page_size: tokens per KV page. num_pages: device KV pages (0: as many as fit `engine.kv_memory_utilization` of
    the device's memory, measured from the compiled step: the real engine on a GPU/TPU). enable_prefix_caching:
    share full pages by a hash chained over the prefix. enable_chunking: split prompts into chunks (chunking
    policies only).
    preemption_mode: 'recompute' (drop KV, recompute prompt + output so far) or 'swap' (copy pages to
    `num_host_pages` host slots; falls back to recompute when host slots run short).
    ordering: 'fcfs' (arrival order) or 'priority' (lower `Request.priority` value first, then arrival).
    watermark: fraction of pages kept free when admitting (avoids preempting right after admission); None =
      the policy's default (0.0 under vllm_v1, as vLLM; 0.01 otherwise). Under vllm_v1 it applies, as in vLLM,
      only while some request is running.
    scheduler_reserve_full_isl (vllm_v1 only, vLLM's name and default): admit a waiting or preempted request
      only when pages for its whole current sequence (prompt, plus outputs so far after a recompute) fit with
      the watermark, not just its first chunk's.
    tile_size: round partial prefill chunks down to a multiple of this (0 = off).
    dynamic_chunking / dynamic_chunk_ref_context / dynamic_chunk_min_tokens: see the module docstring.
    long_prefill_token_threshold: per-request chunk cap per iteration; a prefill longer than this is
      "long" for `max_long_partial_prefills` (0 = off). Under vllm_v1 the cap applies, as in vLLM, only in a
      step that starts with more than one request (running + waiting + swapped).
    max_num_partial_prefills / max_long_partial_prefills (vllm_v1 only, a pdjax extension: vLLM V1 has the
      knobs but its scheduler ignores them): at most this many requests (long ones) in the prefill phase at
      once, enforced at admission (0 = unlimited, the default).
    min_prefill_tokens: prefill-starvation guard of the stall-free policies: when prefill work is pending,
      decodes get at most token_budget - min_prefill_tokens tokens (0 = off; then no decode ever stalls).
    decode_batches: the Sarathi-based policies (sarathi, prefill_only, decode_only and the mixed pool's) split
      the running decodes across this many batches in flight
      (vLLM v0's virtual engines): a batch takes at most ceil(running / decode_batches) decodes, so the next
      batch finds the rest not in flight and a pipelined instance's stages all work. A disaggregated decode
      group with pp > 1 gets its pp (pdjax.config.deployment.instance_scheduler_config); 1 = no split.
    """
    policy: str = one_of("sarathi", POLICIES)
    token_budget: int = positive_int(2048)
    max_num_seqs: int = positive_int(128)
    max_model_len: int = positive_int(2048)
    page_size: int = positive_int(16)
    num_pages: int = nonneg_int(4096, note="(0 = as many as fit the device's memory: the real engine on a GPU/TPU)")
    enable_prefix_caching: bool = flag(False)
    enable_chunking: bool = flag(True)
    preemption_mode: str = one_of("recompute", PREEMPTION_MODES)
    num_host_pages: int = nonneg_int(0, note=OFF)
    ordering: str = one_of("fcfs", ORDERINGS)
    watermark: Optional[float] = number(None, low=0.0, high=1.0, high_open=True, optional=True, expected=(
        f"a fraction in [0, 1), or None for the policy's default ({VLLM_V1_DEFAULT_WATERMARK} under 'vllm_v1', "
        f"{DEFAULT_WATERMARK} otherwise)"))
    scheduler_reserve_full_isl: bool = flag(True)
    tile_size: int = nonneg_int(0, note=OFF)
    dynamic_chunking: bool = flag(False)
    dynamic_chunk_ref_context: int = positive_int(4096)
    dynamic_chunk_min_tokens: int = positive_int(64)
    long_prefill_token_threshold: int = nonneg_int(0, note=OFF)
    max_num_partial_prefills: int = nonneg_int(0, note=OFF)
    max_long_partial_prefills: int = nonneg_int(0, note=OFF)
    min_prefill_tokens: int = nonneg_int(0, note=OFF)
    decode_batches: int = positive_int(1)
    # > 0: prompts with token ids >= vocab_size are rejected (set by the engine)
    vocab_size: int = nonneg_int(0, note="(0 = unchecked)")

    def __post_init__(self):
        check_fields(self)
        if not self.scheduler_reserve_full_isl and self.policy != "vllm_v1":
            raise ValueError(f"scheduler_reserve_full_isl=False is read by policy 'vllm_v1' only, got "
                             f"policy={self.policy!r} (which admits on its first chunk's pages); leave it True")
        info = POLICIES[self.policy]
        if self.decode_batches > 1 and not info.decode_batches:
            raise ValueError(f"decode_batches={self.decode_batches} is read by the Sarathi-based policies only "
                             f"({', '.join(POLICIES.names(decode_batches=True))}), got policy={self.policy!r}; "
                             "leave it 1")
        if self.preemption_mode == "swap" and self.num_host_pages < 1:
            raise ValueError(f"preemption_mode='swap' needs num_host_pages >= 1, got {self.num_host_pages}")
        if not self.chunking:
            if self.token_budget < self.max_model_len:
                why = ("policy never chunks" if not info.chunking else "enable_chunking=False")
                raise ValueError(f"token_budget={self.token_budget} < max_model_len={self.max_model_len} with "
                                 f"no chunking ({why}, policy={self.policy!r}): a max-length prompt could never "
                                 f"be scheduled; raise token_budget or enable chunking")
            for name in ("tile_size", "long_prefill_token_threshold"):
                if getattr(self, name):
                    raise ValueError(f"{name}={getattr(self, name)} needs chunking, which is off for "
                                     f"policy={self.policy!r} enable_chunking={self.enable_chunking}")
            if self.dynamic_chunking:
                raise ValueError(f"dynamic_chunking=True needs chunking, which is off for policy={self.policy!r} "
                                 f"enable_chunking={self.enable_chunking}")
        if info.stall_free and self.token_budget < self.max_num_seqs:
            raise ValueError(f"token_budget={self.token_budget} < max_num_seqs={self.max_num_seqs} under the "
                             f"stall-free policy {self.policy!r}: the running decodes alone could exceed the budget")
        if self.tile_size > self.token_budget:
            raise ValueError(f"tile_size={self.tile_size} > token_budget={self.token_budget}: no chunk could be "
                             f"tile-aligned")
        if self.dynamic_chunking and self.tile_size > self.dynamic_chunk_min_tokens:
            raise ValueError(f"dynamic_chunk_min_tokens={self.dynamic_chunk_min_tokens} < tile_size="
                             f"{self.tile_size}: the floor must hold at least one tile")
        if self.policy != "vllm_v1" and (self.max_num_partial_prefills or self.max_long_partial_prefills):
            raise ValueError(f"max_num_partial_prefills={self.max_num_partial_prefills} / max_long_partial_prefills="
                             f"{self.max_long_partial_prefills} are enforced by policy 'vllm_v1' only, got "
                             f"policy={self.policy!r}; set them to 0")
        if self.max_long_partial_prefills and not self.long_prefill_token_threshold:
            raise ValueError(f"max_long_partial_prefills={self.max_long_partial_prefills} needs "
                             f"long_prefill_token_threshold > 0 to say which prefills are long")
        if (self.max_num_partial_prefills and self.max_long_partial_prefills
                and self.max_long_partial_prefills > self.max_num_partial_prefills):
            raise ValueError(f"max_long_partial_prefills={self.max_long_partial_prefills} > max_num_partial_prefills="
                             f"{self.max_num_partial_prefills}")
        if self.min_prefill_tokens >= self.token_budget:
            raise ValueError(f"min_prefill_tokens={self.min_prefill_tokens}, expected < token_budget="
                             f"{self.token_budget}")
        if self.min_prefill_tokens and not info.min_prefill_tokens:
            raise ValueError(f"min_prefill_tokens={self.min_prefill_tokens} is used by "
                             f"{' and '.join(map(repr, POLICIES.names(min_prefill_tokens=True)))} only, got "
                             f"policy={self.policy!r}")
        if self.num_pages and self.num_pages - self.watermark_pages < self.pages_per_max_request:
            raise ValueError(f"num_pages={self.num_pages} (watermark {self.watermark_pages} pages) cannot hold one "
                             f"max-length request: max_model_len={self.max_model_len} needs "
                             f"{self.pages_per_max_request} pages of page_size={self.page_size}")

    @property
    def chunking(self) -> bool:
        """Whether prompts may be split into chunks under this policy."""
        return self.enable_chunking and POLICIES[self.policy].chunking

    @property
    def pages_per_max_request(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def effective_watermark(self) -> float:
        """`watermark`, or the policy's default when it is None."""
        if self.watermark is not None:
            return float(self.watermark)
        return VLLM_V1_DEFAULT_WATERMARK if self.policy == "vllm_v1" else DEFAULT_WATERMARK

    @property
    def watermark_pages(self) -> int:
        return int(self.effective_watermark * self.num_pages)
