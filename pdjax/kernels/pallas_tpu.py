"""Ragged paged attention for TPUs in Pallas (Mosaic), with the page table and the work list in SMEM via
scalar prefetch; on CPU it runs under TPU interpret mode (`interpret=True` passes
`pltpu.InterpretParams()`), which is ~100x slower than the GPU-style interpreter, so tests keep it tiny.

Design: grid (work item, kv head, page step). Work items and query blocks are the same as the GPU kernel's
(ragged_blocks). The K/V BlockSpecs' index maps read the prefetched page table, so the Pallas pipeline
DMAs page `table[seq, first_page + j]` of this head into VMEM while step j-1 computes (double-buffered by
the pipeline). Steps past a work item's last page clamp to that page: the block index does not change, the
pipeline issues no new copy, and `pl.when` skips the compute. The output block and the fp32 m/l/acc
scratch stay resident across the page axis ("arbitrary"), and the result is written on the last step.

Known limit: one page per grid step keeps the matmuls small (page_size keys); a production TPU kernel
fetches several pages per step with manual async copies. Kept simple here because it cannot be profiled on
a TPU in this project yet.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pdjax.kernels import ragged_blocks as rb

LANES = 128  # m and l scratch are lane-replicated [R, 128] so Mosaic keeps them in native vreg layout


def _tpu_kernel(seq_ref, first_pos_ref, key_start_ref, key_end_ref, table_ref,  # SMEM (prefetched)
                q_ref, k_ref, v_ref,  # q block [R, D]; one page [ps, D] of K and V
                o_ref,  # [R, D]
                m_scr, l_scr, acc_scr, *,
                group_pad: int, sm_scale: float, soft_cap: Optional[float], sliding_window: Optional[int]):
    del seq_ref, table_ref  # used by the index maps only
    w = pl.program_id(0)
    j = pl.program_id(2)
    rows, head_dim = q_ref.shape
    page_size = k_ref.shape[0]
    key_start = key_start_ref[w]
    key_end = key_end_ref[w]
    first_page = key_start // page_size
    num_pages = jnp.where(key_end > 0, (key_end + page_size - 1) // page_size - first_page, 0)

    @pl.when(j == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, rb.NEG_INF, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when(j < num_pages)
    def _step():
        q = q_ref[...]
        k = k_ref[...]
        v = v_ref[...]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        row_pos = first_pos_ref[w] + jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 0) // group_pad
        key_pos = (first_page + j) * page_size + jax.lax.broadcasted_iota(jnp.int32, (rows, page_size), 1)
        mask = (key_pos <= row_pos) & (key_pos < key_end)
        if sliding_window is not None:
            mask &= key_pos > row_pos - sliding_window
        s = jnp.where(mask, s, rb.NEG_INF)
        # Slots past key_end may hold anything (NaN from an aborted request): p is 0 there, but 0 * NaN = NaN.
        key_col = (first_page + j) * page_size + jax.lax.broadcasted_iota(jnp.int32, (page_size, 1), 0)
        v = jnp.where(key_col < key_end, v, 0)
        m_prev = m_scr[...][:, :1]
        m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_new = l_scr[...][:, :1] * alpha + p.sum(axis=1, keepdims=True)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
        acc_scr[...] = acc_scr[...] * alpha + pv
        m_scr[...] = jnp.broadcast_to(m_new, m_scr.shape)
        l_scr[...] = jnp.broadcast_to(l_new, l_scr.shape)

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish():
        l = jnp.maximum(l_scr[...][:, :1], 1e-30)
        o_ref[...] = (acc_scr[...] / l).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "block_q",
                                             "interpret"))
def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale: Optional[float] = None, sliding_window: Optional[int] = None,
                           soft_cap: Optional[float] = None, block_q: int = 16, interpret: bool = False):
    """Seam signature (plus block_q: query tokens per work item, rows rounded to >= 16; interpret: run in
    TPU interpret mode on CPU). Returns [T, num_q_heads, head_dim] in q.dtype, zeros for padding tokens."""
    rb.check_inputs(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    group_pad = rb.next_power_of_2(num_q_heads // num_kv_heads)
    block_q = rb.next_power_of_2(max(block_q, -(-16 // group_pad)))
    pages_per_seq = page_indices.shape[1]
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)

    work = rb.build_work_list(kv_lens, cu_q_lens, num_seqs, num_tokens, block_q, sliding_window)
    table = rb.sanitize_page_table(page_indices, kv_lens, page_size, num_pages, 1).reshape(-1)
    q_blocks = rb.gather_query_blocks(q, work, num_kv_heads, block_q, group_pad)
    num_work, _, rows, _ = q_blocks.shape

    def page_map(w, h, j, seq_ref, first_pos_ref, key_start_ref, key_end_ref, table_ref):
        del first_pos_ref
        first_page = key_start_ref[w] // page_size
        last_page = jnp.maximum((key_end_ref[w] + page_size - 1) // page_size - 1, first_page)
        slot = jnp.minimum(first_page + j, last_page)
        slot = jnp.minimum(slot, pages_per_seq - 1)
        return h, table_ref[seq_ref[w] * pages_per_seq + slot], 0, 0

    block_map = lambda w, h, j, *_: (w, h, 0, 0)  # noqa: E731
    kernel = functools.partial(_tpu_kernel, group_pad=group_pad, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(num_work, num_kv_heads, pages_per_seq),
        in_specs=[pl.BlockSpec((None, None, rows, head_dim), block_map),
                  pl.BlockSpec((None, None, page_size, head_dim), page_map),
                  pl.BlockSpec((None, None, page_size, head_dim), page_map)],
        out_specs=pl.BlockSpec((None, None, rows, head_dim), block_map),
        scratch_shapes=[pltpu.VMEM((rows, LANES), jnp.float32), pltpu.VMEM((rows, LANES), jnp.float32),
                        pltpu.VMEM((rows, head_dim), jnp.float32)],
    )
    out_blocks = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_blocks.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="pdjax_ragged_paged_attention_tpu",
        cost_estimate=pl.CostEstimate(**rb.bucket_cost(q, k_pages, page_indices)),
    )(work.seq, work.first_pos, work.key_start, work.key_end, table, q_blocks, k_pages, v_pages)
    return rb.tokens_from_blocks(out_blocks, work, kv_lens, cu_q_lens, num_seqs, num_tokens, num_q_heads,
                                 block_q, group_pad, q.dtype)
