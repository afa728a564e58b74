"""The machine's own ceilings that benchmarks (experiments/bench_*.py) report their numbers against, measured in the
same run: copy bandwidth and matmul rate on the default JAX device, and a host memory copy rate."""
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def time_fn(fn, *args, reps: int) -> float:
    """Median seconds of `reps` calls after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_ceilings(backend: str, reps: int = 5) -> dict:
    """Copy bandwidth (read + write bytes / s) and matmul FLOP/s measured on the default JAX device."""
    big = (1 << 30) if backend != "cpu" else (1 << 28)  # bytes: 1 GiB accelerator, 256 MiB CPU (past caches)
    x = jnp.ones((big // 4,), jnp.float32)
    t_copy = time_fn(jax.jit(lambda a: a * 1.0001), x, reps=reps)
    n, dtype = (8192, jnp.bfloat16) if backend != "cpu" else (1024, jnp.float32)
    a = jnp.ones((n, n), dtype)
    t_mm = time_fn(jax.jit(lambda m: m @ m), a, reps=reps)
    return {"copy_bandwidth_Bps": 2 * big / t_copy, "matmul_flops": 2 * n ** 3 / t_mm,
            "copy_bytes": 2 * big, "matmul": f"{n}x{n} {jnp.dtype(dtype).name}"}


def host_copy_rate(num_bytes: int = 256 << 20, reps: int = 5) -> float:
    """Bytes copied per second (one way) by a large numpy copy, best of `reps`."""
    src = np.ones(num_bytes // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best
