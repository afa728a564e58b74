"""The params pytree types and the one per-weight table they follow.

`param_table(spec)` is a `LlamaParams` whose leaves are `WeightInfo` (None where the spec has no such tensor:
no qkv biases, tied lm_head), as jax-llm-examples' `ArrayInfo` trees (`Layer.abstract(cfg)`): for every tensor
its shape, its logical axes, its dtype rule, its init rule and which pipeline stage holds it. It is the only
place these are written down; everything else reads it:

- init (`pdjax.models.llama.init_params`): draws each leaf by its `init` rule and `fan_in`;
- checkpoint checks (`pdjax.models.checkpoint`): every HF or orbax tensor is checked against its entry
  (`check_shapes`: errors name the tensor, the expected and the found shape);
- tensor sharding (`pdjax.runtime.mesh`): maps logical axes to mesh axes (heads / kv_heads / mlp -> 'tensor',
  vocab -> 'tensor' when it divides), so a weight's PartitionSpec follows from its `logical_axes`;
- the pipeline stage split (`pdjax.runtime.pipeline.split_params`): `placement` says which stage holds a tensor.

Logical axes (each has one spec dimension, `AXIS_DIMS`, so shapes follow from the axes):
    vocab_in  rows of the embedding table [V, H] (token gathers; kept whole)
    vocab     lm_head's output columns [H, V] (split on 'tensor' when it divides)
    embed     hidden size H          heads  query heads Nq       kv_heads  KV heads Nkv
    head_dim  D                      mlp    intermediate size I
The KV cache [Nkv, pages, page_size, D] has `KV_CACHE_AXES` (None: an axis no spec dimension names).

Init rules: 'norm' -> 1 + 0.1·N(0, 1); 'bias' -> 0.1·N(0, 1); 'fan_in' -> N(0, 1) / sqrt(fan_in), where fan_in
is the product of the input axes (1 for the embedding: unit variance). Dtype rule: `dtype` None means the
params dtype (init's / the loader's dtype argument, else spec.dtype); every weight follows it today.
Placement: 'layer' (the stage whose layer range holds `layer`), 'first' (embedding), 'last' (final norm,
lm_head), 'first+last' (the embedding when tied: the last stage needs it for the logits, as vLLM does).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Dict, Mapping, Optional, Tuple

import jax
from flax import struct

from pdjax.config.model_specs import ModelSpec


@struct.dataclass
class LayerParams:
    attn_norm: jax.Array
    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array
    mlp_norm: jax.Array
    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array
    bq: Optional[jax.Array] = None
    bk: Optional[jax.Array] = None
    bv: Optional[jax.Array] = None


@struct.dataclass
class LlamaParams:
    embed: jax.Array
    layers: Tuple[LayerParams, ...]
    final_norm: jax.Array
    lm_head: Optional[jax.Array] = None  # None: tied to embed


# Logical axis -> the ModelSpec field giving its size.
AXIS_DIMS = {"vocab_in": "vocab_size", "vocab": "vocab_size", "embed": "hidden_size", "heads": "num_heads",
             "kv_heads": "num_kv_heads", "head_dim": "head_dim", "mlp": "intermediate_size"}
KV_CACHE_AXES = ("kv_heads", None, None, "head_dim")   # [Nkv, num_pages, page_size, D]
INIT_RULES = ("norm", "bias", "fan_in")
PLACEMENTS = ("layer", "first", "last", "first+last")

# The table proper: name -> (logical axes, init rule, number of leading input axes forming the fan-in).
_LAYER = {
    "attn_norm": (("embed",), "norm", 0),
    "wq": (("embed", "heads", "head_dim"), "fan_in", 1),
    "wk": (("embed", "kv_heads", "head_dim"), "fan_in", 1),
    "wv": (("embed", "kv_heads", "head_dim"), "fan_in", 1),
    "wo": (("heads", "head_dim", "embed"), "fan_in", 2),
    "mlp_norm": (("embed",), "norm", 0),
    "w_gate": (("embed", "mlp"), "fan_in", 1),
    "w_up": (("embed", "mlp"), "fan_in", 1),
    "w_down": (("mlp", "embed"), "fan_in", 1),
}
_BIASES = {  # only with spec.qkv_bias
    "bq": (("heads", "head_dim"), "bias", 0),
    "bk": (("kv_heads", "head_dim"), "bias", 0),
    "bv": (("kv_heads", "head_dim"), "bias", 0),
}
_TOP = {  # name -> (logical axes, init rule, fan-in axes, placement); lm_head only when untied
    "embed": (("vocab_in", "embed"), "fan_in", 0, "first"),
    "final_norm": (("embed",), "norm", 0, "last"),
    "lm_head": (("embed", "vocab"), "fan_in", 1, "last"),
}
TOP_FIELDS = tuple(_TOP)        # the fields of LlamaParams that are not per-layer


@dataclasses.dataclass(frozen=True)
class WeightInfo:
    """One tensor of the params: see the module docstring for axes, init rules and placements."""
    name: str                          # field of LlamaParams / LayerParams
    layer: Optional[int]               # layer index of a per-layer weight, None for the top-level ones
    shape: Tuple[int, ...]
    logical_axes: Tuple[str, ...]
    init: str                          # one of INIT_RULES
    fan_in: int = 1                    # 'fan_in' rule: N(0, 1) / sqrt(fan_in)
    placement: str = "layer"           # one of PLACEMENTS
    dtype: Optional[str] = None        # None: the params dtype

    @property
    def path(self) -> str:
        """'embed', 'layers.3.wq', ...: the tensor's name in errors and in the orbax tree."""
        return self.name if self.layer is None else f"layers.{self.layer}.{self.name}"

    def on_stage(self, stage: int, num_stages: int) -> bool:
        """Whether pipeline stage `stage` of `num_stages` holds this top-level tensor ('layer' weights go by
        their stage's layer range, see pdjax.runtime.pipeline.split_params)."""
        if self.placement == "layer":
            raise ValueError(f"{self.path} is a per-layer weight: its stage follows the layer ranges")
        return ((stage == 0 and self.placement in ("first", "first+last"))
                or (stage == num_stages - 1 and self.placement in ("last", "first+last")))


