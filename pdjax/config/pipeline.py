"""Pipeline-parallel layer split: which contiguous layer range each stage holds (pure Python, no JAX).

Rule (vLLM's default `get_pp_indices` in vllm/distributed/utils.py, without its env override): every stage gets
num_layers // pp layers; the remainder r = num_layers % pp (r <= pp - 1) adds one layer each to the stages
pp-2, pp-3, ..., pp-1-r, i.e. to every stage but the last, walking back from the second-to-last. The last stage
is spared because it also runs the final norm, lm_head and sampling; when r <= pp - 2 the first stage (which
runs the embedding) is spared too, so the extra layers land on the middle stages.
Examples: 3 layers / pp 2 -> [2, 1]; 5 / 4 -> [1, 1, 2, 1]; 7 / 4 -> [2, 2, 2, 1]; 10 / 4 -> [2, 3, 3, 2].

`layer_to_stage` and `relayout_plan` are what a KV transfer between two pipeline layouts (prefill pp2 ->
decode pp1, pp1 -> pp2) needs to route each layer's pages to the stage that holds that layer.
"""
from __future__ import annotations

from typing import Optional, Tuple


def _check(num_layers: int, pp: int) -> None:
    for name, value in (("num_layers", num_layers), ("pp", pp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}, expected a positive int")
    if pp > num_layers:
        raise ValueError(f"pp={pp} exceeds num_layers={num_layers}: every pipeline stage needs at least one layer")


def stage_layer_counts(num_layers: int, pp: int) -> Tuple[int, ...]:
    """Layers per stage (see the module docstring for the rule); sums to num_layers, every entry >= 1."""
    _check(num_layers, pp)
    counts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        counts[-i] += 1
    return tuple(counts)


def stage_layer_ranges(num_layers: int, pp: int) -> Tuple[Tuple[int, int], ...]:
    """(start, end) half-open layer range of each stage, contiguous and in order."""
    ranges, start = [], 0
    for n in stage_layer_counts(num_layers, pp):
        ranges.append((start, start + n))
        start += n
    return tuple(ranges)


def layer_to_stage(num_layers: int, pp: int) -> Tuple[int, ...]:
    """The stage holding each layer: a tuple of num_layers stage indices (non-decreasing)."""
    return tuple(s for s, (a, b) in enumerate(stage_layer_ranges(num_layers, pp)) for _ in range(a, b))


def relayout_plan(num_layers: int, src_pp: int, dst_pp: int) -> Tuple[Tuple[int, int, int, int, int], ...]:
    """How per-layer KV moves from a src_pp layout to a dst_pp one: one entry per layer,
    (layer, src_stage, index within src stage, dst_stage, index within dst stage)."""
    src_ranges, dst_ranges = stage_layer_ranges(num_layers, src_pp), stage_layer_ranges(num_layers, dst_pp)
    src_of, dst_of = layer_to_stage(num_layers, src_pp), layer_to_stage(num_layers, dst_pp)
    return tuple((layer, src_of[layer], layer - src_ranges[src_of[layer]][0],
                  dst_of[layer], layer - dst_ranges[dst_of[layer]][0]) for layer in range(num_layers))


def check_pipeline_parallel(num_layers: int, pp: int, tp: int, num_devices: Optional[int] = None) -> None:
    """Raise ValueError (one line naming the value) unless pp stages of tp devices fit: pp <= num_layers and,
    when num_devices is given, pp * tp <= num_devices. (Head / MLP divisibility by tp:
    pdjax.runtime.mesh.check_tensor_parallel.)"""
    _check(num_layers, pp)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp={tp!r}, expected a positive int")
    if num_devices is not None and pp * tp > num_devices:
        raise ValueError(f"pp={pp} x tp={tp} needs {pp * tp} devices, only {num_devices} given")
