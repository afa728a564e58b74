"""Step time of one SchedulerOutput for the simulator, including the real engine's shape padding.

Why padding matters: the pdjax engine pads every step to (T, S, P) buckets (tokens, sequences, pages per
sequence; powers of two by default, see pdjax.runtime.batch.Buckets) so it compiles a bounded number of times.
On the CPU engine the plain-jnp reference attention then attends every padded query token over every padded
page of its sequence's table, so a step costs what its *bucket* costs, not what its tokens cost. Two modes:

- `dense_attention=True` (the jnp reference path, CPU): the step is costed as the cost model's composition of
  T_pad one-token queries each reading P_pad·page_size keys (`decodes=((T_pad, P_pad·page_size − 1),)`), which
  is exactly the work of the reference kernel (every token gathers and scores its own K/V block), and linear
  layers on T_pad tokens. The fitted efficiencies absorb the rest.
- `dense_attention=False` (Pallas kernels, GPU/TPU): attention does the real work; only the linear layers see
  the token padding, costed as T_pad − T extra one-token decodes at context 0.
- `attention='blocked'` (the blocked XLA kernel, the CPU default; `dense_attention=False`): as above for the
  chunks, but its decode pass is one loop over the key blocks of the *longest* context in it, run by every slot
  of its padded width (S_pad slots; T_pad tokens when T_pad <= S_pad, where every token, chunk tokens included,
  is an item and there is no chunk pass), so it costs width x key blocks of the longest context, not count x mean
  context (`BatchComposition.decode_pass`, see `_blocked_composition`).
- In both padded modes the per-sequence host cost (`cost_model.per_seq_host_s`) counts the real sequences (the
  composition's stand-in sequences are padded work):
  time = iteration_time(padded composition) + per_seq_host_s · (S − composition seqs).
- No padding (None): the real composition (GPU profiles fitted on operator data, e.g. profiles/a100.json).

Buckets are derived from the serve config with `engine_buckets`, the rule of pdjax.serving.build.default_buckets
(tests check the two agree).

A profile (pdjax.sim.profile) may carry "padding" ({"dense_attention": bool, optional "attention": 'reference' |
'blocked' | 'pallas' and "decode_keys": the blocked decode pass's key block}): `padding_from_profile` turns it into
the EnginePadding of the serve config's buckets, so steps are costed at the engine's bucket shapes and kernel.

Step context: the step-time functions take an optional second argument, a StepContext (pdjax.sim.simulator:
the previous step's SchedulerOutput and the idle seconds before this step; `takes_context` says so), and add
`cost_model.context_time`: `shape_switch_s` when the padded (T, S, P) shape differs from the previous step's
(only with padding), the idle-wake terms after an idle gap. With those CostParams at 0 (the default, every GPU
profile) the context is ignored and the time is bit-identical to the context-free one.

Step noise: a host-CPU profile may carry "step_noise" ({"quantiles": [...], ...}: the engine loop's measured /
predicted step seconds on steady decode steps of a calibration probe, at evenly spaced probabilities 0..1;
experiments.calibrate). With it (and sim.step_noise on), every simulated step is multiplied by a factor drawn
i.i.d. from that distribution (`StepNoise`, seeded by the run's seed, so a run is still deterministic): the
deterministic model has the right median but no tail, and the P99 TBT of a CPU engine is its step-time tail.
GPU profiles carry none.

The step-time sources here are pdjax.sim.step_time.StepTime implementations (StepTimeBase subclasses):
`CostModelStepTime` (one stage) and `PipelineStepTime` (pp stages); `CostModelStack` is the 'pdjax' serving stack
that makes them (registered with pdjax.sim.step_time.register_stack).

Pipeline parallelism (pp > 1): `make_step_time` returns a `PipelineStepTime`, whose `stage_times(out)` gives the
seconds of each stage (its layers only, `cost_model.stage_times`) and of each activation send; the simulator
runs the stages as resources with up to pp batches in flight, so bubbles come out of the schedule (the old
whole-iteration `num_microbatches` formula is not used here any more). Calling it gives one batch's latency
alone through the pipeline (sum of stages and sends). pp == 1 keeps the plain function and its exact numbers.

Speed: `compact_composition` groups decodes into at most two (count, context) groups with the exact same context
sum, which gives the same cost-model time as the per-request composition (the model aggregates decodes by their
mean context) at a fraction of the Python work.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Callable, Optional, Sequence, Tuple

from pdjax.config.buckets import Buckets
from pdjax.config.model_specs import ModelSpec
from pdjax.sim import cost_model as cm
from pdjax.sim.cost_model import BatchComposition, CostParams, _plan
from pdjax.sim.hardware import HardwareSpec
from pdjax.sim.step_time import GroupTiming, StepTime, StepTimeBase, register_stack


ATTENTION_IMPLS = ("reference", "blocked", "pallas")
BLOCKED_DECODE_KEYS = 128    # pdjax.kernels.blocked.DECODE_KEYS (mirrored: pdjax.sim imports no JAX)


@dataclasses.dataclass(frozen=True)
class EnginePadding:
    """How the engine pads a step and which attention implementation runs it (module docstring).
    attention: 'reference' (dense over the page bucket), 'blocked' (the XLA CPU kernel: decodes cost by the
    longest context of the pass), 'pallas', or '' (not recorded: real context unless dense_attention).
    decode_keys: keys per step of the blocked kernel's decode pass (its `decode_keys`)."""
    buckets: Buckets
    page_size: int
    dense_attention: bool = True
    attention: str = ""
    decode_keys: int = BLOCKED_DECODE_KEYS

    def __post_init__(self):
        if self.attention not in ("",) + ATTENTION_IMPLS:
            raise ValueError(f"EnginePadding.attention={self.attention!r}, expected one of {ATTENTION_IMPLS} or ''")
        if self.attention and (self.attention == "reference") != bool(self.dense_attention):
            raise ValueError(f"EnginePadding: attention={self.attention!r} with dense_attention="
                             f"{self.dense_attention!r}; only the 'reference' kernel is dense")
        if not isinstance(self.decode_keys, int) or self.decode_keys < 1:
            raise ValueError(f"EnginePadding.decode_keys={self.decode_keys!r}, expected a positive int")

    def profile_dict(self) -> dict:
        """The profile's "padding" entry for this padding (buckets come from the serve config)."""
        out = {"dense_attention": bool(self.dense_attention)}
        if self.attention:
            out["attention"] = self.attention
        if self.attention == "blocked":
            out["decode_keys"] = self.decode_keys
        return out


