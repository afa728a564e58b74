"""KV transfer between device groups: the one place where data crosses from a prefill group to a decode group.

Both sides may be pipelined (pp stages, each a TP group on its own sub-mesh holding a contiguous layer range:
`pdjax.config.pipeline.stage_layer_ranges`) and the two layouts may differ in pp and tp at the same time
(prefill tp2 x pp2 -> decode tp1 x pp2, pp2 -> pp1, pp1 -> pp2, ...). A side is given as its per-stage KV caches
(source) or per-stage meshes (destination): `ModelRunner.kv_stages` / `kv_stage_meshes` (one stage) and
`PipelineRunner`'s overrides; a single KVCache / Mesh means one stage holding every layer.

A request's KV moves in three steps:
1. `gather_kv_pages` (source side, jitted per source stage, on that stage's devices): the request's pages of the
   stage's layers, one [num_kv_heads, n, page_size, head_dim] array per layer (kv heads stay sharded on the
   stage's 'tensor'). Every stage's gather is enqueued before anything moves.
2. `transfer_kv` (THE crossing, `cross_device_put`): every layer onto the destination stage that holds it
   (`relayout_plan`), with that stage's KV layout (kv heads on its 'tensor' axis); the TP degrees may differ and
   every head goes to the device that owns it. The route is chosen per layer, the same on every process
   (`crossing_route`): in one process, one batched `jax.device_put` (it reshards); between processes
   (multi-controller JAX, pdjax.serving.distributed), JAX 0.10 only sends identical layouts, so identical
   layouts go by one batched device_put (its cross-host transfer) and different ones as single-device head
   pieces: each destination device's heads are cut on a source device holding them, sent device to device
   (one device_put per device pair: a batch mixing devices is mispaired on jax 0.10.2, see `_by_pieces`) and
   concatenated on arrival; groups that share a process copy locally. Returns a `StagedKV` (per layer, in
   layer order, on the destination devices) that waits there until the decode scheduler admits the request;
   on a process holding none of the destination devices its arrays have no local data (and are ready at once).
3. `scatter_kv_pages` (destination side, jitted per destination stage, that stage's cache donated): writes the
   staged pages of the stage's layers into the pages the decode scheduler allocated at admission.

Pages move whole (the tail of a partial last page is junk the decode side never reads: kv_lens mask it).
Byte accounting, both reported:
- `kv_bytes` = 2 · layers · tokens · kv_heads · head_dim · bytes per element (DESIGN.md's formula, the
  payload a perfect transfer would move);
- `moved_bytes` = the same over every page actually sent (whole pages, plus power-of-two padding pages
  when `pad_pages` is on; padding bounds the number of compiled gather/scatter shapes to log2(max pages)).
Synchronous or asynchronous: `transfer_kv(..., wait=True)` (the default) blocks until the staged arrays are
ready, so its `seconds` is the wall time of gather + cross-group copy (not the scatter, which runs on the decode
side before its step). `wait=False` only enqueues the gathers and the copy (JAX dispatch is asynchronous) and
returns at once with `seconds=0.0`: the caller polls `StagedKV.is_ready()` (every staged array ready, i.e. the
pages have landed on the decode devices) or blocks in `StagedKV.wait()`, and measures the time itself
(pdjax.serving.cluster.ClusterEngine does both). The source pages must stay allocated until then: the gather
reads them (the prefill step that runs meanwhile may donate and update the cache; JAX orders the two, and the
held pages are never written by it).
Compiles: one gather per (source stage, padded page count) and one scatter per (destination stage, padded page
count), plus, between processes with different layouts, the pieces' slices and concatenations per page count;
`pdjax.serving.cluster.ClusterEngine.warmup_transfers` runs them all before serving.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import List, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pdjax.config.pipeline import relayout_plan, stage_layer_counts, stage_layer_ranges
from pdjax.models.llama import KVCache

StageCaches = Union[KVCache, Sequence[KVCache]]   # one cache (one stage) or per-stage caches in stage order
StageMeshes = Union[Mesh, Sequence[Mesh]]         # one mesh (one stage) or per-stage meshes in stage order


def _pad_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass
class StagedKV:
    """A request's KV staged on the decode devices: k[l], v[l] [num_kv_heads, n_sent, page_size, head_dim] per
    layer in layer order, each on the destination stage holding layer l (kv heads sharded on its 'tensor');
    `layer_ranges` are the destination stages' layer ranges; the first `num_pages` of n_sent are real pages."""
    k: Tuple[jax.Array, ...]
    v: Tuple[jax.Array, ...]
    layer_ranges: Tuple[Tuple[int, int], ...]
    num_tokens: int
    num_pages: int
    kv_bytes: int
    moved_bytes: int
    seconds: float

    @property
    def num_pages_sent(self) -> int:
        return int(self.k[0].shape[1])

    @property
    def num_stages(self) -> int:
        return len(self.layer_ranges)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.k + self.v)

    def is_ready(self) -> bool:
        """Whether every staged array has landed on the destination devices (never blocks)."""
        return all(a.is_ready() for a in self.k + self.v)

    def wait(self) -> None:
        """Block until every staged array has landed."""
        jax.block_until_ready((self.k, self.v))


