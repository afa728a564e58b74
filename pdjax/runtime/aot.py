"""Ahead-of-time compilation of the engine's steps for devices this host may not have, and HBM planning.

`compile_instance` compiles, for one instance's (1, pp, tp) mesh, exactly the jitted functions the runners run
(`runner.make_mesh_step` when pp == 1, `pipeline.make_stage_fn` per stage otherwise) on abstract arguments
(`jax.ShapeDtypeStruct`s carrying the runner's shardings: nothing is allocated, so a 70B model compiles on a
laptop), one (T, S, P) bucket at a time, and reports per bucket and stage what XLA says of the binary: per-device
bytes (`memory_analysis`: arguments = weights + KV cache + batch, plus temporaries and code, less the donated KV
that aliases the output) and its cost (`cost_analysis`: FLOPs, bytes accessed, optimal seconds). A bucket that
does not compile is reported with its one-line reason, never raised: the caller sees every failure at once.

The mesh may be made of real devices or of a topology's compile-only devices (`topology_devices`): a TPU slice
through the registry's libtpu (`pip install -e ".[tpu]"`: the real XLA and Mosaic compilers on a CPU host), or
NVIDIA GPUs through the CUDA plugin and ptxas (`pip install -e ".[gpu-aot]"`), XLA:GPU compiling against a
description of the GPU (`GPU_TARGETS`) instead of a device. The kernels learn the platform and the TPU generation
from the mesh (pdjax.kernels.shard_over_kv_heads).

KV sizing (`kv_cache_pages`): a given num_pages is checked against the device memory (weights + KV, `fit_error`);
num_pages = 0 asks for the most pages that fit `utilization · HBM` next to the largest bucket's step
(`plan_num_pages`), as vLLM sizes its cache from a profiled forward (`gpu_memory_utilization`). The KV cache grows
the compiled bytes by one page's per-device bytes per page (K and V of every layer the device holds, its share of
the KV heads) - and by more where the compiler copies the cache (a TPU relayout when head_dim < 128) - so the plan
is a secant on compiled totals, each guess compiled and checked.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from pdjax.config.model_specs import ModelSpec
from pdjax.config.pipeline import stage_layer_ranges
from pdjax.models.llama import KVCache, jnp_dtype
from pdjax.models.params import param_table
from pdjax.runtime import mesh as mesh_lib
from pdjax.runtime.batch import empty_batch
from pdjax.runtime.pipeline import make_stage_fn, split_params
from pdjax.runtime.runner import make_mesh_step

Bucket = Tuple[int, int, int]


# NVIDIA GPUs XLA can compile for without one (a GpuTargetConfigProto: what the CUDA runtime would report), from
# the datasheets and CUDA's per-compute-capability limits: (device kind as jax names it, compute capability,
# SMs, FP32 lanes per SM, shared memory per SM / per block opt-in, L2 bytes, boost GHz, HBM bytes, HBM bytes/s).
GPU_TARGETS = {
    "a100": ("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 167936, 166912, 40 * 2**20, 1.41, 80 * 2**30, 2.039e12),
    "h100": ("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 233472, 232448, 50 * 2**20, 1.98, 80 * 2**30, 3.35e12),
    "h200": ("NVIDIA H200", (9, 0), 132, 128, 233472, 232448, 50 * 2**20, 1.98, 141 * 10**9, 4.8e12),
}


def gpu_target_config(name: str) -> str:
    """The GpuTargetConfigProto (text) of GPU_TARGETS[name]: what XLA:GPU compiles against instead of a device."""
    kind, (major, minor), sms, lanes, smem_sm, smem_block, l2, ghz, memory, bandwidth = GPU_TARGETS[name]
    return (f"gpu_device_info {{ threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152 "
            f"shared_memory_per_core: {smem_sm} threads_per_core_limit: 2048 core_count: {sms} fpus_per_core: {lanes} "
            f"block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535 "
            f"memory_bandwidth: {int(bandwidth)} l2_cache_size: {l2} clock_rate_ghz: {ghz} "
            f"device_memory_size: {memory} shared_memory_per_block_optin: {smem_block} "
            f"cuda_compute_capability {{ major: {major} minor: {minor} }} registers_per_core_limit: 65536 "
            f"registers_per_block_limit: 65536 }} platform_name: \"CUDA\" dnn_version_info {{ major: 9 minor: 8 }} "
            f"runtime_version {{ major: 12 minor: 8 }} device_description_str: \"{kind}\"")


def topology_devices(topology: str) -> list:
    """The compile-only devices of `topology`, in the topology's device order: a TPU slice ('v5e:2x2', 'v5p:2x2x2',
    'v6e:2x4', 'v4:2x2x1', ...; needs libtpu, the 'tpu' extra) or NVIDIA GPUs as '<gpu>:<devices>' or
    '<gpu>:<hosts>x<devices per host>' with <gpu> in GPU_TARGETS ('h100:8', 'a100:2x8'; needs the CUDA plugin and
    ptxas, the 'gpu-aot' extra). A bad name raises ValueError naming it."""
    from jax.experimental import topologies   # noqa: PLC0415 (loads libtpu or the CUDA plugin: ahead of time only)

    gpu, _, shape = topology.lower().partition(":")
    try:
        if gpu in GPU_TARGETS:
            dims = [int(d) for d in shape.split("x")] if shape else [1]
            if len(dims) > 2 or min(dims) < 1:
                raise ValueError(f"shape {shape!r}: expected <devices> or <hosts>x<devices per host>")
            hosts, per_host = dims if len(dims) == 2 else (1, dims[0])
            return list(topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(gpu),
                                                     topology=f"1x{hosts}x{per_host}").devices)
        return list(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)
    except Exception as e:   # the plugin missing or the name unknown: re-raised as one line naming the topology
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"topology={topology!r} gives no devices ({type(e).__name__}: {first[:200]}); expected a "
                         f"TPU topology such as 'v5e:2x2', 'v5p:2x2x2' or 'v6e:2x4' (pip install -e \".[tpu]\") or "
                         f"a GPU one such as 'h100:8' or 'a100:2x8' (pip install -e \".[gpu-aot]\")") from e


def shard_bytes(abstract) -> int:
    """Bytes one device holds of a pytree of sharded ShapeDtypeStructs (each leaf's shard shape)."""
    return int(sum(np.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in jax.tree_util.tree_leaves(abstract)))


def _abstract(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)


def abstract_stage_params(spec: ModelSpec, mesh: Mesh, dtype, *, stage: int = 0, pp: int = 1):
    """The weights stage `stage` of `pp` holds (all of them when pp == 1: a LlamaParams), as sharded
    ShapeDtypeStructs on `mesh` (a stage's own (1, 1, tp) mesh), placed as the runners place real weights."""
    table = param_table(spec)
    if pp > 1:
        table = split_params(table, stage_layer_ranges(spec.num_layers, pp), spec)[stage]
    shardings = mesh_lib.table_shardings(table, mesh, spec)
    return jax.tree_util.tree_map(lambda info, sh: _abstract(info.shape, jnp_dtype(info.dtype or dtype), sh),
                                  table, shardings)


def abstract_kv_cache(spec: ModelSpec, mesh: Mesh, *, num_pages: int, page_size: int, dtype,
                      num_layers: int) -> KVCache:
    """A KVCache of `num_layers` layers of [num_kv_heads, num_pages, page_size, head_dim], split on KV heads."""
    sh = mesh_lib.kv_cache_sharding(mesh, spec)
    shape = (spec.num_kv_heads, num_pages, page_size, spec.head_dim)
    return KVCache(k=tuple(_abstract(shape, dtype, sh) for _ in range(num_layers)),
                   v=tuple(_abstract(shape, dtype, sh) for _ in range(num_layers)))


def kv_page_bytes(spec: ModelSpec, *, tp: int, num_layers: int, page_size: int, dtype) -> int:
    """Per-device bytes of one KV page: K and V of `num_layers` layers, num_kv_heads / tp heads each."""
    return 2 * num_layers * (spec.num_kv_heads // tp) * page_size * spec.head_dim * jnp_dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """What XLA reports of one compiled step (one bucket, one pipeline stage). Bytes are per device.

    total_bytes = arguments + outputs - aliased (the donated KV cache) + temporaries + generated code: the HBM the
    step needs while it runs. weights_bytes and kv_bytes are the arguments' shares (from their shardings).
    flops / bytes_accessed / optimal_seconds: XLA's cost analysis of the whole step (per device)."""
    bucket: Bucket
    stage: int
    compiled: bool
    compile_s: float
    weights_bytes: int
    kv_bytes: int
    temp_bytes: int = 0
    code_bytes: int = 0
    argument_bytes: int = 0
    alias_bytes: int = 0
    total_bytes: int = 0
    flops: Optional[float] = None
    bytes_accessed: Optional[float] = None
    optimal_seconds: Optional[float] = None
    error: str = ""

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def one_line(err: BaseException, limit: int = 300) -> str:
    """The first meaningful line of an exception (XLA's errors run to pages), prefixed by its type."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    text = next((ln for ln in lines if "RESOURCE_EXHAUSTED" in ln or "NotImplementedError" in ln),
                lines[0] if lines else "")
    return f"{type(err).__name__}: {text}"[:limit]


def _stage_fn_and_args(spec, attention_impl, mesh, bucket, *, stage, pp, num_pages, page_size, dtype, max_seqs):
    """(jitted fn, abstract args, weights bytes, KV bytes) of one stage of one bucket, as the runner runs it."""
    num_tokens, _, _ = bucket
    sub = mesh_lib.stage_mesh(mesh, stage)
    lo, hi = stage_layer_ranges(spec.num_layers, pp)[stage]
    params = abstract_stage_params(spec, sub, dtype, stage=stage, pp=pp)
    kv = abstract_kv_cache(spec, sub, num_pages=num_pages, page_size=page_size, dtype=dtype, num_layers=hi - lo)
    rep = mesh_lib.replicated(sub)
    batch = jax.tree_util.tree_map(lambda a: _abstract(a.shape, a.dtype, rep), empty_batch(bucket))
    prev_ids = _abstract((max_seqs,), jnp.int32, rep)
    if pp == 1:
        fn = make_mesh_step(spec, attention_impl, sub, max_seqs=max_seqs)
        args = (params, kv, batch, prev_ids)
    else:
        last = stage == pp - 1
        fn = make_stage_fn(spec, attention_impl, sub, stage=stage, pp=pp, num_layers=hi - lo,
                           output="step" if last else "hidden", max_seqs=max_seqs)
        hidden = None if stage == 0 else _abstract((num_tokens, spec.hidden_size), dtype, rep)
        args = (params, kv, hidden, batch, prev_ids if stage == 0 else None)
    return fn, args, shard_bytes(params), shard_bytes(kv)


def compile_step(spec: ModelSpec, attention_impl: str, mesh: Mesh, bucket: Bucket, *, num_pages: int,
                 page_size: int, dtype, max_seqs: int, stage: int = 0) -> CompiledStep:
    """Compile stage `stage` of the step of `bucket` on `mesh` (data=1, stage=pp, tensor=tp) and report it; a
    failure (XLA out of memory, a kernel that does not lower, ...) is reported in `error`, not raised."""
    pp = int(mesh.shape["stage"])
    fn, args, weights, kv = _stage_fn_and_args(spec, attention_impl, mesh, bucket, stage=stage, pp=pp,
                                               num_pages=num_pages, page_size=page_size, dtype=dtype,
                                               max_seqs=max_seqs)
    start = time.perf_counter()
    try:
        compiled = fn.trace(*args).lower().compile()
    except Exception as e:  # noqa: BLE001 (any compiler failure is a row of the report)
        return CompiledStep(bucket, stage, False, time.perf_counter() - start, weights, kv, error=one_line(e))
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
             + mem.temp_size_in_bytes + mem.generated_code_size_in_bytes)
    return CompiledStep(bucket, stage, True, seconds, weights, kv, temp_bytes=int(mem.temp_size_in_bytes),
                        code_bytes=int(mem.generated_code_size_in_bytes),
                        argument_bytes=int(mem.argument_size_in_bytes), alias_bytes=int(mem.alias_size_in_bytes),
                        total_bytes=int(total),
                        flops=cost.get("flops"), bytes_accessed=cost.get("bytes accessed"),
                        optimal_seconds=cost.get("optimal_seconds"))


def compile_instance(spec: ModelSpec, attention_impl: str, mesh: Mesh, buckets: Sequence[Bucket], *, num_pages: int,
                     page_size: int, dtype, max_seqs: int, jobs: int = 1,
                     on_done: Optional[Callable[[CompiledStep], None]] = None) -> List[CompiledStep]:
    """`compile_step` of every bucket and pipeline stage of one instance, `jobs` at a time in threads (it helps small
    models only: libtpu serialized two large compiles, in threads or processes); results in (bucket, stage) order."""
    pp = int(mesh.shape["stage"])
    work = [(tuple(b), s) for b in buckets for s in range(pp)]

    def run(item):
        out = compile_step(spec, attention_impl, mesh, item[0], num_pages=num_pages, page_size=page_size,
                           dtype=dtype, max_seqs=max_seqs, stage=item[1])
        if on_done is not None:
            on_done(out)
        return out

    if jobs <= 1:
        return [run(item) for item in work]
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(run, work))


def max_num_pages(steps: Sequence[CompiledStep], *, num_pages: int, page_bytes: Dict[int, int], hbm_bytes: float,
                  utilization: float) -> int:
    """The most KV pages every compiled step of an instance fits in `utilization · hbm_bytes` per device, from steps
    compiled at `num_pages`, if nothing but the cache grows with it (page_bytes: per-device bytes of one page, by
    stage). 0 when not even the non-KV bytes
    fit; raises ValueError when no step compiled (nothing to plan from)."""
    done = [s for s in steps if s.compiled]
    if not done:
        raise ValueError("no step compiled: nothing to plan the KV cache from")
    budget = utilization * hbm_bytes
    fits = [int((budget - (s.total_bytes - s.kv_bytes)) // page_bytes[s.stage]) for s in done]
    return max(0, min(fits))


def stage_bytes(spec: ModelSpec, mesh: Mesh, dtype, page_size: int) -> List[Tuple[int, int]]:
    """Per pipeline stage of `mesh`: (weights bytes, one KV page's bytes) per device."""
    pp, tp = int(mesh.shape["stage"]), int(mesh.shape["tensor"])
    out = []
    for s, (lo, hi) in enumerate(stage_layer_ranges(spec.num_layers, pp)):
        weights = shard_bytes(abstract_stage_params(spec, mesh_lib.stage_mesh(mesh, s), dtype, stage=s, pp=pp))
        out.append((weights, kv_page_bytes(spec, tp=tp, num_layers=hi - lo, page_size=page_size, dtype=dtype)))
    return out


def fit_error(spec: ModelSpec, where: str, per_stage: Sequence[Tuple[int, int]], num_pages: int,
              budget_bytes: float, pages_label: str) -> Optional[str]:
    """One line when the weights plus `num_pages` KV pages of some stage exceed `budget_bytes` per device (before
    any compile: the step's temporaries come on top), else None. per_stage: `stage_bytes`."""
    for weights, page in per_stage:
        if weights + num_pages * page > budget_bytes:
            return (f"model {spec.name!r} does not fit {where}: needs {(weights + num_pages * page) / 2**30:.2f} GiB "
                    f"per device (weights {weights / 2**30:.2f} GiB + KV {num_pages * page / 2**30:.2f} GiB for "
                    f"{pages_label}), {budget_bytes / 2**30:.2f} GiB available")
    return None


def plan_num_pages(spec: ModelSpec, attention_impl: str, mesh: Mesh, buckets, *, page_size: int, max_model_len: int,
                   dtype, utilization: float, hbm_bytes: Optional[float] = None, where: str = "this instance") -> int:
    """The most KV pages the instance on `mesh` fits in `utilization` of each device's memory (`hbm_bytes`, default:
    what the devices report): its largest bucket compiled at the smallest cache that holds one max-length request
    gives the plan (`max_num_pages`), which is compiled again and corrected (at most twice) until the compiled step
    fits. ValueError (one line naming the model, `where` and the bytes) when not even that
    fits, or when the devices report no memory size (CPU)."""
    hbm = hbm_bytes if hbm_bytes is not None else device_memory_bytes(list(mesh.devices.flat))
    if hbm is None:
        raise ValueError(f"num_pages=0 sizes the KV cache from device memory, and the devices of {where} "
                         f"({mesh.devices.flat[0].device_kind!r}) report none: set scheduler.num_pages")
    min_pages = -(-max_model_len // page_size)
    per_stage = stage_bytes(spec, mesh, dtype, page_size)
    error = fit_error(spec, where, per_stage, min_pages, utilization * hbm, "one max-length request")
    if error:
        raise ValueError(error)
    page_bytes = {s: p for s, (_, p) in enumerate(per_stage)}
    budget = utilization * hbm

    def compiled_total(pages: int):
        """(the largest per-device total of the stages, or None, first error) of the largest bucket at `pages`."""
        probe = compile_instance(spec, attention_impl, mesh, [buckets.all_shapes()[-1]], num_pages=pages,
                                 page_size=page_size, dtype=dtype, max_seqs=buckets.max_seqs)
        failed = [p.error for p in probe if not p.compiled]
        return (None, failed[0]) if failed else (max(p.total_bytes for p in probe), "")

    # A secant on the compiled bytes: the KV cache grows them by page_bytes per page, and a compiler that copies
    # the cache (TPU relayouts of head_dim < 128) by more; two compiles measure the real slope, the next ones check.
    low, (low_total, error) = min_pages, compiled_total(min_pages)
    if error:
        raise ValueError(f"sizing the KV cache of {where}: the step of bucket {buckets.all_shapes()[-1]} at "
                         f"num_pages={min_pages} did not compile: {error}")
    if low_total > budget:
        raise ValueError(f"model {spec.name!r} does not fit {where}: its step needs {low_total / 2**30:.2f} GiB per "
                         f"device with one max-length request's KV, {utilization:.2f} x {hbm / 2**30:.2f} GiB "
                         f"available")
    slope, target = max(page_bytes.values()), 0.995 * budget   # aim just under: compiled bytes move in steps
    for _ in range(4):
        guess = low + int((target - low_total) // slope)
        if guess <= low:
            break
        total, _ = compiled_total(guess)    # a failure here is the guess running out of memory: aim lower
        if total is not None and total <= budget:
            low, low_total = guess, total
        elif total is not None:
            slope = max(slope, (total - low_total) / (guess - low))
        else:
            slope *= 4
    return low


def kv_cache_pages(spec: ModelSpec, attention_impl: str, mesh: Mesh, buckets, *, num_pages: int, page_size: int,
                   max_model_len: int, dtype, utilization: float, hbm_bytes: Optional[float] = None,
                   where: str = "this instance") -> Tuple[int, str]:
    """(KV pages, 'config' | 'planned') of the instance on `mesh`: `num_pages` when > 0, checked against the device
    memory when it is known (`hbm_bytes`, else what the devices report), else `plan_num_pages`. ValueError (one line
    naming the model, `where` and the bytes) when it cannot fit."""
    if not num_pages:
        return plan_num_pages(spec, attention_impl, mesh, buckets, page_size=page_size, max_model_len=max_model_len,
                              dtype=dtype, utilization=utilization, hbm_bytes=hbm_bytes, where=where), "planned"
    hbm = hbm_bytes if hbm_bytes is not None else device_memory_bytes(list(mesh.devices.flat))
    error = hbm and fit_error(spec, where, stage_bytes(spec, mesh, dtype, page_size), num_pages, hbm,
                              f"num_pages={num_pages}")
    if error:
        raise ValueError(error)
    return num_pages, "config"


def device_memory_bytes(devices: Sequence) -> Optional[int]:
    """The smallest memory limit of `devices` as the runtime reports it (`memory_stats()['bytes_limit']`), None
    where a device reports none (CPU, compile-only devices)."""
    limits = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 (CPU raises rather than return None)
            stats = None
        if not stats or "bytes_limit" not in stats:
            return None
        limits.append(int(stats["bytes_limit"]))
    return min(limits) if limits else None


__all__ = ["Bucket", "CompiledStep", "abstract_kv_cache", "abstract_stage_params", "compile_instance",
           "compile_step", "device_memory_bytes", "fit_error", "kv_cache_pages", "kv_page_bytes", "max_num_pages",
           "one_line", "plan_num_pages", "shard_bytes", "stage_bytes", "topology_devices"]
