"""Model specs: the dimensions of Llama-family (and OPT) models, with a registry of real ones.

No JAX here: the simulator and the scheduler read specs too. Numbers are from each model's published
HF `config.json` (the one exception, `llama-2-70b-16k`, says why it exists).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from pdjax.config.parse import FieldError, check_fields, one_of, positive_int

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "float8": 1}
# model.dtype's values: 'auto' (the checkpoint's own dtype, `resolve_dtype`) or a dtype both backends run.
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
ARCHS = ("llama", "opt")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style rope scaling (`rope_type: llama3`)."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Dimensions of one decoder-only transformer.

    arch: "llama" (RMSNorm, RoPE, SwiGLU; runnable) or "opt" (LayerNorm, learned positions, ReLU MLP;
    dimensions only, for the simulator).
    """
    name: str
    vocab_size: int = positive_int()
    hidden_size: int = positive_int()
    intermediate_size: int = positive_int()
    num_layers: int = positive_int()
    num_heads: int = positive_int()
    num_kv_heads: int = positive_int()
    head_dim: int = positive_int()
    arch: str = one_of("llama", ARCHS)
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = positive_int(4096)
    sliding_window: Optional[int] = None
    dtype: str = one_of("bfloat16", tuple(DTYPE_BYTES))

    def __post_init__(self):
        try:
            check_fields(self)
        except FieldError as e:
            raise ValueError(f"ModelSpec {self.name!r}: {e}") from None
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelSpec {self.name!r}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention needs whole groups)")

    @property
    def q_per_kv(self) -> int:
        """GQA ratio: query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def kv_bytes_per_token(self, dtype_bytes: Optional[int] = None) -> int:
        """Bytes of K and V for one token over all layers: 2 · layers · kv_heads · head_dim · bytes."""
        b = self.dtype_bytes if dtype_bytes is None else dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * b

    def num_params(self) -> int:
        """Parameter count (embeddings included, biases of OPT ignored)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * self.num_heads * self.head_dim * 2 + h * self.num_kv_heads * self.head_dim * 2
        mlp = 3 * h * i if self.arch == "llama" else 2 * h * i
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        if self.arch == "opt":
            emb += self.max_position_embeddings * h
        return self.num_layers * per_layer + emb + h

    def replace(self, **changes) -> "ModelSpec":
        return dataclasses.replace(self, **changes)


