"""KV transfer between two device groups on fake CPU devices: exact page contents across TP and pipeline layouts
(each layer lands on the destination stage holding it), byte accounting, padding, warm-up, and bad input."""
import jax
import numpy as np
import pytest

from pdjax.models.llama import KVCache
from pdjax.config.pipeline import stage_layer_ranges
from pdjax.runtime.mesh import make_mesh, stage_meshes
from pdjax.serving.kv_transfer import kv_bytes, scatter_kv_pages, transfer_kv

LAYERS, KV_HEADS, PAGES, PAGE_SIZE, HEAD_DIM = 2, 4, 12, 8, 16


def _cache(mesh, seed=None):
    """A paged cache on `mesh` (kv heads on 'tensor'): random values (seed) or zeros, plus its numpy copy."""
    rng = np.random.default_rng(seed)
    shape = (KV_HEADS, PAGES, PAGE_SIZE, HEAD_DIM)
    make = (lambda: rng.standard_normal(shape).astype(np.float32)) if seed is not None else \
        (lambda: np.zeros(shape, np.float32))
    host_k = [make() for _ in range(LAYERS)]
    host_v = [make() for _ in range(LAYERS)]
    sharding = kv_cache_layout(mesh)
    put = lambda xs: tuple(jax.device_put(x, sharding) for x in xs)  # noqa: E731
    return KVCache(k=put(host_k), v=put(host_v)), (host_k, host_v)


def kv_cache_layout(mesh):
    from jax.sharding import NamedSharding, PartitionSpec as P
    return NamedSharding(mesh, P("tensor", None, None, None))


def _mesh(ids, tp):
    return make_mesh([jax.devices()[i] for i in ids], tp=tp)


