"""Llama-family decoder (Llama 2/3, Mistral, Yi, Qwen2) as a pure forward over a params pytree.

Choices (jax-llm-examples style): params and the KV cache are `flax.struct` dataclasses (pytrees), one entry
per layer in a tuple, so a sharding (TP on heads / MLP columns+rows) or a layer split (PP) is a tree map away
and the step never needs a rewrite. The forward is a plain function of (params, kv_cache, ragged metadata);
layers are a Python loop (unrolled under jit), which keeps the per-layer KV arrays in the layout of
`pdjax.kernels.reference` and costs little compile time at CPU sizes.

Weight layouts (einsum friendly, "in" axis first, heads explicit so TP shards them); shapes, logical axes, init
rules and stage placement of every tensor live in one table, `pdjax.models.params.param_table(spec)`, which
init_params, the checkpoint checks, the TP shardings and the pipeline split all read:
    embed     [V, H]            lm_head   [H, V] (None when tied: logits = h @ embed.T)
    wq        [H, Nq, D]        wk, wv    [H, Nkv, D]      bq [Nq, D], bk/bv [Nkv, D] (None without bias)
    wo        [Nq, D, H]
    w_gate    [H, I]            w_up      [H, I]           w_down [I, H]
    norms     [H]
RoPE follows HF `rotate_half` (first half / second half of the head dim, not interleaved pairs).
The forward runs on the flat ragged token axis [T]: it writes this step's K/V with `write_kv`, then calls the
injected attention fn (the seam of `pdjax.kernels`), so the Pallas kernels drop in unchanged.
`forward_hidden` is the composition embed -> forward_layers -> final_norm; a pipeline stage
(pdjax.runtime.pipeline) runs a slice of it: `embed` on the first stage, `forward_layers` on its own layer range
and KV, `final_logits` on the last.
"""
from __future__ import annotations

import functools
import math
import zlib
from typing import Callable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pdjax.config.model_specs import ModelSpec
from pdjax.kernels import write_kv
from pdjax.models.params import TOP_FIELDS, LayerParams, LlamaParams, WeightInfo, param_table

_JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def jnp_dtype(dtype) -> jnp.dtype:
    """A jnp dtype from a spec dtype string (or a dtype, passed through)."""
    if isinstance(dtype, str):
        if dtype not in _JNP_DTYPES:
            raise ValueError(f"dtype={dtype!r}, expected one of {sorted(_JNP_DTYPES)}")
        return jnp.dtype(_JNP_DTYPES[dtype])
    return jnp.dtype(dtype)


@struct.dataclass
class KVCache:
    """Per-layer paged K/V: k[l], v[l] of shape [num_kv_heads, num_pages, page_size, head_dim]."""
    k: Tuple[jax.Array, ...]
    v: Tuple[jax.Array, ...]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]


def check_runnable(spec: ModelSpec) -> None:
    if spec.arch != "llama":
        raise ValueError(f"spec {spec.name!r} has arch={spec.arch!r}; only 'llama' specs run (OPT is dimensions only)")


def param_shapes(spec: ModelSpec) -> dict:
    """name -> shape of one layer's tensors and the top-level ones, read from `param_table` (kept for callers
    that want plain shapes, e.g. pdjax.models.train)."""
    table = param_table(spec)
    layer = {} if not table.layers else {i.name: i.shape for i in jax.tree_util.tree_leaves(table.layers[0])}
    top = {n: getattr(table, n).shape for n in TOP_FIELDS if getattr(table, n) is not None}
    return {"layer": layer, "top": top}


_HOST_INIT_MAX_PARAMS = 50_000_000


def _weight_dtype(info: WeightInfo, dtype) -> jnp.dtype:
    return dtype if info.dtype is None else jnp_dtype(info.dtype)


def init_params(spec: ModelSpec, seed: int = 0, dtype=None) -> LlamaParams:
    """Random ("dummy") weights for `spec`, one draw per entry of `param_table(spec)` by its init rule:
    N(0, 1/fan_in) matrices, norms near 1, small biases.

    Scaled so activations stay O(1) through the layers and greedy argmaxes are well separated. Small specs
    are drawn with numpy (no compile: jax's threefry costs seconds of XLA compile per shape on CPU); specs
    over 50M params use one jitted function on device (fast generation, one compile). Deterministic in seed:
    each tensor has its own stream, keyed by (seed, layer + 1 (0 for top-level tensors), crc32(name)).
    """
    check_runnable(spec)
    dtype = jnp_dtype(dtype or spec.dtype)
    if spec.num_params() > _HOST_INIT_MAX_PARAMS:
        return _init_params_jit(spec, dtype)(jnp.uint32(seed % (2 ** 32)))

    def make(info: WeightInfo):
        rng = np.random.default_rng([seed % (2 ** 32), _layer_key(info), zlib.crc32(info.name.encode())])
        x = rng.standard_normal(info.shape, dtype=np.float32)
        if info.init == "norm":
            x = 1.0 + 0.1 * x
        elif info.init == "bias":
            x = 0.1 * x
        else:
            x = x / np.float32(math.sqrt(info.fan_in))
        return jnp.asarray(x, dtype=_weight_dtype(info, dtype))

    return jax.tree_util.tree_map(make, param_table(spec))