def _llama(name, vocab, hidden, inter, layers, heads, kv_heads, **kw) -> ModelSpec:
    return ModelSpec(name=name, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                     num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=kw.pop("head_dim", hidden // heads), **kw)


def _opt(name, hidden, layers, heads) -> ModelSpec:
    return ModelSpec(name=name, arch="opt", vocab_size=50272, hidden_size=hidden, intermediate_size=4 * hidden,
                     num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
                     tie_word_embeddings=True, max_position_embeddings=2048, dtype="float16")


_SPECS = [
    _llama("llama-2-7b", 32000, 4096, 11008, 32, 32, 32),
    _llama("llama-2-13b", 32000, 5120, 13824, 40, 40, 40),
    _llama("llama-2-70b", 32000, 8192, 28672, 80, 64, 8),
    _llama("llama-3-8b", 128256, 4096, 14336, 32, 32, 8, rope_theta=500000.0, max_position_embeddings=8192),
    _llama("llama-3-70b", 128256, 8192, 28672, 80, 64, 8, rope_theta=500000.0, max_position_embeddings=8192),
    _llama("llama-3.1-8b", 128256, 4096, 14336, 32, 32, 8, rope_theta=500000.0, rope_scaling=RopeScaling(),
           max_position_embeddings=131072),
    _llama("mistral-7b", 32000, 4096, 14336, 32, 32, 8, max_position_embeddings=32768, sliding_window=4096),
    _llama("yi-34b", 64000, 7168, 20480, 60, 56, 8, rope_theta=5000000.0, max_position_embeddings=4096),
    # 01-ai/Yi-34B-200K: Yi-34B's dimensions and rope_theta, 200k positions (the Sarathi-Serve artifact's Yi).
    _llama("yi-34b-200k", 64000, 7168, 20480, 60, 56, 8, rope_theta=5000000.0, max_position_embeddings=200000),
    _llama("qwen2-7b", 152064, 3584, 18944, 28, 28, 4, rope_theta=1000000.0, qkv_bias=True, rms_norm_eps=1e-6,
           max_position_embeddings=32768),
    _opt("opt-13b", 5120, 40, 40),
    _opt("opt-66b", 9216, 64, 72),
    _opt("opt-175b", 12288, 96, 96),
    # NOT a published checkpoint: Llama-2-70B's dimensions with 16384 positions, as the Sarathi-Serve artifact (its
    # TP4 x PP2 runs at 8k / 16k contexts) and Splitwise (Azure traces up to 14k tokens) served Llama-2-70B beyond
    # its 4096 (RoPE extrapolated). The paper configs name it, so a simulated context never exceeds the spec's.
    _llama("llama-2-70b-16k", 32000, 8192, 28672, 80, 64, 8, max_position_embeddings=16384),
    # CPU-sized specs for tests and the embedded default run.
    _llama("tiny-llama", 512, 128, 384, 2, 4, 2, max_position_embeddings=2048, dtype="float32"),
    _llama("tiny-mha", 512, 128, 384, 2, 4, 4, max_position_embeddings=2048, dtype="float32"),
    _llama("tiny-mqa", 512, 256, 512, 2, 4, 1, head_dim=64, max_position_embeddings=2048, dtype="float32"),
    _llama("tiny-qwen", 512, 256, 512, 2, 8, 2, head_dim=32, qkv_bias=True, tie_word_embeddings=True,
           rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=2048, dtype="float32"),
    _llama("tiny-llama3", 512, 256, 512, 2, 4, 1, head_dim=64, rope_theta=500000.0,
           rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=256),
           max_position_embeddings=2048, dtype="float32"),
    # Byte-level model trained by experiments/train_tiny.py (vocab: 256 bytes + BOS/EOS/PAD); ~0.85M params,
    # sized so a few million bytes of training fit ~15 min on 2 CPU cores (checkpoints/tiny-byte, bfloat16).
    # It trains on 256-byte windows; the 256-token sliding window keeps every served query inside the
    # relative distances it was trained on (full attention degrades to byte soup past ~300 tokens).
    _llama("tiny-byte", 259, 128, 384, 4, 4, 2, head_dim=32, max_position_embeddings=1024, sliding_window=256,
           dtype="float32"),
]

MODEL_SPECS: dict[str, ModelSpec] = {s.name: s for s in _SPECS}


def resolve_dtype(requested: str, checkpoint_dtype: str, *, cpu: bool = False) -> str:
    """The dtype a run computes and stores the model in, for model.dtype = `requested` (MODEL_DTYPES): an explicit
    dtype as given; 'auto' the checkpoint's own (`checkpoint_dtype`: its spec's, e.g. bfloat16 for the Llama
    checkpoints, float16 for OPT, float32 for the tiny CPU specs), except on the CPU engine (`cpu`), which computes
    in float32 whatever the checkpoint stores (XLA:CPU has no fast 16-bit matmul)."""
    if requested not in MODEL_DTYPES:
        raise ValueError(f"model.dtype={requested!r}, expected one of {MODEL_DTYPES}")
    if requested != "auto":
        return requested
    return "float32" if cpu else checkpoint_dtype


def spec_at_dtype(spec: ModelSpec, requested: str) -> ModelSpec:
    """`spec` with the dtype model.dtype = `requested` asks for (`resolve_dtype`; 'auto' keeps the spec's own): what
    the simulator costs, so weight and KV bytes, KV pages and matmul rates follow model.dtype."""
    dtype = resolve_dtype(requested, spec.dtype)
    return spec if dtype == spec.dtype else spec.replace(dtype=dtype)


def get_model_spec(name: str) -> ModelSpec:
    """The registry spec called `name`; a clear error lists the known names."""
    try:
        return MODEL_SPECS[name]
    except KeyError:
        raise ValueError(f"unknown model spec {name!r}; known specs: {', '.join(sorted(MODEL_SPECS))}") from None
