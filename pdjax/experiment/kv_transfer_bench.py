"""KV transfer benchmark: one request's KV moved from a prefill device group to a decode device group.

The command line is experiments/bench_kv_transfer.py (`run` returns its JSON); the cross-process workers run
this module (`python -m pdjax.experiment.kv_transfer_bench OUT REPS QUICK`: `cross_process_worker`).

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
Across processes (`cross_process`, --cross_process): the benchmark starts 2 processes itself (multi-controller JAX,
jax.distributed on localhost, each with --cross_devices_per_process CPU devices (default 4), like launch/local.py;
bounded by --cross_timeout_s, SIGKILLed at the end; CPU only) and moves one request's KV from process 0's
devices (prefill) to process 1's (decode) with transfer_kv, same and different TP (route per case:
`pdjax.serving.kv_transfer.crossing_route`: 'device_put' for identical layouts, 'pieces' otherwise), per length:
- `whole_s`: one transfer_kv of every layer (gather + crossing + reassembly, blocked until it landed);
- `layerwise_s`: one transfer_kv per layer, all dispatched back to back (as a streaming transfer sends each
  layer as soon as its prefill is done), then blocked until every layer landed;
- `crossing_s`: the crossing alone (`cross_device_put` of the pre-gathered pages).
Times are process 1's (the receiver's) wall time from a coordination-service barrier both processes leave
together (not a device collective) until its arrays are ready; median over --reps after one warm-up. Bandwidths
are moved_bytes / time against the same `ceiling` as the in-process cases. `*_sender_call_s`: process 0's
(the prefill side's) time inside the calls (wait=False): what an asynchronous transfer costs the sending loop.
Shapes: Llama-3-8B KV (32 layers, 8 KV heads, head_dim 128, 16-token pages, bf16) on accelerators; on CPU 8
layers in float32 to keep the run short and small.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import pdjax
from pdjax.config.model_specs import get_model_spec
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.models.llama import KVCache, init_params
from pdjax.procs import end_processes, free_port, start_local_processes, wait_processes
from pdjax.runtime.batch import Buckets
from pdjax.runtime.ceilings import host_copy_rate
from pdjax.runtime.mesh import make_mesh
from pdjax.runtime.runner import ModelRunner
from pdjax.scheduler import Request, make_scheduler
from pdjax.serving.cluster import ClusterEngine, Instance
from pdjax.serving.distributed import DistributedCoordinator, initialize, settings_from_env
from pdjax.serving.kv_transfer import (cross_device_put, crossing_route, gather_kv_pages, scatter_kv_pages,
                                       staged_sharding, transfer_kv)

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


def make_cache_multiprocess(mesh, num_layers: int, num_pages: int, dtype, seed: int) -> KVCache:
    """make_cache for a mesh of one process in a multi-process run: each process builds only its own shards
    from host data (a jit of a replicated key onto another process's devices crashes jax 0.10.2 there)."""
    sharding = NamedSharding(mesh, P("tensor", None, None, None))
    shape = (KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM)

    def make(i):
        def shard(index):
            rng = np.random.default_rng((seed, i))
            return rng.random(shape, dtype=np.float32)[index].astype(dtype)
        return jax.make_array_from_callback(shape, sharding, shard, dtype=dtype)
    return KVCache(k=tuple(make(i) for i in range(num_layers)),
                   v=tuple(make(num_layers + i) for i in range(num_layers)))


def engine_sync_vs_async(devices, reps: int, quick: bool) -> dict:
    """The prefill loop's blocked time with synchronous vs asynchronous KV transfer (module docstring)."""
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


CROSS_PAIRS = [(1, 1), (2, 2), (2, 1), (1, 2), (4, 2)]    # (prefill tp on process 0, decode tp on process 1)


def _cross_cases(coord, src_tp: int, dst_tp: int, p0, p1, lengths, num_pages: int, num_layers: int, dtype,
                 reps: int) -> list:
    """The cross-process rows of one (prefill tp, decode tp) pair, one per length (module docstring)."""
    src_mesh, dst_mesh = make_mesh(p0[:src_tp], tp=src_tp), make_mesh(p1[:dst_tp], tp=dst_tp)
    src_cache = make_cache_multiprocess(src_mesh, num_layers, num_pages, dtype, seed=0)
    target = staged_sharding(dst_mesh)
    route = crossing_route(4, src_cache.k[0].sharding, target)
    layers = [KVCache(k=(src_cache.k[i],), v=(src_cache.v[i],)) for i in range(num_layers)]
    rng = np.random.default_rng(0)
    rows = []
    for n in lengths:
        pages = rng.permutation(num_pages)[:-(-n // PAGE_SIZE)].tolist()
        k, v = gather_kv_pages(src_cache, np.asarray(pages, np.int32))

        # Each call below runs within this iteration; the defaults bind this iteration's values.
        def whole(src_cache=src_cache, pages=pages, dst_mesh=dst_mesh, n=n):
            s = transfer_kv(src_cache, pages, dst_mesh, num_tokens=n, pad_pages=False, wait=False)
            return s.k + s.v

        def layerwise(layers=layers, pages=pages, dst_mesh=dst_mesh, n=n):
            staged = [transfer_kv(c, pages, dst_mesh, num_tokens=n, pad_pages=False, wait=False) for c in layers]
            return [a for s in staged for a in s.k + s.v]

        def crossing(k=k, v=v, target=target):
            a, b = cross_device_put(list(k) + list(v), [target] * (2 * num_layers), split=num_layers)
            return a + b

        probe = transfer_kv(src_cache, pages, dst_mesh, num_tokens=n, pad_pages=False)
        moved = probe.moved_bytes
        row = {"tokens": n, "src_tp": src_tp, "dst_tp": dst_tp, "route": route,
               "src_devices": [d.id for d in p0[:src_tp]], "dst_devices": [d.id for d in p1[:dst_tp]],
               "num_pages": probe.num_pages, "kv_bytes": probe.kv_bytes, "moved_bytes": moved}
        for name, fn in (("whole", whole), ("layerwise", layerwise), ("crossing", crossing)):
            row[f"{name}_s"], row[f"{name}_sender_call_s"] = _timed_across(coord, name, fn, reps,
                                                                           f"{src_tp}/{dst_tp}/{n}")
            row[f"{name}_bytes_per_s"] = moved / row[f"{name}_s"]
        rows.append(row)
    return rows


def _timed_across(coord, name: str, fn, reps: int, tag: str):
    """(median seconds on this process from a common barrier until fn's arrays are ready, process 0's median
    seconds inside the call) over `reps` after one warm-up."""
    times, calls = [], []
    for rep in range(reps + 1):   # the first one warms up (compiles)
        coord.barrier(f"{name}/{tag}/{rep}")
        start = time.perf_counter()
        out = fn()
        calls.append(time.perf_counter() - start)
        jax.block_until_ready(out)   # on process 1: until landed; process 0 holds no result shards
        times.append(time.perf_counter() - start)
    coord.barrier(f"{name}/{tag}/end")
    sender_call = coord.agree(statistics.median(calls[1:]), source=0)
    return statistics.median(times[1:]), sender_call


def cross_process_worker(out_path: str, reps: int, quick: bool) -> None:
    """One of the 2 processes of the cross-process measurement (module docstring); process 1 writes the cases."""
    settings = settings_from_env(timeout_s=120)
    initialize(settings)
    coord = DistributedCoordinator(settings, prefix="bench")
    devices = jax.devices()
    p0 = [d for d in devices if d.process_index == 0]
    p1 = [d for d in devices if d.process_index == 1]
    num_layers, dtype = 8, jnp.float32
    lengths = (256,) if quick else (256, 2048)
    num_pages = -(-max(lengths) // PAGE_SIZE) + 8
    cases = []
    for src_tp, dst_tp in CROSS_PAIRS:
        if src_tp <= len(p0) and dst_tp <= len(p1):
            cases += _cross_cases(coord, src_tp, dst_tp, p0, p1, lengths, num_pages, num_layers, dtype, reps)
    coord.barrier("done")
    if jax.process_index() == 1:
        with open(out_path, "w") as f:
            json.dump({"num_processes": jax.process_count(), "devices_per_process": len(p0),
                       "model_kv": {"layers": num_layers, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                    "page_size": PAGE_SIZE, "dtype": jnp.dtype(dtype).name},
                       "lengths": list(lengths), "cases": cases}, f)


def cross_process(ceiling: dict, reps: int, quick: bool, devices_per_process: int, timeout_s: float) -> dict:
    """Start the 2 worker processes (launch/local.py's environment), wait (bounded), return process 1's results
    with each case's fraction of `ceiling`; {"error": ...} when the run fails or times out."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(pdjax.__file__)))
    base = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cross.json")
        cmd = [sys.executable, "-m", "pdjax.experiment.kv_transfer_bench", out, str(reps), str(bool(quick))]
        logs = [open(os.path.join(tmp, f"p{i}.log"), "w+") for i in range(2)]
        start = time.perf_counter()
        procs = start_local_processes(cmd, 2, devices_per_process, free_port(), base_env=base, cwd=repo,
                                      outputs=logs)
        try:
            codes = wait_processes(procs, timeout_s, poll_s=0.2)
        finally:
            end_processes(procs, 0.0)
        wall = time.perf_counter() - start
        if codes != [0, 0]:
            tails = []
            for f in logs:
                f.seek(0)
                tails.append(f.read()[-1500:])
            return {"error": f"exit codes {codes} after {wall:.0f} s (timeout {timeout_s:g} s)", "logs": tails}
        with open(out) as f:
            result = json.load(f)
    for row in result["cases"]:
        for name in ("whole", "layerwise", "crossing"):
            row[f"{name}_fraction_of_ceiling"] = row[f"{name}_bytes_per_s"] / ceiling["bytes_per_s"]
    result["wall_s"] = wall
    return result


def _ceiling(devices, reps: int) -> dict:
    """The copy rate the cases are measured against (module docstring)."""
    if jax.default_backend() == "cpu":
        return {"kind": "host_numpy_copy", "bytes_per_s": host_copy_rate(reps=reps)}
    same_device = len(devices) < 2
    dst_dev = devices[0] if same_device else devices[1]
    kind = "on_device_copy" if same_device else f"device_put {devices[0]} -> {dst_dev}"
    return {"kind": kind, "bytes_per_s": device_copy_rate(devices[0], dst_dev, 1 << 30, reps)}


def _case(src_cache, box: dict, pages, dst_mesh, n: int, reps: int, ceiling: dict, where: dict) -> dict:
    """One in-process row: transfer_kv, the crossing alone and the scatter, timed (module docstring); `where`:
    the pair's tp and devices."""
    staged = transfer_kv(src_cache, pages, dst_mesh, num_tokens=n, pad_pages=False)

    def transfer():
        s = transfer_kv(src_cache, pages, dst_mesh, num_tokens=n, pad_pages=False)
        return s.k, s.v
    transfer_s = _median_time(transfer, reps)
    k, v = gather_kv_pages(src_cache, np.asarray(pages, np.int32))
    crossing_s = _median_time(functools.partial(jax.device_put, (k, v), staged_sharding(dst_mesh)), reps)

    def scatter():
        box["dst"] = scatter_kv_pages(box["dst"], pages, staged)
        return box["dst"].k[0]
    scatter_s = _median_time(scatter, reps)
    moved = staged.moved_bytes
    return {"tokens": n, **where, "num_pages": staged.num_pages, "kv_bytes": staged.kv_bytes, "moved_bytes": moved,
            "transfer_s": transfer_s, "crossing_s": crossing_s, "scatter_s": scatter_s,
            "transfer_bytes_per_s": moved / transfer_s, "crossing_bytes_per_s": moved / crossing_s,
            "transfer_fraction_of_ceiling": moved / transfer_s / ceiling["bytes_per_s"],
            "crossing_fraction_of_ceiling": moved / crossing_s / ceiling["bytes_per_s"]}


def run(*, reps: int = 5, quick: bool = False, engine: bool = True, engine_reps: int = 3,
        cross: bool = True, cross_devices_per_process: int = 4, cross_timeout_s: float = 240.0) -> dict:
    """The benchmark's JSON (module docstring)."""
    backend = jax.default_backend()
    devices = jax.devices()
    on_cpu = backend == "cpu"
    num_layers, dtype = (8, jnp.float32) if on_cpu else (32, jnp.bfloat16)
    lengths = (128, 512, 2048) if on_cpu else (128, 1024, 4096, 16384)
    if quick:
        lengths = lengths[:2]
    pairs = [(2, 1), (1, 2), (2, 2)] if on_cpu else [(1, 1), (2, 1), (1, 2), (4, 4), (2, 4)]
    same_device = len(devices) < 2
    if same_device:
        pairs = [(1, 1)]
    pairs = [(s, d) for s, d in pairs if s + d <= len(devices) or same_device]
    ceiling = _ceiling(devices, reps)
    num_pages = -(-max(lengths) // PAGE_SIZE) + 8
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
            where = {"src_tp": src_tp, "dst_tp": dst_tp, "src_devices": [d.id for d in src_devs],
                     "dst_devices": [d.id for d in dst_devs]}
            cases.append(_case(src_cache, box, pages, dst_mesh, n, reps, ceiling, where))
    return {
        "backend": backend, "device": str(devices[0].device_kind), "num_devices": len(devices),
        "same_device": same_device, "model_kv": {"layers": num_layers, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                                "page_size": PAGE_SIZE, "dtype": jnp.dtype(dtype).name},
        "reps": reps, "ceiling": ceiling, "cases": cases,
        "cross_process": (cross_process(ceiling, reps, quick, cross_devices_per_process, cross_timeout_s)
                          if cross and on_cpu else None),
        "engine": engine_sync_vs_async(devices, engine_reps, quick) if engine and len(devices) >= 2 else None}


if __name__ == "__main__":    # a worker of `cross_process`: OUT_PATH REPS QUICK
    cross_process_worker(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "True")
