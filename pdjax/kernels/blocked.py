"""Blocked ragged paged attention in plain XLA (jnp/lax, no Pallas): the CPU path.

Same seam as `reference.ragged_paged_attention` (cache layout, ragged batch, masking: see reference's module
docstring). The reference gathers every query token's own copy of its key blocks; here a sequence's K/V blocks
are loaded once for a whole block of its queries, as the Pallas kernels do. Everything is an online softmax
(fp32 m, l, acc) over key blocks of whole pages, inside `lax.fori_loop`s that are traced once, so compile time
does not grow with the number of items or blocks. Two passes, chosen statically from the bucket:

- vector pass (`_vector_pass`): one query token per item, all items at once. A fori_loop over key blocks;
  at step j item w reads its block key_start_w // block_k + j (one gather of [W, block_k] keys per KV head and
  two batched mat-vecs, all GQA query heads of a KV head as one [group, D] row block). The trip count is the
  most blocks any item needs (dynamic), so short contexts in a long page-table bucket cost only their blocks.
- chunk pass (`_chunk_pass`): loops over the sequences with q_len >= 2, over their query blocks of
  `block_q` tokens (rows = block_q * group, row r = token r // group, head r % group) and, innermost, over
  exactly the key blocks [key_start // block_k, ceil(key_end / block_k)) of that query block, so a causal
  prefill never touches blocks above the diagonal. A step is two batched matmuls [Hkv, R, D] x [Hkv, block_k, D];
  results are written straight to the token axis (masked to the block's real tokens).

- dense pass (`_dense_pass`): the vector pass without the loop, for items whose whole page-table rows, gathered
  at once, stay small (`DENSE_BYTES` of f32 K; a static choice from the shapes): one gather of [W, P * page_size]
  keys, one masked softmax, two batched mat-vecs. On CPU the loop's per-step gathers and online-softmax
  rescaling cost more than the masked keys past a short context (decode batch 32 x 12 pages: ~0.3 vs ~0.9 ms).

Buckets with T <= S (the runner's decode buckets): the vector (or dense) pass over all T tokens (each token its
own item; exact for any batch, and a decode step needs nothing else). T > S: the vector (or dense) pass over the
S sequence slots for the decodes (q_len == 1), scattered back to their tokens, then the chunk pass for
everything longer. Every pass zeroes V outside its keys' range before p @ V: slots not yet written (or left by
an aborted request) may hold NaN, and their weight 0 times NaN is NaN.
Tiles are static functions of the shapes (block_q from T and the GQA ratio, block_k from the page-table width);
any GQA ratio, page size and head dim work (no power-of-two requirement on CPU). Inputs of any float dtype are
read as such and upcast per block; the output has q's dtype, zeros for padding tokens.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

from pdjax.kernels import ragged_blocks as rb

NEG_INF = rb.NEG_INF
CHUNK_ROWS = 512  # query rows (tokens x group) per chunk work item: big enough for an efficient matmul
CHUNK_KEYS = 128  # keys per chunk-pass step (256 costs ~1.5x on a 128-token causal chunk: half the block is masked)
DECODE_KEYS = 128  # keys per decode-pass step (a mat-vec: smaller blocks stay in L2)
DENSE_BYTES = 4 << 20  # largest gathered K block (f32) for which single-token items skip the key loop


def _pages_per_block(keys: int, page_size: int, pages_per_seq: int) -> int:
    return max(1, min(keys // page_size, pages_per_seq))


def chunk_block_q(num_tokens: int, group: int, rows: int = CHUNK_ROWS) -> int:
    """Query tokens per chunk work item: ~`rows` rows, but no more than the token bucket."""
    return max(1, min(max(1, rows // group), 1 << max(0, (num_tokens - 1).bit_length())))


def _scores(s, soft_cap):
    return s if soft_cap is None else soft_cap * jnp.tanh(s / soft_cap)


def _online_update(carry, s, mask, v, contract: str):
    """One online-softmax step: carry (acc [..., R, D], m [..., R], l [..., R]); s, mask [..., R, K]."""
    acc, m, l = carry
    s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    l = l * alpha + p.sum(axis=-1)
    acc = acc * alpha[..., None] + jnp.einsum(contract, p, v, preferred_element_type=jnp.float32)
    return acc, m_new, l


def _init(shape_rows, head_dim):
    return (jnp.zeros(shape_rows + (head_dim,), jnp.float32), jnp.full(shape_rows, NEG_INF, jnp.float32),
            jnp.zeros(shape_rows, jnp.float32))


def _vector_pass(q, k_pages, v_pages, table, seq, key_start, key_end, *, ppb, soft_cap):
    """One query row block per item, all items at once: q [W, Hkv, G, D] (f32, pre-scaled) is the single
    query token of item w, in sequence seq[w], seeing keys [key_start[w], key_end[w]) (empty: no query).
    A fori_loop over key blocks; step j reads block key_start // block_k + j of every item. Returns
    [W, Hkv, G, D] f32 (zeros for empty items)."""
    num_items, num_kv_heads, group, head_dim = q.shape
    block_k = ppb * k_pages.shape[2]
    lo = key_start // block_k
    nblk = jnp.maximum((key_end + block_k - 1) // block_k - lo, 0)
    width = table.shape[1]
    seq = seq[:, None]

    def body(j, carry):
        b = lo + j
        pages = table[seq, jnp.clip(b[:, None] * ppb + jnp.arange(ppb)[None, :], 0, width - 1)]  # [W, ppb]
        k = k_pages[:, pages].reshape(num_kv_heads, num_items, block_k, head_dim).astype(jnp.float32)
        v = v_pages[:, pages].reshape(num_kv_heads, num_items, block_k, head_dim).astype(jnp.float32)
        s = _scores(jnp.einsum("whgd,hwkd->whgk", q, k, preferred_element_type=jnp.float32), soft_cap)
        key_pos = b[:, None] * block_k + jnp.arange(block_k, dtype=jnp.int32)[None, :]  # [W, K]
        mask = (key_pos < key_end[:, None]) & (key_pos >= key_start[:, None])
        v = jnp.where(mask[None, :, :, None], v, 0)  # unwritten slots may hold NaN: 0 * NaN = NaN
        return _online_update(carry, s, mask[:, None, None, :], v, "whgk,hwkd->whgd")

    acc, _, l = jax.lax.fori_loop(0, jnp.max(nblk), body, _init((num_items, num_kv_heads, group), head_dim))
    return acc / jnp.maximum(l, 1e-30)[..., None]


def _dense_pass(q, k_pages, v_pages, table, seq, key_start, key_end, *, width, soft_cap):
    """`_vector_pass` without the key loop: the first `width` pages of every item's page-table row gathered at
    once ([Hkv, W, width * page_size, D] of K and of V), one masked softmax and two batched mat-vecs. On CPU
    this beats the loop while the gathered block is small (`dense_bytes`); same result as `_vector_pass`."""
    num_items, num_kv_heads, group, head_dim = q.shape
    keys = width * k_pages.shape[2]
    rows = table[seq, :width]  # [W, width]
    k = k_pages[:, rows].reshape(num_kv_heads, num_items, keys, head_dim).astype(jnp.float32)
    v = v_pages[:, rows].reshape(num_kv_heads, num_items, keys, head_dim).astype(jnp.float32)
    key_pos = jnp.arange(keys, dtype=jnp.int32)[None, :]
    valid = (key_pos < key_end[:, None]) & (key_pos >= key_start[:, None])  # [W, keys]
    s = _scores(jnp.einsum("hwgd,hwkd->hwgk", jnp.swapaxes(q, 0, 1), k, preferred_element_type=jnp.float32),
                soft_cap)
    s = jnp.where(valid[None, :, None, :], s, NEG_INF)
    p = jnp.where(valid[None, :, None, :], jnp.exp(s - s.max(axis=-1, keepdims=True)), 0.0)
    v = jnp.where(valid[None, :, :, None], v, 0)  # unwritten slots may hold NaN: 0 * NaN = NaN
    out = jnp.einsum("hwgk,hwkd->hwgd", p, v, preferred_element_type=jnp.float32)
    out = out / jnp.maximum(p.sum(axis=-1), 1e-30)[..., None]
    return jnp.swapaxes(out, 0, 1)  # [W, Hkv, G, D]


def _items_pass(q, k_pages, v_pages, table, seq, key_start, key_end, *, width, ppb, soft_cap, dense_bytes):
    """One query token per item: `_dense_pass` when its gathered K block ([W, width * page_size] keys of every
    KV head, f32; width = the page-table bucket) fits in `dense_bytes` (static), else the key loop of
    `_vector_pass`."""
    num_items, num_kv_heads, _, head_dim = q.shape
    if dense_fits(num_items, width, k_pages.shape[2], num_kv_heads, head_dim, dense_bytes):
        return _dense_pass(q, k_pages, v_pages, table, seq, key_start, key_end, width=width, soft_cap=soft_cap)
    return _vector_pass(q, k_pages, v_pages, table, seq, key_start, key_end, ppb=ppb, soft_cap=soft_cap)


def dense_fits(num_items: int, width: int, page_size: int, num_kv_heads: int, head_dim: int,
               dense_bytes: Optional[int] = None) -> bool:
    """Whether single-token items take the one-shot gather (`_dense_pass`) rather than the key loop."""
    dense_bytes = DENSE_BYTES if dense_bytes is None else dense_bytes
    return num_items * width * page_size * num_kv_heads * head_dim * 4 <= dense_bytes


def _chunk_pass(qs, out, k_pages, v_pages, table, q_start, q_len, kv_lens, real, num_seqs, *, block_q, ppb,
                sliding_window, soft_cap):
    """Sequences with q_len >= 2: loops over sequences, their query blocks of `block_q` tokens and exactly
    each block's key blocks; results are written into out [T + block_q, Hkv, G, D] (f32, updated)."""
    num_tokens, num_kv_heads, group, head_dim = qs.shape
    block_k = ppb * k_pages.shape[2]
    rows = block_q * group
    qs = jnp.pad(qs, ((0, block_q), (0, 0), (0, 0), (0, 0)))  # a block never reads past the end
    row_offset = jnp.arange(rows, dtype=jnp.int32) // group  # row r = token r // G, head r % G
    key_iota = jnp.arange(block_k, dtype=jnp.int32)
    num_qblocks = jnp.where(real & (q_len >= 2), -(-q_len // block_q), 0)

    def seq_body(i, out):
        row_table = table[i]

        def qblock_body(qb, out):
            start = q_start[i] + qb * block_q
            num_q = jnp.minimum(block_q, q_len[i] - qb * block_q)
            first_pos = kv_lens[i] - q_len[i] + qb * block_q
            key_end = jnp.minimum(kv_lens[i], first_pos + num_q)
            key_start = 0 if sliding_window is None else jnp.clip(first_pos - sliding_window + 1, 0, key_end)
            q = jax.lax.dynamic_slice_in_dim(qs, start, block_q)  # [BQ, Hkv, G, D]
            q = jnp.swapaxes(q, 0, 1).reshape(num_kv_heads, rows, head_dim)
            row_pos = first_pos + row_offset

            def key_body(b, carry):
                pages = jax.lax.dynamic_slice_in_dim(row_table, b * ppb, ppb)
                k = k_pages[:, pages].reshape(num_kv_heads, block_k, head_dim).astype(jnp.float32)
                v = v_pages[:, pages].reshape(num_kv_heads, block_k, head_dim).astype(jnp.float32)
                s = _scores(jnp.einsum("hrd,hkd->hrk", q, k, preferred_element_type=jnp.float32), soft_cap)
                key_pos = b * block_k + key_iota
                mask = (key_pos[None, :] <= row_pos[:, None]) & (key_pos[None, :] < key_end)
                if sliding_window is not None:
                    mask &= key_pos[None, :] > row_pos[:, None] - sliding_window
                v = jnp.where((key_pos < key_end)[None, :, None], v, 0)  # unwritten slots may hold NaN
                return _online_update(carry, s, mask[None], v, "hrk,hkd->hrd")

            acc, _, l = jax.lax.fori_loop(key_start // block_k, (key_end + block_k - 1) // block_k, key_body,
                                          _init((num_kv_heads, rows), head_dim))
            res = (acc / jnp.maximum(l, 1e-30)[..., None]).reshape(num_kv_heads, block_q, group, head_dim)
            res = jnp.swapaxes(res, 0, 1)  # [BQ, Hkv, G, D]
            old = jax.lax.dynamic_slice_in_dim(out, start, block_q)
            keep = (jnp.arange(block_q) < num_q)[:, None, None, None]
            return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, res, old), start, 0)

        return jax.lax.fori_loop(0, num_qblocks[i], qblock_body, out)

    return jax.lax.fori_loop(0, num_seqs, seq_body, out)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "chunk_rows",
                                             "chunk_keys", "decode_keys", "dense_bytes"))
