"""KV transfer between two device groups on fake CPU devices: exact page contents across TP layouts, byte
accounting, padding, and bad input."""
import jax
import numpy as np
import pytest

from pdjax.models.llama import KVCache
from pdjax.runtime.mesh import make_mesh
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
    assert {s.device.id for s in staged.k.addressable_shards} == set(dst_ids)
    assert staged.k.addressable_shards[0].data.shape[1] == KV_HEADS // dst_tp
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
    assert staged.moved_bytes == staged.k.nbytes + staged.v.nbytes == 2 * LAYERS * 4 * PAGE_SIZE * KV_HEADS * \
        HEAD_DIM * itemsize
    assert staged.seconds > 0
    exact = transfer_kv(src, [4, 5, 6], dst_mesh, num_tokens=tokens, pad_pages=False)
    assert exact.num_pages_sent == 3 and exact.moved_bytes == exact.k.nbytes + exact.v.nbytes
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