def _layer_key(info: WeightInfo) -> int:
    return 0 if info.layer is None else info.layer + 1


@functools.lru_cache(maxsize=16)
def _init_params_jit(spec: ModelSpec, dtype) -> Callable:
    table = param_table(spec)

    def make(root, info: WeightInfo):
        key = jax.random.fold_in(jax.random.fold_in(root, _layer_key(info)),
                                 zlib.crc32(info.name.encode()) % (2 ** 31))
        x = jax.random.normal(key, info.shape, jnp.float32)
        if info.init == "norm":
            x = 1.0 + 0.1 * x
        elif info.init == "bias":
            x = 0.1 * x
        else:
            x = x / math.sqrt(info.fan_in)
        return x.astype(_weight_dtype(info, dtype))

    def init(seed):
        root = jax.random.PRNGKey(seed)
        return jax.tree_util.tree_map(lambda info: make(root, info), table)

    return jax.jit(init)


def init_kv_cache(spec: ModelSpec, num_pages: int, page_size: int = 16, dtype=None, sharding=None,
                  num_layers: Optional[int] = None) -> KVCache:
    """Zeroed paged KV cache: per layer [num_kv_heads, num_pages, page_size, head_dim]; optional sharding.

    num_layers: layers to allocate (default spec.num_layers; a pipeline stage allocates only its own)."""
    if not isinstance(num_pages, (int, np.integer)) or num_pages <= 0:
        raise ValueError(f"num_pages={num_pages!r}, expected a positive int")
    if not isinstance(page_size, (int, np.integer)) or page_size <= 0:
        raise ValueError(f"page_size={page_size!r}, expected a positive int")
    dtype = jnp_dtype(dtype or spec.dtype)
    shape = (spec.num_kv_heads, int(num_pages), int(page_size), spec.head_dim)
    if sharding is not None:
        make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    else:
        make = lambda: jnp.zeros(shape, dtype)  # noqa: E731
    n = spec.num_layers if num_layers is None else int(num_layers)
    return KVCache(k=tuple(make() for _ in range(n)), v=tuple(make() for _ in range(n)))


# ----------------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------------

def rope_inv_freq(spec: ModelSpec) -> np.ndarray:
    """float32[head_dim // 2] inverse frequencies, with Llama-3 scaling when spec.rope_scaling is set.

    Computed in float64 numpy at trace time (static per spec), as HF's `_compute_llama3_parameters`.
    """
    d = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = spec.rope_scaling
    if rs is not None:
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rope_cos_sin(positions: jax.Array, spec: ModelSpec) -> Tuple[jax.Array, jax.Array]:
    """cos, sin float32[T, head_dim] for absolute positions int32[T] (halves repeated, HF convention)."""
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(rope_inv_freq(spec))[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [T, N, D] rotated by cos/sin [T, D] (HF rotate_half), in float32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf.astype(x.dtype) * weight).astype(x.dtype)


def project_qkv(layer: LayerParams, x, cos, sin, spec: ModelSpec):
    """Attention inputs of the residual stream x [T, H]: q [T, Nq, D], k and v [T, Nkv, D] (pre-attention
    RMSNorm, projections, optional biases, RoPE on q and k with cos/sin [T, D] of `rope_cos_sin`)."""
    h = rms_norm(x, layer.attn_norm, spec.rms_norm_eps)
    q = jnp.einsum("th,hnd->tnd", h, layer.wq)
    k = jnp.einsum("th,hnd->tnd", h, layer.wk)
    v = jnp.einsum("th,hnd->tnd", h, layer.wv)
    if layer.bq is not None:
        q, k, v = q + layer.bq, k + layer.bk, v + layer.bv
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attention_residual(layer: LayerParams, x, attn):
    """x [T, H] plus the output projection of the attention result attn [T, Nq, D].

    As one [T, Nq * D] x [Nq * D, H] matmul: with the (n, d) contraction of an einsum, XLA's CPU layout pass
    chose to transpose wo on every step."""
    num_tokens, num_heads, head_dim = attn.shape
    return x + attn.reshape(num_tokens, num_heads * head_dim) @ layer.wo.reshape(num_heads * head_dim, -1)


