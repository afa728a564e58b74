"""KV transfer benchmark: one request's KV moved from a prefill device group to a decode device group.

    python -m experiments.bench_kv_transfer            # defaults per backend
    python -m experiments.bench_kv_transfer --quick    # shortest lengths (smoke run)

For each request length and each (prefill tp -> decode tp) pair it times, median over --reps after one warm-up:
- `transfer_s`: pdjax.serving.kv_transfer.transfer_kv (gather the request's pages on the prefill group +
  device_put onto the decode group, resharded; blocked until ready), pages sent exactly (no padding);
- `crossing_s`: the device_put alone, on pre-gathered arrays (the cross-group copy itself);
- `scatter_s`: the decode-side scatter into the decode cache.
Bandwidths are `moved_bytes / time` (whole pages, one way). The ceiling is measured on this machine: on CPU
(fake devices share host memory) a large numpy copy, bytes copied per second (one way); on accelerators a
large device_put between the two groups' first devices (the link), or, with a single device (the groups
cannot be disjoint), the device's own copy rate, and the cases then run with both groups on that device
(`same_device: true`, not a real cross-device number).
Engine loop, synchronous vs asynchronous transfer (`engine`, --engine): a disaggregated ClusterEngine (prefill
tp1 -> decode tp1 on two devices, a small dummy-weight Llama with a wide KV: 4 layers x 8 KV heads x 64) serves the
same offline requests with `async_transfer=False` then True; per mode `host_blocked_s` (the prefill loop's time
inside transfer calls: the whole copy when synchronous, the dispatch when asynchronous), the transfers' seconds and
the run's wall time (median over --engine_reps runs after a warm run).
Shapes: Llama-3-8B KV (32 layers, 8 KV heads, head_dim 128, 16-token pages, bf16) on accelerators; on CPU 8
layers in float32 to keep the run short and small.
"""
from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Two disjoint CPU groups need several (fake) host devices; no effect on accelerator platforms.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from experiments.ceilings import host_copy_rate  # noqa: E402
from pdjax.experiment import cli  # noqa: E402
from pdjax.models.llama import KVCache  # noqa: E402
from pdjax.runtime.mesh import make_mesh  # noqa: E402
from pdjax.serving.kv_transfer import gather_kv_pages, scatter_kv_pages, staged_sharding, transfer_kv  # noqa: E402

_QUICK = flags.DEFINE_bool("quick", False, "shortest lengths only, for a smoke run")
_REPS = flags.DEFINE_integer("reps", 5, "timed repetitions per case")
_ENGINE = flags.DEFINE_bool("engine", True, "also time the engine loop with synchronous vs asynchronous transfer")
_ENGINE_REPS = flags.DEFINE_integer("engine_reps", 3, "engine runs per transfer mode")

KV_HEADS, HEAD_DIM, PAGE_SIZE = 8, 128, 16


