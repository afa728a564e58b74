"""Device-side jnp plumbing shared by the Pallas kernels: argument checks, the static work list, query
blocks in, outputs back to tokens, and the split-K combine.

Choice: instead of letting a kernel program slice an unaligned, ragged range of query rows out of the
flat token axis (masked loads/stores, racy writes where two sequences share a tile), the wrapper gathers
each work item's query tokens into an aligned block `[W, num_kv_heads, R, head_dim]` and the kernel writes
an aligned output block of the same shape; a jnp gather puts the rows back on the token axis. The extra
traffic is O((T + S · block_q) · heads · head_dim), negligible next to reading the KV cache, and every
kernel (GPU, TPU, split-K) then sees the same simple rectangular blocks.

Work list. Sequence i has q_len_i query tokens, cut into ceil(q_len_i / block_q) work items of up to
`block_q` tokens. The number of items is bounded statically by W = ceil(T / block_q) + S; the list is
built on device from cu_q_lens, padded items have no tokens and an empty key range.

Rows of a query block. Row r of a block holds token r // group_pad and query head r % group_pad of the
KV head, where group_pad is the GQA ratio rounded up to a power of two (extra heads are zeros, dropped on
the way out). R = block_q · group_pad.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite, so exp(NEG_INF - NEG_INF) is 1 rather than NaN; masked entries are zeroed anyway


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_shapes(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
    """Raise ValueError naming the offending argument when shapes or dtypes break the attention seam's contract
    (every implementation: see pdjax.kernels)."""
    if q.ndim != 3:
        raise ValueError(f"q.shape={q.shape}, expected [T, num_q_heads, head_dim]")
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages.shape={k_pages.shape}, expected [num_kv_heads, num_pages, page_size, head_dim]")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages.shape={v_pages.shape} differs from k_pages.shape={k_pages.shape}")
    _, num_q_heads, head_dim = q.shape
    num_kv_heads, _, _, kv_head_dim = k_pages.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"k_pages head_dim={kv_head_dim} differs from q head_dim={head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if kv_lens.ndim != 1:
        raise ValueError(f"kv_lens.shape={kv_lens.shape}, expected [S]")
    num_slots = kv_lens.shape[0]
    if page_indices.ndim != 2 or page_indices.shape[0] != num_slots:
        raise ValueError(f"page_indices.shape={page_indices.shape}, expected [S={num_slots}, pages_per_seq]")
    if cu_q_lens.shape != (num_slots + 1,):
        raise ValueError(f"cu_q_lens.shape={cu_q_lens.shape}, expected [S + 1] = ({num_slots + 1},)")
    if jnp.size(num_seqs) != 1:
        raise ValueError(f"num_seqs has shape {jnp.shape(num_seqs)}, expected int32[1] or int32[]")
    for name, arr in (("kv_lens", kv_lens), ("page_indices", page_indices), ("cu_q_lens", cu_q_lens)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name}.dtype={arr.dtype}, expected int32")


def check_inputs(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
    """check_shapes, plus what the Pallas kernels' tiles need: power-of-two page size and head dim, no empty
    bucket."""
    check_shapes(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
    page_size, head_dim = k_pages.shape[2], k_pages.shape[3]
    if page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size}, expected a power of two (kernel tiles are powers of two)")
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim}, expected a power of two (kernel tiles are powers of two)")
    if q.shape[0] == 0 or kv_lens.shape[0] == 0:
        raise ValueError(f"empty batch shapes T={q.shape[0]}, S={kv_lens.shape[0]}; pad to a bucket of at least 1")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WorkList:
    """Per work item (all int32[W]): sequence, its first query token on the flat axis, tokens in the
    block, absolute position of the block's first token, and the key range [key_start, key_end) it reads."""
    seq: jax.Array
    q_start: jax.Array
    num_q: jax.Array
    first_pos: jax.Array
    key_start: jax.Array
    key_end: jax.Array
    first_block_of_seq: jax.Array  # int32[S]: index of each sequence's first work item
    seq_in_list: jax.Array  # bool[S]: real sequences this list covers (build_work_list's q_len_range)


def _bucket(cu_ends, x):
    """Index i with cu_ends[i-1] <= x < cu_ends[i] (searchsorted side='right') as one fused compare-and-
    count: the default binary search lowers to a while loop, i.e. several kernel launches on a GPU."""
    return jnp.sum(cu_ends[None, :] <= x[:, None], axis=1, dtype=jnp.int32)


