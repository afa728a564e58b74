"""Training the Llama of `pdjax.models.llama` on bytes: a dense causal forward, the next-byte loss, AdamW.

Choices:
- The dense forward is built from the serving model's own layer functions (`project_qkv`, `attention_residual`,
  `mlp_block`, `rms_norm`, `rope_cos_sin`, `logits_from_hidden`) on the flattened [B*L] token axis; only the
  attention differs: full-sequence causal softmax over [B, L] windows instead of ragged paged attention. So a
  trained model serves unchanged, and a test pins `dense_forward_logits` to the ragged paged path.
- Attention and the loss run in float32 (the params may be any dtype; the optimizer keeps float32 params).
- Init: GPT-2 style N(0, 0.02) matrices, output projections (wo, w_down) scaled by 1/sqrt(2 * layers), norms
  at 1, drawn with numpy from the seed (deterministic, no compile). `llama.init_params` draws "dummy" weights
  scaled for clean argmaxes, not for optimisation (its embeddings have unit variance).
- Optimizer: AdamW with linear warmup then cosine decay to 10% of the peak, global-norm clipping; weight decay
  only on matrices (ndim >= 2), not on norms or biases.
- Batches: random windows of the training bytes (numpy Generator from the seed), no BOS: serving prompts
  are raw bytes too (`pdjax.workload` text prompts), so any position may start a window.
"""
from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Callable, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pdjax.config.model_specs import ModelSpec
from pdjax.config.parse import check_fields, is_int, number, positive_int
from pdjax.models.llama import (LayerParams, LlamaParams, attention_residual, check_runnable, logits_from_hidden,
                                mlp_block, param_shapes, project_qkv, rms_norm, rope_cos_sin)

_NEG_INF = -1e30


# ----------------------------------------------------------------------------------------------------------
# Init and data
# ----------------------------------------------------------------------------------------------------------

def init_train_params(spec: ModelSpec, seed: int = 0, std: float = 0.02) -> LlamaParams:
    """float32 params for training: N(0, std) matrices, wo/w_down scaled by 1/sqrt(2 * num_layers), norms 1,
    biases 0. Deterministic in seed."""
    check_runnable(spec)
    shapes = param_shapes(spec)
    out_scale = 1.0 / math.sqrt(2 * spec.num_layers)

    def make(name, shape, layer_idx):
        if name.endswith("norm"):
            return jnp.ones(shape, jnp.float32)
        if name.startswith("b"):
            return jnp.zeros(shape, jnp.float32)
        rng = np.random.default_rng([seed % (2 ** 32), layer_idx + 1, zlib.crc32(name.encode())])
        x = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        if name in ("wo", "w_down"):
            x *= np.float32(out_scale)
        return jnp.asarray(x)

    layers = tuple(LayerParams(**{n: make(n, s, li) for n, s in shapes["layer"].items()})
                   for li in range(spec.num_layers))
    return LlamaParams(layers=layers, **{n: make(n, s, -1) for n, s in shapes["top"].items()})


