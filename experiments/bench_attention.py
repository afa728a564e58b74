"""Ragged paged attention benchmark: decode (batch x context grid) and prefill chunks.

    python -m experiments.bench_attention            # defaults per backend
    python -m experiments.bench_attention --quick    # smallest grid (smoke run)

Prints one JSON object: the device, its measured ceilings (copy bandwidth from a large array copy, matmul
rate from a large matmul, both on this device), and per case: time, KV bytes read, achieved bandwidth and
FLOP/s, and the fraction of the measured ceiling (bandwidth for decode, FLOP/s for prefill).
CPU: times the jnp reference path (the CPU engine's path; short run). GPU: our Pallas kernels (auto rule,
plus the prefill configuration on decode for contrast) and, on the same arrays, jax's bundled
`jax.experimental.pallas.ops.gpu.paged_attention` as a peer (decode only; it has no prefill mode), plus the
reference. TPU: our Mosaic kernel and the reference.
Shapes are Llama-3-8B attention (8 KV heads, 32 query heads, head_dim 128, 16-token pages): bf16 on
accelerators, float32 on CPU.
"""
from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax.experimental.pallas.ops.gpu import paged_attention as bundled

from pdjax.kernels import pallas_gpu, pallas_tpu
from pdjax.runtime.ceilings import measure_ceilings, time_fn
from pdjax.experiment import cli
from pdjax.kernels import reference

FLAGS = flags.DEFINE_bool("quick", False, "smallest grid, for a smoke run")
_REPS = flags.DEFINE_integer("reps", 0, "timed repetitions per case (0 = per-backend default)")

NUM_KV_HEADS, GROUP, HEAD_DIM, PAGE_SIZE = 8, 4, 128, 16


