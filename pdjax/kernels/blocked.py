"""Blocked ragged paged attention in plain XLA (jnp/lax, no Pallas): the CPU path.

Same seam as `reference.ragged_paged_attention` (cache layout, ragged batch, masking: see reference's module
docstring). The reference gathers every query token's own copy of its key blocks; here a sequence's K/V blocks
are loaded once for a whole block of its queries, as the Pallas kernels do. Everything is an online softmax
(fp32 m, l, acc) over key blocks of whole pages, inside `lax.fori_loop`s that are traced once, so compile time
does not grow with the number of items or blocks. Three passes, chosen statically from the bucket:

- vector pass (`_vector_pass`): one query token per item, all items at once. A fori_loop over key blocks;
  at step j item w reads its block key_start_w // block_k + j (one gather of [W, block_k] keys per KV head and
  two batched mat-vecs, all GQA query heads of a KV head as one [group, D] row block). The trip count is the
  most blocks any item needs (dynamic), so short contexts in a long page-table bucket cost only their blocks.
- chunk pass (`_chunk_pass`): the sequences with q_len >= 2, cut into work items of `block_q` query tokens
  (`ragged_blocks.build_work_list`; rows = block_q * group, row r = token r // group, head r % group). A
  fori_loop over groups of items (as many as keep one step's f32 scores within `group_bytes`, no more than the
  bucket's tokens can fill; items sorted by the key blocks they need, so a group's items need about as many)
  and, inside, over key blocks of whole pages: every item of the group reads its own blocks from
  key_start // block_k on, masked past its key_end, so a causal prefill never touches blocks above the diagonal
  except where a group's items need different numbers of blocks. A step is two batched matmuls
  [Hkv, I, R, D] x [Hkv, I, block_k, D], head-major so no block is transposed; results are scattered straight to
  the token axis. Batching items cut the per-step overhead that dominated one item at a time (a 2048-token
  prefill of 16 x 128-token prompts: attention 28 -> 17 ms per step on the 2-core CPU).
- dense pass (`_dense_pass`): the vector pass without the loop, for items whose whole page-table rows, gathered
  at once, stay small (`DENSE_BYTES` of f32 K; a static choice from the shapes): one gather of [W, P * page_size]
  keys, one masked softmax, two batched mat-vecs. On CPU the loop's per-step gathers and online-softmax
  rescaling cost more than the masked keys past a short context (decode batch 32 x 12 pages: ~0.3 vs ~0.9 ms).

Buckets with T <= S (the runner's decode buckets): the vector (or dense) pass over all T tokens (each token its
own item; exact for any batch, and a decode step needs nothing else). T > S: the vector (or dense) pass over the
S sequence slots for the decodes (q_len == 1; skipped by a `lax.cond` when the bucket holds none), scattered
back to their tokens, then the chunk pass for everything longer. Every pass zeroes V outside its keys' range
before p @ V: slots not yet written (or left by an aborted request) may hold NaN, and their weight 0 times NaN
is NaN.
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
CHUNK_GROUP_BYTES = 2 << 20  # f32 scores of the chunk items processed together per key step
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
    once ([W, width * page_size, D] of K and of V per KV head), one masked softmax and two batched mat-vecs. On
    CPU this beats the loop while the gathered block is small (`dense_bytes`); same result as `_vector_pass`.
    Each KV head is its own chain of ops: XLA's CPU runtime runs independent ops on different cores, and a
    decode step's small ops one at a time otherwise (batch 32 x 12 pages, 2 KV heads: ~10% off the whole step)."""
    num_items, num_kv_heads, group, head_dim = q.shape
    keys = width * k_pages.shape[2]
    rows = table[seq, :width]  # [W, width]
    key_pos = jnp.arange(keys, dtype=jnp.int32)[None, :]
    valid = ((key_pos < key_end[:, None]) & (key_pos >= key_start[:, None]))[:, None, :]  # [W, 1, keys]

    def head(h):
        k = k_pages[h, rows].reshape(num_items, keys, head_dim).astype(jnp.float32)
        v = v_pages[h, rows].reshape(num_items, keys, head_dim).astype(jnp.float32)
        s = _scores(jnp.einsum("wgd,wkd->wgk", q[:, h], k, preferred_element_type=jnp.float32), soft_cap)
        s = jnp.where(valid, s, NEG_INF)
        p = jnp.where(valid, jnp.exp(s - s.max(axis=-1, keepdims=True)), 0.0)
        v = jnp.where(jnp.swapaxes(valid, 1, 2), v, 0)  # unwritten slots may hold NaN: 0 * NaN = NaN
        out = jnp.einsum("wgk,wkd->wgd", p, v, preferred_element_type=jnp.float32)
        return out / jnp.maximum(p.sum(axis=-1), 1e-30)[..., None]

    return jnp.stack([head(h) for h in range(num_kv_heads)], axis=1)  # [W, Hkv, G, D]


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