def kv_bytes(num_layers: int, num_tokens: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """KV bytes of `num_tokens` tokens: 2 (K and V) · layers · tokens · kv_heads · head_dim · itemsize."""
    return 2 * num_layers * num_tokens * num_kv_heads * head_dim * np.dtype(dtype).itemsize


def staged_sharding(mesh: Mesh) -> NamedSharding:
    """Layout of one staged layer [kv_heads, n, page_size, head_dim] on `mesh`: kv heads on 'tensor', the same
    split as the paged cache (pdjax.runtime.mesh.kv_cache_sharding), so the scatter is shard-local."""
    return NamedSharding(mesh, P("tensor", None, None, None))


@jax.jit
def gather_kv_pages(kv_cache: KVCache, pages):
    """K and V of `pages` (int32[n]) for the cache's layers: two tuples of [num_kv_heads, n, page_size, head_dim]
    arrays, one per layer."""
    take = lambda a: jnp.take(a, pages, axis=1, mode="clip")  # noqa: E731
    return tuple(take(a) for a in kv_cache.k), tuple(take(a) for a in kv_cache.v)


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


def as_stage_caches(caches: StageCaches, where: str) -> Tuple[List[KVCache], bool]:
    """(per-stage caches, whether a single KVCache was given); checks the stages split the layers as
    stage_layer_ranges does (the rule PipelineRunner places its stages by)."""
    single = isinstance(caches, KVCache)
    stages = [caches] if single else list(caches)
    if not stages or not all(isinstance(c, KVCache) for c in stages):
        raise ValueError(f"{where}: expected a KVCache or a non-empty sequence of per-stage KVCaches")
    counts = tuple(len(c.k) for c in stages)
    if any(n < 1 for n in counts) or counts != stage_layer_counts(sum(counts), len(stages)):
        raise ValueError(f"{where}: stages hold {list(counts)} layers, expected the pipeline split "
                         f"{list(stage_layer_counts(max(sum(counts), len(stages)), len(stages)))}")
    return stages, single


def transfer_kv(src_cache: StageCaches, src_pages: Sequence[int], dst: StageMeshes, *, num_tokens: int,
                pad_pages: bool = True, wait: bool = True) -> StagedKV:
    """Move the KV of one request from the prefill group to the decode group (the only cross-group copy).

    Args:
      src_cache: the prefill side's paged cache (per layer [kv_heads, num_pages, page_size, head_dim]): one
        KVCache on one mesh, or its per-stage caches (`runner.kv_stages`), each on its stage's devices.
      src_pages: the request's pages in token order; exactly ceil(num_tokens / page_size) of them are sent.
      dst: the decode side's mesh, or its per-stage meshes (`runner.kv_stage_meshes`); layer l is staged on the
        stage holding it (stage_layer_ranges(num_layers, len(dst))) with `staged_sharding` of that stage's mesh.
      num_tokens: tokens whose KV is valid (the prefill's num_computed_tokens).
      pad_pages: pad the page count to a power of two (bounded compiles; padding pages are dropped by
        `scatter_kv_pages` and counted in moved_bytes).
      wait: block until the staged arrays are ready (`seconds` = gather + copy wall time); False: return as
        soon as the copy is enqueued (`seconds` = 0.0; poll `is_ready()` / `wait()` on the result).
    """
    stages, _ = as_stage_caches(src_cache, "transfer_kv src_cache")
    dst_meshes = [dst] if isinstance(dst, Mesh) else list(dst)
    if not dst_meshes or not all(isinstance(m, Mesh) for m in dst_meshes):
        raise ValueError("transfer_kv dst: expected a Mesh or a non-empty sequence of per-stage Meshes")
    num_layers = sum(len(c.k) for c in stages)
    if len(dst_meshes) > num_layers:
        raise ValueError(f"transfer_kv dst: {len(dst_meshes)} stages for {num_layers} layers")
    page_size = stages[0].page_size
    if not isinstance(num_tokens, (int, np.integer)) or num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens!r}, expected a positive int")
    need = -(-int(num_tokens) // page_size)
    if len(src_pages) < need:
        raise ValueError(f"{num_tokens} tokens need {need} pages of {page_size}, src_pages has {len(src_pages)}")
    pages = _check_pages(list(src_pages)[:need], stages[0].num_pages, "transfer_kv src_pages")
    n_sent = _pad_pow2(need) if pad_pages else need
    padded = np.zeros(n_sent, np.int32)   # padding re-reads page 0: cheap, and dropped at the scatter
    padded[:need] = pages
    plan = relayout_plan(num_layers, len(stages), len(dst_meshes))
    targets = [staged_sharding(dst_meshes[ds]) for _, _, _, ds, _ in plan]
    k0 = stages[0].k[0]
    kv_heads, head_dim = k0.shape[0], k0.shape[-1]
    start = time.perf_counter()
    gathered = [gather_kv_pages(c, padded) for c in stages]   # every source stage enqueued before any copy
    k = [gathered[ss][0][si] for _, ss, si, _, _ in plan]
    v = [gathered[ss][1][si] for _, ss, si, _, _ in plan]
    k, v = cross_device_put(k + v, targets + targets, split=len(k))   # per layer, to the stage holding it
    seconds = 0.0
    if wait:
        jax.block_until_ready((k, v))
        seconds = time.perf_counter() - start
    return StagedKV(k=tuple(k), v=tuple(v), layer_ranges=stage_layer_ranges(num_layers, len(dst_meshes)),
                    num_tokens=int(num_tokens), num_pages=need,
                    kv_bytes=kv_bytes(num_layers, int(num_tokens), kv_heads, head_dim, k0.dtype),
                    moved_bytes=kv_bytes(num_layers, n_sent * page_size, kv_heads, head_dim, k0.dtype),
                    seconds=seconds)


# ------------------------------------------------------------------------------------------------------------
# The crossing itself: one device_put where JAX can do it, head pieces between processes otherwise
# ------------------------------------------------------------------------------------------------------------
def _processes(sharding) -> frozenset:
    return frozenset(d.process_index for d in sharding.device_set)


def crossing_route(ndim: int, src: jax.sharding.Sharding, dst: jax.sharding.Sharding) -> str:
    """How `cross_device_put` moves an array of `ndim` dims from sharding `src` to `dst` (the same answer on
    every process: it depends on the global device assignment only):
    - 'device_put': one process, or source and destination on disjoint process sets with the same layout (same
      HLO sharding over their own devices): one jax.device_put (JAX's cross-host transfer between processes);
    - 'local': every device of both on one process p: a local device_put (reshards) on p, a placeholder
      elsewhere;
    - 'pieces': anything else between processes (different TP layouts, groups sharing a process): JAX 0.10 can
      only send identical layouts between processes, so the array travels as single-device head pieces, each
      straight from a source device holding it to the destination device that owns it (single device ->
      single device: an identical layout), and is reassembled there (`_by_pieces`)."""
    if jax.process_count() == 1:
        return "device_put"
    sp, dp = _processes(src), _processes(dst)
    if len(sp | dp) == 1:
        return "local"
    if sp.isdisjoint(dp) and len(src.device_set) == len(dst.device_set) and \
            src._to_xla_hlo_sharding(ndim) == dst._to_xla_hlo_sharding(ndim):
        return "device_put"
    return "pieces"


def _placeholder(shape, sharding, dtype) -> jax.Array:
    """The global array `sharding` describes, on a process holding none of its devices (no local data)."""
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, [], dtype=dtype)