# --------------------------------------------------------------------------------------------------- compositions
def compact_composition(out) -> BatchComposition:
    """The cost-model composition of a SchedulerOutput with decodes folded into <= 2 groups of equal context sum
    (same `iteration_time` as BatchComposition.from_scheduler_output when pp == 1)."""
    starts, news = out.num_computed_tokens, out.num_new_tokens
    if True not in out.is_prefill and news.count(1) == len(news):     # decodes only: no Python loop
        count, total = len(news), sum(starts)
        if not count:
            return BatchComposition((), ())
        q, r = divmod(total, count)
        return BatchComposition((), ((count - r, q), (r, q + 1)) if r else ((count, q),))
    prefills = []
    count = total = 0
    for is_prefill, start, new in zip(out.is_prefill, starts, news):
        if is_prefill or new != 1:
            prefills.append((new, start))
        else:
            count += 1
            total += start
    decodes = ()
    if count:
        q, r = divmod(total, count)
        decodes = ((count - r, q), (r, q + 1)) if r else ((count, q),)
    return BatchComposition(tuple(prefills), decodes)


def padded_shape(out, padding: EnginePadding) -> Tuple[int, int, int]:
    """(T_pad, S_pad, P_pad) the engine pads `out` to."""
    ps = padding.page_size
    max_pages = 1
    for start, new in zip(out.num_computed_tokens, out.num_new_tokens):
        pages = -(-(start + new) // ps)
        if pages > max_pages:
            max_pages = pages
    return padding.buckets.pick(sum(out.num_new_tokens), len(out.num_new_tokens), max_pages)


def blocked_decode_block(padding: EnginePadding, p_pad: int) -> int:
    """Keys per step of the blocked kernel's decode pass for a page bucket of p_pad pages (whole pages,
    at most the page table: pdjax.kernels.blocked._pages_per_block)."""
    ps = padding.page_size
    return max(1, min(padding.decode_keys // ps, p_pad)) * ps


def padded_composition(out, padding: EnginePadding) -> BatchComposition:
    """The work the padded engine step does, as a cost-model composition (see the module docstring)."""
    t_pad, s_pad, p_pad = padded_shape(out, padding)
    if padding.dense_attention:
        return BatchComposition((), ((t_pad, p_pad * padding.page_size - 1),))
    if padding.attention == "blocked":
        return _blocked_composition(out, padding, t_pad, s_pad, p_pad)
    batch = compact_composition(out)
    extra = t_pad - batch.num_tokens
    if extra > 0:
        batch = BatchComposition(batch.prefills, batch.decodes + ((extra, 0),))
    return batch


def _blocked_composition(out, padding: EnginePadding, t_pad: int, s_pad: int, p_pad: int) -> BatchComposition:
    """The blocked XLA kernel's work (pdjax.kernels.blocked): its vector pass runs every item over as many key
    blocks as the longest item needs (one fori_loop, dynamic trip count), so it costs items x key blocks of the
    longest context, not count x mean context.
    - T_pad <= S_pad (token mode): every padded token is an item, chunks included; no chunk pass. The step is
      T_pad one-token queries, each reading the key blocks of the longest sequence (its context + new tokens).
    - T_pad > S_pad: the vector pass over the S_pad sequence slots for the decodes (blocks of the longest decode
      context; it runs, with no key blocks, even without decodes), the chunk pass over each chunk's real
      context; linear layers on T_pad tokens (padding as context-0 decodes, as in the real-context mode)."""
    block = blocked_decode_block(padding, p_pad)
    if t_pad <= s_pad:
        longest = max(c + n for c, n in zip(out.num_computed_tokens, out.num_new_tokens))
        return BatchComposition((), ((t_pad, 0),), decode_pass=(t_pad, -(-longest // block) * block))
    batch = compact_composition(out)
    longest = 0
    for is_prefill, c, n in zip(out.is_prefill, out.num_computed_tokens, out.num_new_tokens):
        if not is_prefill and n == 1 and c + 1 > longest:
            longest = c + 1
    decodes = batch.decodes
    extra = t_pad - batch.num_tokens
    if extra > 0:
        decodes = decodes + ((extra, 0),)
    return BatchComposition(batch.prefills, decodes, decode_pass=(s_pad, -(-longest // block) * block))


class CachedIterationTime:
    """`iteration_time(batch, ...).total` for pp == 1, bit-identical, faster: the token/sequence-count terms
    (linear layers, element-wise kernels, TP communication) are computed once per (tokens, seqs) by the cost
    model's own `_stage_components` and cached; only attention, which depends on every chunk and context, is
    evaluated per batch, with the cost model's op functions in `_stage_components`' order (tests check the
    equality on random batches)."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec, tp: int, params: CostParams):
        self.model, self.hw, self.tp, self.params = model, hw, tp, params
        self.plan = _plan(model, hw, tp, 1)
        self._by_count: dict = {}     # (tokens, seqs) -> (linear, elementwise, communication)
        self._by_tokens: dict = {}    # tokens -> cost_model._token_components
        self._lm_head: dict = {}      # seqs -> the LM head GEMM's seconds (roofline + fixed)
        self._launch: dict = {}
        self._decode_fns: dict = {}

    def _count_terms(self, tokens: int, seqs: int):
        """(linear, elementwise, communication) seconds of `_stage_components` for a batch of `tokens` tokens in
        `seqs` sequences (they depend on nothing else): its own functions, cached per tokens and per seqs and
        added as it adds them."""
        terms = self._by_count.get((tokens, seqs))
        if terms is not None:
            return terms
        p = self.params
        tok = self._by_tokens.get(tokens)
        if tok is None:
            tok = self._by_tokens[tokens] = cm._token_components(tokens, self.plan, p, self.tp)
        lm = self._lm_head.get(seqs)
        if lm is None:
            c, mem = cm._lm_head_terms(seqs, self.plan, p)
            lm = self._lm_head[seqs] = (c if c > mem else mem) + p.kernel_fixed_s
        linear, _, _, elementwise, comm = tok
        terms = self._by_count[(tokens, seqs)] = (linear + lm, elementwise, comm)
        return terms

    def __call__(self, batch: BatchComposition) -> float:
        tokens, seqs = batch.num_tokens, batch.num_seqs
        p = self.params
        overhead = cm.host_time(p, seqs, self.tp)
        if tokens == 0:
            return overhead
        lin, ew, com = self._count_terms(tokens, seqs)
        device = lin + ew + self._attention(batch) + com + 0.0
        if p.launch_overhead_s > 0:
            kinds = (bool(batch.prefills), bool(batch.decodes))
            launch = self._launch.get(kinds)
            if launch is None:
                launch = self._launch[kinds] = p.launch_overhead_s * 1 * cm.kernels_per_iteration(
                    self.plan.shapes, self.plan.layers_per_stage, self.tp, *kinds)
            if launch > device:
                device = launch
        return device + overhead

    def decode_only(self, count: int, total_context: int) -> float:
        """`self(composition)` of `count` one-token decodes whose contexts sum to `total_context` (what
        compact_composition makes of a decode-only SchedulerOutput), bit-identical: `decode_fn(count)`."""
        return self.decode_fn(count)(total_context)

    def decode_fn(self, count: int) -> Callable[[int], float]:
        """total_context -> `self(composition)` of `count` one-token decodes whose contexts sum to total_context,
        bit-identical without building the composition: every term that depends on the count alone is computed
        once (cached per count), and the decode attention (aggregated by the mean context, total / count) is
        `cost_model.decode_attention_terms`' arithmetic, operation for operation (tests check the equality)."""
        fn = self._decode_fns.get(count)
        if fn is not None:
            return fn
        p = self.params
        overhead = cm.host_time(p, count, self.tp)
        if count == 0:
            fn = self._decode_fns[count] = lambda total_context: overhead
            return fn
        lin, ew, com = self._count_terms(count, count)
        lin_ew = lin + ew
        plan = self.plan
        s = plan.shapes
        heads, kv_heads, head_dim, dtype_bytes = s.heads, s.kv_heads, s.head_dim, s.dtype_bytes
        flops_per_visible = 4.0 * heads * head_dim * count          # decode_attention_terms: flops, left to right
        q_bytes = 2 * heads * head_dim
        # fn's int operands as floats: the same results (an int below 2**53 meets a float as its exact double), in
        # float-float operations, which CPython's interpreter specializes (an int-float one takes the generic path)
        fcount, layers = float(count), float(plan.layers_per_stage)
        kv_heads, head_dim, dtype_bytes, q_bytes = float(kv_heads), float(head_dim), float(dtype_bytes), float(q_bytes)
        flops_rate = plan.peak * p.attn_flops_efficiency
        bytes_rate = plan.bandwidth * p.attn_bandwidth_efficiency
        per_item = count * heads * p.attn_seq_head_s
        fixed = p.attn_decode_fixed_s
        launch = 0.0
        if p.launch_overhead_s > 0:
            launch = self._launch.get((False, True))
            if launch is None:
                launch = self._launch[(False, True)] = p.launch_overhead_s * 1 * cm.kernels_per_iteration(
                    plan.shapes, plan.layers_per_stage, self.tp, False, True)

        def fn(total_context: int) -> float:
            visible = total_context / fcount + 1.0
            c = flops_per_visible * visible / flops_rate
            mem = fcount * (visible * 2.0 * kv_heads * head_dim + q_bytes) * dtype_bytes / bytes_rate
            device = lin_ew + (((c if c > mem else mem) + per_item) + fixed) * layers + com + 0.0
            if launch > device:
                device = launch
            return device + overhead

        self._decode_fns[count] = fn
        return fn

    def chunked(self, chunks: Sequence[Tuple[int, int]], count: int, total_context: int) -> float:
        """`self(composition)` of prefill `chunks` ((tokens, context before them), in batch order) and `count`
        one-token decodes whose contexts sum to `total_context` (compact_composition's form of such a step),
        bit-identical without building the composition: __call__'s terms in its order, the decode attention
        aggregated by the mean context (total / count) as cost_model.decode_attention_time does."""
        if not chunks:
            return self.decode_fn(count)(total_context)
        tokens = count
        for n, _ in chunks:
            tokens += n
        seqs = len(chunks) + count
        p = self.params
        overhead = cm.host_time(p, seqs, self.tp)
        lin, ew, com = self._count_terms(tokens, seqs)
        plan = self.plan
        sh = plan.shapes
        peak, bw = plan.peak, plan.bandwidth
        attention = 0.0
        for chunk, context in chunks:
            c, mem = cm.prefill_attention_terms(chunk, context, sh.heads, sh.kv_heads, sh.head_dim, sh.dtype_bytes,
                                                peak, bw, p)
            attention += c + mem
        if count:
            c, mem, per_item = cm.decode_attention_terms(count, total_context / count, sh.heads, sh.kv_heads,
                                                         sh.head_dim, sh.dtype_bytes, peak, bw, p)
            attention += (c if c > mem else mem) + per_item
        attention += p.attn_prefill_fixed_s
        if count:
            attention += p.attn_decode_fixed_s
        device = lin + ew + attention * plan.layers_per_stage + com + 0.0
        if p.launch_overhead_s > 0:
            kinds = (True, bool(count))
            launch = self._launch.get(kinds)
            if launch is None:
                launch = self._launch[kinds] = p.launch_overhead_s * 1 * cm.kernels_per_iteration(
                    plan.shapes, plan.layers_per_stage, self.tp, *kinds)
            if launch > device:
                device = launch
        return device + overhead

    def _attention(self, batch: BatchComposition) -> float:
        plan, p = self.plan, self.params
        s = plan.shapes
        peak, bw = plan.peak, plan.bandwidth
        attention = 0.0
        for chunk, context in batch.prefills:
            c, mem = cm.prefill_attention_terms(chunk, context, s.heads, s.kv_heads, s.head_dim, s.dtype_bytes, peak,
                                                bw, p)
            attention += c + mem
        if batch.decodes or batch.decode_pass:
            attention += cm.decode_attention_time(batch, s, peak, bw, p)
        if batch.prefills:
            attention += p.attn_prefill_fixed_s
        if batch.decodes or batch.decode_pass:
            attention += p.attn_decode_fixed_s
        return attention * plan.layers_per_stage


def stage_times_fn(counts: Sequence[int], launch_overhead_s: float, per_layer_kernels: int) -> Callable:
    """(layer, embedding, head, host) -> tuple(cost_model.stage_device_times(counts, layer, embedding, head, host,
    launch_overhead_s, per_layer_kernels)), bit-identical: two stages written out (the same expressions in the same
    order, the launch floors computed once), other counts through the function itself."""
    if len(counts) != 2:
        return lambda layer, embedding, head, host: tuple(cm.stage_device_times(
            counts, layer, embedding, head, host, launch_overhead_s, per_layer_kernels))
    floors = launch_overhead_s > 0
    n0, n1 = counts
    floor0 = launch_overhead_s * (n0 * per_layer_kernels + 1 + 0)
    floor1 = launch_overhead_s * (n1 * per_layer_kernels + 0 + 2)

    def two(layer, embedding, head, host):
        d0 = n0 * layer + embedding + 0.0
        d1 = n1 * layer + 0.0 + head
        if floors:
            if floor0 > d0:
                d0 = floor0
            if floor1 > d1:
                d1 = floor1
        return (d0 + host, d1)
    return two


class CachedStageTimes:
    """`cost_model.stage_times(batch, model, hw, tp, pp, params)`, bit-identical, faster: the terms that depend on
    the token count (a layer's GEMMs and element-wise kernels, its TP all-reduces, the embedding, the sends) or
    on the sequence count (the LM head) are computed once per count, with the cost model's functions in its
    order, and only the attention is evaluated per batch (tests check the equality)."""

    def __init__(self, model: ModelSpec, hw: HardwareSpec, tp: int, pp: int, params: CostParams):
        self.model, self.hw, self.tp, self.pp, self.params = model, hw, tp, pp, params
        self.plan = _plan(model, hw, tp, pp)
        self.counts = cm.stage_layer_counts(model.num_layers, pp)
        self.links = [cm.stage_link(hw, tp, b) for b in range(pp - 1)]
        self._by_tokens: dict = {}
        self._head: dict = {}
        self._kernels: dict = {}
        self._decode_fns: dict = {}
        self._mixed_fns: dict = {}

    def _token_terms(self, tokens: int):
        terms = self._by_tokens.get(tokens)
        if terms is not None:
            return terms
        plan, p, tp = self.plan, self.params, self.tp
        s = plan.shapes
        peak, bw = plan.peak, plan.bandwidth
        layer = 0.0
        for (k, m), bias in zip(s.gemms, s.gemm_bias):
            c, mem = cm.gemm_terms(tokens, k, m, s.dtype_bytes, peak, bw, plan.compute_units, p, bias=bias)
            layer += (c if c > mem else mem) + p.kernel_fixed_s
        layer += sum(cm.elementwise_time(tokens, nbytes, kind, bw, p) for kind, nbytes in s.layer_elementwise)
        comm = None
        if tp > 1:
            comm = 2 * cm.allreduce_time(tokens * s.hidden * s.dtype_bytes, tp, plan.tp_link[0], plan.tp_link[1], p,
                                         plan.tp_kind, plan.tp_nics)
        embedding = cm.elementwise_time(tokens, s.embedding_bytes_per_token, "embedding", bw, p)
        send_bytes = tokens * s.hidden * s.dtype_bytes
        sends = tuple(cm.p2p_time(send_bytes, *link, p) for link in self.links)
        terms = self._by_tokens[tokens] = (layer, comm, embedding, sends)
        return terms

    def __call__(self, batch: BatchComposition) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
        p, pp = self.params, self.pp
        plan = self.plan
        seqs = batch.num_seqs
        host = cm.host_time(p, seqs, self.tp * pp)
        tokens = batch.num_tokens
        if tokens == 0:
            return (host,) + (0.0,) * (pp - 1), (0.0,) * (pp - 1)
        layer, comm, embedding, sends = self._token_terms(tokens)
        layer += cm.layer_attention_time(batch, plan.shapes, plan.peak, plan.bandwidth, p)
        if comm is not None:
            layer += comm
        head = self._head.get(seqs)
        if head is None:
            c, mem = cm._lm_head_terms(seqs, plan, p)
            head = self._head[seqs] = (c if c > mem else mem) + p.kernel_fixed_s
        kinds = (bool(batch.prefills), bool(batch.decodes))
        per_layer_kernels = self._kernels.get(kinds)
        if per_layer_kernels is None:
            per_layer_kernels = self._kernels[kinds] = cm.kernels_per_iteration(plan.shapes, 1, self.tp, *kinds) - 3
        stages = cm.stage_device_times(self.counts, layer, embedding, head, host, p.launch_overhead_s,
                                       per_layer_kernels)
        return tuple(stages), sends

    def decode_fn(self, count: int) -> Callable[[int], Tuple[Tuple[float, ...], Tuple[float, ...]]]:
        """total_context -> `self(composition)` of `count` one-token decodes whose contexts sum to total_context
        (compact_composition's form), bit-identical without building the composition: the count's terms once,
        per call only the decode attention, `cost_model.decode_attention_terms`' arithmetic aggregated by the
        mean context as `layer_attention_time` adds it (tests check the equality)."""
        fn = self._decode_fns.get(count)
        if fn is not None:
            return fn
        if count == 0:
            empty = self(BatchComposition((), ()))
            fn = self._decode_fns[count] = lambda total_context: empty
            return fn
        p, plan = self.params, self.plan
        host = cm.host_time(p, count, self.tp * self.pp)
        layer, comm, embedding, sends = self._token_terms(count)
        c, mem = cm._lm_head_terms(count, plan, p)
        head = self._head.setdefault(count, (c if c > mem else mem) + p.kernel_fixed_s)
        kernels = self._kernels.get((False, True))
        if kernels is None:
            kernels = self._kernels[(False, True)] = cm.kernels_per_iteration(plan.shapes, 1, self.tp, False,
                                                                              True) - 3
        s = plan.shapes
        kv_heads, head_dim, dtype_bytes = s.kv_heads, s.head_dim, s.dtype_bytes
        flops_per_visible = 4.0 * s.heads * head_dim * count       # decode_attention_terms: flops, left to right
        q_bytes = 2 * s.heads * head_dim
        flops_rate = plan.peak * p.attn_flops_efficiency
        bytes_rate = plan.bandwidth * p.attn_bandwidth_efficiency
        per_item = count * s.heads * p.attn_seq_head_s
        fixed = p.attn_decode_fixed_s
        device_times = stage_times_fn(self.counts, p.launch_overhead_s, kernels)

        def fn(total_context: int):
            visible = total_context / count + 1
            c = flops_per_visible * visible / flops_rate
            mem = count * (visible * 2 * kv_heads * head_dim + q_bytes) * dtype_bytes / bytes_rate
            total = layer + ((0.0 + ((c if c > mem else mem) + per_item)) + fixed)
            if comm is not None:
                total += comm
            return device_times(total, embedding, head, host), sends

        self._decode_fns[count] = fn
        return fn

    def mixed_fn(self, count: int) -> Callable[[int, Sequence[Tuple[int, int]]], Tuple[Tuple[float, ...],
                                                                                 Tuple[float, ...]]]:
        """(total_context, chunks) -> `self(composition)` of prefill `chunks` ((tokens, context before them), in
        batch order) beside `count` one-token decodes whose contexts sum to total_context (compact_composition's
        form; decode_fn's without chunks), bit-identical without building the composition: `__call__`'s terms
        and `cost_model.layer_attention_time`'s arithmetic in their order (tests check the equality)."""
        fn = self._mixed_fns.get(count)
        if fn is not None:
            return fn
        decode = self.decode_fn(count)
        p, plan, token_terms, heads_of = self.params, self.plan, self._token_terms, self._head
        s = plan.shapes
        shape = (s.heads, s.kv_heads, s.head_dim, s.dtype_bytes, plan.peak, plan.bandwidth, p)
        prefill_terms, decode_terms, host_time = cm.prefill_attention_terms, cm.decode_attention_terms, cm.host_time
        kinds = (True, bool(count))
        kernels = self._kernels.get(kinds)
        if kernels is None:
            kernels = self._kernels[kinds] = cm.kernels_per_iteration(s, 1, self.tp, *kinds) - 3
        device_times = stage_times_fn(self.counts, p.launch_overhead_s, kernels)
        workers = self.tp * self.pp
        prefill_fixed, decode_fixed = p.attn_prefill_fixed_s, p.attn_decode_fixed_s

        def fn(total_context: int, chunks: Sequence[Tuple[int, int]]):
            if not chunks:
                return decode(total_context)
            seqs = len(chunks) + count
            tokens = count
            for n, _ in chunks:
                tokens += n
            layer, comm, embedding, sends = token_terms(tokens)
            attention = 0.0
            for chunk, context in chunks:
                c, mem = prefill_terms(chunk, context, *shape)
                attention += c + mem
            if count:
                c, mem, per_item = decode_terms(count, total_context / count, *shape)
                attention += (c if c > mem else mem) + per_item
            attention += prefill_fixed
            if count:
                attention += decode_fixed
            layer += attention
            if comm is not None:
                layer += comm
            head = heads_of.get(seqs)
            if head is None:
                c, mem = cm._lm_head_terms(seqs, plan, p)
                head = heads_of[seqs] = (c if c > mem else mem) + p.kernel_fixed_s
            return device_times(layer, embedding, head, host_time(p, seqs, workers)), sends

        self._mixed_fns[count] = fn
        return fn


class _ContextCost:
    """The step-context seconds of one step (cost_model.context_time) from a `StepContext` (duck-typed:
    `.previous`, the SchedulerOutput the instance ran before, or None; `.idle_s`, seconds its device sat idle
    before this step): a shape switch when the padded (T, S, P) shapes of `out` and `previous` differ (never
    without padding: no buckets, no executables to switch). `active` is False when the parameters make every
    context cost 0, so the step time skips it (and stays bit-identical to the context-free one)."""

    def __init__(self, params: CostParams, padding: Optional[EnginePadding]):
        self.params, self.padding = params, padding
        self.active = params.shape_switch_s > 0 or params.idle_wake_s > 0 or params.idle_wake_fixed_s > 0
        self._last = (None, None)     # (SchedulerOutput, its padded shape): the previous step's, reused

    def shape(self, out):
        last_out, last_shape = self._last
        if out is last_out:
            return last_shape
        shape = padded_shape(out, self.padding)
        self._last = (out, shape)
        return shape

    def __call__(self, out, ctx) -> float:
        if ctx is None or not self.active:
            return 0.0
        switched = False
        if ctx.previous is not None and self.padding is not None and self.params.shape_switch_s > 0:
            previous = self.shape(ctx.previous)
            switched = self.shape(out) != previous
        return cm.context_time(self.params, switched, ctx.idle_s)


class StepNoise:
    """Multiplicative step-time noise (module docstring): `noise()` draws a factor from the empirical
    distribution given by `quantiles` (values at probabilities 0, 1/(n-1), ..., 1; linear in between) with its own
    seeded generator. Raises ValueError for fewer than two quantiles, a decreasing or a non-positive one."""

    def __init__(self, quantiles: Sequence[float], seed: int = 0):
        q = tuple(float(x) for x in quantiles)
        check_step_noise(q)
        self.quantiles = q
        self._rng = random.Random(seed)

    def __call__(self) -> float:
        q = self.quantiles
        u = self._rng.random() * (len(q) - 1)
        i = int(u)
        if i >= len(q) - 1:
            return q[-1]
        return q[i] + (q[i + 1] - q[i]) * (u - i)


def check_step_noise(quantiles: Sequence[float]) -> None:
    q = list(quantiles)
    if len(q) < 2:
        raise ValueError(f"step_noise quantiles: {len(q)} given, expected at least 2 (probabilities 0..1)")
    if any(not x > 0 for x in q):
        raise ValueError(f"step_noise quantiles must be > 0 (step-time factors), got min {min(q)!r}")
    if any(b < a for a, b in zip(q, q[1:])):
        raise ValueError("step_noise quantiles must be non-decreasing (values at increasing probabilities)")


class PipelineStepTime(StepTimeBase):
    """The step time of a pp-stage instance (module docstring): `stage_times(out, ctx=None) -> (per-stage
    seconds, per-boundary send seconds)` for the simulator's stage resources; calling it returns one batch's
    latency alone through the pipeline. `pp` tells the simulator how many batches it may keep in flight. The
    step-context cost (`ctx`, see make_step_time) sits on stage 0."""

    takes_context = True

    def __init__(self, model: ModelSpec, hw: HardwareSpec, tp: int, pp: int, params: CostParams,
                 padding: Optional[EnginePadding] = None, noise: Optional[StepNoise] = None):
        self.model, self.hw, self.tp, self.pp, self.params, self.padding = model, hw, tp, pp, params, padding
        self._per_seq = cm.per_seq_host_s(params, tp * pp)
        self._context = _ContextCost(params, padding)
        self.noise = noise
        self._stages = CachedStageTimes(model, hw, tp, pp, params)

    def stage_times(self, out, ctx=None) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
        if self.padding is not None:
            batch = padded_composition(out, self.padding)
            stages, sends = self._stages(batch)
            # host per-sequence cost counts the real sequences (see make_step_time); it sits on stage 0
            extra = self._per_seq * (len(out.num_new_tokens) - batch.num_seqs)
        else:
            news = out.num_new_tokens
            if True not in out.is_prefill and news.count(1) == len(news):     # decodes only
                stages, sends = self._stages.decode_fn(len(news))(sum(out.num_computed_tokens))
            else:
                stages, sends = self._stages(compact_composition(out))
            extra = 0.0
        if self._context.active:
            extra += self._context(out, ctx)
        if extra != 0.0 or self.padding is not None:
            stages = (stages[0] + extra,) + tuple(stages[1:])
        if self.noise is not None:   # one draw per batch, on every stage
            f = self.noise()
            stages = tuple(f * t for t in stages)
        return stages, sends

    def __call__(self, out, ctx=None) -> float:
        stages, sends = self.stage_times(out, ctx)
        return sum(stages) + sum(sends)

    @property
    def decode_only_exact(self) -> bool:
        """`decode_stages_fn` gives this source's stage times of every decode-only step (no padding, no step
        context, no noise): the simulator's decode runs on pipelined instances (pdjax.sim.simulator) use it."""
        return self.padding is None and not self._context.active and self.noise is None

    def decode_stages_fn(self, count: int) -> Callable[[int], Tuple[Tuple[float, ...], Tuple[float, ...]]]:
        """total_context -> `stage_times(out)` of a decode-only step of `count` one-token decodes whose
        num_computed_tokens sum to total_context, without padding, step context or noise (the same compact
        composition, compact_composition's, through the same CachedStageTimes)."""
        return self._stages.decode_fn(count)

    def composition_stages(self, count: int, total_context: int,
                           chunks: Sequence[Tuple[int, int]]) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
        """`stage_times(out)` of a step of prefill `chunks` ((tokens, context before them), in batch order) and
        `count` one-token decodes whose num_computed_tokens sum to total_context, without padding, step context
        or noise (compact_composition's composition of such a step)."""
        return self._stages.mixed_fn(count)(total_context, chunks)

    def composition_stages_fn(self, count: int) -> Callable[[int, Sequence[Tuple[int, int]]],
                                                            Tuple[Tuple[float, ...], Tuple[float, ...]]]:
        """(total_context, chunks) -> `composition_stages(count, total_context, chunks)`."""
        return self._stages.mixed_fn(count)

    def decode_fn(self, count: int) -> Callable[[int], float]:
        """total_context -> seconds of such a step through the whole pipeline (`self(out)`)."""
        stage_fn = self.decode_stages_fn(count)

        def fn(total_context: int) -> float:
            stages, sends = stage_fn(total_context)
            return sum(stages) + sum(sends)
        return fn


class CostModelStepTime(StepTimeBase):
    """`step_time(out, ctx=None) -> seconds` of a one-stage instance (make_step_time). `takes_context`
    tells the simulator to pass a StepContext (pdjax.sim.simulator): the previous step and the idle gap."""

    takes_context = True

    def __init__(self, model: ModelSpec, hw: HardwareSpec, tp: int, params: CostParams,
                 padding: Optional[EnginePadding], noise: Optional[StepNoise] = None):
        self.params, self.padding = params, padding
        self._cost = CachedIterationTime(model, hw, tp, params)
        self._per_seq = cm.per_seq_host_s(params, tp)
        self._context = _ContextCost(params, padding)
        self.noise = noise

    @property
    def decode_only_exact(self) -> bool:
        """`decode_only(count, total_context)` is this function's time of every decode-only step (no padding, no
        step context, no noise): the simulator's decode runs (pdjax.sim.simulator) cost their steps by it."""
        return self.padding is None and not self._context.active and self.noise is None

    def decode_only(self, count: int, total_context: int) -> float:
        """Seconds of a decode-only step of `count` one-token decodes whose num_computed_tokens sum to
        `total_context`, without padding, step context or noise (the unpadded `base` of such a step)."""
        return self._cost.decode_fn(count)(total_context)

    def decode_fn(self, count: int) -> Callable[[int], float]:
        """total_context -> `decode_only(count, total_context)` (CachedIterationTime.decode_fn)."""
        return self._cost.decode_fn(count)

    def composition(self, count: int, total_context: int, chunks: Sequence[Tuple[int, int]]) -> float:
        """Seconds of a step of prefill `chunks` ((tokens, context before them), in batch order) and `count`
        one-token decodes whose num_computed_tokens sum to `total_context`, without padding, step context or
        noise: the unpadded `base` of such a step (the same compact composition)."""
        return self._cost.chunked(chunks, count, total_context)

    def base(self, out) -> float:
        """The step's own seconds (no step context)."""
        if self.padding is None:
            news = out.num_new_tokens
            if True not in out.is_prefill and news.count(1) == len(news):    # decode only
                return self._cost.decode_fn(len(news))(sum(out.num_computed_tokens))
            chunks = []
            count = total = 0
            for is_prefill, start, new in zip(out.is_prefill, out.num_computed_tokens, news):
                if is_prefill or new != 1:
                    chunks.append((new, start))
                else:
                    count += 1
                    total += start
            return self._cost.chunked(chunks, count, total)
        else:
            batch = padded_composition(out, self.padding)
            # The padded composition's "sequences" are stand-ins for padded work; the host's per-sequence
            # cost (batch building, sampling bookkeeping) counts the real ones.
            return self._cost(batch) + self._per_seq * (len(out.num_new_tokens) - batch.num_seqs)
        return self._cost(compact_composition(out))

    def __call__(self, out, ctx=None) -> float:
        t = self.base(out) + self._context(out, ctx) if self._context.active else self.base(out)
        return t * self.noise() if self.noise is not None else t


def make_step_time(model: ModelSpec, hw: HardwareSpec, tp: int = 1, pp: int = 1,
                   params: Optional[CostParams] = None, padding: Optional[EnginePadding] = None,
                   noise: Optional[StepNoise] = None) -> StepTime:
    """A `(SchedulerOutput, ctx=None) -> seconds` StepTime (the simulator's step_time): the cost model on the
    output's composition, padded as the engine pads it when `padding` is given, plus the step-context cost
    (`cost_model.context_time`: shape switch, idle wake) when a StepContext `ctx` is given (the simulator passes
    one: it has `takes_context`). pp > 1: a `PipelineStepTime` (per-stage times; the simulator pipelines batches,
    so bubbles come from the simulated stage schedule). noise: a StepNoise multiplying every step (module
    docstring); None: deterministic."""
    params = CostParams() if params is None else params
    _plan(model, hw, tp, pp)   # validate the layout now, not at the first step
    if pp > 1:
        return PipelineStepTime(model, hw, tp, pp, params, padding, noise)
    return CostModelStepTime(model, hw, tp, params, padding, noise)


class CostModelStack:
    """The 'pdjax' serving stack: the cost model alone (make_step_time, with the group's padding and noise)."""
    name = "pdjax"
    follows_dtype = True     # costs the model at its spec's dtype (pdjax.sim.build._check_stack_dtype)

    def check(self, model: str, hardware: str, tp: int) -> None:
        """Times every (model, hardware, tp) whose layout fits (make_step_time checks that)."""

    def step_time(self, group: GroupTiming) -> StepTime:
        return make_step_time(group.model, group.hardware, group.tp, group.pp, group.params, group.padding,
                              group.noise)

    def describe(self) -> dict:
        return {"stack": "pdjax"}


register_stack("pdjax", CostModelStack)


# --------------------------------------------------------------------------------------------------- padding entry
PADDING_KEYS = ("dense_attention", "attention", "decode_keys")


def padding_from_profile(padding: dict, buckets: Buckets, page_size: int) -> EnginePadding:
    """The EnginePadding of a profile's "padding" entry ({"dense_attention": bool, optional "attention"
    (ATTENTION_IMPLS) and "decode_keys"}) at the serve config's buckets and page size."""
    return EnginePadding(buckets, page_size, bool(padding.get("dense_attention", True)),
                         str(padding.get("attention", "")), int(padding.get("decode_keys", BLOCKED_DECODE_KEYS)))
