"""Pallas ragged paged attention (interpret mode on CPU) against the jnp reference and against a dense
per-sequence numpy oracle written here, over page sizes, head dims, GQA ratios, chunk offsets, page
boundaries, padding slots and batch kinds; plus the split-K decode variant, the TPU kernel in TPU
interpret mode, dispatch, and argument errors. Compiled GPU/TPU runs carry `gpu`/`tpu` markers."""
from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdjax.kernels import get_attention_fn, pallas_attention, pallas_gpu, ragged_blocks
from pdjax.kernels import reference

TOL = {jnp.float32: dict(atol=2e-5, rtol=2e-5), jnp.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def make_batch(seqs, *, page_size=16, num_kv_heads=2, group=4, head_dim=64, dtype=jnp.float32,
               pad_slots=1, pad_tokens=3, extra_pages=1, seed=0):
    """seqs: list of (q_len, kv_len). Builds a ragged batch with pages scattered over a shuffled pool,
    `pad_slots` empty sequence slots, `pad_tokens` padding tokens, and garbage past each page table."""
    rng = np.random.default_rng(seed)
    num_real = len(seqs)
    num_slots = num_real + pad_slots
    pages_needed = [-(-kv // page_size) for _, kv in seqs]
    pages_per_seq = max(pages_needed + [1]) + extra_pages
    num_pages = sum(pages_needed) + 3
    perm = rng.permutation(num_pages)
    table = np.full((num_slots, pages_per_seq), num_pages + 99, np.int32)  # garbage, must be ignored
    used = 0
    for i, n in enumerate(pages_needed):
        table[i, :n] = perm[used:used + n]
        used += n
    q_lens = [ql for ql, _ in seqs] + [0] * pad_slots
    kv_lens = [kv for _, kv in seqs] + [0] * pad_slots
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(cu[-1]) + pad_tokens
    num_q_heads = num_kv_heads * group
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_kv_heads, num_pages, page_size, head_dim)).astype(np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(kv_lens, jnp.int32), jnp.asarray(table), jnp.asarray(cu),
            jnp.asarray([num_real], jnp.int32))


def dense_oracle(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale=None,
                 sliding_window=None, soft_cap=None):
    """Per sequence: gather its context densely, full softmax in float64 with an explicit causal mask."""
    q, k_pages, v_pages = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k_pages, v_pages))
    kv_lens, table, cu = np.asarray(kv_lens), np.asarray(page_indices), np.asarray(cu_q_lens)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    out = np.zeros_like(q)
    for i in range(int(np.asarray(num_seqs).reshape(()))):
        q_len, ctx = cu[i + 1] - cu[i], kv_lens[i]
        if q_len == 0:
            continue
        slots = np.arange(ctx)
        pages = table[i, slots // page_size]
        k = k_pages[:, pages, slots % page_size]  # [Hkv, ctx, D]
        v = v_pages[:, pages, slots % page_size]
        for j in range(q_len):
            pos = ctx - q_len + j
            visible = slots <= pos
            if sliding_window is not None:
                visible &= slots > pos - sliding_window
            for h in range(num_q_heads):
                s = k[h // group] @ q[cu[i] + j, h] * scale
                if soft_cap is not None:
                    s = soft_cap * np.tanh(s / soft_cap)
                s = np.where(visible, s, -np.inf)
                p = np.exp(s - s.max())
                out[cu[i] + j, h] = p @ v[h // group] / p.sum()
    return out


KERNELS = {
    "auto": functools.partial(pallas_gpu.ragged_paged_attention, interpret=True),
    "prefill": functools.partial(pallas_gpu.prefill_attention, interpret=True),
    "mixed": functools.partial(pallas_gpu.mixed_attention, interpret=True),
    "decode_splitk": functools.partial(pallas_gpu.decode_attention, interpret=True, num_splits=4),
    "small_tiles": functools.partial(pallas_gpu.paged_attention_blocks, interpret=True, block_q=2,
                                     keys_per_block=16, num_splits=3),
}


def check(batch, kernel="auto", **kw):
    dtype = batch[0].dtype
    out = KERNELS[kernel](*batch, **kw)
    assert out.shape == batch[0].shape and out.dtype == dtype
    ref = reference.ragged_paged_attention(*batch, **kw)
    oracle = dense_oracle(*batch, **kw)
    tol = TOL[jnp.float32 if dtype == jnp.float32 else jnp.bfloat16]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **tol)
    np.testing.assert_allclose(np.asarray(out, np.float32), oracle, **tol)
    num_real_tokens = int(batch[5][int(batch[6][0])])
    assert not np.any(np.asarray(out[num_real_tokens:], np.float32)), "padding tokens must be zeros"


MIXED = [(1, 40), (19, 19 + 5), (1, 1), (7, 7)]  # decode, chunk starting & ending mid-page, ctx 1, fresh


@pytest.mark.parametrize("page_size", [8, 16, 32])
@pytest.mark.parametrize("kernel", ["auto", "decode_splitk"])
def test_page_sizes_mixed_batch(page_size, kernel):
    check(make_batch(MIXED, page_size=page_size, seed=page_size), kernel)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_head_dims_and_gqa(head_dim, group):
    batch = make_batch([(5, 21), (1, 33)], head_dim=head_dim, group=group, num_kv_heads=2 if group < 8 else 1,
                       seed=head_dim + group)
    check(batch, "prefill")
    check(batch, "decode_splitk")


@pytest.mark.parametrize("kernel", ["auto", "mixed", "prefill", "decode_splitk", "small_tiles"])
def test_decode_only_page_boundaries(kernel):
    # contexts: 1, exactly one page, exactly two pages, one past a boundary, one short of a boundary
    seqs = [(1, 1), (1, 16), (1, 32), (1, 17), (1, 47)]
    batch = make_batch(seqs, page_size=16, pad_slots=2, pad_tokens=2, seed=3)
    check(batch, kernel)


@pytest.mark.parametrize("kernel", ["auto", "decode_splitk", "small_tiles"])
def test_prefill_only_chunks_mid_page(kernel):
    # chunks at offsets 3, 8 and 0 of 8-token pages, ending mid-page, on a page boundary, and mid-page
    seqs = [(13, 3 + 13), (16, 8 + 16), (5, 5)]
    check(make_batch(seqs, page_size=8, pad_slots=1, pad_tokens=5, seed=4), kernel)


def test_padding_slots_and_all_padding_batch():
    check(make_batch([(3, 10)], pad_slots=4, pad_tokens=9, seed=5), "auto")
    q, k, v, kv, pt, cu, _ = make_batch([(3, 10)], pad_slots=2, seed=6)
    out = KERNELS["auto"](q, k, v, kv, pt, cu, jnp.array(0, jnp.int32))  # no real sequences, scalar num_seqs
    assert out.shape == q.shape and not np.any(np.asarray(out))


@pytest.mark.parametrize("kernel", ["auto", "decode_splitk", "small_tiles"])
def test_nan_in_unwritten_slots_does_not_leak(kernel):
    """NaN in every K/V slot outside the sequences' contexts (past kv_len in a last page, unused pages): what an
    aborted request leaves in freed pages. The kernels weigh those slots by 0, and must not compute 0 * NaN."""
    q, k, v, kv, pt, cu, n = make_batch(MIXED if kernel != "decode_splitk" else [(1, 40), (1, 17), (1, 1)], seed=9)
    page_size = k.shape[2]
    written = np.zeros(k.shape[1:3], bool)
    for i in range(int(n[0])):
        pos = np.arange(int(kv[i]))
        written[np.asarray(pt)[i, pos // page_size], pos % page_size] = True
    assert (~written).any()
    k = jnp.where(jnp.asarray(written)[None, :, :, None], k, jnp.nan)
    v = jnp.where(jnp.asarray(written)[None, :, :, None], v, jnp.nan)
    out = np.asarray(KERNELS[kernel](q, k, v, kv, pt, cu, n))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, dense_oracle(q, k, v, kv, pt, cu, n), **TOL[jnp.float32])


def test_bfloat16_mixed_batch():
    check(make_batch(MIXED, dtype=jnp.bfloat16, seed=7), "auto")
    check(make_batch(MIXED, dtype=jnp.bfloat16, seed=8), "decode_splitk")


@pytest.mark.parametrize("kernel", ["prefill", "decode_splitk"])
def test_sliding_window_soft_cap_and_scale(kernel):
    batch = make_batch([(12, 40), (1, 30), (6, 6)], page_size=8, seed=9)
    check(batch, kernel, sliding_window=10, soft_cap=4.0, sm_scale=0.2)


def test_long_contexts():
    seqs = [(1, 2500), (40, 2048 + 40), (1, 1024)]
    batch = make_batch(seqs, page_size=32, group=2, seed=10)
    check(batch, "prefill")
    check(batch, "decode_splitk")


def test_decode_heuristic_split_count():
    assert pallas_gpu.decode_num_splits(1, 1, 64) == 16  # tiny batch: as many splits as allowed
    assert pallas_gpu.decode_num_splits(64, 8, 64) == 1  # 512 programs already fill the GPU
    assert pallas_gpu.decode_num_splits(4, 2, 3) == 4  # capped by the key blocks (rounded to pow2)
    check(make_batch([(1, 300), (1, 5)], page_size=16, seed=11),  # heuristic path, num_splits=None
          "auto")


@settings(max_examples=6, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 20)), min_size=1, max_size=5),
       st.sampled_from([1, 2, 4]), st.integers(0, 3))