def _local_shard(x: jax.Array, device) -> jax.Array:
    for shard in x.addressable_shards:
        if shard.device == device:
            return shard.data
    raise AssertionError(f"{device} holds no shard of the array")


@functools.partial(jax.jit, static_argnums=(1, 2))
def _slice_heads(x, start: int, stop: int):
    return jax.lax.slice_in_dim(x, start, stop, axis=0)


@jax.jit
def _concat_heads(*xs):
    return jnp.concatenate(xs, axis=0)


def _head_ranges(sharding, shape) -> dict:
    """device -> (start, stop) of axis 0 it holds; every other axis must be whole (the KV layouts: heads split
    on 'tensor', or replicated)."""
    out = {}
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        for axis, sl in enumerate(index[1:], 1):
            if (sl.start or 0) != 0 or sl.stop not in (None, shape[axis]) or sl.step not in (None, 1):
                raise NotImplementedError(f"cross-process transfer splits only axis 0, got {sharding} over {shape}")
        sl = index[0]
        out[device] = (sl.start or 0, shape[0] if sl.stop is None else sl.stop)
    return out


def _piece_plans(xs: Sequence[jax.Array], targets: Sequence[jax.sharding.Sharding]):
    """_by_pieces' plan: (per array [(dst device, [(lo, hi, piece index)])], pieces as (source array index, src
    device, lo - src start, hi - src start, dst device)); each destination range is cut from a source device
    holding it, one on the destination's process if any, else the first in the source's device order."""
    plans = []
    pieces = []
    for i, (x, target) in enumerate(zip(xs, targets)):
        src_ranges = _head_ranges(x.sharding, x.shape)
        order = {d: n for n, d in enumerate(x.sharding._device_assignment)}
        plan = []
        for dev, (a, b) in sorted(_head_ranges(target, x.shape).items(), key=lambda kv: kv[0].id):
            parts, pos = [], a
            while pos < b:
                holders = [d for d, (c, e) in src_ranges.items() if c <= pos < e]
                holders.sort(key=lambda d: (d.process_index != dev.process_index, order[d]))
                src_dev = holders[0]
                c, e = src_ranges[src_dev]
                hi = min(b, e)
                parts.append((pos, hi, len(pieces)))
                pieces.append((i, src_dev, pos - c, hi - c, dev))
                pos = hi
            plan.append((dev, parts))
        plans.append(plan)
    return plans, pieces


