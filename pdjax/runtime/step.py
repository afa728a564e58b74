"""The functional step: step(params, kv_cache, batch, prev_ids) -> (SampledTokens, kv_cache).

A sequence whose logits hold a NaN or an inf gets the id NONFINITE_LOGITS (-2, pdjax.scheduler.output) instead of
a sample (argmax of NaN logits is id 0, which looked like a real token): the flag travels in the ids array itself,
so it costs one [S, V] reduction on the device and no extra output, transfer or compiled shape.

`make_step` returns the jitted step with the KV cache donated (updated in place); only the sampled ids come back
to the host (a `SampledTokens`: the ids, and each row's logprobs, computed only in a batch where some row asks,
`batch.want_logprobs`, pdjax.runtime.sampling.token_logprobs; the host reads them only then). They are padded to
a fixed `max_seqs` rows (the largest sequence bucket), so one step's output can
feed the next step whatever its bucket: tokens with `batch.token_src[i] >= 0` are taken on the device from
`prev_ids` (the previous step's output; async scheduling), so the sync and the async engine run the same
compiled shapes. `make_forward_logits` is the same forward returning float32 logits [S, V] at each sequence's
last token (for tests and --dump_logits). Logits are computed only at the S sample rows, never for all T tokens.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import struct

from pdjax.config.model_specs import ModelSpec
from pdjax.models.llama import KVCache, LlamaParams, forward_hidden, logits_from_hidden
from pdjax.runtime.batch import RaggedBatch
from pdjax.runtime.sampling import sample_tokens, token_logprobs
from pdjax.scheduler.output import NONFINITE_LOGITS


@struct.dataclass
class SampledTokens:
    """What a step returns besides the KV cache, M = max_seqs rows (rows past the batch's S are 0).

    ids int32[M]: the sampled token (`sampled_ids`); logprob float32[M]: its log-probability under the raw logits;
    top_ids int32[M, K] / top_logprobs float32[M, K]: the K = min(20, vocab) most likely tokens, most likely first.
    The logprob fields are zeros unless some row of the batch had want_logprobs.
    """
    ids: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def fed_token_ids(batch: RaggedBatch, prev_ids):
    """int32[T]: batch.token_ids with token i replaced by prev_ids[token_src[i]] where token_src[i] >= 0."""
    taken = prev_ids[jnp.maximum(batch.token_src, 0)].astype(batch.token_ids.dtype)
    return jnp.where(batch.token_src >= 0, taken, batch.token_ids)


def forward_logits(params: LlamaParams, kv_cache: KVCache, batch: RaggedBatch, prev_ids, *, spec: ModelSpec,
                   attention_fn: Callable):
    """(float32 logits [S, V] at batch.sample_indices, updated kv_cache)."""
    hidden, kv_cache = forward_hidden(params, kv_cache, batch, spec=spec, attention_fn=attention_fn,
                                      token_ids=fed_token_ids(batch, prev_ids))
    with jax.named_scope("lm_head"):
        return logits_from_hidden(params, hidden[batch.sample_indices]), kv_cache


def sampled_ids(logits, batch: RaggedBatch, max_seqs: int):
    """int32[max_seqs]: the token sampled from each row of float32 logits [S, V] (rows past S are 0), or
    NONFINITE_LOGITS for a row holding a NaN or an inf."""
    with jax.named_scope("sampling"):
        ids = sample_tokens(logits, batch.kv_lens, batch.temperature, batch.top_k, batch.top_p, batch.seed)
    # max |logit| is NaN or inf exactly when a logit is (XLA's max propagates NaN). Not isfinite(...).all(): with
    # vocab-split logits that is an all-reduce of booleans, which XLA:TPU's cost analysis prices at -1 s.
    finite = jnp.isfinite(jnp.abs(logits).max(axis=-1))
    ids = jnp.where(finite, ids.astype(jnp.int32), NONFINITE_LOGITS)
    return jnp.zeros((max_seqs,), jnp.int32).at[:ids.shape[0]].set(ids)


def sampled_tokens(logits, batch: RaggedBatch, max_seqs: int) -> SampledTokens:
    """The SampledTokens of float32 logits [S, V]: `sampled_ids`, and the logprobs of each row when some row of
    the batch asked (batch.want_logprobs; else zeros, and no work on the device)."""
    ids = sampled_ids(logits, batch, max_seqs)
    with jax.named_scope("logprobs"):
        logprob, top_ids, top_logprobs = token_logprobs(logits, ids[:logits.shape[0]], batch.want_logprobs,
                                                        max_seqs)
    return SampledTokens(ids=ids, logprob=logprob, top_ids=top_ids, top_logprobs=top_logprobs)


def step(params: LlamaParams, kv_cache: KVCache, batch: RaggedBatch, prev_ids, *, spec: ModelSpec,
         attention_fn: Callable, max_seqs: int):
    """(SampledTokens (ids: `sampled_ids`, rows past S are 0, NONFINITE_LOGITS where a row's logits are not
    finite; logprobs where asked), updated kv_cache). A sampled token sits at position kv_len. prev_ids: the
    previous step's SampledTokens.ids."""
    logits, kv_cache = forward_logits(params, kv_cache, batch, prev_ids, spec=spec, attention_fn=attention_fn)
    return sampled_tokens(logits, batch, max_seqs), kv_cache


def _jit(fn, on_trace, out_shardings, **static):
    def traced(params, kv_cache, batch, prev_ids):
        if on_trace is not None:
            on_trace(batch)  # runs once per trace (a compile can also happen without one: pdjax.runtime.compiles)
        return fn(params, kv_cache, batch, prev_ids, **static)

    kwargs = {} if out_shardings is None else {"out_shardings": out_shardings}
    return jax.jit(traced, donate_argnums=(1,), **kwargs)


def make_step(spec: ModelSpec, attention_fn: Callable, *, max_seqs: int, on_trace: Optional[Callable] = None,
              out_shardings=None):
    """Jitted `step` with kv_cache donated. on_trace(batch) is called at each (re)trace."""
    return _jit(step, on_trace, out_shardings, spec=spec, attention_fn=attention_fn, max_seqs=max_seqs)


def make_forward_logits(spec: ModelSpec, attention_fn: Callable, *, on_trace: Optional[Callable] = None,
                        out_shardings=None):
    """Jitted `forward_logits` with kv_cache donated."""
    return _jit(forward_logits, on_trace, out_shardings, spec=spec, attention_fn=attention_fn)