def chunk_items_per_group(num_kv_heads: int, rows: int, block_k: int, group_bytes: int = CHUNK_GROUP_BYTES) -> int:
    """Chunk work items processed together per step of the chunk pass: as many as keep one step's f32
    scores [items, Hkv, rows, block_k] within `group_bytes`."""
    return max(1, group_bytes // (num_kv_heads * rows * block_k * 4))


GROUPED_WASTE = 1.25  # most key blocks computed per block needed for which the chunk pass groups items


def _chunk_pass(qs, k_pages, v_pages, table, kv_lens, cu_q_lens, num_seqs, *, block_q, ppb, sliding_window,
                soft_cap, group_bytes):
    """Sequences with q_len >= 2, cut into work items of `block_q` tokens (`ragged_blocks.build_work_list`),
    processed `chunk_items_per_group` items at a time: a fori_loop over the groups of real items and, inside,
    over the key blocks the group's items need (the most any of them needs; each item reads its own blocks from
    key_start // block_k on, masked past its key_end). Items are sorted by the blocks they need, most first; when
    grouping would still compute more than GROUPED_WASTE times the blocks needed (one long prompt: its query
    blocks need 1, 2, 3, ... key blocks), a `lax.cond` takes groups of one item instead. Works head-major
    ([Hkv, tokens, G, D]) so no block needs a transpose. Returns f32 [T, Hkv * G, D], zeros for the tokens of
    other sequences (decodes, padding)."""
    num_tokens, num_kv_heads, group, head_dim = qs.shape
    block_k = ppb * k_pages.shape[2]
    rows = block_q * group
    work = rb.build_work_list(kv_lens, cu_q_lens, num_seqs, num_tokens, block_q, sliding_window,
                              q_len_range=(2, num_tokens))
    num_items = work.seq.shape[0]
    # Groups no larger than the bucket's tokens can fill (a short bucket's one chunk is not padded 8-fold).
    per_group = min(num_items, max(1, num_tokens // block_q), chunk_items_per_group(num_kv_heads, rows, block_k,
                                                                                   group_bytes))
    need = jnp.where(work.num_q > 0, (work.key_end + block_k - 1) // block_k - work.key_start // block_k, 0)
    order = jnp.argsort(-need, stable=True)  # padding items need none: last
    items = tuple(a[order] for a in (work.seq, work.q_start, work.num_q, work.first_pos, work.key_start,
                                     work.key_end))
    num_real = jnp.sum(work.num_q > 0)
    qs_h = jnp.swapaxes(qs, 0, 1)  # [Hkv, T, G, D]

    def run(size):
        return _chunk_groups(qs_h, k_pages, v_pages, table, items, num_real, size=size, block_q=block_q, ppb=ppb,
                             sliding_window=sliding_window, soft_cap=soft_cap)

    if per_group == 1:
        out = run(1)
    else:
        sorted_need = need[order]
        computed = per_group * jnp.sum(jnp.where(jnp.arange(num_items) % per_group == 0, sorted_need, 0))
        out = jax.lax.cond(computed <= GROUPED_WASTE * jnp.sum(need), lambda: run(per_group), lambda: run(1))
    return jnp.swapaxes(out, 0, 1).reshape(num_tokens, num_kv_heads * group, head_dim)


def _chunk_groups(qs_h, k_pages, v_pages, table, items, num_real, *, size, block_q, ppb, sliding_window, soft_cap):
    """The chunk pass's loops over groups of `size` items (sorted: a group's first item needs the most blocks);
    qs_h [Hkv, T, G, D]; returns [Hkv, T, G, D] f32 with the items' tokens filled in."""
    num_kv_heads, num_tokens, group, head_dim = qs_h.shape
    block_k = ppb * k_pages.shape[2]
    rows = block_q * group
    width = table.shape[1]
    pad = -items[0].shape[0] % size  # padded items: no tokens, empty key range
    seq, q_start, num_q, first_pos, key_start, key_end = (jnp.pad(a, (0, pad)) for a in items)
    row_offset = jnp.arange(rows, dtype=jnp.int32) // group  # row r = token r // G, head r % G
    tok_offset = jnp.arange(block_q, dtype=jnp.int32)
    key_iota = jnp.arange(block_k, dtype=jnp.int32)

    def group_body(g, out):
        take = lambda a: jax.lax.dynamic_slice_in_dim(a, g * size, size)  # noqa: E731
        items_seq, items_end, items_start = take(seq), take(key_end), take(key_start)
        tok = take(q_start)[:, None] + tok_offset[None, :]  # [I, BQ]
        q = qs_h[:, jnp.clip(tok, 0, num_tokens - 1)].reshape(num_kv_heads, size, rows, head_dim)
        row_pos = take(first_pos)[:, None] + row_offset[None, :]  # [I, R]
        lo = items_start // block_k
        num_blocks = jnp.maximum((items_end + block_k - 1) // block_k - lo, 0)

        def key_body(j, carry):
            b = lo + j
            pages = table[items_seq[:, None], jnp.clip(b[:, None] * ppb + jnp.arange(ppb)[None, :], 0, width - 1)]
            k = k_pages[:, pages].reshape(num_kv_heads, size, block_k, head_dim).astype(jnp.float32)
            v = v_pages[:, pages].reshape(num_kv_heads, size, block_k, head_dim).astype(jnp.float32)
            s = _scores(jnp.einsum("hird,hikd->hirk", q, k, preferred_element_type=jnp.float32), soft_cap)
            key_pos = b[:, None] * block_k + key_iota[None, :]  # [I, K]
            in_range = (key_pos < items_end[:, None]) & (key_pos >= items_start[:, None])
            mask = in_range[:, None, :] & (key_pos[:, None, :] <= row_pos[:, :, None])  # [I, R, K]
            if sliding_window is not None:
                mask &= key_pos[:, None, :] > row_pos[:, :, None] - sliding_window
            v = jnp.where(in_range[None, :, :, None], v, 0)  # unwritten slots may hold NaN: 0 * NaN = NaN
            return _online_update(carry, s, mask[None], v, "hirk,hikd->hird")

        acc, _, l = jax.lax.fori_loop(0, jnp.max(num_blocks), key_body, _init((num_kv_heads, size, rows), head_dim))
        res = (acc / jnp.maximum(l, 1e-30)[..., None]).reshape(num_kv_heads, size * block_q, group, head_dim)
        dest = jnp.where(tok_offset[None, :] < take(num_q)[:, None], tok, num_tokens).reshape(-1)  # past: dropped
        return out.at[:, dest].set(res, mode="drop")

    return jax.lax.fori_loop(0, -(-num_real // size), group_body, jnp.zeros_like(qs_h))


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "chunk_rows",
                                             "chunk_keys", "decode_keys", "dense_bytes",
                                             "group_bytes"))
def _blocked(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale, sliding_window,
             soft_cap, chunk_rows, chunk_keys, decode_keys, dense_bytes, group_bytes):
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

    # Decodes (q_len == 1): one item per sequence slot, scattered back to their tokens; skipped (cond) when the
    # bucket holds none, as in a prefill-only step.
    is_decode = real & (q_len == 1)
    key_end = jnp.where(is_decode, kv_lens, 0)

    def decodes():
        return _items_pass(qs[jnp.clip(q_start, 0, num_tokens - 1)], k_pages, v_pages, table,
                           jnp.arange(num_slots, dtype=jnp.int32), _window_start(key_end, sliding_window), key_end,
                           width=pages_per_seq, ppb=ppb_d, soft_cap=soft_cap, dense_bytes=dense_bytes)

    dec = jax.lax.cond(jnp.any(is_decode), decodes,
                       lambda: jnp.zeros((num_slots, num_kv_heads, group, head_dim), jnp.float32))
    # Chunks (q_len >= 2), then the decodes' rows written over their (zero) tokens.
    out = _chunk_pass(qs, k_pages, v_pages, table, kv_lens, cu_q_lens, num_seqs,
                      block_q=chunk_block_q(num_tokens, group, chunk_rows), ppb=ppb_c, sliding_window=sliding_window,
                      soft_cap=soft_cap, group_bytes=group_bytes)
    out = out.at[jnp.where(is_decode, q_start, jnp.iinfo(jnp.int32).max)].set(
        dec.reshape(num_slots, num_q_heads, head_dim), mode="drop")
    return out.astype(q.dtype)


def _window_start(key_end, sliding_window):
    """First visible key of a query at position key_end - 1."""
    if sliding_window is None:
        return jnp.zeros_like(key_end)
    return jnp.clip(key_end - sliding_window, 0, key_end)


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale: Optional[float] = None, sliding_window: Optional[int] = None,
                           soft_cap: Optional[float] = None, chunk_rows: int = CHUNK_ROWS,
                           chunk_keys: int = CHUNK_KEYS, decode_keys: int = DECODE_KEYS,
                           dense_bytes: int = DENSE_BYTES, group_bytes: int = CHUNK_GROUP_BYTES):
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
                    chunk_keys=int(chunk_keys), decode_keys=int(decode_keys), dense_bytes=int(dense_bytes),
                    group_bytes=int(group_bytes))