def _by_pieces(xs: Sequence[jax.Array], targets: Sequence[jax.sharding.Sharding]) -> List[jax.Array]:
    """Every xs[i] onto targets[i] as head pieces (crossing_route 'pieces'), identically on every process: for
    each destination device, the head ranges it owns are cut (on the source device, locally) from a source
    device holding them (one on the destination's process if any, else the first); the pieces that cross
    processes go in one batched device_put per (source device, destination device) pair (single device ->
    single device, every process calls it, pairs in device id order), the others are copied by the process
    holding both ends; the destination process concatenates each device's pieces on that device and every
    process wraps the per-device arrays into the target sharding (no local data on a process without
    destination devices).

    Why per pair: on jax 0.10.2 (CPU, jax_cross_host_transfer_socket_address), ONE cross-process device_put of
    several single-device arrays whose source or destination devices differ pairs the buffers up wrongly:
    [dev0 -> dev4, dev1 -> dev4] lands dev1's data in the first result and dev0's in the second (silently,
    when the shapes agree), [dev0 -> dev4, dev0 -> dev5] swaps them too, and after such a batch later transfers
    may never land (the receiver blocks forever). Batches of one source and one destination device land
    exactly (and so do identical-layout multi-device arrays, the 'device_put' route), in any sequence tried."""
    me = jax.process_index()
    plans, pieces = _piece_plans(xs, targets)

    def cut(i, src_dev, lo, hi):   # the piece on its source device: a real array on its process, else a placeholder
        x = xs[i]
        shape = (hi - lo,) + tuple(x.shape[1:])
        if src_dev.process_index != me:
            return _placeholder(shape, jax.sharding.SingleDeviceSharding(src_dev), x.dtype)
        shard = _local_shard(x, src_dev)
        return shard if (lo, hi) == (0, shard.shape[0]) else _slice_heads(shard, lo, hi)

    arrived: List = [None] * len(pieces)
    pairs: dict = {}     # (src device, dst device) -> crossing pieces, in piece order
    for n, (_, s, _, _, d) in enumerate(pieces):
        if s.process_index != d.process_index:
            pairs.setdefault((s.id, d.id), []).append(n)
    for _, ns in sorted(pairs.items()):
        # ONE device_put per device pair: a batch mixing devices is mispaired on jax 0.10.2 (see the docstring)
        sent = jax.device_put([cut(*pieces[n][:4]) for n in ns],
                              [jax.sharding.SingleDeviceSharding(pieces[ns[0]][4])] * len(ns))
        for n, a in zip(ns, sent):
            arrived[n] = a
    for n, (i, src_dev, lo, hi, dev) in enumerate(pieces):
        if arrived[n] is None and dev.process_index == me:   # both ends on this process
            piece = cut(i, src_dev, lo, hi)
            arrived[n] = piece if src_dev == dev else jax.device_put(piece, dev)
    out = []
    for x, target, plan in zip(xs, targets, plans):
        local = []
        for dev, parts in plan:
            if dev.process_index != me:
                continue
            got = [arrived[n] for _, _, n in parts]
            local.append(got[0] if len(got) == 1 else _concat_heads(*got))
        out.append(jax.make_array_from_single_device_arrays(tuple(x.shape), target, local, dtype=x.dtype))
    return out


