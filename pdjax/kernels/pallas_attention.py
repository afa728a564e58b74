"""Backend dispatch for the Pallas kernels, all with the seam signature of
`reference.ragged_paged_attention`.

gpu (cuda/rocm) -> pallas_gpu (Triton lowering, compiled); tpu -> pallas_tpu (Mosaic, compiled);
cpu -> pallas_gpu in `interpret=True` mode (the GPU-style interpreter is ~100x faster on CPU than TPU
interpret mode, and the kernel body is the one the GPU runs). Used by `pdjax.kernels.get_attention_fn`.
"""
from __future__ import annotations

import functools
from typing import Callable

from pdjax.kernels import pallas_gpu, pallas_tpu

GPU_BACKENDS = ("gpu", "cuda", "rocm")


def get_pallas_attention_fn(backend: str) -> Callable:
    """The Pallas ragged paged attention for a jax backend name ('cpu' | 'gpu' | 'cuda' | 'rocm' | 'tpu')."""
    if backend in GPU_BACKENDS:
        return pallas_gpu.ragged_paged_attention
    if backend == "tpu":
        return pallas_tpu.ragged_paged_attention
    if backend == "cpu":
        return functools.partial(pallas_gpu.ragged_paged_attention, interpret=True)
    raise ValueError(f"backend={backend!r}, expected one of {GPU_BACKENDS + ('tpu', 'cpu')}")