def _blocked(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window,
             soft_cap, chunk_rows, chunk_keys, decode_keys, dense_bytes):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    num_slots, pages_per_seq = page_indices.shape
    group = num_q_heads // num_kv_heads
    kv_lens = kv_lens.astype(jnp.int32)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    num_seqs = jnp.clip(jnp.reshape(num_seqs, ()).astype(jnp.int32), 0, num_slots)
    real = jnp.arange(num_slots) < num_seqs
    q_start = cu_q_lens[:-1]
    q_len = jnp.where(real, cu_q_lens[1:] - q_start, 0)
    qs = (q.astype(jnp.float32) * sm_scale).reshape(num_tokens, num_kv_heads, group, head_dim)

    ppb_d = _pages_per_block(decode_keys, page_size, pages_per_seq)
    ppb_c = _pages_per_block(chunk_keys, page_size, pages_per_seq)
    token_mode = num_tokens <= num_slots
    table = rb.sanitize_page_table(page_indices, kv_lens, page_size, num_pages,
                                   ppb_d if token_mode else math.lcm(ppb_d, ppb_c))
    if token_mode:  # every token its own item: exact for any batch, and a decode bucket needs no more
        t = jnp.arange(num_tokens, dtype=jnp.int32)
        seq = jnp.minimum(jnp.sum(cu_q_lens[None, 1:] <= t[:, None], axis=1, dtype=jnp.int32), num_slots - 1)
        pos = kv_lens[seq] - q_len[seq] + t - q_start[seq]
        key_end = jnp.where(t < cu_q_lens[num_seqs], pos + 1, 0)
        out = _items_pass(qs, k_pages, v_pages, table, seq, _window_start(key_end, sliding_window), key_end,
                          width=pages_per_seq, ppb=ppb_d, soft_cap=soft_cap, dense_bytes=dense_bytes)
        return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)

    # Decodes (q_len == 1): one item per sequence slot, scattered back to their tokens.
    is_decode = real & (q_len == 1)
    key_end = jnp.where(is_decode, kv_lens, 0)
    dec = _items_pass(qs[jnp.clip(q_start, 0, num_tokens - 1)], k_pages, v_pages, table,
                      jnp.arange(num_slots, dtype=jnp.int32), _window_start(key_end, sliding_window), key_end,
                      width=pages_per_seq, ppb=ppb_d, soft_cap=soft_cap, dense_bytes=dense_bytes)
    block_q = chunk_block_q(num_tokens, group, chunk_rows)
    out = jnp.zeros((num_tokens + block_q, num_kv_heads, group, head_dim), jnp.float32)
    out = out.at[jnp.where(is_decode, q_start, jnp.iinfo(jnp.int32).max)].set(dec, mode="drop")
    # Chunks (q_len >= 2).
    out = _chunk_pass(qs, out, k_pages, v_pages, table, q_start, q_len, kv_lens, real, num_seqs,
                      block_q=block_q, ppb=ppb_c, sliding_window=sliding_window, soft_cap=soft_cap)
    return out[:num_tokens].reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def _window_start(key_end, sliding_window):
    """First visible key of a query at position key_end - 1."""
    if sliding_window is None:
        return jnp.zeros_like(key_end)
    return jnp.clip(key_end - sliding_window, 0, key_end)


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale: Optional[float] = None, sliding_window: Optional[int] = None,
                           soft_cap: Optional[float] = None, chunk_rows: int = CHUNK_ROWS,
                           chunk_keys: int = CHUNK_KEYS, decode_keys: int = DECODE_KEYS,
                           dense_bytes: int = DENSE_BYTES):
    """Ragged paged attention with K/V loaded per query block; the seam of `reference.ragged_paged_attention`.

    Returns [T, num_q_heads, head_dim] in q's dtype, zeros for padding tokens. chunk_rows / chunk_keys /
    decode_keys are the tiles (module docstring); every setting is exact.
    """
    rb.check_shapes(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    if q.shape[0] == 0 or kv_lens.shape[0] == 0 or page_indices.shape[1] == 0:
        return jnp.zeros(q.shape, q.dtype)
    sm_scale = 1.0 / math.sqrt(q.shape[2]) if sm_scale is None else float(sm_scale)
    return _blocked(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                    sliding_window=None if sliding_window is None else int(sliding_window),
                    soft_cap=None if soft_cap is None else float(soft_cap), chunk_rows=int(chunk_rows),
                    chunk_keys=int(chunk_keys), decode_keys=int(decode_keys), dense_bytes=int(dense_bytes))
