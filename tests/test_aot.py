"""Ahead-of-time compilation for TPUs on this CPU host (the 'tpu' extra's libtpu: the real XLA and Mosaic compilers,
compile-only devices of a topology): the engine's own steps with the Pallas kernel under TP and PP, the per-device
bytes they need, the KV planning, and the experiments.aot_compile report. Skipped without libtpu."""
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest

pytest.importorskip("libtpu", reason="the 'tpu' extra (libtpu) compiles for TPUs ahead of time")

from pdjax.config.model_specs import get_model_spec
from pdjax.runtime import aot
from pdjax.runtime import mesh as mesh_lib
from pdjax.runtime.batch import empty_batch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TOPOLOGIES = {}


def topology(name):
    if name not in _TOPOLOGIES:
        _TOPOLOGIES[name] = aot.topology_devices(name)
    return _TOPOLOGIES[name]


def batch_bytes(bucket, max_seqs):
    """Bytes of one step's batch arguments (every array replicated on each device) and the previous ids."""
    leaves = [getattr(empty_batch(bucket), f) for f in empty_batch(bucket).__dataclass_fields__]
    return sum(a.nbytes for a in leaves) + 4 * max_seqs


@pytest.mark.parametrize("topo", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_pallas_step_compiles_under_tp_with_the_kv_cache_split(topo, tp):
    """The TPU kernel inside the whole step at TP 1/2/4: XLA cannot partition a Mosaic call, so before the seam was
    shard_mapped every TP > 1 step failed here. Each device's arguments are its weight shards, 1/tp of the KV cache
    and the replicated batch, nothing more (no gathered copy), and the donated cache aliases the output in place."""
    spec, bucket, num_pages = get_model_spec("tiny-mha"), (32, 8, 8), 512
    mesh = mesh_lib.make_mesh(topology(topo)[:tp], tp=tp)
    step = aot.compile_step(spec, "pallas", mesh, bucket, num_pages=num_pages, page_size=16, dtype=jnp.bfloat16,
                            max_seqs=8)
    assert step.compiled, step.error
    full_kv = 2 * spec.num_layers * spec.num_kv_heads * num_pages * 16 * spec.head_dim * 2
    assert step.kv_bytes == full_kv // tp
    # the batch's few small int arrays, in the TPU's padded tiles: far below one layer's KV, which a gather would add
    assert 0 <= step.argument_bytes - step.weights_bytes - step.kv_bytes - batch_bytes(bucket, 8) < 32 * 1024
    assert step.alias_bytes == step.kv_bytes
    assert step.flops > 0


def test_pipeline_stages_compile_on_their_own_meshes():
    """pp=2 x tp=2: each stage is its own TP group (the embedding on stage 0, final norm and LM head on stage 1)."""
    spec = get_model_spec("tiny-llama")
    mesh = mesh_lib.make_mesh(topology("v5e:2x2"), pp=2, tp=2)
    steps = aot.compile_instance(spec, "pallas", mesh, [(16, 4, 4), (64, 16, 4)], num_pages=64, page_size=16,
                                 dtype=jnp.bfloat16, max_seqs=16, jobs=2)
    assert [(s.bucket, s.stage) for s in steps] == [((16, 4, 4), 0), ((16, 4, 4), 1), ((64, 16, 4), 0),
                                                     ((64, 16, 4), 1)]
    assert all(s.compiled for s in steps), [s.error for s in steps]
    table = aot.stage_bytes(spec, mesh, jnp.bfloat16, 16)
    assert [s.weights_bytes for s in steps[:2]] == [w for w, _ in table]
    assert steps[0].kv_bytes == 64 * table[0][1]


def test_kv_bytes_are_linear_in_num_pages_and_the_plan_fits_its_budget():
    """The KV cache's per-device bytes grow exactly by one page's bytes per page; the planned num_pages, compiled,
    fits utilization x HBM, and fills it up to the compiler's own slack."""
    from pdjax.config.buckets import Buckets
    spec, bucket = get_model_spec("tiny-llama"), (64, 8, 8)
    mesh = mesh_lib.make_mesh(topology("v5e:2x2")[:2], tp=2)
    small, large = (aot.compile_step(spec, "pallas", mesh, bucket, num_pages=n, page_size=16, dtype=jnp.bfloat16,
                                     max_seqs=8) for n in (128, 384))
    page = aot.kv_page_bytes(spec, tp=2, num_layers=spec.num_layers, page_size=16, dtype=jnp.bfloat16)
    assert large.kv_bytes - small.kv_bytes == 256 * page == large.alias_bytes - small.alias_bytes
    hbm, utilization = 64 * 2 ** 20, 0.5
    pages = aot.plan_num_pages(spec, "pallas", mesh, Buckets((64,), (8,), (8,)), page_size=16, max_model_len=128,
                               dtype=jnp.bfloat16, utilization=utilization, hbm_bytes=hbm)
    planned = aot.compile_step(spec, "pallas", mesh, bucket, num_pages=pages, page_size=16, dtype=jnp.bfloat16,
                               max_seqs=8)
    assert planned.total_bytes <= utilization * hbm < planned.total_bytes + 0.05 * hbm
    with pytest.raises(ValueError, match="'tiny-llama' does not fit this instance"):
        aot.plan_num_pages(spec, "pallas", mesh, Buckets((64,), (8,), (8,)), page_size=16, max_model_len=128,
                           dtype=jnp.bfloat16, utilization=utilization, hbm_bytes=2 * 2 ** 20)


def test_a_failure_is_a_row_not_an_exception():
    """A step that cannot compile (here: the KV cache alone exceeds a v5e's HBM) is reported with XLA's one line."""
    spec = get_model_spec("tiny-mha")
    mesh = mesh_lib.make_mesh(topology("v5e:2x2")[:1], tp=1)
    step = aot.compile_step(spec, "pallas", mesh, (16, 4, 4), num_pages=2_000_000, page_size=16,
                            dtype=jnp.bfloat16, max_seqs=4)
    assert not step.compiled and "RESOURCE_EXHAUSTED" in step.error and "\n" not in step.error


def test_bad_topology_is_one_line():
    with pytest.raises(ValueError, match="topology='v9z:1x1'"):
        aot.topology_devices("v9z:1x1")


def _aot_compile(*args, timeout=600):
    cmd = [sys.executable, "-m", "experiments.aot_compile", "--config=configs/serve.py", "--jobs=2", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_aot_compile_disaggregated_plans_pages_and_writes_json(tmp_path):
    """experiments.aot_compile on a disaggregated deployment (prefill TP 2 + decode TP 1 x 2 replicas, split over
    one v5e:2x2): every bucket of both groups compiles, num_pages=0 is planned from the compiled bytes, and the
    report is the JSON and the table."""
    out = tmp_path / "aot.json"
    proc = _aot_compile("--config.model.checkpoint=tiny-mha", "--config.model.dtype=bfloat16",
                        "--config.deployment.kind=disaggregated", "--config.deployment.prefill.tp=2",
                        "--config.deployment.decode.num_instances=2", "--config.scheduler.num_pages=0",
                        "--config.scheduler.token_budget=64", "--config.scheduler.max_num_seqs=8",
                        "--config.scheduler.max_model_len=256", "--topology=v5e:2x2", "--compare_sim",
                        f"--out={out}")
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    report = json.loads(out.read_text())
    prefill, decode = report["groups"]
    assert (prefill["role"], prefill["tp"], decode["role"], decode["instances"]) == ("prefill", 2, "decode", 2)
    assert prefill["devices"] == [0, 1] and decode["devices"] == [2]    # the engine's own placement order
    for group in (prefill, decode):
        assert group["num_pages_source"] == "planned" and group["num_pages"] > 1000
        assert len(group["steps"]) == len(group["buckets"]) and all(s["compiled"] and s["fits"]
                                                                    for s in group["steps"])
        assert all(s["flops_ratio"] is not None for s in group["steps"])
    assert "group prefill" in proc.stdout and "group decode" in proc.stdout


def test_aot_compile_refuses_a_model_that_cannot_fit_in_one_line():
    """Llama-3.1-8B in bf16 at TP 1 on a v5e (16 GB): refused before compiling, naming the model, the group and the
    bytes; exit status 1."""
    proc = _aot_compile("--config.model.checkpoint=llama-3.1-8b", "--config.model.dtype=bfloat16",
                        "--topology=v5e:2x2", timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if "error:" in ln)
    assert "'llama-3.1-8b' does not fit deployment.colocated (pp=1, tp=1" in line and "GiB per device" in line
    assert "0 step(s) compiled" in proc.stdout


def test_tpu_pod_launch_stops_when_the_config_does_not_fit():
    """launch/tpu_pod.sh compiles a serving config for TOPOLOGY first and launches nothing when it cannot fit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRY_RUN")}
    env.update(TOPOLOGY="v5e:2x2", PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    proc = subprocess.run(["bash", os.path.join(REPO, "launch", "tpu_pod.sh"), "my-tpu", "us-west4-a", "python3", "-m",
                           "experiments.serve", "--config=configs/serve.py",
                           "--config.model.checkpoint=llama-3.1-8b", "--config.model.dtype=bfloat16"],
                          env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "does not fit deployment.colocated" in proc.stdout and "not launching" in proc.stderr


def test_instance_devices_one_topology_or_one_per_group():
    """One list for every group: the deployment's own assignment (prefill first). A list per group (or groups
    sharing one beside a group with its own): each group's instances take the next free devices of its list."""
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.experiment.aot import instance_devices
    cfg = serve_config_from_dict({"workload": {"preset": "chat"}, "deployment": {
        "kind": "disaggregated", "prefill": {"tp": 2}, "decode": {"num_instances": 2}}})
    one = list(range(8))
    assert instance_devices(cfg, {"prefill": one, "decode": one}) == {
        "prefill0": [0, 1], "decode0": [2], "decode1": [3]}
    own = {"prefill": ["p0", "p1", "p2"], "decode": ["d0", "d1"]}
    assert instance_devices(cfg, own) == {"prefill0": ["p0", "p1"], "decode0": ["d0"], "decode1": ["d1"]}
    with pytest.raises(ValueError, match=r"deployment.decode: 2 instance\(s\) x pp 1 x tp 1 need 2 devices, its "
                                         r"topology has 1 left"):
        instance_devices(cfg, {"prefill": ["p0", "p1"], "decode": ["d0"]})
