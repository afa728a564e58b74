"""Device meshes with axes ('data', 'stage', 'tensor') and the shardings of params and the KV cache.

Tensor parallelism (Megatron layout): query/KV heads and the MLP's gate/up columns are split on 'tensor'
(column parallel), the attention output projection's heads and the MLP down projection's rows too (row
parallel), so each layer needs one all-reduce after attention and one after the MLP; XLA's SPMD partitioner
inserts them from these input shardings. The KV cache is split on its leading kv-head axis, matching the
K/V projections, so attention stays local to each shard. Embeddings and norms are replicated; the lm_head is
split on vocab when it divides. 'data' is carried for later DP work and unused by the step.

All of this is one rule on logical axes (`logical_axis_rules`): heads, kv_heads and mlp -> 'tensor' (they must
divide: `check_tensor_parallel`), vocab -> 'tensor' when it divides, every other axis (embed, head_dim, the
embedding's vocab_in, pages) whole. A weight's sharding is that rule applied to the `logical_axes` of its entry
in `pdjax.models.params.param_table(spec)` (`table_shardings`); the KV cache's to `KV_CACHE_AXES`.

Pipeline parallelism ('stage', pdjax.runtime.pipeline): stage s of a (data=1, stage=pp, tensor=tp) mesh runs on
its own sub-mesh `stage_mesh(mesh, s)`, the (1, 1, tp) slice of the devices at stage index s with the same axis
names, so every sharding above applies to it unchanged (a stage is a TP group holding a layer range).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pdjax.config.model_specs import ModelSpec
from pdjax.models.llama import KVCache
from pdjax.models.params import AXIS_DIMS, KV_CACHE_AXES, LlamaParams, axis_size, check_params, param_table

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


# Logical axes split on 'tensor' whatever the spec (they must divide by tp) and those split only when they divide.
TENSOR_AXES = ("heads", "kv_heads", "mlp")
TENSOR_AXES_WHEN_DIVISIBLE = ("vocab",)


def check_tensor_parallel(spec: ModelSpec, tp: int) -> None:
    """Raise ValueError unless heads, KV heads and the MLP width (the TENSOR_AXES) all divide by tp."""
    for axis in TENSOR_AXES:
        name, value = AXIS_DIMS[axis], axis_size(spec, axis)
        if value % tp:
            raise ValueError(f"spec {spec.name!r}: {name}={value} does not divide by tensor parallelism tp={tp}")


def logical_axis_rules(mesh: Mesh, spec: ModelSpec) -> Dict[str, Optional[str]]:
    """Logical axis -> mesh axis ('tensor') for `spec` on `mesh`; axes not named here stay whole."""
    tp = mesh.shape["tensor"]
    rules = {axis: "tensor" for axis in TENSOR_AXES}
    rules.update({axis: "tensor" if axis_size(spec, axis) % tp == 0 else None for axis in TENSOR_AXES_WHEN_DIVISIBLE})
    return rules


def partition_spec(logical_axes: Sequence[Optional[str]], rules: Dict[str, Optional[str]]) -> P:
    """The PartitionSpec of an array with `logical_axes` under `rules` (P() when nothing is split)."""
    axes = tuple(None if a is None else rules.get(a) for a in logical_axes)
    return P(*axes) if any(a is not None for a in axes) else P()


def table_shardings(table, mesh: Mesh, spec: ModelSpec):
    """The NamedSharding of every WeightInfo leaf of `table` (param_table(spec) or a slice of it, e.g. a
    pipeline stage's), in the same tree structure (None stays None)."""
    rules = logical_axis_rules(mesh, spec)
    return jax.tree_util.tree_map(lambda info: NamedSharding(mesh, partition_spec(info.logical_axes, rules)), table)


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


def param_shardings(params: LlamaParams, mesh: Mesh, spec: ModelSpec) -> LlamaParams:
    """A LlamaParams-shaped pytree of NamedSharding (None where the param is None), from `param_table(spec)`;
    params must match the table (checked: a mismatch names the tensor and both shapes)."""
    check_tensor_parallel(spec, mesh.shape["tensor"])
    check_params(params, spec)
    return table_shardings(param_table(spec), mesh, spec)


def kv_cache_sharding(mesh: Mesh, spec: ModelSpec) -> NamedSharding:
    """Sharding of each per-layer [num_kv_heads, num_pages, page_size, head_dim] array: heads on 'tensor'."""
    check_tensor_parallel(spec, mesh.shape["tensor"])
    return NamedSharding(mesh, partition_spec(KV_CACHE_AXES, logical_axis_rules(mesh, spec)))


def kv_cache_shardings(mesh: Mesh, spec: ModelSpec) -> KVCache:
    s = kv_cache_sharding(mesh, spec)
    return KVCache(k=(s,) * spec.num_layers, v=(s,) * spec.num_layers)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_params(params: LlamaParams, mesh: Mesh, spec: ModelSpec) -> LlamaParams:
    """params placed on `mesh` with `param_shardings`."""
    return jax.device_put(params, param_shardings(params, mesh, spec))