def bucket_cost(q, k_pages, page_indices) -> dict:
    """{flops, transcendentals, bytes_accessed} a kernel call declares to XLA (`pl.CostEstimate`): the bucket's
    ceiling, every one of the T query tokens attending its sequence's whole page table (P · page_size keys), and
    each of the S sequences' pages read once per KV head, plus q and the output. The call's real work follows
    kv_lens, which XLA cannot see; the ceiling keeps the step's total (and `optimal_seconds`) an upper bound.
    `pdjax.sim.cost_model.step_counts` counts the same work for the same shapes."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    num_slots, pages_per_seq = page_indices.shape
    keys = pages_per_seq * page_size
    flops = 4 * num_tokens * num_q_heads * head_dim * keys
    kv_read = 2 * num_slots * keys * num_kv_heads * head_dim * k_pages.dtype.itemsize
    return dict(flops=flops, transcendentals=num_tokens * num_q_heads * keys,
                bytes_accessed=kv_read + 2 * q.size * q.dtype.itemsize)


def num_work_items(num_tokens: int, num_slots: int, block_q: int) -> int:
    return -(-num_tokens // block_q) + num_slots


def build_work_list(kv_lens, cu_q_lens, num_seqs, num_tokens: int, block_q: int,
                    sliding_window: Optional[int] = None,
                    q_len_range: Optional[Tuple[int, int]] = None) -> WorkList:
    """Cut every real sequence's query tokens into blocks of `block_q`; see the module docstring.

    q_len_range: None = all sequences; (lo, hi) = only sequences with lo <= q_len <= hi (disjoint ranges
    partition a batch). With hi <= block_q every sequence is one item, so the list has only S items."""
    num_slots = kv_lens.shape[0]
    num_seqs = jnp.reshape(num_seqs, ()).astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    real = jnp.arange(num_slots) < num_seqs
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    if q_len_range is not None:
        real &= (q_lens >= q_len_range[0]) & (q_lens <= q_len_range[1])
    q_lens = jnp.where(real, q_lens, 0)
    blocks = -(-q_lens // block_q)
    cu_blocks = jnp.cumsum(blocks)
    first_block = (cu_blocks - blocks).astype(jnp.int32)
    one_item_each = q_len_range is not None and q_len_range[1] <= block_q
    num_items = num_slots if one_item_each else num_work_items(num_tokens, num_slots, block_q)
    w = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.minimum(_bucket(cu_blocks, w), num_slots - 1)
    valid = w < cu_blocks[-1]
    offset = (w - first_block[seq]) * block_q
    num_q = jnp.where(valid, jnp.clip(q_lens[seq] - offset, 0, block_q), 0)
    first_pos = kv_lens[seq] - q_lens[seq] + offset
    key_end = jnp.where(num_q > 0, jnp.minimum(kv_lens[seq], first_pos + num_q), 0)
    if sliding_window is None:
        key_start = jnp.zeros_like(key_end)
    else:
        key_start = jnp.minimum(jnp.maximum(first_pos - sliding_window + 1, 0), key_end)
    return WorkList(seq=seq, q_start=cu_q_lens[seq] + offset, num_q=num_q.astype(jnp.int32),
                    first_pos=first_pos.astype(jnp.int32), key_start=key_start.astype(jnp.int32),
                    key_end=key_end.astype(jnp.int32), first_block_of_seq=first_block, seq_in_list=real)


def sanitize_page_table(page_indices, kv_lens, page_size: int, num_pages: int, pages_multiple: int):
    """Zero entries past each sequence's last page (the contract lets them hold anything, and a kernel
    must never address memory with them) and pad the page axis to a multiple of `pages_multiple`."""
    pages_per_seq = page_indices.shape[1]
    used = -(-kv_lens.astype(jnp.int32) // page_size)
    keep = jnp.arange(pages_per_seq)[None, :] < used[:, None]
    table = jnp.where(keep, jnp.clip(page_indices.astype(jnp.int32), 0, num_pages - 1), 0)
    pad = -pages_per_seq % pages_multiple
    return jnp.pad(table, ((0, 0), (0, pad)))


def gather_query_blocks(q, work: WorkList, num_kv_heads: int, block_q: int, group_pad: int):
    """q [T, Hq, D] -> query blocks [W, Hkv, block_q * group_pad, D] (rows past a block's tokens hold
    copies of other tokens; their results are never read)."""
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    if group_pad != group:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))
    tok = jnp.clip(work.q_start[:, None] + jnp.arange(block_q)[None, :], 0, num_tokens - 1)
    blocks = qg[tok]  # [W, block_q, Hkv, Gp, D]
    blocks = jnp.transpose(blocks, (0, 2, 1, 3, 4))
    return blocks.reshape(blocks.shape[0], num_kv_heads, block_q * group_pad, head_dim)


def tokens_from_blocks(out_blocks, work: WorkList, kv_lens, cu_q_lens, num_seqs, num_tokens: int,
                       num_q_heads: int, block_q: int, group_pad: int, dtype):
    """Output blocks [W, Hkv, R, D] -> out [T, Hq, D] in `dtype`, zeros for padding tokens and for tokens
    of sequences outside the list."""
    num_work, num_kv_heads, _, head_dim = out_blocks.shape
    group = num_q_heads // num_kv_heads
    num_seqs = jnp.reshape(num_seqs, ()).astype(jnp.int32)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.minimum(_bucket(cu_q_lens[1:], t), kv_lens.shape[0] - 1)
    valid = (t < cu_q_lens[num_seqs]) & work.seq_in_list[seq]
    local = jnp.arange(num_tokens, dtype=jnp.int32) - cu_q_lens[seq]
    item = jnp.clip(work.first_block_of_seq[seq] + local // block_q, 0, num_work - 1)
    blocks = out_blocks.reshape(num_work, num_kv_heads, block_q, group_pad, head_dim)
    out = blocks[item, :, local % block_q]  # [T, Hkv, Gp, D]
    out = out[:, :, :group].reshape(num_tokens, num_q_heads, head_dim)
    return jnp.where(valid[:, None, None], out, 0).astype(dtype)


def combine_splits(acc, m, l, base2: bool = False):
    """Merge split-K partials: acc [NS, ..., D] (unnormalized), m, l [NS, ...] -> normalized [..., D].
    base2: m is a running max of base-2 logits (p = exp2(s - m))."""
    m_max = m.max(axis=0)
    scale = (jnp.exp2 if base2 else jnp.exp)(m - m_max[None])
    denom = (l * scale).sum(axis=0)
    num = (acc * scale[..., None]).sum(axis=0)
    return num / jnp.maximum(denom, 1e-30)[..., None]