def split_train_val(data: bytes, val_fraction: float) -> Tuple[np.ndarray, np.ndarray]:
    """(train, val) uint8 arrays: the last `val_fraction` of the bytes is held out."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r}, expected a number in (0, 1)")
    arr = np.frombuffer(bytes(data), dtype=np.uint8)
    cut = int(round(len(arr) * (1.0 - val_fraction)))
    if cut < 2 or len(arr) - cut < 2:
        raise ValueError(f"text of {len(arr)} bytes is too short to hold out val_fraction={val_fraction}")
    return arr[:cut].copy(), arr[cut:].copy()


def sample_windows(data: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """int32[batch, seq_len + 1] random windows of `data` (inputs are [:, :-1], targets [:, 1:])."""
    if len(data) < seq_len + 1:
        raise ValueError(f"data of {len(data)} bytes is shorter than seq_len + 1 = {seq_len + 1}")
    starts = rng.integers(0, len(data) - seq_len, size=batch)
    return np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int32)


def eval_windows(data: np.ndarray, seq_len: int) -> np.ndarray:
    """int32[N, seq_len + 1] windows that tile `data` with stride seq_len (each byte a target once; the tail
    that does not fill a window is dropped)."""
    n = (len(data) - 1) // seq_len
    if n < 1:
        raise ValueError(f"data of {len(data)} bytes is shorter than seq_len + 1 = {seq_len + 1}")
    return np.stack([data[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)]).astype(np.int32)


# ----------------------------------------------------------------------------------------------------------
# Dense forward and loss
# ----------------------------------------------------------------------------------------------------------

def causal_attention(q, k, v, *, sm_scale: float, sliding_window: Optional[int] = None):
    """Dense causal GQA attention, float32 softmax.

    q [B, L, Nq, D], k/v [B, L, Nkv, D] -> [B, L, Nq, D] in q's dtype. Query head h reads KV head
    h // (Nq // Nkv) (as `pdjax.kernels.reference`); with a sliding window, key j is visible to query i when
    i - window < j <= i.
    """
    b, length, nq, d = q.shape
    nkv = k.shape[2]
    qg = (q.astype(jnp.float32) * sm_scale).reshape(b, length, nkv, nq // nkv, d)
    s = jnp.einsum("bqngd,bknd->bngqk", qg, k.astype(jnp.float32))
    i = jnp.arange(length)[:, None]
    j = jnp.arange(length)[None, :]
    mask = j <= i
    if sliding_window is not None:
        mask &= j > i - sliding_window
    p = jax.nn.softmax(jnp.where(mask, s, _NEG_INF), axis=-1)
    out = jnp.einsum("bngqk,bknd->bqngd", p, v.astype(jnp.float32))
    return out.reshape(b, length, nq, d).astype(q.dtype)


def dense_forward_logits(params: LlamaParams, token_ids, spec: ModelSpec, positions=None):
    """float32 logits [B, L, V] of token_ids int32[B, L] (each row one causal sequence; positions int32[B, L],
    default 0..L-1)."""
    b, length = token_ids.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    x = params.embed[token_ids.reshape(-1)]
    cos, sin = rope_cos_sin(positions.reshape(-1), spec)
    for layer in params.layers:
        q, k, v = project_qkv(layer, x, cos, sin, spec)
        attn = causal_attention(q.reshape(b, length, *q.shape[1:]), k.reshape(b, length, *k.shape[1:]),
                                v.reshape(b, length, *v.shape[1:]), sm_scale=1.0 / math.sqrt(spec.head_dim),
                                sliding_window=spec.sliding_window)
        x = attention_residual(layer, x, attn.reshape(b * length, *attn.shape[2:]))
        x = mlp_block(layer, x, spec)
    x = rms_norm(x, params.final_norm, spec.rms_norm_eps)
    return logits_from_hidden(params, x).reshape(b, length, -1)


def next_token_loss(params: LlamaParams, windows, spec: ModelSpec):
    """Mean next-token cross-entropy in nats (per byte for a byte model) of windows int32[B, L + 1]."""
    logits = dense_forward_logits(params, windows[:, :-1], spec)
    logp = jax.nn.log_softmax(logits, axis=-1)
    target_logp = jnp.take_along_axis(logp, windows[:, 1:, None], axis=-1)[..., 0]
    return -jnp.mean(target_logp)


# ----------------------------------------------------------------------------------------------------------
# Optimizer and loop
# ----------------------------------------------------------------------------------------------------------

def make_optimizer(*, lr: float, total_steps: int, warmup_steps: int, weight_decay: float = 0.1,
                   clip_norm: float = 1.0, b2: float = 0.99) -> optax.GradientTransformation:
    """AdamW, linear warmup to `lr` then cosine decay to lr/10 at total_steps; decay on matrices only."""
    if total_steps < 1 or not 0 <= warmup_steps < total_steps:
        raise ValueError(f"total_steps={total_steps}, warmup_steps={warmup_steps}: expected total_steps >= 1 "
                         f"and 0 <= warmup_steps < total_steps")
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, total_steps, end_value=lr / 10)
    decay_mask = lambda params: jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(clip_norm),
                       optax.adamw(schedule, b1=0.9, b2=b2, weight_decay=weight_decay, mask=decay_mask))


def make_train_step(spec: ModelSpec, optimizer: optax.GradientTransformation) -> Callable:
    """jitted (params, opt_state, windows int32[B, L+1]) -> (params, opt_state, loss); params/state donated."""

    def train_step(params, opt_state, windows):
        loss, grads = jax.value_and_grad(next_token_loss)(params, windows, spec)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(train_step, donate_argnums=(0, 1))


def make_eval_fn(spec: ModelSpec) -> Callable:
    """jitted (params, windows int32[B, L+1]) -> (nats float32[B], correct argmax predictions int32[B]),
    summed over each window's L targets."""

    def eval_batch(params, windows):
        logits = dense_forward_logits(params, windows[:, :-1], spec)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, windows[:, 1:, None], axis=-1)[..., 0]
        correct = jnp.argmax(logits, axis=-1) == windows[:, 1:]
        return nll.sum(axis=1), correct.sum(axis=1)

    return jax.jit(eval_batch)


