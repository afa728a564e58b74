"""Attention kernels. One seam: every implementation has the signature of
`reference.ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
sm_scale=None, sliding_window=None, soft_cap=None)`. Kernels know nothing of schedulers.

Implementations: 'reference' (plain jnp, per-token key gathers; the oracle), 'blocked' (plain XLA, K/V loaded
once per query block; the CPU path, `blocked.py`), 'pallas' (GPU/TPU kernels).

Under tensor parallelism the seam is `shard_map`ped over the mesh's head axis (`shard_over_kv_heads`): each shard
runs the kernel on its own query heads and its own KV heads (the cache is split on KV heads), so attention needs no
communication, and a Pallas call, which XLA cannot partition ("Mosaic kernels cannot be automatically
partitioned"), sees only local shapes. The mesh also names the platform the kernel is compiled for, so a TPU mesh
picks the Mosaic kernel on a CPU host (ahead-of-time compilation) and the kernel reads the TPU generation from the
mesh's devices.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
from jax.sharding import Mesh, PartitionSpec as P

from pdjax.kernels import blocked, pallas_attention, reference
from pdjax.kernels.reference import ragged_paged_attention as reference_attention
from pdjax.kernels.reference import write_kv

ATTENTION_IMPLS = ("auto", "reference", "blocked", "pallas")


def get_attention_fn(impl: str = "auto", mesh: Optional[Mesh] = None, *, head_axis: str = "tensor") -> Callable:
    """The attention function for `impl` ('auto' | 'reference' | 'blocked' | 'pallas'); with a `mesh`, for that
    mesh's platform and sharded over its `head_axis` (`shard_over_kv_heads`), else for jax's default backend.

    'auto' picks the Pallas kernel on GPU/TPU and the blocked XLA path on CPU. 'blocked' runs anywhere (plain
    jnp/lax); 'reference' is the per-token jnp oracle. 'pallas' picks
    `pallas_gpu.ragged_paged_attention` (Triton) on GPU, `pallas_tpu.ragged_paged_attention` (Mosaic) on TPU,
    and on CPU the GPU kernel in interpret mode (slow; for tests). See `pallas_attention`.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r}, expected one of {ATTENTION_IMPLS}")
    backend = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
    if impl == "reference":
        fn = reference_attention
    elif impl == "blocked" or (impl == "auto" and backend == "cpu"):
        fn = blocked.ragged_paged_attention
    else:
        fn = pallas_attention.get_pallas_attention_fn(backend)
    return fn if mesh is None else shard_over_kv_heads(fn, mesh, head_axis)


def shard_over_kv_heads(attention_fn: Callable, mesh: Mesh, head_axis: str = "tensor") -> Callable:
    """`attention_fn` (seam signature) run per shard of `mesh`'s `head_axis`: q [T, Nq, D] split on its heads,
    k/v pages [Nkv, N, page_size, D] on their KV heads, the batch metadata replicated, the output [T, Nq, D] split
    as q. Contiguous head blocks keep GQA groups whole (shard i holds q heads i·Nq/tp.. and KV heads i·Nkv/tp..,
    and q head h reads KV head h // (Nq/Nkv)), so it is exact whenever tp divides Nkv (checked by the mesh rules).
    """
    heads, kv_heads, whole = P(None, head_axis, None), P(head_axis), P()

    def sharded(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **static):
        local = functools.partial(attention_fn, **static)
        return jax.shard_map(local, mesh=mesh, in_specs=(heads, kv_heads, kv_heads, whole, whole, whole, whole),
                             out_specs=heads, check_vma=False)(
            q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)

    sharded.__wrapped__ = attention_fn
    return sharded


__all__ = ["ATTENTION_IMPLS", "get_attention_fn", "shard_over_kv_heads", "reference", "reference_attention", "write_kv"]
