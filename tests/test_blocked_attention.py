"""The blocked XLA attention (pdjax.kernels.blocked): against the jnp reference and an independent numpy oracle,
and end to end (greedy tokens of the model equal the reference path's)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdjax.config.model_specs import get_model_spec
from pdjax.kernels import ATTENTION_IMPLS, blocked, get_attention_fn, reference
from pdjax.models.llama import init_params
from pdjax.runtime.batch import Buckets
from pdjax.runtime.generate import generate
from pdjax.runtime.runner import ModelRunner

# Small tiles so small batches still cross many query blocks and key blocks (every setting is exact); with
# dense_bytes=0 single-token items take the key loop (`_vector_pass`), with the default tiles the one-shot
# gather (`_dense_pass`), so every case checked with both covers both.
SMALL_TILES = dict(chunk_rows=16, chunk_keys=16, decode_keys=16, dense_bytes=0, group_bytes=2 * 2 * 16 * 16 * 4)


def make_case(seqs, *, page_size=16, num_kv_heads=2, group=2, head_dim=64, num_slots=None, num_tokens=None,
              pages_per_seq=None, dtype=np.float32, seed=0):
    """Seam arguments (numpy) of a ragged batch. seqs: [(q_len, kv_len)]; slots past len(seqs) are padding
    (q_len 0, kv_len 0) and tokens past the last sequence's are padding. Pages are shuffled; page-table
    entries past a sequence's last page hold random (valid) page ids, which must be ignored."""
    rng = np.random.RandomState(seed)
    num_slots = num_slots or max(1, len(seqs))
    q_lens = [q for q, _ in seqs]
    pages_needed = [-(-kv // page_size) for _, kv in seqs]
    pages_per_seq = pages_per_seq or max([1] + pages_needed)
    num_tokens = num_tokens or max(1, sum(q_lens))
    num_pages = sum(pages_needed) + 3
    perm = rng.permutation(num_pages)
    table = rng.randint(0, num_pages, (num_slots, pages_per_seq)).astype(np.int32)
    used = 0
    for i, n in enumerate(pages_needed):
        table[i, :n] = perm[used:used + n]
        used += n
    kv_lens = np.zeros(num_slots, np.int32)
    kv_lens[:len(seqs)] = [kv for _, kv in seqs]
    cu = np.zeros(num_slots + 1, np.int32)
    cu[1:len(seqs) + 1] = np.cumsum(q_lens)
    cu[len(seqs) + 1:] = cu[len(seqs)]
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    cast = lambda x: np.asarray(jnp.asarray(x, dtype))  # noqa: E731  (bf16 rounding done once, here)
    q = cast(rng.randn(num_tokens, num_kv_heads * group, head_dim))
    k, v = cast(rng.randn(*shape)), cast(rng.randn(*shape))
    return q, k, v, kv_lens, table, cu, np.asarray([len(seqs)], np.int32)


def numpy_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale=None,
                    sliding_window=None, soft_cap=None):
    """Independent oracle, float64, one query at a time: query j of sequence i sits at position
    kv_len - q_len + j and sees keys at positions p with max(0, pos - window + 1) <= p <= pos."""
    q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    scale = 1.0 / np.sqrt(head_dim) if sm_scale is None else sm_scale
    out = np.zeros_like(q)
    for i in range(int(np.reshape(num_seqs, ()))):
        start, end, kv_len = int(cu_q_lens[i]), int(cu_q_lens[i + 1]), int(kv_lens[i])
        positions = np.arange(kv_len)
        pages = np.asarray(page_indices[i])[positions // page_size]
        keys = k_pages[:, pages, positions % page_size]  # [Hkv, kv_len, D]
        values = v_pages[:, pages, positions % page_size]
        for j, t in enumerate(range(start, end)):
            pos = kv_len - (end - start) + j
            visible = positions <= pos
            if sliding_window is not None:
                visible &= positions > pos - sliding_window
            for h in range(num_q_heads):
                s = keys[h // group] @ q[t, h] * scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                s = np.where(visible, s, -np.inf)
                p = np.exp(s - s.max())
                out[t, h] = (p / p.sum()) @ values[h // group]
    return out


def tolerance(dtype):
    return dict(atol=2e-5, rtol=2e-5) if dtype == np.float32 else dict(atol=3e-2, rtol=3e-2)


def check(case, dtype=np.float32, **kw):
    """blocked == numpy oracle, blocked == reference, padding tokens exactly zero; returns blocked's output."""
    tiles = {k: kw.pop(k) for k in list(kw) if k in SMALL_TILES}
    args = tuple(jnp.asarray(x) for x in case)
    got = blocked.ragged_paged_attention(*args, **kw, **tiles)
    assert got.shape == case[0].shape and got.dtype == args[0].dtype
    got = np.asarray(got.astype(jnp.float32))
    want = numpy_attention(*case, **kw)
    ref = np.asarray(reference.ragged_paged_attention(*args, **kw).astype(jnp.float32))
    np.testing.assert_allclose(got, want, **tolerance(dtype))
    np.testing.assert_allclose(got, ref, **tolerance(dtype))
    real_tokens = int(case[5][int(case[6][0])])
    assert not np.any(got[real_tokens:]), "padding tokens must be zero"
    return got


# ------------------------------------------------------------------------------------------------------------
# Kernel against the oracles
# ------------------------------------------------------------------------------------------------------------

# (page_size, head_dim, num_kv_heads, group): every page size, head dim and GQA ratio appears, and pairs mix.
GEOMETRIES = [(8, 64, 2, 1), (16, 128, 1, 2), (32, 64, 2, 4), (8, 128, 1, 8), (16, 64, 1, 8), (32, 128, 4, 1),
              (16, 64, 2, 3)]


@pytest.mark.parametrize("page_size,head_dim,num_kv_heads,group", GEOMETRIES)
def test_mixed_batch_geometries(page_size, head_dim, num_kv_heads, group):
    ps = page_size
    seqs = [(1, 1),                 # context 1: a first token
            (5, 3 * ps + 7),        # chunk starting mid-page, ending mid-page
            (1, 2 * ps),            # decode that fills a page exactly
            (1, 2 * ps + 1),        # decode that opens a new page
            (2 * ps + 3, 2 * ps + 3),   # whole prompt from 0, partial last page
            (1, 5 * ps - 3)]        # decode, partial page
    case = make_case(seqs, page_size=ps, head_dim=head_dim, num_kv_heads=num_kv_heads, group=group,
                     num_slots=8, num_tokens=sum(q for q, _ in seqs) + 5, pages_per_seq=6, seed=page_size + group)
    check(case, **SMALL_TILES)
    check(case)  # default tiles: one block covers everything


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind", ["decode_only", "prefill_only", "mixed", "chunk_in_decode_bucket"])
def test_batch_kinds(kind, dtype):
    if kind == "decode_only":  # T <= S: the token-mode path
        case = make_case([(1, 40), (1, 16), (1, 17), (1, 1), (1, 33)], num_slots=8, num_tokens=8,
                         pages_per_seq=4, dtype=dtype)
    elif kind == "prefill_only":
        case = make_case([(70, 70)], num_slots=1, num_tokens=96, pages_per_seq=6, dtype=dtype)
    elif kind == "mixed":
        case = make_case([(1, 40), (20, 37), (1, 9), (33, 33), (1, 48)], num_slots=8, num_tokens=64,
                         pages_per_seq=4, dtype=dtype)
    else:  # T <= S but a multi-token chunk: token mode must still be exact
        case = make_case([(3, 20), (1, 7), (2, 2)], num_slots=8, num_tokens=8, pages_per_seq=2, dtype=dtype)
    check(case, dtype=dtype, **SMALL_TILES)
    check(case, dtype=dtype)


@pytest.mark.parametrize("num_tokens,num_slots", [(8, 4), (4, 8)])
def test_empty_batch(num_tokens, num_slots):
    case = make_case([], num_slots=num_slots, num_tokens=num_tokens, pages_per_seq=2)
    got = check(case)
    assert not np.any(got)


def test_long_context_many_blocks_default_tiles():
    # Several 256-key chunk blocks and 128-key decode blocks; a chunk deep into its context.
    case = make_case([(1, 700), (100, 650), (1, 129), (300, 300)], num_slots=4, num_tokens=512,
                     pages_per_seq=44, head_dim=64, seed=3)
    check(case)


@pytest.mark.parametrize("items_per_group", [1, 3, 64])
def test_chunk_items_grouped_any_size(items_per_group):
    # Chunks of unequal lengths and contexts share groups (one item needs more key blocks than its neighbours),
    # the last group is partial, and decodes sit between the chunks on the token axis.
    seqs = [(40, 40), (1, 70), (9, 130), (33, 33), (1, 5), (2, 90), (24, 24), (17, 60)]
    case = make_case(seqs, num_slots=10, num_tokens=160, pages_per_seq=9, head_dim=64, group=2, seed=7)
    rows, block_k, num_kv_heads = 16, 16, 2
    group_bytes = items_per_group * num_kv_heads * rows * block_k * 4
    assert blocked.chunk_items_per_group(num_kv_heads, rows, block_k, group_bytes) == items_per_group
    check(case, chunk_rows=rows, chunk_keys=block_k, group_bytes=group_bytes)
    check(case, chunk_rows=rows, chunk_keys=block_k, group_bytes=group_bytes, sliding_window=20)
    # Equal prompts (grouping computes only needed blocks: grouped) and one long prompt (its query blocks need
    # 1, 2, 3, ... key blocks: past GROUPED_WASTE, groups of one).
    for seqs in ([(24, 24)] * 6, [(150, 150)]):
        case = make_case(seqs, num_slots=6, num_tokens=160, pages_per_seq=10, head_dim=64, group=2, seed=8)
        check(case, chunk_rows=rows, chunk_keys=block_k, group_bytes=group_bytes)


@pytest.mark.parametrize("tiles", [{}, SMALL_TILES])
@pytest.mark.parametrize("window,cap", [(50, None), (None, 30.0), (37, 5.0)])
def test_sliding_window_and_soft_cap(window, cap, tiles):
    seqs = [(1, 300), (60, 200), (1, 20), (17, 17), (1, 129)]
    case = make_case(seqs, num_slots=6, num_tokens=96, pages_per_seq=19, head_dim=64, seed=4)
    check(case, sliding_window=window, soft_cap=cap, **tiles)
    decode = make_case([(1, 300), (1, 20), (1, 51)], num_slots=4, num_tokens=4, pages_per_seq=19, seed=5)
    check(decode, sliding_window=window, soft_cap=cap, **tiles)


def test_bf16_long_mixed():
    case = make_case([(1, 300), (90, 250), (1, 64)], num_slots=4, num_tokens=128, pages_per_seq=19,
                     dtype=jnp.bfloat16, seed=6)
    check(case, dtype=jnp.bfloat16, sliding_window=100)


def poison_unwritten_slots(case):
    """The case with NaN in every K/V slot no sequence's context covers (slots past kv_len in a last page, whole
    unused pages, pages only garbage page-table entries point at): what an aborted request's NaN leaves behind."""
    q, k, v, kv_lens, table, cu, n = case
    page_size = k.shape[2]
    written = np.zeros(k.shape[1:3], bool)  # [num_pages, page_size]
    for i in range(int(n[0])):
        pos = np.arange(kv_lens[i])
        written[table[i, pos // page_size], pos % page_size] = True
    k, v = k.copy(), v.copy()
    k[:, ~written], v[:, ~written] = np.nan, np.nan
    assert (~written).any()
    return q, k, v, kv_lens, table, cu, n


@pytest.mark.parametrize("impl", ["blocked_dense", "blocked_loop", "reference"])
@pytest.mark.parametrize("kind", ["decode_only", "mixed", "window"])
def test_nan_in_unwritten_slots_does_not_leak(impl, kind):
    if kind == "decode_only":   # T <= S: token mode; partial last pages and a page-aligned context
        case = make_case([(1, 40), (1, 16), (1, 17), (1, 1)], num_slots=6, num_tokens=6, pages_per_seq=4)
    else:                       # T > S: the decode items and the chunk pass; chunks ending mid-page
        case = make_case([(1, 40), (20, 37), (1, 9), (33, 33), (1, 48)], num_slots=8, num_tokens=64,
                         pages_per_seq=5, seed=2)
    case = poison_unwritten_slots(case)
    kw = {"sliding_window": 7} if kind == "window" else {}
    args = tuple(jnp.asarray(x) for x in case)
    if impl == "reference":
        got = reference.ragged_paged_attention(*args, **kw)
    else:
        got = blocked.ragged_paged_attention(*args, **kw, **({} if impl == "blocked_dense" else SMALL_TILES))
    got = np.asarray(got)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, numpy_attention(*case, **kw), atol=2e-5, rtol=2e-5)


def test_jit_with_traced_metadata_and_sm_scale():
    case = make_case([(1, 40), (20, 37), (1, 9)], num_slots=4, num_tokens=32, pages_per_seq=3)
    args = tuple(jnp.asarray(x) for x in case)
    fn = jax.jit(functools.partial(blocked.ragged_paged_attention, sm_scale=0.3, **SMALL_TILES))
    np.testing.assert_allclose(np.asarray(fn(*args)), numpy_attention(*case, sm_scale=0.3), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(fn(*args[:6], jnp.int32(3))), np.asarray(fn(*args)), atol=0, rtol=0)


def test_rejects_bad_shapes():
    q, k, v, kv_lens, table, cu, n = make_case([(2, 2)], num_kv_heads=2, group=2)
    with pytest.raises(ValueError, match="not a multiple"):
        blocked.ragged_paged_attention(q[:, :3], k, v, kv_lens, table, cu, n)
    with pytest.raises(ValueError, match="cu_q_lens"):
        blocked.ragged_paged_attention(q, k, v, kv_lens, table, cu[:1], n)


def test_registered_and_auto_on_cpu():
    assert "blocked" in ATTENTION_IMPLS
    assert get_attention_fn("blocked") is blocked.ragged_paged_attention
    assert get_attention_fn("reference") is reference.ragged_paged_attention
    if jax.default_backend() == "cpu":
        assert get_attention_fn("auto") is blocked.ragged_paged_attention


# ------------------------------------------------------------------------------------------------------------
# End to end
# ------------------------------------------------------------------------------------------------------------

def test_model_greedy_tokens_match_reference():
    spec = get_model_spec("tiny-llama")
    params = init_params(spec, 0)
    rng = np.random.RandomState(7)
    prompts = [list(rng.randint(0, spec.vocab_size, n)) for n in (37, 70, 5)]
    tokens = {}
    for impl in ("reference", "blocked"):
        # T=4 <= S=4 (decode steps: token mode) and T=32 > S (chunks + decodes: both passes).
        runner = ModelRunner(spec, params, num_pages=40, page_size=8, attention_impl=impl,
                             buckets=Buckets(tokens=(4, 32), seqs=(4,), pages=(12,)), max_model_len=96)
        tokens[impl], _ = generate(runner, prompts, 12, chunk_size=16, token_budget=32)
    assert tokens["blocked"] == tokens["reference"]
