"""PipelineRunner: one model replica split into pp pipeline stages, each a TP group on its own sub-mesh.

Layout. The instance's mesh is (data=1, stage=pp, tensor=tp). Stage s runs on `mesh.stage_mesh(mesh, s)` (the tp
devices at stage index s) and holds only:
- its layer range (`pdjax.config.pipeline.stage_layer_ranges`: num_layers // pp each, the remainder on the stages
  before the last, vLLM's rule) with the usual Megatron TP shardings of `pdjax.runtime.mesh`;
- the KV pages of those layers (per-layer KVCache arrays, kv heads on that sub-mesh's 'tensor');
- the embedding on stage 0; final norm and lm_head on the last stage (plus a copy of the embedding there when
  embeddings are tied, as vLLM does): the `placement` of each entry of `pdjax.models.params.param_table`,
  which `split_params` reads.
All stages use the same page tables and RaggedBatch (one block manager per instance): page p of layer l lives on
the stage holding l, and a scheduler never needs to know the split.

One step = stage 0 (embed + its layers) -> `send_activations` -> stage 1 (its layers) -> ... -> last stage (its
layers, final norm, logits at the sample rows, sampling). `send_activations` is the only place activations
cross a stage boundary (a `jax.device_put` of the hidden states [T, H] onto the next stage's sub-mesh), as KV
crosses device groups only in `pdjax.serving.kv_transfer.transfer_kv`. Each stage's function is jitted with its
KV cache donated (updated in place) and compiles once per (T, S, P) bucket of the RaggedBatch.

Asynchrony. `dispatch` only enqueues work (jit calls and device_put are asynchronous in JAX) and returns the last
stage's (not yet computed) sampled ids, so with batches k and k+1 dispatched back to back, stage 0 runs k+1
while stage 1 still runs k: every stage's work depends only on its own cache (previous batch on that stage)
and the activations of the stage before it. Nothing here limits the number of batches in flight; a request must
not sit in two in-flight batches unless its next token is fed from the previous batch's device output via
`prev` (then stage 0 of batch k+1 waits for the last stage of batch k: the token feedback path,
last stage -> stage 0, is a device_put of the sampled ids in `dispatch`).

Compile count. `stage_traces` records (stage, kind, (T, S, P)) for every trace of every stage function (kind
'hidden' for stages before the last, shared by step and logits; 'step' / 'logits' for the last stage);
`traces` / `compile_count` follow ModelRunner's meaning (one entry per compiled step / logits shape, recorded by
the last stage), so the bound `buckets.num_shapes` per function holds as for ModelRunner while the real number
of XLA compilations is at most pp times that.

Swap preemption copies a page of every layer: each stage gathers / scatters its own layers' pages, the host
store keeps [num_layers, ...] arrays in layer order (the same host format as ModelRunner).

KV between pipeline layouts: `split_kv_cache` / `merge_kv_cache` turn a per-layer cache into per-stage caches
and back (no copies); with `pdjax.config.pipeline.relayout_plan` a transfer routes each layer's pages to the
stage holding it in the destination layout (`pdjax.serving.kv_transfer.transfer_kv` reads `kv_stages` and
`kv_stage_meshes`, the hooks ModelRunner has with one stage, and scatters into `kv_stages` stage by stage).
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np
from flax import struct

from pdjax.config.model_specs import ModelSpec
from pdjax.config.pipeline import check_pipeline_parallel, stage_layer_ranges
from pdjax.kernels import get_attention_fn
from pdjax.models.llama import (KVCache, LayerParams, LlamaParams, check_runnable, embed, final_logits,
                                forward_layers, init_kv_cache)
from pdjax.models.params import TOP_FIELDS, param_table
from pdjax.runtime import mesh as mesh_lib
from pdjax.runtime.batch import Buckets, RaggedBatch, empty_batch
from pdjax.runtime.runner import ModelRunner
from pdjax.runtime.step import fed_token_ids, sampled_tokens
from pdjax.scheduler.output import SchedulerOutput


@struct.dataclass
class StageParams:
    """The params one pipeline stage holds (None where the stage does not hold that tensor)."""
    layers: Tuple[LayerParams, ...]
    embed: Optional[jax.Array] = None        # stage 0; also the last stage when embeddings are tied
    final_norm: Optional[jax.Array] = None   # last stage
    lm_head: Optional[jax.Array] = None      # last stage, untied embeddings


# --------------------------------------------------------------------------------------------------------------
# Splitting params and KV by stage (pure pytree slicing: no copies, no device work)
# --------------------------------------------------------------------------------------------------------------

def split_params(params, ranges: Sequence[Tuple[int, int]], spec: ModelSpec) -> Tuple[StageParams, ...]:
    """The StageParams of each stage for layer `ranges` (from stage_layer_ranges), by the placement of each
    tensor in `param_table(spec)`: per-layer weights go with their layer's range, the top-level ones to the
    stages their placement names (embedding first, final norm and lm_head last, a tied embedding both).

    `params` is any LlamaParams-shaped tree: arrays, shardings, or the table itself."""
    table = param_table(spec)

    def top(field: str, s: int):
        info = getattr(table, field)
        return getattr(params, field) if info is not None and info.on_stage(s, len(ranges)) else None

    return tuple(StageParams(layers=tuple(params.layers[a:b]), **{f: top(f, s) for f in TOP_FIELDS})
                 for s, (a, b) in enumerate(ranges))


def merge_params(stages: Sequence[StageParams]) -> LlamaParams:
    """A LlamaParams view of per-stage params (arrays stay where they are, on their stages' devices): the layers
    in stage order, each top-level tensor from the first stage holding it (stage 0's embedding when tied)."""
    def first_held(field: str):
        return next((getattr(st, field) for st in stages if getattr(st, field) is not None), None)

    return LlamaParams(layers=tuple(l for st in stages for l in st.layers), **{f: first_held(f) for f in TOP_FIELDS})


def split_kv_cache(kv_cache: KVCache, ranges: Sequence[Tuple[int, int]]) -> Tuple[KVCache, ...]:
    """Per-stage KVCaches of a per-layer cache: stage s gets layers ranges[s] (no copy, arrays are shared)."""
    if ranges[-1][1] != len(kv_cache.k):
        raise ValueError(f"layer ranges {list(ranges)} do not cover a KV cache of {len(kv_cache.k)} layers")
    return tuple(KVCache(k=tuple(kv_cache.k[a:b]), v=tuple(kv_cache.v[a:b])) for a, b in ranges)


def merge_kv_cache(stage_caches: Sequence[KVCache]) -> KVCache:
    """The per-layer KVCache of per-stage caches in stage order (inverse of split_kv_cache; no copy)."""
    return KVCache(k=tuple(a for c in stage_caches for a in c.k), v=tuple(a for c in stage_caches for a in c.v))


# --------------------------------------------------------------------------------------------------------------
# The stage boundary and the stage function
# --------------------------------------------------------------------------------------------------------------

def send_activations(hidden: jax.Array, dst_sharding) -> jax.Array:
    """THE stage boundary: hidden states [T, H] of one stage, placed on the next stage's sub-mesh
    (asynchronous device-to-device copy; on a real pipeline, the point-to-point send/recv)."""
    return jax.device_put(hidden, dst_sharding)


def stage_forward(params: StageParams, kv_cache: KVCache, hidden, batch: RaggedBatch, prev_ids, *,
                  spec: ModelSpec, attention_fn, first: bool, last: bool, output: str = "step", max_seqs: int = 0):
    """One stage of one step. Input: the fed token ids (first stage: batch.token_ids, with batch.token_src
    taken from prev_ids, the previous step's sampled ids) or the previous stage's hidden [T, H].
    Output: (hidden [T, H], kv_cache) for stages before the last; for the last stage (float32 logits [S, V] at
    batch.sample_indices, kv_cache) when output == 'logits', else (SampledTokens (pdjax.runtime.step.sampled_tokens:
    ids int32[max_seqs], rows past S are 0, NONFINITE_LOGITS for non-finite logits; logprobs where asked),
    kv_cache)."""
    if first:
        with jax.named_scope("embed"):
            x = embed(params, fed_token_ids(batch, prev_ids))
    else:
        x = hidden
    x, kv_cache = forward_layers(params.layers, kv_cache, x, batch, spec=spec, attention_fn=attention_fn)
    if not last:
        return x, kv_cache
    with jax.named_scope("lm_head"):
        logits = final_logits(params, x[batch.sample_indices], spec)
    if output == "logits":
        return logits, kv_cache
    return sampled_tokens(logits, batch, max_seqs), kv_cache


def make_stage_fn(spec: ModelSpec, attention_impl: str, stage_mesh, *, stage: int, pp: int, num_layers: int,
                  output: str, max_seqs: int, on_trace: Optional[Callable] = None):
    """The jitted `stage_forward` of stage `stage` of `pp` on its (1, 1, tp) `stage_mesh` (num_layers: the
    stage's layer count; output: 'hidden' before the last stage, 'step' or 'logits' on it), KV cache donated, as
    the runner runs it and `pdjax.runtime.aot` compiles it. on_trace(batch) runs at each trace."""
    attention_fn = get_attention_fn(attention_impl, stage_mesh)
    kv_sh = mesh_lib.kv_cache_sharding(stage_mesh, spec)
    out_shardings = (mesh_lib.replicated(stage_mesh), KVCache(k=(kv_sh,) * num_layers, v=(kv_sh,) * num_layers))

    def traced(params, kv_cache, hidden, batch, prev_ids):
        if on_trace is not None:
            on_trace(batch)
        return stage_forward(params, kv_cache, hidden, batch, prev_ids, spec=spec, attention_fn=attention_fn,
                             first=stage == 0, last=stage == pp - 1, output=output, max_seqs=max_seqs)

    return jax.jit(traced, donate_argnums=(1,), out_shardings=out_shardings)


# --------------------------------------------------------------------------------------------------------------
# The runner
# --------------------------------------------------------------------------------------------------------------

class PipelineRunner(ModelRunner):
    """ModelRunner's interface (build_batch, dispatch/collect, execute, execute_logits, warmup, swap,
    free_host_slots, compile_count / traces, kv_cache) over pp pipeline stages.

    Args: as ModelRunner; `mesh` is a (data=1, stage=pp, tensor=tp) mesh (pdjax.runtime.mesh.make_mesh(dp=1,
    pp=pp, tp=tp)); None means one stage on the first device. Raises ValueError (one line, naming the value) when
    the mesh is not such a mesh, pp exceeds the layer count, or tp does not divide heads / KV heads / MLP width.
    Inherits build_batch, collect, execute, swap, free_host_slots and compile_count from ModelRunner (swap works
    stage by stage through `kv_stages` and `layer_ranges`; it does not call
    ModelRunner.__init__: params and KV are allocated per stage).
    """

    def __init__(self, spec: ModelSpec, params: LlamaParams, *, num_pages: int, page_size: int = 16,
                 buckets: Optional[Buckets] = None, attention_impl: str = "auto", kv_dtype=None,
                 mesh=None, max_model_len: Optional[int] = None):
        check_runnable(spec)
        if mesh is None:
            mesh = mesh_lib.make_mesh(jax.devices()[:1])
        if tuple(mesh.axis_names) != mesh_lib.MESH_AXES:
            raise ValueError(f"mesh axes {tuple(mesh.axis_names)}, expected {mesh_lib.MESH_AXES}")
        dp, pp, tp = (int(mesh.shape[a]) for a in mesh_lib.MESH_AXES)
        if dp != 1:
            raise ValueError(f"mesh data={dp}: a PipelineRunner is one replica, expected data=1")
        check_pipeline_parallel(spec.num_layers, pp, tp, mesh.devices.size)
        mesh_lib.check_tensor_parallel(spec, tp)
        if len(params.layers) != spec.num_layers:
            raise ValueError(f"params have {len(params.layers)} layers, spec {spec.name!r} has "
                             f"num_layers={spec.num_layers}")
        self._set_limits(spec, num_pages, page_size, buckets, max_model_len, attention_impl)
        self.mesh = mesh
        self.pp, self.tp = pp, tp
        kv_dtype = kv_dtype or params.embed.dtype
        self._layer_ranges = stage_layer_ranges(spec.num_layers, pp)
        self.stage_meshes = mesh_lib.stage_meshes(mesh)
        self.attention_fn = get_attention_fn(self.attention_impl, self.stage_meshes[0])   # every stage's kind
        self._replicated = tuple(mesh_lib.replicated(m) for m in self.stage_meshes)

        stage_params, caches = [], []
        for s, (sp, sub) in enumerate(zip(split_params(params, self.layer_ranges, spec), self.stage_meshes)):
            stage_params.append(jax.device_put(sp, self._stage_param_shardings(s, sub)))
            caches.append(init_kv_cache(spec, self.num_pages, self.page_size, kv_dtype,
                                        sharding=mesh_lib.kv_cache_sharding(sub, spec), num_layers=len(sp.layers)))
        self.stage_params: Tuple[StageParams, ...] = tuple(stage_params)
        self.kv_caches: List[KVCache] = caches
        # The "previous step's ids" of a step that takes no token from one, placed like the fed-back ones.
        self._no_prev_ids = jax.device_put(np.zeros(buckets.max_seqs, np.int32), self._replicated[0])
        self.traces: List[Tuple[str, Tuple[int, int, int]]] = []
        self.stage_traces: List[Tuple[int, str, Tuple[int, int, int]]] = []
        # fns[s][kind]: kind 'hidden' for s < pp-1, 'step' and 'logits' for the last stage.
        self._fns = [self._make_stage_fn(s, kinds) for s, kinds in
                     enumerate([("hidden",)] * (pp - 1) + [("step", "logits")])]
        self.host_pages: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}

    # ----------------------------------------------------------------------------------------------------------
    def _stage_param_shardings(self, s: int, sub) -> StageParams:
        """Shardings of stage s's params on its sub-mesh `sub`: stage s's slice of the weight table, each
        entry's logical axes mapped to mesh axes (pdjax.runtime.mesh.table_shardings)."""
        stage_table = split_params(param_table(self.spec), self.layer_ranges, self.spec)[s]
        return mesh_lib.table_shardings(stage_table, sub, self.spec)

    def _make_stage_fn(self, s: int, kinds: Sequence[str]) -> dict:
        def on_trace(kind, batch):
            self.stage_traces.append((s, kind, batch.shape_key))   # once per trace = per compiled shape
            if s == self.pp - 1:
                self.traces.append((kind, batch.shape_key))

        n_layers = self.layer_ranges[s][1] - self.layer_ranges[s][0]
        return {kind: make_stage_fn(self.spec, self.attention_impl, self.stage_meshes[s], stage=s, pp=self.pp,
                                    num_layers=n_layers, output=kind, max_seqs=self.buckets.max_seqs,
                                    on_trace=functools.partial(on_trace, kind))
                for kind in kinds}

    # ----------------------------------------------------------------------------------------------------------
    @property
    def kv_cache(self) -> KVCache:
        """All layers' caches in layer order (a view; each array stays on its stage's sub-mesh)."""
        return merge_kv_cache(self.kv_caches)

    @kv_cache.setter
    def kv_cache(self, value: KVCache) -> None:
        """Replace the cache with a per-layer KVCache whose layer l is placed as its stage's cache
        (`mesh.kv_cache_sharding` of that stage's sub-mesh), e.g. KV routed here from another pipeline layout."""
        parts = split_kv_cache(value, self.layer_ranges)
        for s, part in enumerate(parts):
            want = mesh_lib.kv_cache_sharding(self.stage_meshes[s], self.spec)
            for i, arr in enumerate(part.k + part.v):
                sharding = getattr(arr, "sharding", None)
                if sharding is None or not sharding.is_equivalent_to(want, arr.ndim):
                    layer = self.layer_ranges[s][0] + i % len(part.k)
                    raise ValueError(f"KV of layer {layer} is placed as {sharding}, expected stage {s}'s {want}")
        self.kv_caches = list(parts)

    @property
    def layer_ranges(self) -> List[Tuple[int, int]]:
        """[(first, last + 1)] layers of each stage (pdjax.config.pipeline.stage_layer_ranges)."""
        return self._layer_ranges

    @property
    def kv_stages(self) -> List[KVCache]:
        """The per-stage caches (ModelRunner's hook for KV transfers; stage s holds layer_ranges[s])."""
        return list(self.kv_caches)

    @kv_stages.setter
    def kv_stages(self, caches: Sequence[KVCache]) -> None:
        caches = list(caches)
        if len(caches) != self.pp:
            raise ValueError(f"{len(caches)} stage caches given, the pipeline has pp={self.pp} stages")
        self.kv_caches = caches

    @property
    def output_devices(self) -> tuple:
        """The devices holding a step's sampled ids: the last stage's (a process without them cannot read them:
        pdjax.serving.distributed.Coordinator.collect)."""
        return tuple(self.stage_meshes[-1].devices.flat)

    @property
    def kv_stage_meshes(self) -> tuple:
        return self.stage_meshes

    @property
    def params(self) -> LlamaParams:
        """All params as a LlamaParams view (each tensor stays on its stage's sub-mesh)."""
        return merge_params(self.stage_params)

    # ----------------------------------------------------------------------------------------------------------
    def _run(self, batch: RaggedBatch, kind: str, prev_ids=None):
        """Enqueue every stage of one step (asynchronously); the last stage's output (ids or logits).
        prev_ids: the previous step's sampled ids on stage 0 (default: none fed)."""
        hidden = out = None
        outs = []
        for s in range(self.pp):
            last = s == self.pp - 1
            if s > 0:
                hidden = send_activations(out, self._replicated[s])
            fn = self._fns[s][kind if last else "hidden"]
            stage_prev = (self._no_prev_ids if prev_ids is None else prev_ids) if s == 0 else None
            out, self.kv_caches[s] = fn(self.stage_params[s], self.kv_caches[s], hidden, batch, stage_prev)
            outs.append(out)
        self._on_stage_outputs(outs)
        return out

    stage_watch = None    # a hook: on_stage_outputs(outs) per step (pdjax.runtime.stage_watch.StageWatch)

    def _on_stage_outputs(self, outs) -> None:
        """Called with every stage's (unfinished) output of a step just enqueued; hands them to the
        `stage_watch` hook when one is set (experiments/bench_pipeline.py times when each becomes ready)."""
        if self.stage_watch is not None:
            self.stage_watch.on_stage_outputs(outs)

    def dispatch(self, sched_out: SchedulerOutput, *, prev=None):
        """Launch one iteration through all stages without waiting for the device; pass the handle to
        `collect`. prev: as ModelRunner.dispatch (samples of the previous, possibly uncollected step feed this
        step's tokens on device; they travel from the last stage to stage 0)."""
        batch = self._prepare(sched_out)
        if batch is None:
            return None, np.zeros((0,), bool), False
        prev_ids = None
        if prev is not None and prev[1][0] is not None:
            src = self._sample_sources(sched_out, prev[0], batch.token_ids.shape[0])
            if src is not None:
                batch = batch.replace(token_src=src)
                prev_ids = jax.device_put(prev[1][0].ids, self._replicated[0])   # token feedback: last -> first
        sampled = self._run(batch, "step", prev_ids)
        return sampled, np.asarray(sched_out.do_sample, bool), bool(batch.want_logprobs.any())

    def execute_logits(self, sched_out: SchedulerOutput) -> np.ndarray:
        """As ModelRunner.execute_logits: float32 [num_seqs, vocab] logits at each sequence's last fed token."""
        batch = self._prepare(sched_out)
        if batch is None:
            return np.zeros((0, self.spec.vocab_size), np.float32)
        return np.asarray(self._run(batch, "logits"))[:sched_out.num_seqs]

    def warmup(self, shapes: Optional[Sequence[Tuple[int, int, int]]] = None, *, logits: bool = False,
               swap: bool = False, progress: Optional[Callable[[int], None]] = None) -> float:
        """As ModelRunner.warmup: compile every stage for `shapes` ((T, S, P) buckets; default all of them) and,
        with swap=True, every stage's swap copies of each SWAP_BUCKETS size; returns seconds taken."""
        shapes = self.buckets.all_shapes() if shapes is None else shapes
        start = time.perf_counter()
        for shape in shapes:
            jax.block_until_ready(self._run(empty_batch(tuple(shape)), "logits" if logits else "step"))
            if progress is not None:
                progress(1)
        if swap:
            self.warmup_swap()
        return time.perf_counter() - start

    # ----------------------------------------------------------------------------------------------------------