def test_work_list_covers_every_token_once(seqs, block_q, pad_tokens):
    seqs = [(min(ql, kv), kv) for ql, kv in seqs]
    q_lens = [ql for ql, _ in seqs]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = max(1, int(cu[-1]) + pad_tokens)
    kv = jnp.asarray([kv for _, kv in seqs], jnp.int32)
    def tokens(q_len_range):
        work = ragged_blocks.build_work_list(kv, jnp.asarray(cu), jnp.asarray(len(seqs)), num_tokens, block_q,
                                             q_len_range=q_len_range)
        covered = []
        for w in range(work.seq.shape[0]):
            n = int(work.num_q[w])
            covered += list(range(int(work.q_start[w]), int(work.q_start[w]) + n))
            if n:
                i = int(work.seq[w])
                assert int(work.first_pos[w]) == seqs[i][1] - seqs[i][0] + int(work.q_start[w]) - int(cu[i])
                assert int(work.key_end[w]) == int(work.first_pos[w]) + n
                assert q_len_range is None or q_len_range[0] <= seqs[i][0] <= q_len_range[1]
        return covered

    assert sorted(tokens(None)) == list(range(int(cu[-1])))
    # disjoint q_len ranges partition the tokens, with a split point below, at, and above block_q
    for cut in (1, block_q, block_q + 3):
        assert sorted(tokens((1, cut)) + tokens((cut + 1, num_tokens))) == list(range(int(cu[-1])))


