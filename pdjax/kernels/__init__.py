"""Attention kernels. One seam: every implementation has the signature of
`reference.ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
sm_scale=None, sliding_window=None, soft_cap=None)`. Kernels know nothing of schedulers.

Implementations: 'reference' (plain jnp, per-token key gathers; the oracle), 'blocked' (plain XLA, K/V loaded
once per query block; the CPU path, `blocked.py`), 'pallas' (GPU/TPU kernels).
"""
from __future__ import annotations

from typing import Callable

import jax

from pdjax.kernels import blocked, pallas_attention, reference
from pdjax.kernels.reference import ragged_paged_attention as reference_attention
from pdjax.kernels.reference import write_kv

ATTENTION_IMPLS = ("auto", "reference", "blocked", "pallas")


def get_attention_fn(impl: str = "auto") -> Callable:
    """The attention function for `impl` ('auto' | 'reference' | 'blocked' | 'pallas').

    'auto' picks the Pallas kernel on GPU/TPU and the blocked XLA path on CPU. 'blocked' runs anywhere (plain
    jnp/lax); 'reference' is the per-token jnp oracle. 'pallas' picks
    `pallas_gpu.ragged_paged_attention` (Triton) on GPU, `pallas_tpu.ragged_paged_attention` (Mosaic) on TPU,
    and on CPU the GPU kernel in interpret mode (slow; for tests). See `pallas_attention`.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r}, expected one of {ATTENTION_IMPLS}")
    backend = jax.default_backend()
    if impl == "reference":
        return reference_attention
    if impl == "blocked" or (impl == "auto" and backend == "cpu"):
        return blocked.ragged_paged_attention
    return pallas_attention.get_pallas_attention_fn(backend)


__all__ = ["ATTENTION_IMPLS", "get_attention_fn", "reference", "reference_attention", "write_kv"]
