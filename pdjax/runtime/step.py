"""The functional step: step(params, kv_cache, batch) -> (sampled_token_ids int32[S], kv_cache).

`make_step` returns the jitted step with the KV cache donated (updated in place); only the sampled ids
(int32[S]) are meant to come back to the host. `make_forward_logits` is the same forward returning float32
logits [S, V] at each sequence's last token (for tests and --dump_logits). Logits are computed only at the
S sample rows, never for all T tokens.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax

from pdjax.config.model_specs import ModelSpec
from pdjax.models.llama import KVCache, LlamaParams, forward_hidden, logits_from_hidden
from pdjax.runtime.batch import RaggedBatch
from pdjax.runtime.sampling import sample_tokens


def forward_logits(params: LlamaParams, kv_cache: KVCache, batch: RaggedBatch, *, spec: ModelSpec,
                   attention_fn: Callable):
    """(float32 logits [S, V] at batch.sample_indices, updated kv_cache)."""
    hidden, kv_cache = forward_hidden(
        params, kv_cache, batch.token_ids, batch.positions, batch.slot_mapping, batch.kv_lens,
        batch.page_indices, batch.cu_q_lens, batch.num_seqs, spec=spec, attention_fn=attention_fn)
    return logits_from_hidden(params, hidden[batch.sample_indices]), kv_cache


def step(params: LlamaParams, kv_cache: KVCache, batch: RaggedBatch, *, spec: ModelSpec,
         attention_fn: Callable):
    """(sampled token ids int32[S], updated kv_cache). The sampled token sits at position kv_len."""
    logits, kv_cache = forward_logits(params, kv_cache, batch, spec=spec, attention_fn=attention_fn)
    ids = sample_tokens(logits, batch.kv_lens, batch.temperature, batch.top_k, batch.top_p, batch.seed)
    return ids, kv_cache


def _jit(fn, spec, attention_fn, on_trace, out_shardings):
    def traced(params, kv_cache, batch):
        if on_trace is not None:
            on_trace(batch)  # runs once per trace, i.e. once per compiled shape
        return fn(params, kv_cache, batch, spec=spec, attention_fn=attention_fn)

    kwargs = {} if out_shardings is None else {"out_shardings": out_shardings}
    return jax.jit(traced, donate_argnums=(1,), **kwargs)


def make_step(spec: ModelSpec, attention_fn: Callable, *, on_trace: Optional[Callable] = None,
              out_shardings=None):
    """Jitted `step` with kv_cache donated. on_trace(batch) is called at each (re)trace."""
    return _jit(step, spec, attention_fn, on_trace, out_shardings)


def make_forward_logits(spec: ModelSpec, attention_fn: Callable, *, on_trace: Optional[Callable] = None,
                        out_shardings=None):
    """Jitted `forward_logits` with kv_cache donated."""
    return _jit(forward_logits, spec, attention_fn, on_trace, out_shardings)