def test_tpu_kernel_in_tpu_interpret_mode():
    try:
        from pdjax.kernels import pallas_tpu
        from jax.experimental.pallas import tpu as pltpu
        pltpu.InterpretParams()
    except (ImportError, AttributeError) as err:
        pytest.skip(f"this jax cannot run Mosaic TPU kernels in interpret mode: {err}")
    for seqs, page_size, group in (([(3, 11), (1, 1)], 8, 2), ([(1, 20), (5, 5)], 16, 4)):
        batch = make_batch(seqs, page_size=page_size, num_kv_heads=1, group=group, head_dim=128, seed=12)
        out = pallas_tpu.ragged_paged_attention(*batch, interpret=True)
        oracle = dense_oracle(*batch)
        np.testing.assert_allclose(np.asarray(out), oracle, **TOL[jnp.float32])
        np.testing.assert_allclose(np.asarray(out), np.asarray(reference.ragged_paged_attention(*batch)),
                                   **TOL[jnp.float32])


LOWERING_BATCH = dict(seqs=[(1, 100), (37, 137), (1, 16)], page_size=16, head_dim=128, dtype=jnp.bfloat16)


@pytest.mark.parametrize("fn", [pallas_gpu.ragged_paged_attention, pallas_gpu.prefill_attention,
                                pallas_gpu.decode_attention], ids=["auto", "prefill", "decode"])
def test_gpu_kernels_lower_to_triton(fn):
    """Cross-platform lowering runs Pallas' Triton lowering on CPU: it rejects non-power-of-two tiles and
    primitives Triton cannot express, so the compiled GPU path is checked as far as a CPU can."""
    batch = make_batch(**LOWERING_BATCH)
    text = jax.jit(fn).trace(*batch).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


def test_tpu_kernel_lowers_to_mosaic(monkeypatch):
    """Mosaic lowering on CPU, pretending the default device is a TPU v5e (jax reads the chip kind to pick
    tilings); the TPU compiler's own layout checks still only run on a TPU."""
    from pdjax.kernels import pallas_tpu
    try:
        from jax._src.pallas.mosaic import tpu_info
        monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5e")
        monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    except (ImportError, AttributeError) as err:
        pytest.skip(f"this jax has no patchable tpu_info for CPU-side Mosaic lowering: {err}")
    for page_size, dtype in ((16, jnp.bfloat16), (8, jnp.float32)):
        batch = make_batch(**{**LOWERING_BATCH, "page_size": page_size, "dtype": dtype})
        text = jax.jit(pallas_tpu.ragged_paged_attention).trace(*batch).lower(
            lowering_platforms=("tpu",)).as_text()
        assert "tpu_custom_call" in text


def test_dispatch():
    assert get_attention_fn("reference") is reference.ragged_paged_attention
    from pdjax.kernels import blocked
    assert get_attention_fn("auto") is blocked.ragged_paged_attention  # tests run on CPU: the blocked XLA path
    assert get_attention_fn("blocked") is blocked.ragged_paged_attention
    fn = get_attention_fn("pallas")
    assert fn.func is pallas_gpu.ragged_paged_attention and fn.keywords == {"interpret": True}
    assert pallas_attention.get_pallas_attention_fn("gpu") is pallas_gpu.ragged_paged_attention
    with pytest.raises(ValueError, match="attention_impl='cuda'"):
        get_attention_fn("cuda")
    with pytest.raises(ValueError, match="backend='metal'"):
        pallas_attention.get_pallas_attention_fn("metal")


