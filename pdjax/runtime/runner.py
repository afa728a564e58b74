"""ModelRunner: the host object that executes SchedulerOutputs on one model replica.

It owns the params, the paged KV cache (donated to every step), the shape buckets and the jitted step; it
decides nothing about who runs (DESIGN.md §3). Compile count = number of traces of the step / logits
functions, recorded with the (T, S, P) bucket of each trace; with fixed buckets it is bounded by
`buckets.num_shapes` per function.

Swap preemption: `swap_out` pairs (host_slot, device_page) copy a device page (all layers, K and V) into a
host numpy store; `swap_in` pairs copy a host slot back into a device page. Both read the state from before
the call (device pages and host slots are all read first, then written), so a page or slot reused in the
same call is handled whatever the order. Copies move in chunks padded to SWAP_BUCKETS pages, so swapping
compiles two shapes per direction, both precompiled by `warmup(swap=True)`.

Slow paths are named once per process at construction (one warning line each, `slow_path_warnings`): the Pallas
kernel on CPU (interpret mode, ~100x slower than the blocked path) and a page size beyond max_model_len (every
sequence's single page is read whole by the attention, however short the sequence).

No compile after warm-up: every array the step sees is placed exactly as at warm-up (params and KV cache
committed to the runner's mesh, a single-device mesh by default; the batch as host numpy; the previous step's
ids as the step's own replicated output), so warm-up compiles each (T, S, P) bucket once and the run reuses it.
`pdjax.runtime.compiles` counts what JAX actually compiled, to check.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from pdjax.config.model_specs import ModelSpec
from pdjax.config.validate import check_max_model_len
from pdjax.kernels import get_attention_fn
from pdjax.models.llama import KVCache, LlamaParams, check_runnable, init_kv_cache
from pdjax.runtime import mesh as mesh_lib
from pdjax.runtime.batch import Buckets, RaggedBatch, build_ragged_batch, empty_batch
from pdjax.runtime.step import make_forward_logits, make_step
from pdjax.scheduler.output import SchedulerOutput

SWAP_BUCKETS = (8, 64)   # pages per swap copy; more pages move in several copies of the largest
_warned = set()          # slow-path warnings already given in this process


def slow_path_warnings(attention_impl: str, backend: str, page_size: int, max_model_len: int) -> List[str]:
    """One line per slow path this runner configuration takes (none for the default ones)."""
    notes = []
    if attention_impl == "pallas" and backend == "cpu":
        notes.append("attention_impl='pallas' on CPU runs the Pallas kernel in interpret mode, about 100x slower "
                     "than the default blocked path: use attention_impl='auto' unless you are testing the kernel")
    if page_size > max_model_len:
        notes.append(f"page_size={page_size} exceeds max_model_len={max_model_len}: every sequence gets one page of "
                     f"{page_size} tokens and the attention reads all of it however short the sequence (slow); "
                     f"a page size <= max_model_len (default 16) serves the same requests")
    return notes


def _warn_slow_paths(*args) -> None:
    for note in slow_path_warnings(*args):
        if note not in _warned:
            _warned.add(note)
            logging.warning("%s", note)


def host_local(arr) -> np.ndarray:
    """numpy copy of `arr` as far as this process can see it: the whole array when every shard is local, else
    the process's own shards in place and zeros elsewhere (multi-controller runs: a pipeline stage or TP group on
    other processes). Written back with the same sharding, each process supplies exactly its own shards, so a
    swap round trip is exact on every process."""
    if getattr(arr, "is_fully_addressable", True):
        return np.asarray(arr)
    out = np.zeros(arr.shape, arr.dtype)
    for shard in arr.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    return out


def swap_chunks(n: int):
    """[(start, stop, padded size)] covering n pages in copies of SWAP_BUCKETS sizes."""
    chunks, start = [], 0
    while start < n:
        stop = min(n, start + SWAP_BUCKETS[-1])
        chunks.append((start, stop, next(b for b in SWAP_BUCKETS if b >= stop - start)))
        start = stop
    return chunks


@jax.jit
def _gather_pages(kv_cache: KVCache, pages):
    """K and V of `pages` for all layers: two arrays [L, num_kv_heads, n, page_size, head_dim]."""
    take = lambda a: jnp.take(a, pages, axis=1, mode="clip")  # noqa: E731
    return jnp.stack([take(a) for a in kv_cache.k]), jnp.stack([take(a) for a in kv_cache.v])


@jax.jit
def _scatter_pages(kv_cache: KVCache, pages, k, v):
    """kv_cache with `pages` overwritten by k, v [L, num_kv_heads, n, page_size, head_dim]; ids out of range
    are dropped (padding)."""
    put = lambda a, new: a.at[:, pages].set(new.astype(a.dtype), mode="drop")  # noqa: E731
    return KVCache(k=tuple(put(a, k[i]) for i, a in enumerate(kv_cache.k)),
                   v=tuple(put(a, v[i]) for i, a in enumerate(kv_cache.v)))


_scatter_pages_donated = jax.jit(_scatter_pages.__wrapped__, donate_argnums=(0,))


def make_mesh_step(spec: ModelSpec, attention_impl: str, mesh, *, max_seqs: int, output: str = "step",
                   on_trace: Optional[Callable] = None):
    """The jitted step (output 'step': SampledTokens) or forward (output 'logits') of one (1, 1, tp) `mesh`, as the
    runner runs it and as `pdjax.runtime.aot` compiles it for a device it does not have: attention for the mesh's
    platform, sharded over its 'tensor' axis; the sampled ids and logprobs replicated, the KV cache donated and kept
    split on KV heads."""
    attention_fn = get_attention_fn(attention_impl, mesh)
    out_shardings = (mesh_lib.replicated(mesh), mesh_lib.kv_cache_shardings(mesh, spec))
    if output == "logits":
        return make_forward_logits(spec, attention_fn, out_shardings=out_shardings, on_trace=on_trace)
    return make_step(spec, attention_fn, max_seqs=max_seqs, out_shardings=out_shardings, on_trace=on_trace)


class ModelRunner:
    """Executes ragged steps for one model.

    Args:
      spec, params: the model (params from `init_params` / `load_model`).
      num_pages, page_size: KV cache size (pages of page_size tokens).
      buckets: padded (T, S, P) sizes; default powers of two up to 512 tokens, 64 sequences and
        max_model_len / page_size pages.
      attention_impl: 'auto' | 'blocked' | 'reference' | 'pallas' (see pdjax.kernels.get_attention_fn).
      kv_dtype: KV cache dtype (default: the params' dtype).
      mesh: optional mesh (pdjax.runtime.mesh.make_mesh); params and cache get sharded on it. Default: a
        one-device mesh on jax.devices()[0].
      max_model_len: longest sequence allowed (default spec.max_position_embeddings).
    """

    def __init__(self, spec: ModelSpec, params: LlamaParams, *, num_pages: int, page_size: int = 16,
                 buckets: Optional[Buckets] = None, attention_impl: str = "auto", kv_dtype=None,
                 mesh=None, max_model_len: Optional[int] = None):
        check_runnable(spec)
        self._set_limits(spec, num_pages, page_size, buckets, max_model_len, attention_impl)
        kv_dtype = kv_dtype or params.embed.dtype
        if mesh is None:
            mesh = mesh_lib.make_mesh(jax.devices()[:1])
        if mesh.shape["data"] != 1 or mesh.shape["stage"] != 1:   # such devices would only hold copies
            raise ValueError(f"ModelRunner runs one (1, 1, tp) mesh, got data={mesh.shape['data']} "
                             f"stage={mesh.shape['stage']}: use PipelineRunner for stages and one runner per replica")
        self.mesh = mesh
        self.params = mesh_lib.shard_params(params, mesh, spec)
        self.attention_fn = get_attention_fn(self.attention_impl, mesh)
        self.kv_cache = init_kv_cache(spec, self.num_pages, self.page_size, kv_dtype,
                                      sharding=mesh_lib.kv_cache_sharding(mesh, spec))
        # The "previous step's ids" of a step that takes no token from one: placed like the step's output.
        self._no_prev_ids = jax.device_put(np.zeros(self.buckets.max_seqs, np.int32), mesh_lib.replicated(mesh))
        self.traces: List[Tuple[str, Tuple[int, int, int]]] = []
        self._step, self._forward_logits = (
            make_mesh_step(spec, self.attention_impl, mesh, max_seqs=self.buckets.max_seqs, output=kind,
                           on_trace=lambda b, _kind=kind: self.traces.append((_kind, b.shape_key)))
            for kind in ("step", "logits"))
        self.host_pages: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}

    def _set_limits(self, spec, num_pages, page_size, buckets, max_model_len, attention_impl) -> None:
        """The host-side limits every runner checks batches against (shared with PipelineRunner)."""
        self.spec = spec
        self.page_size = int(page_size)
        self.num_pages = int(num_pages)
        self.max_model_len = int(max_model_len or spec.max_position_embeddings)
        check_max_model_len(self.max_model_len, spec, key="max_model_len")
        if buckets is None:
            buckets = Buckets.powers_of_two(512, 64, -(-self.max_model_len // self.page_size))
        self.buckets = buckets
        get_attention_fn(attention_impl)   # checks the name; each mesh gets its own (sharded) function
        self.attention_impl = attention_impl
        _warn_slow_paths(attention_impl, jax.default_backend(), self.page_size, self.max_model_len)

    @property
    def compile_count(self) -> int:
        """Number of distinct compiled step/logits shapes so far (one trace each)."""
        return len(self.traces)

    # KV by pipeline stage: what a KV transfer between instances reads and writes (pdjax.serving.kv_transfer).
    # One stage holding every layer here; PipelineRunner overrides both with its stages.
    @property
    def kv_stages(self) -> List[KVCache]:
        """The KV cache per pipeline stage, in stage order (stage s holds the layers
        pdjax.config.pipeline.stage_layer_ranges(num_layers, pp)[s])."""
        return [self.kv_cache]

    @kv_stages.setter
    def kv_stages(self, caches: Sequence[KVCache]) -> None:
        (self.kv_cache,) = caches

    @property
    def layer_ranges(self) -> List[Tuple[int, int]]:
        """[(first, last + 1)] layers of each stage in kv_stages."""
        return [(0, self.spec.num_layers)]

    @property
    def kv_stage_meshes(self) -> tuple:
        """The mesh each stage's KV lives on (kv heads on its 'tensor' axis), in stage order."""
        return (self.mesh,)

    # ------------------------------------------------------------------------------------------------------
    def build_batch(self, sched_out: SchedulerOutput) -> RaggedBatch:
        """The padded numpy RaggedBatch of `sched_out` (validated against this runner's limits)."""
        lens = [len(t) for t in sched_out.token_ids]
        if sched_out.num_new_tokens and list(sched_out.num_new_tokens) != lens:
            raise ValueError(f"num_new_tokens={list(sched_out.num_new_tokens)} do not match the lengths of "
                             f"token_ids {lens}")
        sampling = sched_out.sampling if sched_out.sampling else [None] * len(lens)
        return build_ragged_batch(
            sched_out.token_ids, sched_out.num_computed_tokens, sched_out.page_tables, sched_out.do_sample,
            sampling, page_size=self.page_size, buckets=self.buckets, max_model_len=self.max_model_len,
            num_pages=self.num_pages, vocab_size=self.spec.vocab_size)

    def _prepare(self, sched_out: SchedulerOutput) -> Optional[RaggedBatch]:
        if sched_out.swap_out or sched_out.swap_in:
            self.swap(sched_out.swap_out, sched_out.swap_in)
        if sched_out.is_empty:
            return None
        return self.build_batch(sched_out)

    def dispatch(self, sched_out: SchedulerOutput, *, prev=None):
        """Launch one iteration without waiting for the device (JAX dispatch is async); pass the returned
        handle to `collect` (and `collect_logprobs`). Lets the host do scheduler work while the step runs.

        prev: (SchedulerOutput, handle) of the previous, possibly uncollected step (async scheduling). A request
        sampled there whose entry here starts right after that step's tokens feeds that sample as its first
        token: it is taken from the previous step's device output, so the host never waits for it (the token id
        in `sched_out` is a placeholder)."""
        batch = self._prepare(sched_out)
        if batch is None:
            return None, np.zeros((0,), bool), False
        prev_ids = self._no_prev_ids
        if prev is not None and prev[1][0] is not None:
            src = self._sample_sources(sched_out, prev[0], batch.token_ids.shape[0])
            if src is not None:
                batch, prev_ids = batch.replace(token_src=src), prev[1][0].ids
        sampled, self.kv_cache = self._step(self.params, self.kv_cache, batch, prev_ids)
        return sampled, np.asarray(sched_out.do_sample, bool), bool(batch.want_logprobs.any())

    @staticmethod
    def _sample_sources(sched_out: SchedulerOutput, prev_out: SchedulerOutput, num_tokens: int):
        """int32[num_tokens]: index into the previous step's sampled ids for each fed token, -1 for tokens the
        host knows; None when no token comes from the previous step."""
        prev_end = {rid: (j, c + n) for j, (rid, c, n, s) in enumerate(zip(
            prev_out.req_ids, prev_out.num_computed_tokens, prev_out.num_new_tokens, prev_out.do_sample)) if s}
        src = None
        offset = 0
        for rid, start, n in zip(sched_out.req_ids, sched_out.num_computed_tokens, sched_out.num_new_tokens):
            hit = prev_end.get(rid)
            if hit is not None:
                if start != hit[1]:
                    raise RuntimeError(f"request {rid!r} resumes at token {start}, but its sample from the "
                                       f"previous step sits at {hit[1]}: that token is not known on the host")
                if src is None:
                    src = np.full(num_tokens, -1, np.int32)
                src[offset] = hit[0]
            offset += n
        return src

    @property
    def output_devices(self) -> tuple:
        """The devices holding a step's sampled ids (replicated): the whole tensor-parallel mesh."""
        return tuple(self.mesh.devices.flat)

    @staticmethod
    def collect(handle) -> np.ndarray:
        """Wait for a dispatched iteration; int32[num_seqs] sampled ids, -1 where do_sample is False."""
        sampled, do_sample = handle[0], handle[1]
        if sampled is None:
            return np.zeros((0,), np.int32)
        ids = np.asarray(sampled.ids)[:do_sample.shape[0]].astype(np.int32)   # ids: int32[max_seqs]
        return np.where(do_sample, ids, -1).astype(np.int32)

    @staticmethod
    def logprobs_asked(handle) -> bool:
        """Whether some sequence of a dispatched iteration asked for logprobs (known on the host: no device read)."""
        return handle[0] is not None and bool(handle[2])

    @staticmethod
    def collect_logprobs(handle) -> Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """The logprobs of a dispatched iteration whose batch asked for some: (logprob float32[num_seqs] of each
        sampled token, top ids int32[num_seqs, K], top logprobs float32[num_seqs, K]; rows of sequences that did
        not ask hold values too); None when none asked (nothing is read from the device)."""
        if not ModelRunner.logprobs_asked(handle):
            return None
        sampled, do_sample, _ = handle
        n = do_sample.shape[0]
        return (np.asarray(sampled.logprob)[:n], np.asarray(sampled.top_ids)[:n],
                np.asarray(sampled.top_logprobs)[:n])

    def execute(self, sched_out: SchedulerOutput) -> np.ndarray:
        """Run one iteration; int32[num_seqs] sampled ids, -1 where do_sample is False."""
        return self.collect(self.dispatch(sched_out))

    def execute_logits(self, sched_out: SchedulerOutput) -> np.ndarray:
        """Run one iteration (KV written as in `execute`); float32 [num_seqs, vocab] logits at each
        sequence's last fed token."""
        batch = self._prepare(sched_out)
        if batch is None:
            return np.zeros((0, self.spec.vocab_size), np.float32)
        logits, self.kv_cache = self._forward_logits(self.params, self.kv_cache, batch, self._no_prev_ids)
        return np.asarray(logits)[:sched_out.num_seqs]

    def warmup(self, shapes: Optional[Sequence[Tuple[int, int, int]]] = None, *, logits: bool = False,
               swap: bool = False, progress: Optional[Callable[[int], None]] = None) -> float:
        """Compile the step for `shapes` ((T, S, P) buckets; default all of them), and with swap=True the swap
        copies of every SWAP_BUCKETS size; returns seconds taken. progress(1) after each shape."""
        shapes = self.buckets.all_shapes() if shapes is None else shapes
        start = time.perf_counter()
        fn = self._forward_logits if logits else self._step
        for shape in shapes:
            out, self.kv_cache = fn(self.params, self.kv_cache, empty_batch(tuple(shape)), self._no_prev_ids)
            jax.block_until_ready(out)
            if progress is not None:
                progress(1)
        if swap:
            self.warmup_swap()
        return time.perf_counter() - start

    def warmup_swap(self) -> None:
        """Compile every stage's swap copies of each SWAP_BUCKETS size (pages out of range: nothing written)."""
        stages = self.kv_stages
        for size in SWAP_BUCKETS:
            for s, cache in enumerate(stages):
                k, v = _gather_pages(cache, np.zeros(size, np.int32))
                stages[s] = _scatter_pages_donated(cache, np.full(size, self.num_pages, np.int32), host_local(k),
                                                   host_local(v))
        jax.block_until_ready(stages)
        self.kv_stages = stages

    # ------------------------------------------------------------------------------------------------------
    def swap(self, swap_out: Sequence[Tuple[int, int]], swap_in: Sequence[Tuple[int, int]]) -> None:
        """Copy device pages to host slots (swap_out) and host slots to device pages (swap_in); the host store holds
        [num_layers, ...] arrays whatever the pipeline split (each stage copies its own layers' pages)."""
        for _, page in list(swap_out) + list(swap_in):
            if not 0 <= page < self.num_pages:
                raise ValueError(f"swap page {page} outside [0, {self.num_pages})")
        missing = [slot for slot, _ in swap_in if slot not in self.host_pages]
        if missing:
            raise ValueError(f"swap_in of host slots {missing} that hold no swapped-out page")
        out_data = []   # (k, v) numpy [L, kvh, page_size, hd] per swapped-out page, read before any write
        for a, b, size in swap_chunks(len(swap_out)):
            pages = np.zeros(size, np.int32)
            pages[:b - a] = [p for _, p in swap_out[a:b]]
            parts = [_gather_pages(cache, pages) for cache in self.kv_stages]   # every stage enqueued first
            k, v = (np.concatenate([host_local(part[i]) for part in parts]) for i in (0, 1))
            out_data += [(k[:, :, j].copy(), v[:, :, j].copy()) for j in range(b - a)]
        in_data = [self.host_pages[slot] for slot, _ in swap_in]
        for a, b, size in swap_chunks(len(swap_in)):
            pages = np.full(size, self.num_pages, np.int32)  # out of range -> dropped
            pages[:b - a] = [p for _, p in swap_in[a:b]]
            shape = in_data[0][0].shape  # [L, kvh, page_size, hd]
            k = np.zeros(shape[:2] + (size,) + shape[2:], in_data[0][0].dtype)
            v = np.zeros_like(k)
            for j, (hk, hv) in enumerate(in_data[a:b]):
                k[:, :, j], v[:, :, j] = hk, hv
            stages = self.kv_stages
            for st, (lo, hi) in enumerate(self.layer_ranges):
                stages[st] = _scatter_pages_donated(stages[st], pages, k[lo:hi], v[lo:hi])
            self.kv_stages = stages
        for (slot, _), data in zip(swap_out, out_data):
            self.host_pages[slot] = data

    def zero_pages(self, pages: Sequence[int]) -> None:
        """Overwrite device `pages` with zeros in every stage, K and V. For the pages a request whose logits went
        non-finite leaves behind: attention weighs a page's not yet written slots by 0, and 0 * NaN = NaN would
        poison the next request given the page. Uses the swap-in copies (precompiled by warmup(swap=True))."""
        template = self.kv_stages[0].k[0]                       # [num_kv_heads, num_pages, page_size, head_dim]
        kvh, _, ps, hd = template.shape
        for a, b, size in swap_chunks(len(pages)):
            chunk = np.full(size, self.num_pages, np.int32)     # out of range -> dropped
            chunk[:b - a] = pages[a:b]
            stages = self.kv_stages
            for st, (lo, hi) in enumerate(self.layer_ranges):
                zeros = np.zeros((hi - lo, kvh, size, ps, hd), template.dtype)
                stages[st] = _scatter_pages_donated(stages[st], chunk, zeros, zeros)
            self.kv_stages = stages

    def free_host_slots(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self.host_pages.pop(slot, None)