def _median_time(fn, reps: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_copy_rate(src_dev, dst_dev, num_bytes: int, reps: int) -> float:
    """Bytes per second (one way) of a large device_put from src_dev to dst_dev (or an on-device copy when
    they are the same device)."""
    x = jax.device_put(jnp.ones((num_bytes // 2,), jnp.bfloat16), src_dev)
    if src_dev == dst_dev:
        copy = jax.jit(lambda a: a + jnp.bfloat16(1))
        return num_bytes / _median_time(lambda: copy(x), reps)
    return num_bytes / _median_time(lambda: jax.device_put(x, dst_dev), reps)


def make_cache(mesh, num_layers: int, num_pages: int, dtype, seed: int) -> KVCache:
    """Random paged cache [kv_heads, num_pages, page_size, head_dim] per layer, kv heads on 'tensor'."""
    sharding = NamedSharding(mesh, P("tensor", None, None, None))
    shape = (KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM)
    make = jax.jit(lambda key: jax.random.normal(key, shape, jnp.float32).astype(dtype), out_shardings=sharding)
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * num_layers)
    return KVCache(k=tuple(make(keys[i]) for i in range(num_layers)),
                   v=tuple(make(keys[num_layers + i]) for i in range(num_layers)))


def engine_sync_vs_async(devices, reps: int, quick: bool) -> dict:
    """The prefill loop's blocked time with synchronous vs asynchronous KV transfer (module docstring)."""
    import dataclasses  # noqa: PLC0415
    from pdjax.config.model_specs import get_model_spec  # noqa: PLC0415
    from pdjax.config.sampling import SamplingParams  # noqa: PLC0415
    from pdjax.config.scheduler import SchedulerConfig  # noqa: PLC0415
    from pdjax.models.llama import init_params  # noqa: PLC0415
    from pdjax.runtime.batch import Buckets  # noqa: PLC0415
    from pdjax.runtime.runner import ModelRunner  # noqa: PLC0415
    from pdjax.scheduler import Request, make_scheduler  # noqa: PLC0415
    from pdjax.serving.cluster import ClusterEngine, Instance  # noqa: PLC0415
    spec = dataclasses.replace(get_model_spec("tiny-mha"), name="bench-wide-kv", hidden_size=512, num_layers=4,
                               num_heads=8, num_kv_heads=8, head_dim=64, intermediate_size=1024)
    params = init_params(spec, seed=0)
    page, max_len, budget, pages = 16, 1024, 512, 256
    buckets = Buckets(tokens=(budget,), seqs=(8,), pages=(max_len // page,))
    runners = [ModelRunner(spec, params, num_pages=pages, page_size=page, buckets=buckets,
                           attention_impl="auto", mesh=make_mesh([d]), max_model_len=max_len)
               for d in devices[:2]]
    for r in runners:
        r.warmup()
    rng = np.random.default_rng(0)
    lens = [int(n) for n in rng.integers(256, 513, 4 if quick else 8)]
    prompts = [[int(t) for t in rng.integers(0, spec.vocab_size, n)] for n in lens]

    def sched(policy):
        return make_scheduler(SchedulerConfig(policy=policy, token_budget=budget, max_num_seqs=8,
                                              max_model_len=max_len, page_size=page, num_pages=pages, watermark=0.0))

    out = {"model_kv": {"layers": spec.num_layers, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
                        "page_size": page, "dtype": "float32"},
           "prompt_tokens": lens, "max_tokens": 4, "modes": {}}
    tokens = {}
    for mode in ("sync", "async"):
        runs = []
        for rep in range(reps + 1):     # the first run warms the transfer shapes
            engine = ClusterEngine([Instance("prefill0", "prefill", runners[0], sched("prefill_only")),
                                    Instance("decode0", "decode", runners[1], sched("decode_only"))],
                                   async_transfer=(mode == "async"))
            if rep == 0:
                engine.warmup_transfers(max_len)
            reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=4), 0.0) for i, p in enumerate(prompts)]
            result = engine.run(reqs)
            summary = result.transfer_summary()
            runs.append({"host_blocked_s": summary["host_blocked_s"], "transfer_seconds": summary["seconds"],
                         "wall_s": result.duration_s, "moved_bytes": summary["moved_bytes"],
                         "num_transfers": summary["num_transfers"]})
            tokens[mode] = result.output_tokens
        timed = runs[1:]
        out["modes"][mode] = {k: statistics.median(r[k] for r in timed) for k in timed[0]}
    out["same_tokens"] = tokens["sync"] == tokens["async"]
    s, a = out["modes"]["sync"]["host_blocked_s"], out["modes"]["async"]["host_blocked_s"]
    out["blocked_time_ratio_async_over_sync"] = a / s if s > 0 else None
    return out


def main(_):
    backend = jax.default_backend()
    devices = jax.devices()
    reps = _REPS.value
    on_cpu = backend == "cpu"
    num_layers, dtype = (8, jnp.float32) if on_cpu else (32, jnp.bfloat16)
    lengths = (128, 512, 2048) if on_cpu else (128, 1024, 4096, 16384)
    if _QUICK.value:
        lengths = lengths[:2]
    pairs = [(2, 1), (1, 2), (2, 2)] if on_cpu else [(1, 1), (2, 1), (1, 2), (4, 4), (2, 4)]
    same_device = len(devices) < 2
    if same_device:
        pairs = [(1, 1)]
    pairs = [(s, d) for s, d in pairs if s + d <= len(devices) or same_device]

    if on_cpu:
        ceiling = {"kind": "host_numpy_copy", "bytes_per_s": host_copy_rate(reps=reps)}
    else:
        dst_dev = devices[0] if same_device else devices[1]
        kind = "on_device_copy" if same_device else f"device_put {devices[0]} -> {dst_dev}"
        ceiling = {"kind": kind, "bytes_per_s": device_copy_rate(devices[0], dst_dev, 1 << 30, reps)}

    max_pages = -(-max(lengths) // PAGE_SIZE)
    num_pages = max_pages + 8
    cases = []
    for src_tp, dst_tp in pairs:
        src_devs = devices[:src_tp]
        dst_devs = src_devs if same_device else devices[src_tp:src_tp + dst_tp]
        src_mesh, dst_mesh = make_mesh(src_devs, tp=src_tp), make_mesh(dst_devs, tp=dst_tp)
        src_cache = make_cache(src_mesh, num_layers, num_pages, dtype, seed=0)
        box = {"dst": make_cache(dst_mesh, num_layers, num_pages, dtype, seed=1)}
        rng = np.random.default_rng(0)
        for n in lengths:
            pages = rng.permutation(num_pages)[:-(-n // PAGE_SIZE)].tolist()   # scattered, like a real table
            staged = transfer_kv(src_cache, pages, dst_mesh, num_tokens=n, pad_pages=False)
            transfer_s = _median_time(
                lambda: (lambda s: (s.k, s.v))(transfer_kv(src_cache, pages, dst_mesh, num_tokens=n,
                                                           pad_pages=False)), reps)
            k, v = gather_kv_pages(src_cache, np.asarray(pages, np.int32))
            target = staged_sharding(dst_mesh)
            crossing_s = _median_time(lambda: jax.device_put((k, v), target), reps)

            def scatter():
                box["dst"] = scatter_kv_pages(box["dst"], pages, staged)
                return box["dst"].k[0]
            scatter_s = _median_time(scatter, reps)
            moved = staged.moved_bytes
            cases.append({
                "tokens": n, "src_tp": src_tp, "dst_tp": dst_tp,
                "src_devices": [d.id for d in src_devs], "dst_devices": [d.id for d in dst_devs],
                "num_pages": staged.num_pages, "kv_bytes": staged.kv_bytes, "moved_bytes": moved,
                "transfer_s": transfer_s, "crossing_s": crossing_s, "scatter_s": scatter_s,
                "transfer_bytes_per_s": moved / transfer_s, "crossing_bytes_per_s": moved / crossing_s,
                "transfer_fraction_of_ceiling": moved / transfer_s / ceiling["bytes_per_s"],
                "crossing_fraction_of_ceiling": moved / crossing_s / ceiling["bytes_per_s"],
            })
    print(json.dumps({
        "backend": backend, "device": str(devices[0].device_kind), "num_devices": len(devices),
        "same_device": same_device, "model_kv": {"layers": num_layers, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                                "page_size": PAGE_SIZE, "dtype": jnp.dtype(dtype).name},
        "reps": reps, "ceiling": ceiling, "cases": cases,
        "engine": (engine_sync_vs_async(devices, _ENGINE_REPS.value, _QUICK.value)
                   if _ENGINE.value and len(devices) >= 2 else None)}, indent=1))


if __name__ == "__main__":
    cli.run(main)
