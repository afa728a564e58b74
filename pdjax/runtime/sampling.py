"""On-device sampling: greedy, temperature, top-k, top-p, one seed per request.

Each request draws the token at absolute position p with key fold_in(PRNGKey(seed), p), so its samples do not
depend on which other requests share the batch or on where it sits in it. top-k and top-p are applied as
logit thresholds found on one descending sort of each row (ties at a threshold are all kept).
A batch with no random row (every temperature 0: greedy) skips the sort and the draws (`lax.cond`): on CPU the
sort of [S, V] logits cost as much as the lm_head matmul, for a result that is the argmax anyway.

Logprobs (`token_logprobs`) are log_softmax of the raw model logits: before temperature, top-k and top-p, as vLLM
returns them by default (its `raw_logprobs` mode; OpenAI's too), so a request's logprobs do not change with its
sampling settings. The top MAX_TOP_LOGPROBS (OpenAI's cap) are always returned (a static shape); a batch where no
row asks skips the work on the device (`lax.cond`), so requests that do not ask cost no compile and next to nothing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

MAX_TOP_LOGPROBS = 20     # OpenAI's cap on top_logprobs: the step returns this many top entries per row


def sample_tokens(logits: jax.Array, positions: jax.Array, temperature: jax.Array, top_k: jax.Array,
                  top_p: jax.Array, seed: jax.Array) -> jax.Array:
    """int32[S] token ids from float32 logits [S, V].

    positions int32[S]: absolute position of the token being sampled (the key's fold-in);
    temperature float32[S] (0 = greedy argmax), top_k int32[S] (0 = off), top_p float32[S] (>= 1 = off),
    seed uint32[S].
    """
    logits = logits.astype(jnp.float32)
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_random = temperature > 0
    return jax.lax.cond(jnp.any(is_random), _sample_random, lambda *_: greedy_ids,
                        logits, greedy_ids, is_random, positions, temperature, top_k, top_p, seed)


def _sample_random(logits, greedy_ids, is_random, positions, temperature, top_k, top_p, seed):
    """`sample_tokens` of a batch with at least one random row (greedy rows keep greedy_ids)."""
    vocab = logits.shape[-1]
    scaled = logits / jnp.where(is_random, temperature, 1.0)[:, None]

    sorted_desc = jnp.sort(scaled, axis=-1, stable=False, descending=True)   # stable: 2x the TPU compile time
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth_value = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    rank = jnp.arange(vocab)[None, :]
    sorted_topk = jnp.where(rank < k[:, None], sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_topk, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= rank < k[:, None]
    num_keep = jnp.maximum(keep.sum(axis=-1), 1)
    p_value = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)
    threshold = jnp.maximum(kth_value, p_value)
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)

    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(seed, positions)
    drawn = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
    return jnp.where(is_random, drawn, greedy_ids)


def token_logprobs(logits: jax.Array, ids: jax.Array, want: jax.Array, num_rows: int):
    """(logprob float32[num_rows] of ids, top ids int32[num_rows, K], top logprobs float32[num_rows, K]) of float32
    logits [S, V] (S <= num_rows; rows past S are 0), K = min(MAX_TOP_LOGPROBS, V), top entries in descending order.

    ids int32[S]: the sampled ids (an id outside [0, V), e.g. a non-finite row's flag, reads the clipped column);
    want bool[S]: rows that asked. Logprobs are log_softmax of the raw logits (module docstring). With no row
    wanting them the step returns zeros without computing anything (`lax.cond`); with some, every row is computed
    (the host keeps the ones that asked).
    """
    s, vocab = logits.shape
    k = min(MAX_TOP_LOGPROBS, vocab)

    def compute(logits, ids):
        # logprob = logit - logsumexp(row): top-k of the logits themselves, so no [S, V] logprobs array is made
        logits = logits.astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        chosen = jnp.take_along_axis(logits, jnp.clip(ids, 0, vocab - 1)[:, None], axis=-1)[:, 0] - lse
        top_logits, top_ids = jax.lax.top_k(logits, k)
        top_logprobs = top_logits - lse[:, None]
        pad = lambda a: jnp.zeros((num_rows,) + a.shape[1:], a.dtype).at[:s].set(a)  # noqa: E731
        return pad(chosen), pad(top_ids.astype(jnp.int32)), pad(top_logprobs)

    def skip(logits, ids):
        return (jnp.zeros((num_rows,), jnp.float32), jnp.zeros((num_rows, k), jnp.int32),
                jnp.zeros((num_rows, k), jnp.float32))

    return jax.lax.cond(jnp.any(want), compute, skip, logits, ids)