@pytest.mark.parametrize("src_ids,src_tp,dst_ids,dst_tp", [
    ((0, 1), 2, (2,), 1),          # prefill TP2 -> decode TP1
    ((3,), 1, (4, 5), 2),          # prefill TP1 -> decode TP2
    ((0, 1), 2, (4, 5, 6, 7), 4),  # prefill TP2 -> decode TP4
])
@pytest.mark.parametrize("num_tokens", [19, 16])   # partial last page / exact page boundary
def test_transfer_reshards_and_pages_arrive_exactly(src_ids, src_tp, dst_ids, dst_tp, num_tokens):
    src_mesh, dst_mesh = _mesh(src_ids, src_tp), _mesh(dst_ids, dst_tp)
    src, (src_k, src_v) = _cache(src_mesh, seed=1)
    dst, _ = _cache(dst_mesh)
    src_pages, dst_pages = [7, 2, 9, 0], [3, 10, 5, 1]   # more pages than needed: only ceil(tokens/8) move
    need = -(-num_tokens // PAGE_SIZE)

    staged = transfer_kv(src, src_pages, dst_mesh, num_tokens=num_tokens)
    # Staged on the decode group only, kv heads split over its tensor axis.
    assert {s.device.id for s in staged.k[0].addressable_shards} == set(dst_ids)
    assert staged.k[0].addressable_shards[0].data.shape[0] == KV_HEADS // dst_tp
    assert staged.num_pages == need

    new = scatter_kv_pages(dst, dst_pages, staged)
    for layer in range(LAYERS):
        for got_cache, want_host in ((new.k, src_k), (new.v, src_v)):
            got = np.asarray(got_cache[layer])
            for s, d in zip(src_pages[:need], dst_pages[:need]):
                np.testing.assert_array_equal(got[:, d], want_host[layer][:, s])
            untouched = [p for p in range(PAGES) if p not in dst_pages[:need]]
            assert not got[:, untouched].any(), "pages outside the destination table changed"
    # The decode cache keeps its layout (shard-local scatter), and the source is unchanged.
    assert new.k[0].sharding.is_equivalent_to(kv_cache_layout(dst_mesh), 4)
    assert {s.device.id for s in new.k[0].addressable_shards} == set(dst_ids)
    np.testing.assert_array_equal(np.asarray(src.k[1]), src_k[1])


def test_byte_accounting_and_padding():
    src_mesh, dst_mesh = _mesh((0,), 1), _mesh((1,), 1)
    src, _ = _cache(src_mesh, seed=2)
    dst, _ = _cache(dst_mesh)
    tokens = 19                                  # 3 pages -> padded to 4 sent
    staged = transfer_kv(src, [4, 5, 6], dst_mesh, num_tokens=tokens)
    itemsize = np.dtype(np.float32).itemsize
    assert staged.kv_bytes == 2 * LAYERS * tokens * KV_HEADS * HEAD_DIM * itemsize
    assert staged.num_pages_sent == 4
    assert staged.moved_bytes == staged.nbytes == 2 * LAYERS * 4 * PAGE_SIZE * KV_HEADS * HEAD_DIM * itemsize
    assert staged.seconds > 0
    exact = transfer_kv(src, [4, 5, 6], dst_mesh, num_tokens=tokens, pad_pages=False)
    assert exact.num_pages_sent == 3 and exact.moved_bytes == exact.nbytes
    # The padding page is dropped at the scatter: only the 3 table pages change.
    new = np.asarray(scatter_kv_pages(dst, [0, 1, 2, 3], staged).k[0])
    assert new[:, :3].any() and not new[:, 3:].any()
    assert kv_bytes(32, 1000, 8, 128, "bfloat16") == 2 * 32 * 1000 * 8 * 128 * 2


def test_bad_input_names_the_problem():
    src_mesh, dst_mesh = _mesh((0,), 1), _mesh((1,), 1)
    src, _ = _cache(src_mesh, seed=3)
    dst, _ = _cache(dst_mesh)
    with pytest.raises(ValueError, match="page id 12 outside"):
        transfer_kv(src, [1, 12], dst_mesh, num_tokens=9)
    with pytest.raises(ValueError, match="need 3 pages"):
        transfer_kv(src, [1, 2], dst_mesh, num_tokens=17)
    with pytest.raises(ValueError, match="num_tokens=0"):
        transfer_kv(src, [1], dst_mesh, num_tokens=0)
    staged = transfer_kv(src, [1, 2], dst_mesh, num_tokens=9)
    with pytest.raises(ValueError, match="the staged KV needs 2"):
        scatter_kv_pages(dst, [0], staged)
    with pytest.raises(ValueError, match="page id -1 outside"):
        scatter_kv_pages(dst, [0, -1], staged)
    other = KVCache(k=tuple(x[:2] for x in dst.k), v=tuple(x[:2] for x in dst.v))   # 2 kv heads, not 4
    with pytest.raises(ValueError, match="does not fit a cache"):
        scatter_kv_pages(other, [0, 1], staged)


# ------------------------------------------------------------------------------------------------------------
# Between pipeline layouts: each layer's pages land on the destination stage holding that layer
# ------------------------------------------------------------------------------------------------------------
PP_LAYERS = 3   # uneven splits: pp2 -> [2, 1], pp3 -> [1, 1, 1]


def _stage_caches(ids, pp, tp, seed=None):
    """Per-stage caches of a (1, pp, tp) mesh over devices `ids` (stage s holds layers stage_layer_ranges[s] on
    its sub-mesh, kv heads on 'tensor'), random (seed) or zeros; plus the stage meshes and numpy copies per layer."""
    mesh = make_mesh([jax.devices()[i] for i in ids], pp=pp, tp=tp)
    subs = stage_meshes(mesh)
    rng = np.random.default_rng(seed)
    shape = (KV_HEADS, PAGES, PAGE_SIZE, HEAD_DIM)
    make = (lambda: rng.standard_normal(shape).astype(np.float32)) if seed is not None else \
        (lambda: np.zeros(shape, np.float32))
    host_k = [make() for _ in range(PP_LAYERS)]
    host_v = [make() for _ in range(PP_LAYERS)]
    caches = []
    for sub, (a, b) in zip(subs, stage_layer_ranges(PP_LAYERS, pp)):
        put = lambda xs, sub=sub: tuple(jax.device_put(x, kv_cache_layout(sub)) for x in xs)  # noqa: E731
        caches.append(KVCache(k=put(host_k[a:b]), v=put(host_v[a:b])))
    return caches, subs, (host_k, host_v)


@pytest.mark.parametrize("src_pp,src_tp,dst_pp,dst_tp", [
    (2, 2, 2, 1),    # prefill tp2 x pp2 -> decode tp1 x pp2
    (2, 1, 1, 1),    # pp2 -> pp1
    (1, 1, 2, 1),    # pp1 -> pp2
    (2, 2, 1, 4),    # pp2 -> pp1 and tp2 -> tp4 at once
    (1, 2, 3, 1),    # pp1 tp2 -> pp3 tp1 (one layer per stage)
    (3, 1, 2, 2),    # pp3 -> pp2 tp2
], ids=lambda x: str(x))
def test_transfer_between_pipeline_layouts_pages_land_exactly(src_pp, src_tp, dst_pp, dst_tp):
    n_src = src_pp * src_tp
    src, _, (src_k, src_v) = _stage_caches(range(n_src), src_pp, src_tp, seed=4)
    dst, dst_subs, _ = _stage_caches(range(n_src, n_src + dst_pp * dst_tp), dst_pp, dst_tp)
    src_pages, dst_pages = [7, 2, 9], [3, 10, 5, 1]
    num_tokens = 19   # 3 pages, padded to 4 sent

    staged = transfer_kv(src, src_pages, dst_subs, num_tokens=num_tokens)
    assert staged.layer_ranges == stage_layer_ranges(PP_LAYERS, dst_pp) and staged.num_pages_sent == 4
    ranges = stage_layer_ranges(PP_LAYERS, dst_pp)
    for layer in range(PP_LAYERS):   # staged on the destination stage holding the layer, its TP layout
        stage = next(s for s, (a, b) in enumerate(ranges) if a <= layer < b)
        want = kv_cache_layout(dst_subs[stage])
        assert staged.k[layer].sharding.is_equivalent_to(want, 4)
        assert staged.v[layer].sharding == staged.k[layer].sharding
    assert staged.moved_bytes == staged.nbytes

    new = scatter_kv_pages(dst, dst_pages, staged)
    assert isinstance(new, list) and len(new) == dst_pp
    for s, (cache, (a, b)) in enumerate(zip(new, ranges)):
        assert len(cache.k) == b - a
        for i, layer in enumerate(range(a, b)):
            for got_arr, want_host in ((cache.k[i], src_k[layer]), (cache.v[i], src_v[layer])):
                assert got_arr.sharding.is_equivalent_to(kv_cache_layout(dst_subs[s]), 4)   # stays on its stage
                got = np.asarray(got_arr)
                for sp, dp in zip(src_pages, dst_pages[:3]):
                    np.testing.assert_array_equal(got[:, dp], want_host[:, sp])
                untouched = [p for p in range(PAGES) if p not in dst_pages[:3]]
                assert not got[:, untouched].any(), f"layer {layer}: pages outside the table changed"
    # The source is unchanged.
    np.testing.assert_array_equal(np.asarray(src[-1].v[-1]), src_v[-1])


def test_pipeline_transfer_compiles_nothing_once_warm():
    from pdjax.runtime import compiles
    src, _, _ = _stage_caches(range(4), 2, 2, seed=5)
    box = {"dst": _stage_caches(range(4, 6), 2, 1)[0]}
    dst_subs = _stage_caches(range(4, 6), 2, 1)[1]

    def move(n):
        staged = transfer_kv(src, list(range(n)), dst_subs, num_tokens=n * PAGE_SIZE)
        box["dst"] = scatter_kv_pages(box["dst"], list(range(n)), staged)

    for n in (1, 2, 4):
        move(n)
    jax.block_until_ready(box["dst"])
    mark = compiles.count()
    for n in (3, 1, 4, 2):    # 3 pads to 4
        move(n)
    jax.block_until_ready(box["dst"])
    assert compiles.since(mark) == []


def test_pipeline_layout_mismatch_is_refused():
    src, _, _ = _stage_caches(range(2), 2, 1, seed=6)
    dst_pp2, subs2, _ = _stage_caches(range(2, 4), 2, 1)
    dst_pp1, subs1, _ = _stage_caches(range(4, 5), 1, 1)
    staged = transfer_kv(src, [0], subs2, num_tokens=3)
    with pytest.raises(ValueError, match=r"in stages \[\(0, 2\), \(2, 3\)\] does not fit a cache of 3 layers"):
        scatter_kv_pages(dst_pp1, [0], staged)
    with pytest.raises(ValueError, match=r"stages hold \[1, 2\] layers, expected the pipeline split \[2, 1\]"):
        transfer_kv([KVCache(k=src[1].k, v=src[1].v), KVCache(k=src[0].k, v=src[0].v)], [0], subs1, num_tokens=3)


# ------------------------------------------------------------------------------------------------------------
# The crossing between processes, in one process: the piecewise route (head pieces, one device_put per device
# pair, reassembled on the destination) lands exactly; the multi-process runs are tests/test_multiprocess_transfer.py
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("src_ids,src_tp,dst_ids,dst_tp", [
    ((0, 1), 2, (2,), 1),          # both source shards onto one device: concatenated there
    ((3,), 1, (4, 5), 2),          # the source cut in two, one piece per destination device
    ((0, 1, 2, 3), 4, (4, 5), 2),  # two pieces per destination device
    ((0, 1), 2, (4, 5, 6, 7), 4),  # a piece of each source shard per destination device
    ((0, 1, 2), 3, (4, 5), 2),     # replicated source (kv heads not split) -> split
])
def test_piecewise_crossing_lands_exactly(src_ids, src_tp, dst_ids, dst_tp):
    from jax.sharding import NamedSharding, PartitionSpec as P
    from pdjax.serving.kv_transfer import _by_pieces, cross_device_put, crossing_route, staged_sharding
    src_mesh, dst_mesh = _mesh(src_ids, src_tp), _mesh(dst_ids, dst_tp)
    if KV_HEADS % src_tp:
        src_k = [np.random.default_rng(i).standard_normal((KV_HEADS, PAGES, PAGE_SIZE, HEAD_DIM)).astype(np.float32)
                 for i in range(LAYERS)]
        put = lambda xs: tuple(jax.device_put(x, NamedSharding(src_mesh, P())) for x in xs)  # noqa: E731
        src = KVCache(k=put(src_k), v=put(src_k[::-1]))
    else:
        src, (src_k, _) = _cache(src_mesh, seed=7)
    target = staged_sharding(dst_mesh)
    assert crossing_route(4, src.k[0].sharding, target) == "device_put"    # one process: JAX's device_put
    out = _by_pieces(list(src.k), [target] * LAYERS)
    for layer, arr in enumerate(out):
        assert arr.sharding == target
        np.testing.assert_array_equal(np.asarray(arr), src_k[layer])
        for shard in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), src_k[layer][shard.index])
    k, v = cross_device_put(list(src.k) + list(src.v), [target] * (2 * LAYERS), split=LAYERS)
    assert len(k) == len(v) == LAYERS and all(a.sharding == target for a in k + v)
    np.testing.assert_array_equal(np.asarray(k[1]), src_k[1])
