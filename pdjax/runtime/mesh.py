"""Device meshes with axes ('data', 'stage', 'tensor') and the shardings of params and the KV cache.

Tensor parallelism (Megatron layout): query/KV heads and the MLP's gate/up columns are split on 'tensor'
(column parallel), the attention output projection's heads and the MLP down projection's rows too (row
parallel), so each layer needs one all-reduce after attention and one after the MLP; XLA's SPMD partitioner
inserts them from these input shardings. The KV cache is split on its leading kv-head axis, matching the
K/V projections, so attention stays local to each shard. Embeddings and norms are replicated; the lm_head is
split on vocab when it divides. 'data' is carried for later DP work and unused by the step.

Pipeline parallelism ('stage', pdjax.runtime.pipeline): stage s of a (data=1, stage=pp, tensor=tp) mesh runs on
its own sub-mesh `stage_mesh(mesh, s)`, the (1, 1, tp) slice of the devices at stage index s with the same axis
names, so every sharding above applies to it unchanged (a stage is a TP group holding a layer range).
"""
from __future__ import annotations

from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pdjax.config.model_specs import ModelSpec
from pdjax.models.llama import KVCache, LayerParams, LlamaParams

MESH_AXES = ("data", "stage", "tensor")


def make_mesh(devices: Optional[Sequence] = None, dp: int = 1, pp: int = 1, tp: int = 1) -> Mesh:
    """A (dp, pp, tp) mesh over the first dp·pp·tp of `devices` (default: jax.devices())."""
    for name, value in (("dp", dp), ("pp", pp), ("tp", tp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}, expected a positive int")
    devices = list(jax.devices() if devices is None else devices)
    need = dp * pp * tp
    if len(devices) < need:
        raise ValueError(f"mesh dp={dp} x pp={pp} x tp={tp} needs {need} devices, only {len(devices)} given")
    return Mesh(np.array(devices[:need]).reshape(dp, pp, tp), MESH_AXES)


def check_tensor_parallel(spec: ModelSpec, tp: int) -> None:
    """Raise ValueError unless heads, KV heads and the MLP width all divide by tp."""
    for name in ("num_heads", "num_kv_heads", "intermediate_size"):
        value = getattr(spec, name)
        if value % tp:
            raise ValueError(f"spec {spec.name!r}: {name}={value} does not divide by tensor parallelism tp={tp}")


def stage_mesh(mesh: Mesh, stage: int) -> Mesh:
    """The sub-mesh of pipeline stage `stage`: devices mesh[:, stage, :] as a (data, 1, tensor) mesh with the
    same axis names (so param_shardings / kv_cache_sharding apply to it as to any mesh)."""
    pp = mesh.shape["stage"]
    if isinstance(stage, bool) or not isinstance(stage, (int, np.integer)) or not 0 <= stage < pp:
        raise ValueError(f"stage={stage!r} outside [0, {pp}) of a mesh with stage={pp}")
    return Mesh(mesh.devices[:, int(stage):int(stage) + 1, :], MESH_AXES)


def stage_meshes(mesh: Mesh) -> tuple:
    """`stage_mesh` of every stage, in order."""
    return tuple(stage_mesh(mesh, s) for s in range(mesh.shape["stage"]))


def layer_shardings(layer: LayerParams, mesh: Mesh) -> LayerParams:
    """A LayerParams-shaped pytree of NamedSharding for one decoder layer (Megatron layout on 'tensor')."""
    def ns(*axes):
        return NamedSharding(mesh, P(*axes))

    bias = None if layer.bq is None else ns("tensor", None)
    return LayerParams(attn_norm=ns(), wq=ns(None, "tensor", None), wk=ns(None, "tensor", None),
                       wv=ns(None, "tensor", None), wo=ns("tensor", None, None), mlp_norm=ns(),
                       w_gate=ns(None, "tensor"), w_up=ns(None, "tensor"), w_down=ns("tensor", None),
                       bq=bias, bk=bias, bv=bias)


def lm_head_sharding(mesh: Mesh, spec: ModelSpec) -> NamedSharding:
    """lm_head [H, V]: vocab on 'tensor' when it divides, else replicated."""
    return NamedSharding(mesh, P(None, "tensor") if spec.vocab_size % mesh.shape["tensor"] == 0 else P())


def param_shardings(params: LlamaParams, mesh: Mesh, spec: ModelSpec) -> LlamaParams:
    """A LlamaParams-shaped pytree of NamedSharding (None where the param is None)."""
    check_tensor_parallel(spec, mesh.shape["tensor"])
    lm_head = None if params.lm_head is None else lm_head_sharding(mesh, spec)
    return LlamaParams(embed=replicated(mesh), layers=tuple(layer_shardings(l, mesh) for l in params.layers),
                       final_norm=replicated(mesh), lm_head=lm_head)


def kv_cache_sharding(mesh: Mesh, spec: ModelSpec) -> NamedSharding:
    """Sharding of each per-layer [num_kv_heads, num_pages, page_size, head_dim] array: heads on 'tensor'."""
    check_tensor_parallel(spec, mesh.shape["tensor"])
    return NamedSharding(mesh, P("tensor", None, None, None))


def kv_cache_shardings(mesh: Mesh, spec: ModelSpec) -> KVCache:
    s = kv_cache_sharding(mesh, spec)
    return KVCache(k=(s,) * spec.num_layers, v=(s,) * spec.num_layers)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_params(params: LlamaParams, mesh: Mesh, spec: ModelSpec) -> LlamaParams:
    """params placed on `mesh` with `param_shardings`."""
    return jax.device_put(params, param_shardings(params, mesh, spec))
