"""Analytical cost model: the time of one engine iteration from first principles, with fitted efficiencies.

What one iteration costs (per device of an instance with TP degree `tp` and PP degree `pp`):

- Linear layers (QKV, O, gate+up, down; LM head for one row per sequence): a roofline per GEMM,
  `max(FLOPs / (peak · gemm_flops_efficiency), bytes / (bandwidth · gemm_bandwidth_efficiency)) + kernel_fixed_s`,
  FLOPs counted on the token dimension rounded *up* to `gemm_token_tile` (the GEMM kernel computes whole tiles,
  so 257 tokens pay for 320 with a tile of 64), and a GEMM too small to fill the device's compute units runs at
  a lower rate (`gemm_outputs_per_unit`, `gemm_occupancy_exponent`). Bytes are weights + activations in and out.
  TP shards the output columns of QKV/gate+up and the input rows of O/down (Megatron); KV heads fewer than `tp`
  are replicated.
- Element-wise kernels (2 norms, RoPE, activation, residual add per layer; embedding once): bytes per token over
  `hbm_bandwidth` times that kernel kind's efficiency (`norm_bandwidth_efficiency`, ...), plus `kernel_fixed_s`.
- Attention, per layer, by its real work: a prefill chunk of `c` new tokens after `k` cached ones does
  `4 · heads · head_dim · c · (k + c · (1 − attn_causal_skip / 2))` FLOPs (`attn_causal_skip` = 1: the kernel
  skips the masked half of the chunk's own square; 0: it computes the whole rectangle) and every tile of
  `attn_query_tile` queries re-reads the KV it sees (so a later chunk re-reads the KV of all earlier chunks, and
  MHA pays more than GQA); compute + KV-read time, as fitted. A decode reads `context + 1` tokens of KV (a
  roofline), plus a per-(sequence, head) cost (`attn_seq_head_s`, the work-item scheduling of paged decode
  kernels that dominates at short contexts); each attention kernel call (one for the prefills, one for the
  decodes) costs `attn_prefill_fixed_s` / `attn_decode_fixed_s`. A batch's `decode_pass` (items, keys) replaces
  the decodes' own contexts by one pass of `items` queries over `keys` keys each: the blocked CPU kernel runs
  every slot of its padded width over the key blocks of the longest context (`decode_attention_time`).
- Step context (`context_time`, added by the simulator's step-time function, not by `iteration_time`): a step
  whose padded shape differs from the previous step's pays `shape_switch_s`; one after the engine sat idle g
  seconds pays `idle_wake_fixed_s + idle_wake_s · min(1, g / idle_wake_tau_s)`. All 0 by default (GPU
  profiles).
- TP: two all-reduces per layer of `tokens · hidden` activations, a ring over the slowest link the group
  crosses (`HardwareSpec.group_link`) with latency and efficiency terms per link kind (`HardwareSpec.link_kind`:
  NVLink pair, NVSwitch, PCIe, inter-node network), fitted per kind on NCCL measurements:
  `comm_<kind>_fixed_s + (n−1)·comm_<kind>_step_s + 2(n−1)/n · bytes / (link_bw · comm_<kind>_bandwidth_efficiency
  · NICs)`; a kind without fitted terms falls back to the generic alpha-beta ring `comm_fixed_s + 2(n−1)·hop_latency
  + 2(n−1)/n · bytes / (link_bw · comm_bandwidth_efficiency)` (see `allreduce_time`).
- PP: layers split into `pp` stages; the batch runs as `num_microbatches` microbatches (sequences dealt round
  robin); the critical path is every microbatch through the bottleneck stage plus `(pp − 1)` fills/drains
  (the bubble) plus `(pp − 1)` activation sends.
- Host and floor, once per iteration: `total = host + max(device work, launch floor)`, where host =
  `iteration_overhead_s + per_seq_overhead_s · sequences` (scheduling, input prep, sampling, output processing),
  plus `tp_sync_s + tp_sync_per_seq_s · sequences` for an instance of several workers (the batch broadcast to
  them), and the launch floor = kernels of the iteration (per layer: GEMMs, element-wise kernels, attention calls,
  all-reduces; `kernels_per_iteration`) · `launch_overhead_s`: the device cannot finish before the host has
  issued every kernel, which is what bounds small decode steps of deep models at high TP.
- Architectures (`sharded_shapes`): Llama (RMSNorm, RoPE, SwiGLU: three GEMM matrices, no biases) and OPT
  (LayerNorm, learned positions, ReLU MLP of 4x hidden: two GEMMs, full multi-head attention, biases on every
  GEMM); FLOPs, bytes and KV sizes come from each one's own shapes. `param_count` counts the weights exactly.

Efficiency factors live in `CostParams` (a "machine profile", JSON) and are fitted (pdjax.sim.calibration);
nothing here is a per-shape table, so a profile fitted on one model and TP degree carries to others.

Speed: the per-(model, hardware, tp, pp, params) constants are computed once (`_plan`, cached), and
`iteration_time` is plain Python arithmetic (tens of µs for a typical batch). The op-level functions accept numpy
arrays too (pass `maximum=np.maximum`), which is how the calibration evaluates thousands of operator
measurements at once with the very same formulas.

No JAX here.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from typing import Any, Callable, Mapping, Optional, Sequence

from pdjax.config.model_specs import ModelSpec
from pdjax.config.parse import dataclass_from_dict
from pdjax.config.pipeline import stage_layer_counts
from pdjax.sim.hardware import HardwareSpec


# --------------------------------------------------------------------------------------------------- parameters
# Element-wise kernel kinds and the CostParams field holding each one's achieved fraction of HBM bandwidth
# (each kernel implementation reaches its own fraction; one factor per kind still carries across shapes).
ELEMENTWISE_EFFICIENCY = {"norm": "norm_bandwidth_efficiency", "rope": "rope_bandwidth_efficiency",
                          "activation": "activation_bandwidth_efficiency",
                          "residual": "residual_bandwidth_efficiency", "embedding": "embedding_bandwidth_efficiency"}


@dataclasses.dataclass(frozen=True)
class CostParams:
    """Efficiency factors and fixed costs of one machine + software stack. Dimensionless factors are fractions
    of the datasheet peak; times in seconds. Defaults are A100-like priors (see profiles/a100.json for fitted)."""
    gemm_flops_efficiency: float = 0.7
    gemm_bandwidth_efficiency: float = 0.8
    gemm_token_tile: int = 64
    gemm_outputs_per_unit: float = 24000.0
    gemm_occupancy_exponent: float = 0.27
    kernel_fixed_s: float = 4e-6
    norm_bandwidth_efficiency: float = 0.35
    rope_bandwidth_efficiency: float = 0.45
    activation_bandwidth_efficiency: float = 0.5
    residual_bandwidth_efficiency: float = 0.9
    embedding_bandwidth_efficiency: float = 0.15
    attn_flops_efficiency: float = 0.5
    attn_causal_skip: float = 1.0
    attn_query_tile: int = 128
    attn_bandwidth_efficiency: float = 0.9
    attn_seq_head_s: float = 4e-8
    attn_prefill_fixed_s: float = 2e-5
    attn_decode_fixed_s: float = 5e-6
    comm_bandwidth_efficiency: float = 0.7
    comm_fixed_s: float = 10e-6
    iteration_overhead_s: float = 1e-3
    per_seq_overhead_s: float = 1e-5
    # Host floor of a multi-device instance (tp·pp > 1): the per-iteration broadcast of the batch to the workers
    # and the gather of their results, fixed and per sequence (0: a single-process engine / no such cost).
    tp_sync_s: float = 0.0
    tp_sync_per_seq_s: float = 0.0
    # Host time to issue one kernel: the device cannot finish an iteration before the host has launched all of
    # its kernels (layers x kernels per layer + embedding, LM head, sampling). 0: no launch floor.
    launch_overhead_s: float = 0.0
    # Per link kind (see HardwareSpec.link_kind) all-reduce terms: fixed_s + (n - 1)·step_s + 2(n-1)/n · bytes /
    # (link bandwidth · bandwidth_efficiency · NICs in parallel). A kind whose bandwidth_efficiency is 0 uses
    # the generic alpha-beta ring (comm_fixed_s, the spec's hop latency, comm_bandwidth_efficiency).
    comm_pair_fixed_s: float = 0.0
    comm_pair_step_s: float = 0.0
    comm_pair_bandwidth_efficiency: float = 0.0
    comm_switch_fixed_s: float = 0.0
    comm_switch_step_s: float = 0.0
    comm_switch_bandwidth_efficiency: float = 0.0
    comm_pcie_fixed_s: float = 0.0
    comm_pcie_step_s: float = 0.0
    comm_pcie_bandwidth_efficiency: float = 0.0
    comm_network_fixed_s: float = 0.0
    comm_network_step_s: float = 0.0
    comm_network_bandwidth_efficiency: float = 0.0
    # Step context (see `context_time`; the simulator passes the previous step and the idle gap before a step,
    # pdjax.sim.simulator.StepContext): a step whose padded (T, S, P) shape differs from the previous step's
    # costs `shape_switch_s` more (the CPU runtime switches executables: caches and the thread pool go cold); a
    # step after the engine sat idle for g > 0 seconds costs idle_wake_fixed_s + idle_wake_s · min(1, g /
    # idle_wake_tau_s) more (XLA's worker threads park, caches go cold; tau 0: the full idle_wake_s after any
    # idle gap). 0 (the default): no such cost.
    shape_switch_s: float = 0.0
    idle_wake_s: float = 0.0
    idle_wake_tau_s: float = 0.0
    idle_wake_fixed_s: float = 0.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"CostParams.{f.name}={value!r}, expected a finite number")
            if value < 0:
                raise ValueError(f"CostParams.{f.name}={value!r}, expected >= 0")
        for name in ("gemm_flops_efficiency", "gemm_bandwidth_efficiency", *ELEMENTWISE_EFFICIENCY.values(),
                     "attn_flops_efficiency", "attn_bandwidth_efficiency", "comm_bandwidth_efficiency"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CostParams.{name}={getattr(self, name)!r}, expected > 0")
        for name in ("gemm_token_tile", "attn_query_tile"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"CostParams.{name}={value!r}, expected a positive int")
        if self.attn_causal_skip > 1:
            raise ValueError(f"CostParams.attn_causal_skip={self.attn_causal_skip!r}, expected in [0, 1]")

    def replace(self, **changes) -> "CostParams":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "CostParams":
        """From a mapping (a profile's cost_params) by the one parser (pdjax.config.parse.dataclass_from_dict:
        an unknown key fails naming it and the known keys); the tile sizes may be written as floats (16.0)."""
        values = dict(values)
        for name in ("gemm_token_tile", "attn_query_tile"):
            if name in values:
                values[name] = int(values[name])
        return dataclass_from_dict(cls, values, "CostParams")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "CostParams":
        return cls.from_dict(json.loads(text))


# --------------------------------------------------------------------------------------------------- batches
@dataclasses.dataclass(frozen=True)
class BatchComposition:
    """What one iteration runs.

    prefills: (tokens in this chunk, tokens of the same request already in the KV cache before the chunk).
    decodes: (number of requests, context length = tokens already in each one's KV cache); each decodes 1 token.
    """
    prefills: tuple[tuple[int, int], ...] = ()
    decodes: tuple[tuple[int, int], ...] = ()
    # (items, keys per item) of a decode attention pass that does not follow each decode's own context: the
    # blocked CPU kernel's vector pass runs every slot of its padded width over the key blocks of the longest
    # context in it (pdjax.sim.step_cost.padded_composition). Set: it replaces the decodes' attention work
    # (they still count as tokens and sequences for every other term); (): each decode reads its own context.
    decode_pass: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "prefills", tuple((int(t), int(c)) for t, c in self.prefills))
        object.__setattr__(self, "decodes", tuple((int(n), int(c)) for n, c in self.decodes))
        object.__setattr__(self, "decode_pass", tuple(int(x) for x in self.decode_pass))
        if self.decode_pass and (len(self.decode_pass) != 2 or self.decode_pass[0] < 1 or self.decode_pass[1] < 0):
            raise ValueError(f"BatchComposition: decode_pass={self.decode_pass}; expected () or (items >= 1, "
                             f"keys per item >= 0)")
        for tokens, context in self.prefills:
            if tokens < 1 or context < 0:
                raise ValueError(f"BatchComposition: prefill chunk (tokens={tokens}, context={context}); "
                                 f"expected tokens >= 1 and context >= 0")
        for count, context in self.decodes:
            if count < 1 or context < 0:
                raise ValueError(f"BatchComposition: decode group (count={count}, context={context}); "
                                 f"expected count >= 1 and context >= 0")

    @property
    def num_tokens(self) -> int:
        return sum(t for t, _ in self.prefills) + sum(n for n, _ in self.decodes)

    @property
    def num_seqs(self) -> int:
        return len(self.prefills) + sum(n for n, _ in self.decodes)

    @classmethod
    def parse(cls, text: str) -> "BatchComposition":
        """From 'prefill:<tokens>@<context>,decode:<count>@<context>,...' (the cost CLI's --batch)."""
        prefills, decodes = [], []
        items = [item.strip() for item in text.split(",")]
        if not text.strip():
            raise ValueError("empty batch string; expected items like 'prefill:512@0' or 'decode:8@1024'")
        for item in items:
            match = re.fullmatch(r"(prefill|decode):(\d+)@(\d+)", item)
            if not match:
                raise ValueError(f"bad batch item {item!r} in {text!r}; expected 'prefill:<tokens>@<context before "
                                 f"the chunk>' or 'decode:<count>@<context>' with non-negative integers")
            kind, a, b = match.group(1), int(match.group(2)), int(match.group(3))
            if a < 1:
                raise ValueError(f"bad batch item {item!r}: {'tokens' if kind == 'prefill' else 'count'} must be >= 1")
            (prefills if kind == "prefill" else decodes).append((a, b))
        return cls(tuple(prefills), tuple(decodes))

    @classmethod
    def from_scheduler_output(cls, output) -> "BatchComposition":
        """The composition of a `pdjax.scheduler.output.SchedulerOutput` (duck-typed): prompt tokens (incl.
        recompute) are prefill chunks after `num_computed_tokens`; a non-prompt request feeding one token is a
        decode with that context, feeding several (e.g. speculative) is costed as a chunk."""
        prefills, decodes = [], []
        for is_prefill, start, new in zip(output.is_prefill, output.num_computed_tokens, output.num_new_tokens):
            if is_prefill or new != 1:
                prefills.append((new, start))
            else:
                decodes.append((1, start))
        return cls(tuple(prefills), tuple(decodes))

    def split_round_robin(self, parts: int) -> list["BatchComposition"]:
        """Deal the sequences into `parts` microbatches round robin (empty ones dropped)."""
        seqs = [("p", t, c) for t, c in self.prefills]
        for n, c in self.decodes:
            seqs.extend(("d", 1, c) for _ in range(n))
        out = []
        for i in range(parts):
            mine = seqs[i::parts]
            if mine:
                out.append(BatchComposition(tuple((t, c) for k, t, c in mine if k == "p"),
                                            tuple((1, c) for k, _, c in mine if k == "d")))
        return out


@dataclasses.dataclass(frozen=True)
class CostBreakdown:
    """Predicted seconds of one iteration. total = linear + elementwise + attention + communication +
    pipeline_bubble + overhead. linear_flops_s / linear_memory_s: the two roofline terms summed over the GEMMs
    (which one is larger says whether the linear layers are compute- or bandwidth-bound). overhead = host_s plus
    whatever the launch floor adds on top of the device work (launch_s − device time, when positive)."""
    total: float
    linear: float
    attention: float
    communication: float
    overhead: float
    elementwise: float
    pipeline_bubble: float
    linear_flops_s: float
    linear_memory_s: float
    num_tokens: int
    num_seqs: int
    launch_s: float = 0.0     # host time to launch the iteration's kernels (the floor of the device part)
    host_s: float = 0.0       # host scheduling / sync / per-sequence time (part of `overhead`)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------------- op costs
def padded_tokens(tokens, tile: int):
    """Tokens rounded up to whole tiles (works on ints and integer numpy arrays)."""
    return -(-tokens // tile) * tile


def gemm_terms(tokens, k, m, dtype_bytes: int, peak_flops: float, bandwidth: float, compute_units: int,
               params: CostParams, minimum: Callable = min, bias: bool = False):
    """(compute seconds, memory seconds) of a [tokens, k] x [k, m] GEMM, tokens tile-padded for FLOPs.

    A GEMM whose output (padded tokens x m) is too small to give every compute unit
    `gemm_outputs_per_unit` elements runs at a lower rate: efficiency x occupancy^gemm_occupancy_exponent
    (split-K and smaller tiles win back part of the idle units, hence the sub-linear exponent).
    bias: the GEMM adds a bias vector in its epilogue (OPT): m more weights read, tokens x m more adds."""
    padded = padded_tokens(tokens, params.gemm_token_tile)
    occupancy = minimum(1.0, padded * m / (compute_units * params.gemm_outputs_per_unit))
    flops = 2.0 * padded * k * m
    moved = (k * m + tokens * (k + m)) * dtype_bytes
    if bias:
        flops = flops + padded * m
        moved = moved + m * dtype_bytes
    return (flops / (peak_flops * params.gemm_flops_efficiency * occupancy ** params.gemm_occupancy_exponent),
            moved / (bandwidth * params.gemm_bandwidth_efficiency))


def gemm_time(tokens, k, m, dtype_bytes, peak_flops, bandwidth, compute_units, params: CostParams,
              maximum: Callable = max, minimum: Callable = min):
    compute, memory = gemm_terms(tokens, k, m, dtype_bytes, peak_flops, bandwidth, compute_units, params, minimum)
    return maximum(compute, memory) + params.kernel_fixed_s


def elementwise_time(tokens, bytes_per_token, kind: str, bandwidth: float, params: CostParams):
    """One element-wise kernel of `kind` (a key of ELEMENTWISE_EFFICIENCY) moving bytes_per_token per token."""
    efficiency = getattr(params, ELEMENTWISE_EFFICIENCY[kind])
    return tokens * bytes_per_token / (bandwidth * efficiency) + params.kernel_fixed_s


def prefill_attention_terms(chunk, context, heads, kv_heads, head_dim, dtype_bytes, peak_flops, bandwidth,
                            params: CostParams):
    """(compute s, memory s) of one prefill chunk's attention in one layer on one device; the kernel's time is
    their sum (fitted on A100: the sum reproduces the measurements, the max does not).

    Flash-style kernels stream K/V once per tile of `attn_query_tile` query rows, so every query tile re-reads
    the KV it can see (context + the causal part of the chunk): KV bytes = ceil(chunk / tile) x visible x KV
    bytes per token. That is why MHA attention is slower than GQA at the same FLOPs."""
    visible = context + chunk * (1.0 - 0.5 * params.attn_causal_skip)   # mean keys per query row
    flops = 4.0 * heads * head_dim * chunk * visible
    query_tiles = -(-chunk // params.attn_query_tile)
    moved = (query_tiles * visible * 2 * kv_heads * head_dim + 2 * chunk * heads * head_dim) * dtype_bytes
    return (flops / (peak_flops * params.attn_flops_efficiency),
            moved / (bandwidth * params.attn_bandwidth_efficiency))


def decode_attention_terms(count, context, heads, kv_heads, head_dim, dtype_bytes, peak_flops, bandwidth,
                           params: CostParams):
    """(compute s, memory s, per-item s) of `count` decodes with `context` cached tokens each, one layer."""
    visible = context + 1
    flops = 4.0 * heads * head_dim * count * visible
    moved = count * (visible * 2 * kv_heads * head_dim + 2 * heads * head_dim) * dtype_bytes
    return (flops / (peak_flops * params.attn_flops_efficiency),
            moved / (bandwidth * params.attn_bandwidth_efficiency),
            count * heads * params.attn_seq_head_s)


def decode_attention_time(batch: "BatchComposition", shapes: "ShardedShapes", peak: float, bandwidth: float,
                          params: CostParams) -> float:
    """Seconds of one layer's decode attention work of `batch` (0 without decodes; the fixed per-call cost
    `attn_decode_fixed_s` is added by the caller when `batch.decodes or batch.decode_pass`).

    `batch.decode_pass` (items, keys) set: `items` queries each reading `keys` keys (a roofline plus the
    per-(item, head) cost): the blocked CPU kernel, whose cost follows the longest context of the pass, not the
    mean. Else every decode reads its own context + 1 keys; all decodes share one FLOPs-to-bytes ratio, so the
    roofline of their sum equals the sum of their rooflines and they are aggregated by their mean context."""
    s = shapes
    if batch.decode_pass:
        items, keys = batch.decode_pass
        if keys <= 0:
            return 0.0
        c, mem, per_item = decode_attention_terms(items, keys - 1, s.heads, s.kv_heads, s.head_dim, s.dtype_bytes,
                                                  peak, bandwidth, params)
        return (c if c > mem else mem) + per_item
    if not batch.decodes:
        return 0.0
    count = sum(n for n, _ in batch.decodes)
    mean_context = sum(n * c for n, c in batch.decodes) / count
    c, mem, per_item = decode_attention_terms(count, mean_context, s.heads, s.kv_heads, s.head_dim, s.dtype_bytes,
                                              peak, bandwidth, params)
    return (c if c > mem else mem) + per_item


def context_time(params: CostParams, shape_switched: bool, idle_s: float) -> float:
    """Seconds a step costs on top of its batch because of what came before it (CostParams' step-context
    terms): `shape_switch_s` when its padded shape differs from the previous step's, plus
    idle_wake_fixed_s + idle_wake_s · min(1, idle_s / idle_wake_tau_s) after the engine sat idle for idle_s > 0
    seconds (tau 0: the full idle_wake_s). The two add up (measured on the CPU engine: a step after both pays
    about the sum, within the noise). 0 with the default parameters."""
    extra = params.shape_switch_s if shape_switched else 0.0
    if idle_s > 0:
        tau = params.idle_wake_tau_s
        extra += params.idle_wake_fixed_s + params.idle_wake_s * (1.0 if tau <= 0 or idle_s >= tau else idle_s / tau)
    return extra


LINK_KINDS = ("pair", "switch", "pcie", "network")


def allreduce_time(num_bytes, group: int, link_bandwidth: float, hop_latency: float, params: CostParams,
                   kind: Optional[str] = None, nics: int = 1):
    """Ring all-reduce of `num_bytes` per device over `group` devices (0 when group == 1).

    kind (a LINK_KINDS entry, from HardwareSpec.link_kind) with fitted terms in `params`
    (`comm_<kind>_bandwidth_efficiency` > 0): `comm_<kind>_fixed_s + (group - 1)·comm_<kind>_step_s +
    2(group-1)/group · bytes / (link_bandwidth · efficiency · nics)`, where `nics` is the number of inter-node
    links used in parallel (a group spanning nodes with d devices on each node runs d rings, each crossing the
    node boundary on its own NIC; 1 inside a node). Otherwise the generic alpha-beta ring:
    `comm_fixed_s + 2(group-1)·hop_latency + 2(group-1)/group · bytes / (link_bandwidth · comm_bandwidth_efficiency)`.
    The latency terms are per link kind because NCCL's small-message time is protocol, not hops: on the NVSwitch
    DGX an 8-GPU all-reduce of 16-64 kB takes ~30 µs, on the pairwise-NVLink PCIe box a 4-GPU one ~60 µs."""
    if group <= 1:
        return 0.0 * num_bytes
    steps = 2 * (group - 1)
    efficiency = getattr(params, f"comm_{kind}_bandwidth_efficiency", 0.0) if kind else 0.0
    if efficiency > 0:
        return (getattr(params, f"comm_{kind}_fixed_s") + (group - 1) * getattr(params, f"comm_{kind}_step_s")
                + steps / group * num_bytes / (link_bandwidth * efficiency * nics))
    return (params.comm_fixed_s + steps * hop_latency
            + steps / group * num_bytes / (link_bandwidth * params.comm_bandwidth_efficiency))


def p2p_time(num_bytes, link_bandwidth: float, hop_latency: float, params: CostParams):
    return params.comm_fixed_s + hop_latency + num_bytes / (link_bandwidth * params.comm_bandwidth_efficiency)


# --------------------------------------------------------------------------------------------------- model shapes
@dataclasses.dataclass(frozen=True)
class ShardedShapes:
    """Per-device shapes of one layer under TP degree `tp`."""
    hidden: int
    heads: int          # query heads per device
    kv_heads: int       # KV heads per device (replicated when fewer than tp)
    head_dim: int
    gemms: tuple[tuple[int, int], ...]   # (k, m) of QKV, O, gate+up (or fc1), down (or fc2)
    lm_head: tuple[int, int]
    layer_elementwise: tuple[tuple[str, int], ...]  # (kind, bytes per token): norms, RoPE, activation, add
    embedding_bytes_per_token: int
    dtype_bytes: int
    gemm_bias: tuple[bool, ...] = (False, False, False, False)   # per GEMM: adds a bias (OPT: all four)


def _check_parallel(model: ModelSpec, tp: int, pp: int):
    if not isinstance(tp, int) or tp < 1 or model.num_heads % tp:
        raise ValueError(f"tp={tp!r}: expected a positive int dividing num_heads={model.num_heads} of {model.name}")
    if not isinstance(pp, int) or pp < 1 or pp > model.num_layers:
        raise ValueError(f"pp={pp!r}: expected a positive int <= num_layers={model.num_layers} of {model.name}")


@functools.lru_cache(maxsize=256)
def sharded_shapes(model: ModelSpec, tp: int = 1) -> ShardedShapes:
    """Per-device GEMM shapes and element-wise traffic of one layer, from the architecture:

    - llama: RMSNorm x2, RoPE on q and k, SwiGLU MLP (gate+up as one [h, 2i] GEMM, down), no biases (qkv_bias
      models such as Qwen2: a bias on the QKV GEMM).
    - opt: LayerNorm x2 (same traffic as RMSNorm: read and write the hidden vector; the affine parameters are
      negligible), no RoPE (learned positions are added once, at the embedding), ReLU MLP of two GEMMs (fc1
      [h, 4h], fc2 [4h, h]), full multi-head attention, a bias on every GEMM (q/k/v, out, fc1, fc2); the
      embedding gathers a token row and a position row and writes their sum (3 hidden vectors per token).
    """
    _check_parallel(model, tp, 1)
    b = model.dtype_bytes
    h, d = model.hidden_size, model.head_dim
    heads = model.num_heads // tp
    kv_heads = -(-model.num_kv_heads // tp)
    inter = -(-model.intermediate_size // tp)
    gated = model.arch == "llama"
    gemms = ((h, (heads + 2 * kv_heads) * d), (heads * d, h), (h, (2 if gated else 1) * inter), (inter, h))
    # Bytes per token: norms read and write the hidden vector, RoPE rewrites q and k, the activation reads
    # gate and up (or fc1's output) and writes one, the residual add reads two and writes one.
    elementwise = [("norm", 2 * h * b), ("norm", 2 * h * b)]
    if model.arch == "llama":
        elementwise.append(("rope", 2 * (heads + kv_heads) * d * b))
    elementwise += [("activation", (3 if gated else 2) * inter * b), ("residual", 3 * h * b)]
    if model.arch == "opt":
        bias, embedding = (True, True, True, True), 3 * h * b
    else:
        bias, embedding = (bool(model.qkv_bias), False, False, False), 2 * h * b
    return ShardedShapes(hidden=h, heads=heads, kv_heads=kv_heads, head_dim=d, gemms=gemms,
                         lm_head=(h, -(-model.vocab_size // tp)), layer_elementwise=tuple(elementwise),
                         embedding_bytes_per_token=embedding, dtype_bytes=b, gemm_bias=bias)


def param_count(model: ModelSpec) -> int:
    """Exact parameter count from the architecture (what the weights occupy), biases and positions included.

    llama: q, k, v, o, gate, up, down weights, two RMSNorm weights per layer, the final norm, token embeddings
    and an untied LM head (plus the QKV biases when qkv_bias). opt (HF OPTForCausalLM): q, k, v, out, fc1, fc2
    weights and biases, two LayerNorms (weight + bias) per layer, the final LayerNorm, token embeddings tied to
    the LM head, and learned positions with HF's offset of 2 rows (max_position_embeddings + 2 rows).
    OPT-13B: 12,853,473,280; OPT-66B: 65,719,701,504; OPT-175B: 174,604,468,224 (paper: 12.85B / 66B / 175B).
    """
    h, i, d = model.hidden_size, model.intermediate_size, model.head_dim
    q, kv = model.num_heads * d, model.num_kv_heads * d
    attn = h * (q + 2 * kv) + q * h
    if model.arch == "opt":
        per_layer = attn + (q + 2 * kv) + h + 2 * h * i + i + h + 2 * 2 * h
        emb = model.vocab_size * h * (1 if model.tie_word_embeddings else 2)
        return model.num_layers * per_layer + emb + (model.max_position_embeddings + 2) * h + 2 * h
    per_layer = attn + 3 * h * i + 2 * h + ((q + 2 * kv) if model.qkv_bias else 0)
    emb = model.vocab_size * h * (1 if model.tie_word_embeddings else 2)
    return model.num_layers * per_layer + emb + h


def kernels_per_iteration(shapes: ShardedShapes, layers: int, tp: int, prefill: bool, decode: bool) -> int:
    """Kernels the host launches for one iteration of one stage: per layer the GEMMs, the element-wise
    kernels, one attention call per kind of work (prefills, decodes) and two all-reduces when tp > 1; once the
    embedding, the LM head and the sampler."""
    per_layer = len(shapes.gemms) + len(shapes.layer_elementwise) + int(prefill) + int(decode)
    if tp > 1:
        per_layer += 2
    return layers * per_layer + 3


@dataclasses.dataclass(frozen=True)
class _Plan:
    shapes: ShardedShapes
    layers_per_stage: int
    peak: float
    bandwidth: float
    compute_units: int
    tp_link: tuple[float, float]
    pp_link: tuple[float, float]
    tp_kind: str = "switch"
    tp_nics: int = 1


@functools.lru_cache(maxsize=256)
def _plan(model: ModelSpec, hw: HardwareSpec, tp: int, pp: int) -> _Plan:
    _check_parallel(model, tp, pp)
    kind = hw.link_kind(tp)
    return _Plan(shapes=sharded_shapes(model, tp), layers_per_stage=-(-model.num_layers // pp),
                 peak=hw.peak_flops(model.dtype), bandwidth=hw.hbm_bandwidth, compute_units=hw.compute_units,
                 tp_link=hw.group_link(tp),
                 pp_link=hw.group_link(tp * pp), tp_kind=kind,
                 tp_nics=min(tp, hw.devices_per_node) if kind == "network" else 1)


def _stage_components(batch: BatchComposition, plan: _Plan, params: CostParams, tp: int):
    """(linear, elementwise, attention, tp comm, flops-term, memory-term) seconds of one microbatch through the
    bottleneck stage (its layers, plus embedding and LM head)."""
    s = plan.shapes
    linear, flops_s, memory_s, elementwise, comm = _token_components(batch.num_tokens, plan, params, tp)
    c, mem = _lm_head_terms(batch.num_seqs, plan, params)
    linear += (c if c > mem else mem) + params.kernel_fixed_s
    flops_s += c
    memory_s += mem
    attention = plan.layers_per_stage * layer_attention_time(batch, s, plan.peak, plan.bandwidth, params)
    return linear, elementwise, attention, comm, flops_s, memory_s


def _token_components(tokens: int, plan: _Plan, params: CostParams, tp: int):
    """The terms of `_stage_components` that depend on the token count alone: (the layers' GEMMs, their flops
    and memory terms, element-wise kernels, TP communication) seconds."""
    s = plan.shapes
    peak, bw = plan.peak, plan.bandwidth
    layers = plan.layers_per_stage
    linear = flops_s = memory_s = 0.0
    for (k, m), bias in zip(s.gemms, s.gemm_bias):
        c, mem = gemm_terms(tokens, k, m, s.dtype_bytes, peak, bw, plan.compute_units, params, bias=bias)
        flops_s += c
        memory_s += mem
        linear += (c if c > mem else mem) + params.kernel_fixed_s
    linear *= layers
    flops_s *= layers
    memory_s *= layers
    elementwise = layers * sum(elementwise_time(tokens, nbytes, kind, bw, params)
                               for kind, nbytes in s.layer_elementwise)
    elementwise += elementwise_time(tokens, s.embedding_bytes_per_token, "embedding", bw, params)
    comm = 0.0
    if tp > 1:
        comm = layers * 2 * allreduce_time(tokens * s.hidden * s.dtype_bytes, tp, plan.tp_link[0], plan.tp_link[1],
                                           params, plan.tp_kind, plan.tp_nics)
    return linear, flops_s, memory_s, elementwise, comm


def _lm_head_terms(seqs: int, plan: _Plan, params: CostParams):
    """(flops s, memory s) of the LM head GEMM for `seqs` sequences (one row each)."""
    s = plan.shapes
    return gemm_terms(seqs, s.lm_head[0], s.lm_head[1], s.dtype_bytes, plan.peak, plan.bandwidth, plan.compute_units,
                      params)


def layer_attention_time(batch, s, peak: float, bw: float, params: CostParams) -> float:
    """Seconds of one layer's attention for `batch` on one TP shard (shapes `s`): prefill chunks one by one,
    decodes aggregated, plus each pass's fixed cost."""
    attention = 0.0
    for chunk, context in batch.prefills:
        c, mem = prefill_attention_terms(chunk, context, s.heads, s.kv_heads, s.head_dim, s.dtype_bytes, peak, bw,
                                         params)
        attention += c + mem
    decodes = bool(batch.decodes or batch.decode_pass)
    if decodes:
        attention += decode_attention_time(batch, s, peak, bw, params)   # aggregated (see there)
    if batch.prefills:
        attention += params.attn_prefill_fixed_s
    if decodes:
        attention += params.attn_decode_fixed_s
    return attention


def host_time(params: CostParams, num_seqs: int, workers: int = 1) -> float:
    """Host seconds of one iteration outside the device work: scheduling and input preparation
    (`iteration_overhead_s`), per-sequence work (`per_seq_overhead_s`: batch building, sampling, output
    processing; this is what makes large decode batches cost more than their FLOPs and bytes), and, for an
    instance of several workers (tp·pp > 1), the broadcast of the batch to them (`tp_sync_s`, `tp_sync_per_seq_s`)."""
    host = params.iteration_overhead_s + params.per_seq_overhead_s * num_seqs
    if workers > 1:
        host = host + params.tp_sync_s + params.tp_sync_per_seq_s * num_seqs
    return host


def per_seq_host_s(params: CostParams, workers: int = 1) -> float:
    """The per-sequence part of `host_time` (seconds per sequence)."""
    return params.per_seq_overhead_s + (params.tp_sync_per_seq_s if workers > 1 else 0.0)


def iteration_time(batch: BatchComposition, model: ModelSpec, hw: HardwareSpec, tp: int = 1, pp: int = 1,
                   params: Optional[CostParams] = None, num_microbatches: int = 1) -> CostBreakdown:
    """Predicted wall time (seconds) of one engine iteration running `batch` on an instance of tp·pp devices:
    host_time + max(device work, kernel-launch floor) -- the floor and the host terms once per iteration."""
    params = CostParams() if params is None else params
    plan = _plan(model, hw, tp, pp)
    overhead = host_time(params, batch.num_seqs, tp * pp)
    if batch.num_tokens == 0:
        return CostBreakdown(overhead, 0.0, 0.0, 0.0, overhead, 0.0, 0.0, 0.0, 0.0, 0, 0, 0.0, overhead)
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches!r}, expected >= 1")
    micro = [batch] if num_microbatches == 1 or pp == 1 else batch.split_round_robin(num_microbatches)
    linear = elementwise = attention = comm = flops_s = memory_s = 0.0
    slowest = 0.0
    for mb in micro:
        lin, ew, att, com, fl, mem = _stage_components(mb, plan, params, tp)
        linear += lin
        elementwise += ew
        attention += att
        comm += com
        flops_s += fl
        memory_s += mem
        slowest = max(slowest, lin + ew + att + com)
    bubble = 0.0
    if pp > 1:
        s = plan.shapes
        send = p2p_time(batch.num_tokens / len(micro) * s.hidden * s.dtype_bytes, plan.pp_link[0], plan.pp_link[1],
                        params)
        comm += (pp - 1) * send
        bubble = (pp - 1) * slowest
    device = linear + elementwise + attention + comm + bubble
    launch = 0.0
    if params.launch_overhead_s > 0:
        launch = params.launch_overhead_s * len(micro) * kernels_per_iteration(
            plan.shapes, plan.layers_per_stage, tp, bool(batch.prefills), bool(batch.decodes))
    total = (device if device >= launch else launch) + overhead
    host = overhead
    if launch > device:
        overhead = overhead + (launch - device)
    return CostBreakdown(total=total, linear=linear, attention=attention, communication=comm, overhead=overhead,
                         elementwise=elementwise, pipeline_bubble=bubble, linear_flops_s=flops_s,
                         linear_memory_s=memory_s, num_tokens=batch.num_tokens, num_seqs=batch.num_seqs,
                         launch_s=launch, host_s=host)


# --------------------------------------------------------------------------------------------------- pipeline stages
def stage_link(hw: HardwareSpec, tp: int, boundary: int) -> tuple[float, float]:
    """(bandwidth per device per direction, latency) of the activation send from stage `boundary` to stage
    `boundary + 1` of an instance whose stages take consecutive blocks of `tp` devices (stage s on devices
    [s·tp, (s+1)·tp), node = device // devices_per_node). Device i of one stage sends to device i of the next;
    if any such pair sits on two nodes the send crosses the inter-node network, else it stays on the node's
    intra-node link (the NVLink bridge when the pair is bridged on a pairwise box)."""
    dpn = hw.devices_per_node
    first = boundary * tp
    pairs = [(d, d + tp) for d in range(first, first + tp)]
    if any(a // dpn != b // dpn for a, b in pairs):
        return hw.inter_node_bandwidth, hw.inter_node_latency
    if hw.intra_node_topology == "pairwise" and all(a // 2 == b // 2 for a, b in pairs):
        return hw.pairwise_bandwidth, hw.intra_node_latency
    return hw.intra_node_bandwidth, hw.intra_node_latency


def stage_device_times(counts: Sequence[int], layer: float, embedding: float, head: float, host: float,
                       launch_overhead_s: float, per_layer_kernels: int) -> list:
    """Per-stage seconds of one step: stage i runs counts[i] layers of `layer` s (stage 0 + embedding + host, the
    last + lm_head), or its kernels' launch floor when that is larger. Shared by stage_times and
    pdjax.sim.step_cost's cached form (bit-identical by sharing)."""
    pp = len(counts)
    stages = []
    for st, n in enumerate(counts):
        first, last = st == 0, st == pp - 1
        device = n * layer + (embedding if first else 0.0) + (head if last else 0.0)
        if launch_overhead_s > 0:
            launch = launch_overhead_s * (n * per_layer_kernels + int(first) + 2 * int(last))
            if launch > device:
                device = launch
        stages.append(device + host if first else device)
    return stages


def stage_times(batch: BatchComposition, model: ModelSpec, hw: HardwareSpec, tp: int = 1, pp: int = 1,
                params: Optional[CostParams] = None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(seconds of each pipeline stage, seconds of each activation send between stages s and s+1) for one batch
    on an instance of pp stages of tp devices: what the simulator's pipeline (pdjax.sim.simulator) occupies
    each stage with, so pipeline bubbles come out of its schedule instead of a formula.

    Stage s runs its own layers only (`pdjax.config.pipeline.stage_layer_ranges`: vLLM's split), costed per
    layer exactly as `iteration_time` costs a layer (GEMMs, element-wise kernels, attention, TP all-reduces);
    stage 0 also runs the embedding, the last stage the LM head (one row per sequence). Each stage's device
    time is floored by its own kernel launches (its layers' kernels, plus the embedding on stage 0 and the LM
    head and sampler on the last). The host's per-iteration time (`host_time`: scheduling, input preparation,
    sampling bookkeeping) precedes the launch of stage 0 and is counted on stage 0. A send moves the hidden
    states of every token (tokens · hidden · dtype bytes; each device of the next stage receives them whole, as
    pdjax.runtime.pipeline.send_activations places them) over the link between the two stages' devices
    (`stage_link`) as a point-to-point copy (`p2p_time`). With pp == 1 the single stage's time equals
    `iteration_time(...).total` up to float rounding."""
    params = CostParams() if params is None else params
    plan = _plan(model, hw, tp, pp)
    counts = stage_layer_counts(model.num_layers, pp)
    host = host_time(params, batch.num_seqs, tp * pp)
    tokens = batch.num_tokens
    if tokens == 0:
        return (host,) + (0.0,) * (pp - 1), (0.0,) * (pp - 1)
    s = plan.shapes
    peak, bw = plan.peak, plan.bandwidth
    layer = 0.0      # one layer: linear + element-wise + attention + TP communication
    for (k, m), bias in zip(s.gemms, s.gemm_bias):
        c, mem = gemm_terms(tokens, k, m, s.dtype_bytes, peak, bw, plan.compute_units, params, bias=bias)
        layer += (c if c > mem else mem) + params.kernel_fixed_s
    layer += sum(elementwise_time(tokens, nbytes, kind, bw, params) for kind, nbytes in s.layer_elementwise)
    layer += layer_attention_time(batch, s, peak, bw, params)
    if tp > 1:
        layer += 2 * allreduce_time(tokens * s.hidden * s.dtype_bytes, tp, plan.tp_link[0], plan.tp_link[1], params,
                                    plan.tp_kind, plan.tp_nics)
    embedding = elementwise_time(tokens, s.embedding_bytes_per_token, "embedding", bw, params)
    c, mem = gemm_terms(batch.num_seqs, s.lm_head[0], s.lm_head[1], s.dtype_bytes, peak, bw, plan.compute_units,
                        params)
    head = (c if c > mem else mem) + params.kernel_fixed_s
    per_layer_kernels = kernels_per_iteration(s, 1, tp, bool(batch.prefills), bool(batch.decodes)) - 3
    stages = stage_device_times(counts, layer, embedding, head, host, params.launch_overhead_s, per_layer_kernels)
    send_bytes = tokens * s.hidden * s.dtype_bytes
    sends = tuple(p2p_time(send_bytes, *stage_link(hw, tp, b), params) for b in range(pp - 1))
    return tuple(stages), sends


# --------------------------------------------------------------------------------------------------- memory
def step_counts(model: ModelSpec, tp: int, *, tokens: int, seqs: int, keys: int, layers: Optional[int] = None,
                lm_head: bool = True) -> dict[str, float]:
    """Exact per-device FLOPs and bytes of one step's matrix work, no tiles or efficiencies: for `layers` layers
    (default all) the four GEMMs at `tokens` rows and attention of every token over `keys` keys (each of `seqs`
    sequences' K/V read once), plus the LM head at `seqs` rows. With keys = a bucket's page-table width it counts
    what the Pallas kernels declare to XLA (pdjax.kernels.ragged_blocks.bucket_cost), so XLA's totals of a compiled
    step compare with it (pdjax.experiment.aot); element-wise work (norms, RoPE, softmax, sampling) is left out."""
    s = sharded_shapes(model, tp)
    layers = model.num_layers if layers is None else layers
    b = s.dtype_bytes
    flops = layers * (sum(2 * tokens * k * m for k, m in s.gemms) + 4 * tokens * s.heads * s.head_dim * keys)
    moved = layers * (sum((k * m + tokens * (k + m)) * b for k, m in s.gemms)
                      + (2 * seqs * keys * s.kv_heads + 2 * tokens * s.heads) * s.head_dim * b)
    if lm_head:
        h, v = s.lm_head
        flops += 2 * seqs * h * v
        moved += (h * v + seqs * (h + v)) * b
    return {"flops": float(flops), "bytes": float(moved)}


def kv_bytes(model: ModelSpec, tokens: int, dtype_bytes: Optional[int] = None) -> int:
    """Bytes of K and V for `tokens` tokens of one request over all layers (all devices together)."""
    if tokens < 0:
        raise ValueError(f"kv_bytes: tokens={tokens}, expected >= 0")
    return tokens * model.kv_bytes_per_token(dtype_bytes)


def activation_bytes(model: ModelSpec, tp: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Peak activation memory of one forward pass per device: the widest layer's live tensors for every
    batched token (residual, normed input, QKV, gate+up and its product) plus fp32 logits for every sequence."""
    s = sharded_shapes(model, tp)
    per_token = (2 * s.hidden + (s.heads + 2 * s.kv_heads) * s.head_dim + 3 * s.gemms[2][1] // 2) * s.dtype_bytes
    return max_num_batched_tokens * per_token + max_num_seqs * s.lm_head[1] * 4


def kv_cache_capacity_tokens(model: ModelSpec, hw: HardwareSpec, tp: int = 1, pp: int = 1, mem_util: float = 0.9,
                             activation_reserve: Optional[float] = None,
                             max_num_batched_tokens: Optional[int] = None, max_num_seqs: int = 256,
                             kv_dtype_bytes: Optional[int] = None) -> int:
    """How many tokens of KV cache an instance holds: per device, `mem_util · HBM − params/(tp·pp) −
    activations`, divided by the KV bytes per token that device stores (its stage's layers, its KV heads).

    activation_reserve: bytes; None estimates it from `max_num_batched_tokens` (default: the model's max
    context, an unchunked prefill of the longest prompt) and `max_num_seqs` (see `activation_bytes`).
    """
    _check_parallel(model, tp, pp)
    if not 0 < mem_util <= 1:
        raise ValueError(f"mem_util={mem_util!r}, expected in (0, 1]")
    if activation_reserve is None:
        tokens = model.max_position_embeddings if max_num_batched_tokens is None else max_num_batched_tokens
        activation_reserve = activation_bytes(model, tp, tokens, max_num_seqs)
    param_bytes = param_count(model) * model.dtype_bytes / (tp * pp)
    free = mem_util * hw.hbm_capacity - param_bytes - activation_reserve
    b = model.dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
    per_token = 2 * (-(-model.num_layers // pp)) * (-(-model.num_kv_heads // tp)) * model.head_dim * b
    if free < per_token:
        raise ValueError(
            f"{model.name} does not fit on {hw.name} with tp={tp}, pp={pp}: {mem_util:.2f} x "
            f"{hw.hbm_capacity / 2**30:.1f} GiB minus params {param_bytes / 2**30:.1f} GiB/device minus activations "
            f"{activation_reserve / 2**30:.2f} GiB leaves {free / 2**30:.2f} GiB for KV")
    return int(free // per_token)


def step_time_fn(model: ModelSpec, hw: HardwareSpec, tp: int = 1, pp: int = 1, params: Optional[CostParams] = None,
                 num_microbatches: int = 1) -> Callable[[Any], float]:
    """A `SchedulerOutput -> seconds` function for the discrete-event simulator's step_time."""
    params = CostParams() if params is None else params
    _plan(model, hw, tp, pp)   # validate the layout now, not at the first step

    def step_time(output) -> float:
        batch = BatchComposition.from_scheduler_output(output)
        return iteration_time(batch, model, hw, tp, pp, params, num_microbatches).total
    return step_time


def iteration_times(batches: Sequence[BatchComposition], model: ModelSpec, hw: HardwareSpec, tp: int = 1,
                    pp: int = 1, params: Optional[CostParams] = None) -> list[float]:
    """Total seconds for each batch (convenience for fitting and sweeps)."""
    return [iteration_time(b, model, hw, tp, pp, params).total for b in batches]
