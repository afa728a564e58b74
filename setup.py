"""pdjax: a JAX research framework for LLM serving (chunked prefill vs PD disaggregation)."""
from setuptools import find_packages, setup

setup(
    name="pdjax",
    version="0.1.0",
    description="JAX research framework for LLM serving: chunked prefill, stall-free batching, "
    "prefill/decode disaggregation, and a calibrated simulator.",
    packages=find_packages(include=["pdjax", "pdjax.*"]),
    package_data={"pdjax.sim": ["profiles/*.json"], "pdjax.workload": ["data/*.json.xz"]},
    python_requires=">=3.10",
    install_requires=[
        # Tested with jax/jaxlib 0.10.2 on CPU; the upper bounds admit 0.11.x, which the GPU image carries (untested).
        "jax>=0.10.0,<0.13",
        "jaxlib>=0.10.0,<0.13",
        "flax>=0.12.0,<0.13",
        "optax>=0.2.4,<0.3",
        "orbax-checkpoint>=0.11.0,<0.13",
        "absl-py>=2.1,<3",
        "ml-collections>=1.0,<2",
        "numpy>=1.26,<3",
        "safetensors>=0.4,<1",
        "matplotlib>=3.8,<4",
        "tqdm>=4.66,<5",
        # Text for HF model directories (pdjax.workload.tokenizer: tokenizer.json; chat_template in jinja2's sandbox,
        # as transformers renders it); tested with tokenizers 0.23.3, jinja2 3.1.6 (older jinja2 has sandbox escapes).
        "tokenizers>=0.19,<1",
        "jinja2>=3.1.6,<4",
    ],
    extras_require={
        "test": ["pytest>=8,<10", "hypothesis>=6.100,<7", "ruff==0.17.6"],   # ruff: pinned, its rules change
        # Sweeps on a cluster (python -m experiments.sweep --executor=ray); tested with ray 2.60.0.
        "cluster": ["ray[default]>=2.40,<3"],
        # bench_throughput --backend=hf (PyTorch eager baseline, CPU) and tests/test_tiny_hf_parity.py (checkpoints/
        # tiny-hf: same chat ids and greedy tokens as transformers); tested with torch 2.13.0+cpu and
        # transformers 5.24. Never installed by CI.
        "hf": ["torch>=2.2", "transformers>=4.45,<6"],
        # Ahead-of-time compilation for TPUs on any host (python -m experiments.aot_compile): libtpu, the real XLA
        # and Mosaic compilers, from the registry; pinned to the jax it was tested with (0.10.2). CPU runs keep
        # working with it installed (pdjax tells libtpu there is no TPU on a host without one).
        "tpu": ["jax[tpu]==0.10.2"],
        # Ahead-of-time compilation for NVIDIA GPUs on any host (--topology=h100:8): the CUDA PJRT plugin and ptxas,
        # 1.2 GB, without the CUDA libraries a GPU host needs to run (jax[cuda12], 5.5 GB). On a host without an
        # NVIDIA driver every JAX process then logs two "Could not find cuda drivers" lines: keep it in its own venv.
        "gpu-aot": ["jax-cuda12-plugin==0.10.2", "jax-cuda12-pjrt==0.10.2", "nvidia-cuda-nvcc-cu12>=12.6,<13"],
        # The OpenAI-compatible HTTP server (python -m experiments.api_server) and its test's clients; tested with
        # fastapi 0.165, uvicorn 0.54, prometheus-client 0.26, openai 3.57, httpx 0.28.
        "serve": ["fastapi>=0.110,<1", "uvicorn>=0.29,<1", "prometheus-client>=0.20,<1", "openai>=1.40,<4",
                  "httpx>=0.27,<1"],
    },
)
