"""KV transfer between device groups: the one place where data crosses from a prefill group to a decode group.

A request's KV moves in three steps:
1. `gather_kv_pages` (prefill side, jitted on the prefill mesh): its pages of every layer, stacked into
   k, v [L, num_kv_heads, n, page_size, head_dim]; kv heads stay sharded on the prefill mesh's 'tensor'.
2. `transfer_kv` (THE crossing): `jax.device_put` of that pair onto the decode mesh with the decode layout
   (kv heads on the decode 'tensor' axis). The TP degrees may differ (prefill TP2 -> decode TP1 or TP4):
   device_put reshards, moving every head to the decode device that owns it. Returns a `StagedKV` that
   lives on the decode devices until the decode scheduler admits the request.
3. `scatter_kv_pages` (decode side, jitted on the decode mesh, cache donated): writes the staged pages
   into the pages the decode scheduler allocated at admission.

Pages move whole (the tail of a partial last page is junk the decode side never reads: kv_lens mask it).
Byte accounting, both reported:
- `kv_bytes` = 2 · layers · tokens · kv_heads · head_dim · bytes per element (DESIGN.md's formula, the
  payload a perfect transfer would move);
- `moved_bytes` = the same over every page actually sent (whole pages, plus power-of-two padding pages
  when `pad_pages` is on; padding bounds the number of compiled gather/scatter shapes to log2(max pages)).
The transfer is synchronous: `transfer_kv` blocks until the staged arrays are ready, so its `seconds` is the
wall time of gather + cross-group copy (not the scatter, which runs on the decode side before its step).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pdjax.models.llama import KVCache


def _pad_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass
class StagedKV:
    """A request's KV staged on the decode devices: k, v [L, num_kv_heads, n_sent, page_size, head_dim]
    (kv heads sharded on the decode mesh's 'tensor'); the first `num_pages` of n_sent are real pages."""
    k: jax.Array
    v: jax.Array
    num_tokens: int
    num_pages: int
    kv_bytes: int
    moved_bytes: int
    seconds: float

    @property
    def num_pages_sent(self) -> int:
        return int(self.k.shape[2])


def kv_bytes(num_layers: int, num_tokens: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """KV bytes of `num_tokens` tokens: 2 (K and V) · layers · tokens · kv_heads · head_dim · itemsize."""
    return 2 * num_layers * num_tokens * num_kv_heads * head_dim * np.dtype(dtype).itemsize


def staged_sharding(mesh: Mesh) -> NamedSharding:
    """Layout of staged k / v [L, kv_heads, n, page_size, head_dim] on `mesh`: kv heads on 'tensor', the
    same split as the paged cache (pdjax.runtime.mesh.kv_cache_sharding), so the scatter is shard-local."""
    return NamedSharding(mesh, P(None, "tensor", None, None, None))


@jax.jit
def gather_kv_pages(kv_cache: KVCache, pages):
    """K and V of `pages` (int32[n]) for all layers: two arrays [L, num_kv_heads, n, page_size, head_dim]."""
    take = lambda a: jnp.take(a, pages, axis=1, mode="clip")  # noqa: E731
    return jnp.stack([take(a) for a in kv_cache.k]), jnp.stack([take(a) for a in kv_cache.v])


def _scatter(kv_cache: KVCache, pages, k, v):
    put = lambda a, new: a.at[:, pages].set(new.astype(a.dtype), mode="drop")  # noqa: E731
    return KVCache(k=tuple(put(a, k[i]) for i, a in enumerate(kv_cache.k)),
                   v=tuple(put(a, v[i]) for i, a in enumerate(kv_cache.v)))


_scatter_donated = jax.jit(_scatter, donate_argnums=(0,))


def _check_pages(pages: Sequence[int], num_pages: int, where: str) -> np.ndarray:
    arr = np.asarray(list(pages), dtype=np.int64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{where}: expected a non-empty list of page ids, got {list(pages)!r:.80}")
    bad = arr[(arr < 0) | (arr >= num_pages)]
    if bad.size:
        raise ValueError(f"{where}: page id {int(bad[0])} outside [0, {num_pages})")
    return arr.astype(np.int32)


def transfer_kv(src_cache: KVCache, src_pages: Sequence[int], dst_mesh: Mesh, *, num_tokens: int,
                pad_pages: bool = True) -> StagedKV:
    """Move the KV of one request from the prefill group to the decode group (the only cross-group copy).

    Args:
      src_cache: the prefill runner's paged cache (per layer [kv_heads, num_pages, page_size, head_dim],
        sharded on the prefill mesh).
      src_pages: the request's pages in token order; exactly ceil(num_tokens / page_size) of them are sent.
      dst_mesh: the decode instance's mesh; the staged arrays get `staged_sharding(dst_mesh)`.
      num_tokens: tokens whose KV is valid (the prefill's num_computed_tokens).
      pad_pages: pad the page count to a power of two (bounded compiles; padding pages are dropped by
        `scatter_kv_pages` and counted in moved_bytes).
    """
    page_size = src_cache.page_size
    if not isinstance(num_tokens, (int, np.integer)) or num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens!r}, expected a positive int")
    need = -(-int(num_tokens) // page_size)
    if len(src_pages) < need:
        raise ValueError(f"{num_tokens} tokens need {need} pages of {page_size}, src_pages has {len(src_pages)}")
    pages = _check_pages(list(src_pages)[:need], src_cache.num_pages, "transfer_kv src_pages")
    n_sent = _pad_pow2(need) if pad_pages else need
    padded = np.zeros(n_sent, np.int32)   # padding re-reads page 0: cheap, and dropped at the scatter
    padded[:need] = pages
    k0 = src_cache.k[0]
    num_layers, (kv_heads, _, _, head_dim) = len(src_cache.k), k0.shape
    start = time.perf_counter()
    k, v = gather_kv_pages(src_cache, padded)
    dst = staged_sharding(dst_mesh)
    k, v = jax.device_put((k, v), dst)
    jax.block_until_ready((k, v))
    seconds = time.perf_counter() - start
    return StagedKV(k=k, v=v, num_tokens=int(num_tokens), num_pages=need,
                    kv_bytes=kv_bytes(num_layers, int(num_tokens), kv_heads, head_dim, k0.dtype),
                    moved_bytes=kv_bytes(num_layers, n_sent * page_size, kv_heads, head_dim, k0.dtype),
                    seconds=seconds)


def scatter_kv_pages(dst_cache: KVCache, dst_pages: Sequence[int], staged: StagedKV) -> KVCache:
    """dst_cache (donated: do not use it afterwards) with the staged pages written into `dst_pages` (the
    decode scheduler's page table; its first staged.num_pages entries receive the KV)."""
    if staged.k.shape[2:] != (staged.num_pages_sent, dst_cache.page_size, dst_cache.k[0].shape[-1]) or \
            staged.k.shape[:2] != (len(dst_cache.k), dst_cache.k[0].shape[0]):
        raise ValueError(f"staged KV of shape {tuple(staged.k.shape)} does not fit a cache of {len(dst_cache.k)} "
                         f"layers x {tuple(dst_cache.k[0].shape)} (expected [L, kv_heads, n, page_size, head_dim])")
    if len(dst_pages) < staged.num_pages:
        raise ValueError(f"dst_pages has {len(dst_pages)} pages, the staged KV needs {staged.num_pages}")
    pages = _check_pages(list(dst_pages)[:staged.num_pages], dst_cache.num_pages, "scatter_kv_pages dst_pages")
    padded = np.full(staged.num_pages_sent, dst_cache.num_pages, np.int32)   # out of range -> dropped
    padded[:staged.num_pages] = pages
    return _scatter_donated(dst_cache, padded, staged.k, staged.v)