def cross_device_put(xs: Sequence[jax.Array], targets: Sequence[jax.sharding.Sharding],
                     split: int = 0) -> Tuple[List[jax.Array], ...]:
    """xs[i] onto targets[i], between any two layouts and processes (route per array: `crossing_route`),
    without blocking; every process must call it with the same (global) arrays and targets. Returns the list
    split in two at `split` (transfer_kv: K layers then V layers), or (list, []) when split is 0."""
    xs, targets = list(xs), list(targets)
    out: List = [None] * len(xs)
    routes = [crossing_route(x.ndim, x.sharding, t) for x, t in zip(xs, targets)]
    direct = [i for i, r in enumerate(routes) if r == "device_put"]
    if direct:
        for i, a in zip(direct, jax.device_put([xs[i] for i in direct], [targets[i] for i in direct])):
            out[i] = a
    me = jax.process_index()
    for i, r in enumerate(routes):
        if r == "local":
            owner = next(iter(_processes(targets[i])))
            out[i] = jax.device_put(xs[i], targets[i]) if owner == me else \
                _placeholder(xs[i].shape, targets[i], xs[i].dtype)
    by_pieces = [i for i, r in enumerate(routes) if r == "pieces"]
    if by_pieces:
        for i, a in zip(by_pieces, _by_pieces([xs[i] for i in by_pieces], [targets[i] for i in by_pieces])):
            out[i] = a
    split = split or len(out)
    return out[:split], out[split:]


def scatter_kv_pages(dst_cache: StageCaches, dst_pages: Sequence[int], staged: StagedKV) -> StageCaches:
    """dst_cache (donated: do not use it afterwards) with the staged pages written into `dst_pages` (the
    decode scheduler's page table; its first staged.num_pages entries receive the KV). dst_cache is one KVCache
    (one stage) or the per-stage caches (`runner.kv_stages`); returns the same kind."""
    stages, single = as_stage_caches(dst_cache, "scatter_kv_pages dst_cache")
    ranges = stage_layer_ranges(sum(len(c.k) for c in stages), len(stages))
    first = stages[0].k[0]
    want = (first.shape[0], staged.num_pages_sent, first.shape[2], first.shape[3])
    if tuple(ranges) != tuple(staged.layer_ranges) or any(tuple(a.shape) != want for a in staged.k + staged.v):
        raise ValueError(f"staged KV of {len(staged.k)} layers x {tuple(staged.k[0].shape)} in stages "
                         f"{list(staged.layer_ranges)} does not fit a cache of {ranges[-1][1]} layers x "
                         f"{tuple(first.shape)} in stages {list(ranges)} (expected per layer [kv_heads, n, "
                         "page_size, head_dim], the same pipeline split)")
    if len(dst_pages) < staged.num_pages:
        raise ValueError(f"dst_pages has {len(dst_pages)} pages, the staged KV needs {staged.num_pages}")
    pages = _check_pages(list(dst_pages)[:staged.num_pages], stages[0].num_pages, "scatter_kv_pages dst_pages")
    padded = np.full(staged.num_pages_sent, stages[0].num_pages, np.int32)   # out of range -> dropped
    padded[:staged.num_pages] = pages
    out = [_scatter_donated(cache, padded, staged.k[a:b], staged.v[a:b]) for cache, (a, b) in zip(stages, ranges)]
    return out[0] if single else out
