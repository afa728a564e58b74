"""Ahead-of-time compilation for NVIDIA GPUs on this host, which has none (the 'gpu-aot' extra: XLA:GPU compiles
against a GpuTargetConfigProto, pdjax.runtime.aot.GPU_TARGETS): the engine's step with the Triton Pallas kernel
shard_mapped over TP, and experiments.aot_compile's report. Skipped without the CUDA plugin."""
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

pytest.importorskip("jax_plugins.xla_cuda12", reason="the 'gpu-aot' extra (the CUDA plugin) compiles for GPUs")

from pdjax.config.model_specs import get_model_spec
from pdjax.runtime import aot
from pdjax.runtime import mesh as mesh_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("gpu", ["h100", "a100"])
def test_sharded_triton_step_compiles_for_a_gpu_target(gpu):
    devices = aot.topology_devices(f"{gpu}:2")
    assert devices[0].device_kind == aot.GPU_TARGETS[gpu][0] and devices[0].platform == "gpu"
    spec = get_model_spec("tiny-mha")
    steps = [aot.compile_step(spec, "pallas", mesh_lib.make_mesh(devices[:tp], tp=tp), (64, 8, 8), num_pages=512,
                              page_size=16, dtype=jnp.bfloat16, max_seqs=8) for tp in (1, 2)]
    assert all(s.compiled for s in steps), [s.error for s in steps]
    assert steps[1].kv_bytes * 2 == steps[0].kv_bytes
    assert steps[1].alias_bytes == steps[1].kv_bytes       # the donated cache stays split, updated in place


def test_bad_gpu_topology_is_one_line():
    with pytest.raises(ValueError, match="topology='h100:2x2x2'"):
        aot.topology_devices("h100:2x2x2")


def test_aot_compile_for_h100(tmp_path):
    out = tmp_path / "h100.json"
    proc = subprocess.run([sys.executable, "-m", "experiments.aot_compile", "--config=configs/serve.py",
                           "--config.model.checkpoint=tiny-mha", "--config.model.dtype=bfloat16",
                           "--config.deployment.colocated.tp=2", "--config.scheduler.token_budget=64",
                           "--config.scheduler.max_num_seqs=8", "--topology=h100:2", f"--out={out}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (group,) = json.loads(out.read_text())["groups"]
    assert group["hardware"] == "h100" and group["hbm_bytes"] > 70 * 2 ** 30
    assert all(s["compiled"] and s["fits"] for s in group["steps"]) and len(group["steps"]) == len(group["buckets"])
