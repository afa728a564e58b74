"""FLOPs and bytes of one executed batch for the benchmarks' rooflines, counted by the simulator's cost model
(pdjax.sim.cost_model: the same GEMM shapes, attention and element-wise traffic the simulator costs), so the
repository has one model of what a step does.

The cost model's term functions return seconds at a peak rate and a bandwidth; called with a rate and a
bandwidth of 1 and `COUNTING` (every efficiency 1, no tile padding, no occupancy penalty, each KV row read once
per chunk, exact causal skipping) they return the FLOPs and the bytes themselves. Per step: every layer's GEMMs
(QKV, O, MLP) over the fed tokens with the activations they read and write, its attention (prefill chunks: the
causal part of the chunk plus the cached context; decodes: their context plus the token), its element-wise
kernels (norms, RoPE, activation, residual), the embedding gather, and the LM head over one row per sequence.
JAX-free.
"""
from __future__ import annotations

from typing import Tuple

from pdjax.config.model_specs import ModelSpec
from pdjax.sim.cost_model import (BatchComposition, CostParams, decode_attention_terms, gemm_terms,
                                  prefill_attention_terms, sharded_shapes)

COUNTING = CostParams(gemm_flops_efficiency=1.0, gemm_bandwidth_efficiency=1.0, gemm_token_tile=1,
                      gemm_occupancy_exponent=0.0, attn_flops_efficiency=1.0, attn_bandwidth_efficiency=1.0,
                      attn_causal_skip=1.0, attn_query_tile=1 << 30)


def step_counts(batch, spec: ModelSpec) -> Tuple[float, float]:
    """(FLOPs, bytes moved) on one device (module docstring) of one executed batch: a BatchComposition, or a
    SchedulerOutput (duck-typed: is_prefill, num_computed_tokens, num_new_tokens)."""
    if not isinstance(batch, BatchComposition):
        batch = BatchComposition.from_scheduler_output(batch)
    s = sharded_shapes(spec, 1)
    b, tokens = s.dtype_bytes, batch.num_tokens
    flops = moved = 0.0
    for (k, m), bias in zip(s.gemms, s.gemm_bias):
        f, nbytes = gemm_terms(tokens, k, m, b, 1.0, 1.0, 1, COUNTING, bias=bias)
        flops, moved = flops + f, moved + nbytes
    for chunk, context in batch.prefills:
        f, nbytes = prefill_attention_terms(chunk, context, s.heads, s.kv_heads, s.head_dim, b, 1.0, 1.0, COUNTING)
        flops, moved = flops + f, moved + nbytes
    for count, context in batch.decodes:
        f, nbytes, _ = decode_attention_terms(count, context, s.heads, s.kv_heads, s.head_dim, b, 1.0, 1.0, COUNTING)
        flops, moved = flops + f, moved + nbytes
    moved += tokens * sum(per_token for _, per_token in s.layer_elementwise)
    flops, moved = flops * spec.num_layers, moved * spec.num_layers
    head_flops, head_bytes = gemm_terms(batch.num_seqs, s.lm_head[0], s.lm_head[1], b, 1.0, 1.0, 1, COUNTING)
    return flops + head_flops, moved + head_bytes + tokens * s.embedding_bytes_per_token