def axis_size(spec: ModelSpec, axis: str) -> int:
    return int(getattr(spec, AXIS_DIMS[axis]))


def _info(spec: ModelSpec, name, layer, axes, init, n_in, placement="layer") -> WeightInfo:
    shape = tuple(axis_size(spec, a) for a in axes)
    return WeightInfo(name=name, layer=layer, shape=shape, logical_axes=axes, init=init,
                      fan_in=math.prod(shape[:n_in]), placement=placement)


def layer_table(spec: ModelSpec, layer: int) -> LayerParams:
    """A LayerParams of the WeightInfo of layer `layer` (biases None without spec.qkv_bias)."""
    rows = dict(_LAYER, **(_BIASES if spec.qkv_bias else {}))
    return LayerParams(**{n: _info(spec, n, layer, *row) for n, row in rows.items()})


@functools.lru_cache(maxsize=64)
def param_table(spec: ModelSpec) -> LlamaParams:
    """THE per-weight table of `spec`: a LlamaParams whose leaves are WeightInfo (None where absent)."""
    top = {n: _info(spec, n, None, axes, init, n_in, placement) for n, (axes, init, n_in, placement) in _TOP.items()}
    if spec.tie_word_embeddings:
        top["lm_head"] = None
        top["embed"] = dataclasses.replace(top["embed"], placement="first+last")
    return LlamaParams(layers=tuple(layer_table(spec, i) for i in range(spec.num_layers)), **top)


def is_weight_info(x) -> bool:
    return isinstance(x, WeightInfo)


def table_items(table) -> Dict[str, WeightInfo]:
    """path -> WeightInfo of every leaf of a table (or of a slice of one, e.g. a pipeline stage's), in tree order."""
    return {info.path: info for info in jax.tree_util.tree_leaves(table)}


def flat_params(params: LlamaParams) -> Dict[str, Any]:
    """path -> leaf of a LlamaParams-shaped tree ('embed', 'layers.0.attn_norm', ..., None leaves left out)."""
    out = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if f.name == "layers":
            for i, layer in enumerate(value):
                out.update({f"layers.{i}.{g.name}": getattr(layer, g.name) for g in dataclasses.fields(layer)
                            if getattr(layer, g.name) is not None})
        elif value is not None:
            out[f.name] = value
    return out


def check_shapes(shapes: Mapping[str, Tuple[int, ...]], spec: ModelSpec, where: str = "params") -> None:
    """Raise ValueError unless `shapes` (path -> shape) holds exactly the table's tensors with its shapes.

    The error names `where`, the tensor (its path), the expected and the found shape."""
    table = table_items(param_table(spec))
    for path, info in table.items():
        if path not in shapes:
            raise ValueError(f"{where} lacks tensor {path!r} (expected shape {info.shape} for spec {spec.name!r})")
        found = tuple(int(n) for n in shapes[path])
        if found != info.shape:
            raise ValueError(f"{where}: tensor {path!r} has shape {found}, expected {info.shape} for spec "
                             f"{spec.name!r} (logical axes {info.logical_axes})")
    extra = [p for p in shapes if p not in table]
    if extra:
        raise ValueError(f"{where} has tensors that spec {spec.name!r} does not have: {extra[:10]}")


def check_params(params: LlamaParams, spec: ModelSpec, where: str = "params") -> None:
    """`check_shapes` of a LlamaParams (arrays, or anything with a .shape)."""
    check_shapes({p: tuple(x.shape) for p, x in flat_params(params).items()}, spec, where)
