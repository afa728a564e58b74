"""Plain-jnp ragged paged attention and KV-cache writes: the oracle for the Pallas kernels and the CPU path.

KV cache layout (one pair of arrays per layer):
    k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim]
A token at slot `s` lives at page `s // page_size`, offset `s % page_size`. The head axis leads so tensor
parallelism shards it, and one (page, head) block of [page_size, head_dim] is contiguous for kernels.
This is also the layout of jax's bundled GPU `paged_attention`, so the two compare on the same arrays.

Ragged batch (DESIGN.md §3): the query tokens of all sequences are concatenated on one axis.
    q:            [T, num_q_heads, head_dim]   (T padded to a bucket; tokens past cu_q_lens[num_seqs] are padding)
    kv_lens:      int32[S]      context length of each sequence INCLUDING this step's tokens (0 for padding)
    page_indices: int32[S, P]   page table of each sequence (entries past its last page are ignored)
    cu_q_lens:    int32[S + 1]  query offsets: sequence i owns tokens [cu_q_lens[i], cu_q_lens[i+1])
    num_seqs:     int32[1] or int32[]  number of real sequences (<= S)
Query token j of sequence i sits at absolute position kv_lens[i] - q_len_i + j and sees every key at a
position <= its own (causal within the chunk, all earlier context visible). K/V of this step's tokens must be
written (`write_kv`) before attention runs.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

_NEG_INF = -1e30


def token_metadata(kv_lens, cu_q_lens, num_seqs, num_tokens: int):
    """Per query token: (sequence id int32[T], absolute position int32[T], is-real bool[T])."""
    num_seqs = jnp.reshape(num_seqs, ())
    s = kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, s - 1)
    valid = t < cu_q_lens[num_seqs]
    q_start = cu_q_lens[seq]
    q_len = cu_q_lens[seq + 1] - q_start
    pos = kv_lens[seq] - q_len + (t - q_start)
    return seq, pos, valid


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale: Optional[float] = None, sliding_window: Optional[int] = None,
                           soft_cap: Optional[float] = None, keys_per_block: int = 128):
    """Attention of a ragged batch over its paged KV cache, as an online softmax over key blocks.

    Shapes as in the module docstring; returns [T, num_q_heads, head_dim] in q's dtype, zeros for padding
    tokens. Accumulates in float32. Scans over blocks of `keys_per_block` keys of every sequence's page table,
    so memory is O(T · keys_per_block) rather than O(T · context).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    pages_per_seq = page_indices.shape[1]
    pages_per_block = max(1, min(pages_per_seq, keys_per_block // page_size))
    num_blocks = -(-pages_per_seq // pages_per_block)
    pad = num_blocks * pages_per_block - pages_per_seq
    page_indices = jnp.pad(page_indices, ((0, 0), (0, pad)))

    seq, pos, valid = token_metadata(kv_lens, cu_q_lens, num_seqs, num_tokens)
    ctx = jnp.where(valid, kv_lens[seq], 0)
    qg = (q.astype(jnp.float32) * sm_scale).reshape(num_tokens, num_kv_heads, group, head_dim)
    block_keys = pages_per_block * page_size

    def body(carry, b):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(page_indices, b * pages_per_block, pages_per_block, axis=1)[seq]
        k = k_pages[:, pages].reshape(num_kv_heads, num_tokens, block_keys, head_dim).astype(jnp.float32)
        v = v_pages[:, pages].reshape(num_kv_heads, num_tokens, block_keys, head_dim).astype(jnp.float32)
        key_pos = b * block_keys + jnp.arange(block_keys, dtype=jnp.int32)
        mask = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] < ctx[:, None])
        if sliding_window is not None:
            mask &= key_pos[None, :] > pos[:, None] - sliding_window
        # Keys past a token's context may hold anything (NaN in unwritten slots): p is 0 there, 0 * NaN is not.
        v = jnp.where(mask[None, :, :, None], v, 0)
        s = jnp.einsum("tkgd,ktsd->tkgs", qg, k)
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask[:, None, None, :], s, _NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(mask[:, None, None, :], jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("tkgs,ktsd->tkgd", p, v)
        return (m_new, l, acc), None

    init = (jnp.full((num_tokens, num_kv_heads, group), _NEG_INF, jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group), jnp.float32),
            jnp.zeros((num_tokens, num_kv_heads, group, head_dim), jnp.float32))
    (_, l, acc), _ = jax.lax.scan(body, init, jnp.arange(num_blocks, dtype=jnp.int32))
    out = acc / jnp.maximum(l, 1e-30)[..., None]
    out = jnp.where(valid[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def write_kv(k_pages, v_pages, k, v, slot_mapping):
    """Scatter this step's K/V into their slots.

    k_pages, v_pages: [num_kv_heads, num_pages, page_size, head_dim]; k, v: [T, num_kv_heads, head_dim];
    slot_mapping: int32[T], slot = page * page_size + offset, negative for padding tokens (written nowhere).
    Returns the updated (k_pages, v_pages); under a donating jit the update is in place.
    """
    _, num_pages, page_size, _ = k_pages.shape
    page = jnp.where(slot_mapping < 0, num_pages, slot_mapping // page_size)  # out of range -> dropped
    offset = slot_mapping % page_size

    def scatter(pages, new):
        # Indexed on (page, offset) of the 4-D cache, not on a [heads, pages * page_size, D] view: on a TPU that
        # reshape of a tiled layout is a copy of the whole layer (HBM traffic and a temporary that grows with the
        # cache).
        return pages.at[:, page, offset].set(jnp.swapaxes(new, 0, 1).astype(pages.dtype), mode="drop")

    return scatter(k_pages, k), scatter(v_pages, v)