def test_bad_inputs_name_the_value():
    q, k, v, kv, pt, cu, n = make_batch([(2, 5)], seed=13)
    fn = KERNELS["auto"]
    with pytest.raises(ValueError, match="num_q_heads=8 is not a multiple of num_kv_heads=3"):
        fn(q, k[:1].repeat(3, 0), v[:1].repeat(3, 0), kv, pt, cu, n)
    with pytest.raises(ValueError, match=r"cu_q_lens.shape=\(2,\)"):
        fn(q, k, v, kv, pt, cu[:2], n)
    with pytest.raises(ValueError, match="page_size=12"):
        fn(q, k[:, :, :12], v[:, :, :12], kv, pt, cu, n)
    with pytest.raises(ValueError, match="kv_lens.dtype=float32"):
        fn(q, k, v, kv.astype(jnp.float32), pt, cu, n)
    with pytest.raises(ValueError, match="v_pages.shape"):
        fn(q, k, v[:, :2], kv, pt, cu, n)


def _compiled_check(fn):
    batch = make_batch([(1, 1000), (37, 37 + 100), (1, 16)], page_size=16, head_dim=128, seed=14,
                       dtype=jnp.bfloat16)
    out = jax.block_until_ready(fn(*batch))
    np.testing.assert_allclose(np.asarray(out, np.float32), dense_oracle(*batch), **TOL[jnp.bfloat16])


@pytest.mark.gpu
def test_compiled_gpu_kernels():
    if jax.default_backend() != "gpu":
        pytest.skip(f"needs a GPU, default backend is {jax.default_backend()}")
    _compiled_check(pallas_gpu.ragged_paged_attention)
    _compiled_check(pallas_gpu.prefill_attention)
    _compiled_check(pallas_gpu.decode_attention)


@pytest.mark.tpu
def test_compiled_tpu_kernel():
    if jax.default_backend() != "tpu":
        pytest.skip(f"needs a TPU, default backend is {jax.default_backend()}")
    from pdjax.kernels import pallas_tpu
    _compiled_check(pallas_tpu.ragged_paged_attention)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("impl", ["reference", "blocked", "pallas"])
def test_attention_sharded_over_kv_heads(impl, tp):
    """The seam under tensor parallelism (shard_over_kv_heads): each 'tensor' shard attends its own query heads over
    its own KV heads. Equal to the dense oracle with GQA groups that straddle no shard boundary (4 KV heads x 2)."""
    from pdjax.runtime.mesh import make_mesh
    if len(jax.devices()) < tp:
        pytest.skip(f"needs {tp} devices")
    mesh = make_mesh(jax.devices()[:tp], tp=tp)
    batch = make_batch(MIXED, num_kv_heads=4, group=2, head_dim=32, seed=tp)
    fn = get_attention_fn(impl, mesh)
    out = jax.jit(fn)(*batch)
    np.testing.assert_allclose(np.asarray(out, np.float32), dense_oracle(*batch), **TOL[jnp.float32])
    assert inspect.unwrap(fn) is get_attention_fn(impl) or impl == "pallas"


def test_sharded_gpu_step_lowers_to_triton_under_tp2():
    """The whole model step with the GPU kernel shard_mapped over TP 2 lowers for CUDA (no GPU here: XLA's partitioner
    refuses an unwrapped Pallas call, 'Mosaic kernels cannot be automatically partitioned', at compile time)."""
    from pdjax.config.model_specs import get_model_spec
    from pdjax.kernels import shard_over_kv_heads
    from pdjax.runtime import aot
    from pdjax.runtime import mesh as mesh_lib
    from pdjax.runtime.batch import empty_batch
    from pdjax.runtime.step import make_step
    spec = get_model_spec("tiny-mha")
    mesh = mesh_lib.make_mesh(jax.devices()[:2], tp=2)
    rep = mesh_lib.replicated(mesh)
    step = make_step(spec, shard_over_kv_heads(pallas_gpu.ragged_paged_attention, mesh), max_seqs=8,
                     out_shardings=(rep, mesh_lib.kv_cache_shardings(mesh, spec)))
    params = aot.abstract_stage_params(spec, mesh, jnp.bfloat16)
    kv = aot.abstract_kv_cache(spec, mesh, num_pages=64, page_size=16, dtype=jnp.bfloat16, num_layers=spec.num_layers)
    batch = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep),
                                   empty_batch((32, 8, 8)))
    prev = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=rep)
    text = step.trace(params, kv, batch, prev).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2   # the mixed rule's two launches (the layers share them)
    assert "manual_computation" in text              # inside the shard_map: per-shard shapes