def make_batch(q_lens, ctx_lens, dtype, num_slots=None, seed=0):
    """Ragged batch with shuffled pages. Returns the seam arguments and (kv_bytes, flops)."""
    rng = np.random.default_rng(seed)
    num_slots = num_slots or len(q_lens)
    pages = [-(-c // PAGE_SIZE) for c in ctx_lens]
    pages_per_seq = max(pages)
    num_pages = sum(pages) + 1
    perm = rng.permutation(num_pages).astype(np.int32)
    table = np.zeros((num_slots, pages_per_seq), np.int32)
    used = 0
    for i, n in enumerate(pages):
        table[i, :n] = perm[used:used + n]
        used += n
    q_all = list(q_lens) + [0] * (num_slots - len(q_lens))
    kv_all = list(ctx_lens) + [0] * (num_slots - len(ctx_lens))
    cu = np.concatenate([[0], np.cumsum(q_all)]).astype(np.int32)
    key = jax.random.PRNGKey(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    shape = (NUM_KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM)
    q = jax.random.normal(k1, (int(cu[-1]), NUM_KV_HEADS * GROUP, HEAD_DIM), dtype)
    k = jax.random.normal(k2, shape, dtype)
    v = jax.random.normal(k3, shape, dtype)
    args = (q, k, v, jnp.asarray(kv_all, jnp.int32), jnp.asarray(table), jnp.asarray(cu),
            jnp.asarray([len(q_lens)], jnp.int32))
    itemsize = jnp.dtype(dtype).itemsize
    kv_bytes = sum(2 * c * NUM_KV_HEADS * HEAD_DIM * itemsize for c in ctx_lens)
    visible = sum(sum(c - ql + j + 1 for j in range(ql)) for ql, c in zip(q_lens, ctx_lens))
    flops = 4 * visible * NUM_KV_HEADS * GROUP * HEAD_DIM
    return args, kv_bytes, flops


def bundled_gpu_decode(args):
    """jax's bundled GPU paged_attention on the same arrays (decode: one query token per sequence).
    Returns a zero-argument function to time."""
    q, k, v, kv_lens, table, _, _ = args
    q = (q.astype(jnp.float32) * HEAD_DIM ** -0.5).astype(q.dtype)  # it applies no softmax scale itself
    pages_per_seq = table.shape[1]
    k_splits = 16 if pages_per_seq % 16 == 0 else 1
    ppcb = max(1, min(8, pages_per_seq // k_splits))
    while (pages_per_seq // k_splits) % ppcb:
        ppcb //= 2
    fn = jax.jit(lambda q, k, v, t, l: bundled.paged_attention(
        q, k, v, t, l, k_splits=k_splits, pages_per_compute_block=ppcb))
    return lambda: fn(q, k, v, table, kv_lens)


def implementations(backend: str):
    """name -> seam function for this backend."""
    impls = {"reference": jax.jit(reference.ragged_paged_attention)}
    if backend == "gpu":
        impls = {"pallas": jax.jit(pallas_gpu.ragged_paged_attention),
                 "pallas_prefill_config": jax.jit(pallas_gpu.prefill_attention), **impls}
    elif backend == "tpu":
        impls = {"pallas_tpu": jax.jit(pallas_tpu.ragged_paged_attention), **impls}
    return impls


def max_abs_diff(out, expected) -> float:
    return float(jnp.max(jnp.abs(out.astype(jnp.float32) - expected.astype(jnp.float32))))


def record(kind, case, name, seconds, kv_bytes, flops, ceilings, diff):
    bw, fl = kv_bytes / seconds, flops / seconds
    peak = bw / ceilings["copy_bandwidth_Bps"] if kind == "decode" else fl / ceilings["matmul_flops"]
    return {**case, "impl": name, "time_s": seconds, "kv_bytes": kv_bytes, "bandwidth_Bps": bw,
            "flops": flops, "flops_per_s": fl, "fraction_of_peak": peak,
            "peak_kind": "copy_bandwidth" if kind == "decode" else "matmul_flops",
            "max_abs_diff_vs_reference": diff}


def main(_):
    backend = jax.default_backend()
    on_cpu = backend == "cpu"
    reps = _REPS.value or (3 if on_cpu else 20)
    dtype = jnp.float32 if on_cpu else jnp.bfloat16
    if FLAGS.value:
        batches, contexts, chunks = [1, 8], [256], [(128, 0)]
    elif on_cpu:
        batches, contexts, chunks = [1, 8], [256, 1024], [(128, 0), (256, 512)]
    else:
        batches, contexts = [1, 8, 32, 64, 128], [1024, 4096, 16384]
        chunks = [(512, 0), (512, 4096), (2048, 0), (2048, 8192)]
    ceilings = measure_ceilings(backend, reps)
    impls = implementations(backend)
    decode, prefill = [], []
    for batch in batches:
        for ctx in contexts:
            args, kv_bytes, flops = make_batch([1] * batch, [ctx] * batch, dtype)
            case = {"batch": batch, "context": ctx}
            expected = impls["reference"](*args)
            runs = {name: functools.partial(fn, *args) for name, fn in impls.items()}
            if backend == "gpu":
                runs["jax_bundled_paged_attention"] = bundled_gpu_decode(args)
            for name, run in runs.items():
                decode.append(record("decode", case, name, time_fn(run, reps=reps), kv_bytes, flops, ceilings,
                                     max_abs_diff(run(), expected)))
    for chunk, offset in chunks:
        args, kv_bytes, flops = make_batch([chunk], [offset + chunk], dtype)
        case = {"chunk": chunk, "offset": offset}
        expected = impls["reference"](*args)
        for name, fn in impls.items():
            run = functools.partial(fn, *args)
            prefill.append(record("prefill", case, name, time_fn(run, reps=reps), kv_bytes, flops, ceilings,
                                  max_abs_diff(run(), expected)))
    print(json.dumps({"backend": backend, "device": str(jax.devices()[0].device_kind), "dtype":
                      jnp.dtype(dtype).name, "shape": {"num_kv_heads": NUM_KV_HEADS, "group": GROUP,
                                                       "head_dim": HEAD_DIM, "page_size": PAGE_SIZE},
                      "reps": reps, "ceilings": ceilings, "decode": decode, "prefill": prefill}, indent=1))


if __name__ == "__main__":
    cli.run(main)