def evaluate(params: LlamaParams, data: np.ndarray, spec: ModelSpec, *, seq_len: int, batch: int = 16,
             eval_fn: Optional[Callable] = None) -> Dict[str, float]:
    """{'loss': nats/byte, 'bpb': bits/byte, 'accuracy': next-byte argmax accuracy, 'bytes': count} over
    the stride-seq_len windows of `data` (the last batch is padded with copies, which are not counted)."""
    eval_fn = eval_fn or make_eval_fn(spec)
    windows = eval_windows(data, seq_len)
    total_nll, total_correct = 0.0, 0
    for start in range(0, len(windows), batch):
        chunk = windows[start:start + batch]
        n = len(chunk)
        if n < batch:  # one shape, one compile
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - n, axis=0)])
        nll, correct = eval_fn(params, jnp.asarray(chunk))
        total_nll += float(np.asarray(nll, np.float64)[:n].sum())
        total_correct += int(np.asarray(correct)[:n].sum())
    count = len(windows) * seq_len
    loss = total_nll / count
    return {"loss": loss, "bpb": loss / math.log(2), "accuracy": total_correct / count, "bytes": count}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = positive_int(450)
    batch: int = positive_int(16)
    seq_len: int = positive_int(256)
    lr: float = number(3e-3, low=0, low_open=True)
    warmup_steps: int = 30
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    seed: int = 0
    log_every: int = positive_int(100)

    def __post_init__(self):
        check_fields(self, "train")
        if not is_int(self.warmup_steps) or not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"train.warmup_steps={self.warmup_steps!r}, expected an int in [0, steps={self.steps})")


def train(spec: ModelSpec, train_data: np.ndarray, cfg: TrainConfig, *, params: Optional[LlamaParams] = None,
          on_log: Optional[Callable[[int, float], None]] = None) -> Tuple[LlamaParams, List[Tuple[int, float]]]:
    """Trained float32 params and the logged (step, mean train loss since the last log) pairs.

    Deterministic in cfg.seed (init and batch order), up to XLA's float reduction order.
    """
    params = params if params is not None else init_train_params(spec, cfg.seed)
    optimizer = make_optimizer(lr=cfg.lr, total_steps=cfg.steps, warmup_steps=cfg.warmup_steps,
                               weight_decay=cfg.weight_decay, clip_norm=cfg.clip_norm)
    opt_state = optimizer.init(params)
    step_fn = make_train_step(spec, optimizer)
    rng = np.random.default_rng([cfg.seed, 7])
    history: List[Tuple[int, float]] = []
    losses = []
    for step in range(1, cfg.steps + 1):
        windows = jnp.asarray(sample_windows(train_data, cfg.batch, cfg.seq_len, rng))
        params, opt_state, loss = step_fn(params, opt_state, windows)
        losses.append(loss)
        if step % cfg.log_every == 0 or step == cfg.steps:
            mean = float(np.mean([float(x) for x in losses]))
            losses = []
            history.append((step, mean))
            if on_log is not None:
                on_log(step, mean)
    return params, history