def attention_block(layer: LayerParams, x, k_pages, v_pages, cos, sin, batch, spec: ModelSpec,
                    attention_fn: Callable):
    """x [T, H] plus the attention half of a decoder layer, and the layer's pages with this step's K/V written
    (batch: the step's ragged metadata, see `forward_hidden`)."""
    with jax.named_scope("qkv"):
        q, k, v = project_qkv(layer, x, cos, sin, spec)
    with jax.named_scope("kv_write"):
        k_pages, v_pages = write_kv(k_pages, v_pages, k, v, batch.slot_mapping)
    with jax.named_scope("attention"):
        attn = attention_fn(q, k_pages, v_pages, batch.kv_lens, batch.page_indices, batch.cu_q_lens, batch.num_seqs,
                            sm_scale=1.0 / math.sqrt(spec.head_dim), sliding_window=spec.sliding_window)
    with jax.named_scope("attn_out"):
        return attention_residual(layer, x, attn), k_pages, v_pages


def mlp_block(layer: LayerParams, x, spec: ModelSpec):
    """x [T, H] plus the SwiGLU MLP of its RMSNorm (the second half of a decoder layer)."""
    h = rms_norm(x, layer.mlp_norm, spec.rms_norm_eps)
    gate = jnp.einsum("th,hi->ti", h, layer.w_gate)
    up = jnp.einsum("th,hi->ti", h, layer.w_up)
    return x + jnp.einsum("ti,ih->th", jax.nn.silu(gate) * up, layer.w_down)


def embed(params, token_ids: jax.Array) -> jax.Array:
    """Residual stream [T, H] of token ids int32[T] (params: anything with an `.embed` [V, H] table)."""
    return params.embed[token_ids]


def forward_layers(layers: Sequence[LayerParams], kv_cache: KVCache, x, batch, *, spec: ModelSpec,
                   attention_fn: Callable):
    """Run a contiguous range of decoder layers on the residual stream x [T, H].

    `kv_cache` holds exactly those layers' pages (kv_cache.k[i] belongs to layers[i]), so a pipeline stage
    passes its own layers and its own cache slice. Returns (x after the last layer, KVCache of the same layers
    with this step's K/V written). batch as in `forward_hidden`. Each layer is a named scope ('layer3/mlp', ...),
    so a device profile reads like this code.
    """
    if len(layers) != len(kv_cache.k):
        raise ValueError(f"forward_layers got {len(layers)} layers but a KV cache of {len(kv_cache.k)} layers")
    with jax.named_scope("rope"):
        cos, sin = rope_cos_sin(batch.positions, spec)
    new_k, new_v = [], []
    for li, layer in enumerate(layers):
        with jax.named_scope(f"layer{li}"):
            x, k_pages, v_pages = attention_block(layer, x, kv_cache.k[li], kv_cache.v[li], cos, sin, batch, spec,
                                                  attention_fn)
            with jax.named_scope("mlp"):
                x = mlp_block(layer, x, spec)
        new_k.append(k_pages)
        new_v.append(v_pages)
    return x, KVCache(k=tuple(new_k), v=tuple(new_v))


def final_norm(params, x: jax.Array, spec: ModelSpec) -> jax.Array:
    """The final RMSNorm of hidden states [N, H] (params: anything with a `.final_norm`)."""
    return rms_norm(x, params.final_norm, spec.rms_norm_eps)


def final_logits(params, x: jax.Array, spec: ModelSpec) -> jax.Array:
    """float32 logits [N, V] of last-layer hidden states [N, H]: final norm, then lm_head (or tied embed)."""
    return logits_from_hidden(params, final_norm(params, x, spec))


def forward_hidden(params: LlamaParams, kv_cache: KVCache, batch, *, spec: ModelSpec, attention_fn: Callable,
                   token_ids=None):
    """Final-normed hidden states [T, H] of a ragged batch, and the KV cache with this step's K/V written.

    batch: a `pdjax.runtime.batch.RaggedBatch` (or anything with its fields): token_ids, positions, slot_mapping
    int32[T]; kv_lens int32[S]; page_indices int32[S, P]; cu_q_lens int32[S+1]; num_seqs int32[] (see
    pdjax/kernels/reference.py for the ragged layout). token_ids: the ids to feed instead of batch.token_ids (the
    step's, with the previous step's samples taken on the device).
    The composition embed -> forward_layers (all layers) -> final_norm; a pipeline stage runs a slice of it.
    """
    with jax.named_scope("embed"):
        x = embed(params, batch.token_ids if token_ids is None else token_ids)
    x, kv_cache = forward_layers(params.layers, kv_cache, x, batch, spec=spec, attention_fn=attention_fn)
    with jax.named_scope("final_norm"):
        return final_norm(params, x, spec), kv_cache


def logits_from_hidden(params: LlamaParams, hidden: jax.Array) -> jax.Array:
    """float32 logits [N, V] of hidden states [N, H] (tied embeddings when lm_head is None)."""
    if params.lm_head is None:
        out = jnp.einsum("nh,vh->nv", hidden, params.embed)
    else:
        out = jnp.einsum("nh,hv->nv", hidden, params.lm_head)
    return out.astype(jnp.float32)
