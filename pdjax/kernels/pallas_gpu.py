"""Ragged paged attention for GPUs in Pallas (Triton lowering); on CPU the same kernel runs with
`interpret=True` for tests.

Design (see ragged_blocks for the work list and the block layout):
- Grid (work item, kv head, split). A program loads its query block [R = block_q · group_pad, D] (all
  query heads of one KV head for block_q tokens, so GQA never repeats K/V), then loops over its key range in
  blocks of `pages_per_block` pages: the page ids come from the page table row (`pt_ref[seq, ds]`), K and V
  are gathered page-wise from the head's pages (`k_ref[page_ids]`), and an online softmax (fp32 m, l, acc)
  accumulates. The causal / sliding-window / length mask comes from absolute positions.
- Split-K (flash-decoding): with num_splits > 1 each program reduces only its share of the work item's
  key blocks and writes unnormalized partials (acc, m, l); `ragged_blocks.combine_splits` merges them in
  jnp. Work is split per item by its own length, so short and long contexts in one batch stay balanced.
- Logits, m and l are in base-2 units (scores · log2 e) so the softmax uses exp2; the combine knows it.
- All tile extents are powers of two (Triton requires it): R ≥ 16 rows and block_k = pages_per_block ·
  page_size ≥ 16 keys (dot operands need ≥ 16), head_dim a power of two.

Selection (`ragged_paged_attention`), static on shapes so it costs nothing under jit: T <= S means the
bucket has no more tokens than sequence slots, which is how the runner pads decode-only steps (T == S), so
the decode configuration runs: 16-row query blocks (the fewest tokens of one sequence that fill a Triton
dot: 16 / group tokens, so a decode is one work item), 128-key steps, split-K with enough splits to fill
~2 waves of a 132-SM GPU. Otherwise `mixed_attention`: sequences whose q_len fits one decode block go through the decode
configuration and the rest through the prefill configuration (no split, 64-row query blocks, 64-key
steps), two launches over a partition of the sequences. All configurations are exact for every batch (a
prefill that lands in a T <= S bucket is just slower); the rule only picks speed. `decode_attention`,
`prefill_attention` and `mixed_attention` expose each one with the seam's signature.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pdjax.kernels import ragged_blocks as rb

TARGET_PROGRAMS = 264  # ~2 waves of programs on a 132-SM H100/H200; sets the decode split count
MAX_SPLITS = 16
MIN_DOT = 16  # Triton dot operands need >= 16 on the M and K/N extents
LOG2E = math.log2(math.e)  # logits are kept in base-2 units (exp2 is the native instruction)


def _attention_kernel(seq_ref, first_pos_ref, key_start_ref, key_end_ref, pt_ref,  # scalars / table
                      q_ref, k_ref, v_ref,  # q block [R, D]; k/v: this head's pages [N, ps, D]
                      o_ref, *ml_refs,  # out block [R, D] (+ m, l [R] when split)
                      group_pad: int, pages_per_block: int, num_splits: int, sm_scale: float,
                      soft_cap: Optional[float], sliding_window: Optional[int]):
    w = pl.program_id(0)
    split = pl.program_id(2)
    rows, head_dim = q_ref.shape
    page_size = k_ref.shape[1]
    block_k = pages_per_block * page_size
    seq = seq_ref[w]
    key_start = key_start_ref[w]
    key_end = key_end_ref[w]

    first_blk = key_start // block_k
    end_blk = (key_end + block_k - 1) // block_k
    per_split = (jnp.maximum(end_blk - first_blk, 0) + num_splits - 1) // num_splits
    lo = first_blk + split * per_split
    hi = jnp.minimum(lo + per_split, end_blk)

    q = q_ref[...]
    row_pos = first_pos_ref[w] + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group_pad

    def body(b, carry):
        acc, m, l = carry
        page_ids = pt_ref[seq, pl.ds(b * pages_per_block, pages_per_block)]
        k = k_ref[page_ids].reshape(block_k, head_dim)
        v = v_ref[page_ids].reshape(block_k, head_dim)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if soft_cap is None:
            s = s * (sm_scale * LOG2E)
        else:
            s = (soft_cap * LOG2E) * jnp.tanh(s * (sm_scale / soft_cap))
        key_pos = b * block_k + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        mask = (key_pos <= row_pos) & (key_pos < key_end)
        if sliding_window is not None:
            mask &= key_pos > row_pos - sliding_window
        s = jnp.where(mask, s, rb.NEG_INF)
        # Slots past key_end may hold anything (NaN from an aborted request): p is 0 there, but 0 * NaN = NaN.
        key_col = b * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        v = jnp.where(key_col < key_end, v, 0)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.where(mask, jnp.exp2(s - m_new[:, None]), 0.0)
        alpha = jnp.exp2(m - m_new)
        l = l * alpha + p.sum(axis=1)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + pv, m_new, l

    init = (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), rb.NEG_INF, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(lo, hi, body, init)
    if num_splits == 1:
        o_ref[...] = (acc / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)
    else:
        m_ref, l_ref = ml_refs
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


def decode_block_q(group_pad: int) -> int:
    """Query tokens per decode work item: the fewest that give a 16-row (Triton dot minimum) block."""
    return rb.next_power_of_2(-(-MIN_DOT // group_pad))


def decode_num_splits(num_slots: int, num_kv_heads: int, max_key_blocks: int) -> int:
    """Static split count: enough programs for ~TARGET_PROGRAMS, a power of two, <= key blocks."""
    want = -(-TARGET_PROGRAMS // max(1, num_slots * num_kv_heads))
    return max(1, min(rb.next_power_of_2(want), MAX_SPLITS, rb.next_power_of_2(max_key_blocks)))


def _launch(q, k_pages, v_pages, page_indices, work, table, q_blocks, *, group_pad, pages_per_block, num_splits,
            sm_scale, soft_cap, sliding_window, interpret, num_warps, num_stages, declare_cost):
    """The pallas_call of `paged_attention_blocks`: grid (work item, kv head, split); outputs [num_splits, W, Hkv,
    R, D] (q.dtype without a split; float32 partials plus m and l [num_splits, W, Hkv, R] with one)."""
    _, num_pages, page_size, head_dim = k_pages.shape
    num_work, num_kv_heads, rows, _ = q_blocks.shape
    kernel = functools.partial(_attention_kernel, group_pad=group_pad, pages_per_block=pages_per_block,
                               num_splits=num_splits, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window)
    whole = lambda shape: pl.BlockSpec(shape, lambda w, h, k: (0,) * len(shape))  # noqa: E731
    head_pages = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda w, h, k: (h, 0, 0, 0))
    out_block = pl.BlockSpec((None, None, None, rows, head_dim), lambda w, h, k: (k, w, h, 0, 0))
    out_shape = [jax.ShapeDtypeStruct((num_splits, num_work, num_kv_heads, rows, head_dim),
                                      q.dtype if num_splits == 1 else jnp.float32)]
    out_specs = [out_block]
    if num_splits > 1:
        vec = jax.ShapeDtypeStruct((num_splits, num_work, num_kv_heads, rows), jnp.float32)
        out_shape += [vec, vec]
        out_specs += [pl.BlockSpec((None, None, None, rows), lambda w, h, k: (k, w, h, 0))] * 2
    return pl.pallas_call(
        kernel,
        grid=(num_work, num_kv_heads, num_splits),
        in_specs=[whole((num_work,))] * 4 + [whole(table.shape),
                  pl.BlockSpec((None, None, rows, head_dim), lambda w, h, k: (w, h, 0, 0)),
                  head_pages, head_pages],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"pdjax_ragged_paged_attention_splits{num_splits}",
        cost_estimate=pl.CostEstimate(**rb.bucket_cost(q, k_pages, page_indices)) if declare_cost else None,
    )(work.seq, work.first_pos, work.key_start, work.key_end, table, q_blocks, k_pages, v_pages)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_q",
                                             "keys_per_block", "num_splits", "interpret", "num_warps",
                                             "num_stages", "q_len_range", "declare_cost"))
def paged_attention_blocks(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale: Optional[float] = None, sliding_window: Optional[int] = None,
                           soft_cap: Optional[float] = None, block_q: int = 16, keys_per_block: int = 64,
                           num_splits: Optional[int] = 1, interpret: bool = False, num_warps: int = 4,
                           num_stages: int = 2, q_len_range: Optional[Tuple[int, int]] = None,
                           declare_cost: bool = True):
    """The seam with explicit tiling. block_q: query tokens per work item (rounded up so a block has
    >= 16 rows); keys_per_block: keys per inner step (>= 16, whole pages); num_splits: split-K factor
    (None = decode heuristic); q_len_range: None = every sequence, (lo, hi) = only sequences with
    lo <= q_len <= hi (rb.build_work_list); declare_cost: give XLA the bucket's cost (rb.bucket_cost; off for
    all but one of the calls that split a bucket, so the step counts it once). Returns [T, num_q_heads, head_dim] in
    q.dtype, zeros for padding tokens and for tokens of sequences left out."""
    rb.check_inputs(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    group_pad = rb.next_power_of_2(num_q_heads // num_kv_heads)
    block_q = rb.next_power_of_2(max(block_q, decode_block_q(group_pad)))
    pages_per_block = rb.next_power_of_2(max(1, keys_per_block // page_size, -(-MIN_DOT // page_size)))
    pages_per_block = min(pages_per_block, rb.next_power_of_2(page_indices.shape[1]))
    if pages_per_block * page_size < MIN_DOT:  # tiny page tables: pad the table instead of shrinking tiles
        pages_per_block = -(-MIN_DOT // page_size)
    max_key_blocks = -(-page_indices.shape[1] // pages_per_block)
    if num_splits is None:
        num_splits = decode_num_splits(kv_lens.shape[0], num_kv_heads, max_key_blocks)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits}, expected >= 1")
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)

    work = rb.build_work_list(kv_lens, cu_q_lens, num_seqs, num_tokens, block_q, sliding_window, q_len_range)
    table = rb.sanitize_page_table(page_indices, kv_lens, page_size, num_pages, pages_per_block)
    q_blocks = rb.gather_query_blocks(q, work, num_kv_heads, block_q, group_pad)
    num_work, _, rows, _ = q_blocks.shape

    outs = _launch(q, k_pages, v_pages, page_indices, work, table, q_blocks, group_pad=group_pad,
                   pages_per_block=pages_per_block, num_splits=num_splits, sm_scale=sm_scale, soft_cap=soft_cap,
                   sliding_window=sliding_window, interpret=interpret, num_warps=num_warps, num_stages=num_stages,
                   declare_cost=declare_cost)
    if num_splits == 1:
        out_blocks = outs[0][0]
    else:
        out_blocks = rb.combine_splits(*outs, base2=True)
    return rb.tokens_from_blocks(out_blocks, work, kv_lens, cu_q_lens, num_seqs, num_tokens, num_q_heads,
                                 block_q, group_pad, q.dtype)


def prefill_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale=None,
                      sliding_window=None, soft_cap=None, interpret: bool = False):
    """Seam signature; tiles for prefill chunks: 64-row query blocks, 64-key steps, no split."""
    group_pad = rb.next_power_of_2(q.shape[1] // k_pages.shape[0])
    return paged_attention_blocks(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                  sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                  block_q=max(1, 64 // group_pad), keys_per_block=64, num_splits=1,
                                  interpret=interpret)


def decode_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale=None,
                     sliding_window=None, soft_cap=None, interpret: bool = False,
                     num_splits: Optional[int] = None):
    """Seam signature; flash-decoding tiles: 16-row query blocks, 128-key steps, split-K over the context
    (num_splits None = heuristic from S and heads). Exact for any batch, fast when q_lens are 1."""
    return paged_attention_blocks(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                  sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                                  block_q=1, keys_per_block=128, num_splits=num_splits,
                                  interpret=interpret)


def mixed_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale=None,
                    sliding_window=None, soft_cap=None, interpret: bool = False):
    """Seam signature; two launches that partition the sequences: short ones (decodes, q_len <= one
    decode block) through the split-K decode tiles, longer chunks through the prefill tiles. A mixed
    chunked-prefill step thus keeps flash-decoding for its decodes."""
    group_pad = rb.next_power_of_2(q.shape[1] // k_pages.shape[0])
    short_max = decode_block_q(group_pad)
    common = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret)
    short = paged_attention_blocks(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                   block_q=short_max, keys_per_block=128, num_splits=None,
                                   q_len_range=(1, short_max), declare_cost=False, **common)
    long = paged_attention_blocks(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                  block_q=max(1, 64 // group_pad), keys_per_block=64, num_splits=1,
                                  q_len_range=(short_max + 1, q.shape[0]), **common)
    return short + long  # each is zero on the other's tokens


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale=None, sliding_window=None, soft_cap=None, interpret: bool = False):
    """Seam signature. Static rule: T <= S (a decode bucket) -> decode_attention, else mixed_attention."""
    pick = decode_attention if q.shape[0] <= kv_lens.shape[0] else mixed_attention
    return pick(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
                sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret)
