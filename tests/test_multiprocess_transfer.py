"""KV transfer between processes (pdjax.serving.kv_transfer.transfer_kv across jax.distributed processes): 2
processes x 4 CPU devices on localhost (process 0 holds global devices 0-3, process 1 holds 4-7), started like
launch/local.py starts them, every run bounded by a timeout and its processes SIGKILLed at the end (slow).

- pages land exactly between different TP (and pipeline) layouts across processes: prefill tp2 on process 0 ->
  decode tp1 / tp2 on process 1, tp1 -> tp2, tp4 -> tp2, pp2 x tp2 -> pp1 x tp1, a group spanning both processes,
  and both groups on one process; the decode side's scattered cache equals the expected pages (the source is
  built from a seed on every process), and the digest of the pages process 1 received equals the digest of the
  pages process 0 gathered (exchanged through the coordination service);
- a disaggregated run with prefill tp2 on process 0 and decode tp1 on process 1 gives the tokens of the same
  deployment in one process.

Run as a script (`python tests/test_multiprocess_transfer.py OUT_DIR`) it is the worker of the first test.
"""
import hashlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

from multiprocess_util import BASE_ENV, REPO, RUN_TIMEOUT, run_all


LAYERS, KV_HEADS, PAGES, PAGE_SIZE, HEAD_DIM = 3, 4, 12, 8, 16
# name: (src device ids, src pp, src tp, dst device ids, dst pp, dst tp, wait)
CASES = {
    "tp2->tp1": ((0, 1), 1, 2, (4,), 1, 1, True),
    "tp1->tp2": ((0,), 1, 1, (4, 5), 1, 2, True),
    "tp2->tp2": ((2, 3), 1, 2, (6, 7), 1, 2, True),          # identical layouts: one device_put
    "tp4->tp2 async": ((0, 1, 2, 3), 1, 4, (4, 5), 1, 2, False),
    "pp2xtp2->pp1xtp1": ((0, 1, 2, 3), 2, 2, (5,), 1, 1, True),
    "tp2 spanning->tp1": ((3, 4), 1, 2, (5,), 1, 1, True),  # the source on both processes
    "tp1->tp2 spanning": ((1,), 1, 1, (3, 4), 1, 2, True),  # the destination on both processes
    "same process tp2->tp1": ((4, 5), 1, 2, (6,), 1, 1, True),
}
EXPECTED_ROUTES = {"tp2->tp1": "pieces", "tp1->tp2": "pieces", "tp2->tp2": "device_put",
                   "tp4->tp2 async": "pieces", "pp2xtp2->pp1xtp1": "pieces", "tp2 spanning->tp1": "pieces",
                   "tp1->tp2 spanning": "pieces", "same process tp2->tp1": "local"}


def worker(out_dir: str) -> None:
    """One process of the page-exactness run: every case, then results to OUT_DIR/p<process id>.json."""
    from pdjax.serving.distributed import DistributedCoordinator, initialize, settings_from_env
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ.get("PDJAX_TEST_HANG_S", "100")), exit=True)
    settings = settings_from_env(timeout_s=60)
    initialize(settings)
    import jax
    import numpy as np
    from jax._src import distributed as jax_distributed
    from jax.sharding import NamedSharding, PartitionSpec as P
    from pdjax.config.pipeline import stage_layer_ranges
    from pdjax.models.llama import KVCache
    from pdjax.runtime.mesh import make_mesh, stage_meshes
    from pdjax.serving.kv_transfer import crossing_route, gather_kv_pages, scatter_kv_pages, staged_sharding, \
        transfer_kv

    me = jax.process_index()
    client = jax_distributed.global_state.client
    coord = DistributedCoordinator(settings)
    devices = jax.devices()
    results = {"process_id": me, "device_processes": [d.process_index for d in devices], "cases": {}}
    shape = (KV_HEADS, PAGES, PAGE_SIZE, HEAD_DIM)

    def stage_caches(ids, pp, tp, host):
        subs = stage_meshes(make_mesh([devices[i] for i in ids], pp=pp, tp=tp))
        caches = []
        for sub, (a, b) in zip(subs, stage_layer_ranges(LAYERS, pp)):
            sharding = NamedSharding(sub, P("tensor", None, None, None))
            put = lambda xs: tuple(jax.make_array_from_callback(shape, sharding, lambda idx, x=x: x[idx],  # noqa
                                                             dtype=np.float32)
                                   for x in xs)
            caches.append(KVCache(k=put(host[0][a:b]), v=put(host[1][a:b])))
        return caches, subs

    def digest(arrays, num_pages):
        h = hashlib.sha256()
        for a in arrays:
            h.update(np.ascontiguousarray(np.asarray(a)[:, :num_pages]).tobytes())
        return h.hexdigest()

    only = os.environ.get("PDJAX_TEST_CASES")
    # Every case twice: the second round runs after every kind of transfer has been through (a mispaired
    # cross-process batch used to make later transfers hang: kv_transfer._by_pieces).
    for n, (name, (src_ids, src_pp, src_tp, dst_ids, dst_pp, dst_tp, wait)) in enumerate(list(CASES.items()) * 2):
        if only and name not in only.split(","):
            continue
        print(f"case {name}", file=sys.stderr, flush=True)
        rng = np.random.default_rng(n)   # round 2: other values
        src_host = [[rng.standard_normal(shape).astype(np.float32) for _ in range(LAYERS)] for _ in "kv"]
        zeros = [[np.zeros(shape, np.float32) for _ in range(LAYERS)] for _ in "kv"]
        src, _ = stage_caches(src_ids, src_pp, src_tp, src_host)
        dst, dst_subs = stage_caches(dst_ids, dst_pp, dst_tp, zeros)
        src_pages, dst_pages, num_tokens = [7, 2, 9], [3, 10, 5, 1], 19     # 3 pages, padded to 4 sent
        route = crossing_route(4, src[0].k[0].sharding, staged_sharding(dst_subs[0]))
        staged = transfer_kv(src, src_pages, dst_subs, num_tokens=num_tokens, wait=wait)
        new = scatter_kv_pages(dst, dst_pages, staged)
        jax.block_until_ready(new)
        case = {"route": route, "checked_shards": 0, "mismatches": []}
        ranges = stage_layer_ranges(LAYERS, dst_pp)
        for cache, (a, _) in zip(new, ranges):           # every local shard of the decode cache, exactly
            for kind, arrays in (("k", cache.k), ("v", cache.v)):
                for i, arr in enumerate(arrays):
                    layer = a + i
                    want = np.zeros(shape, np.float32)
                    for sp, dp in zip(src_pages, dst_pages[:3]):
                        want[:, dp] = src_host["kv".index(kind)][layer][:, sp]
                    for shard in arr.addressable_shards:
                        case["checked_shards"] += 1
                        if not np.array_equal(np.asarray(shard.data), want[shard.index]):
                            case["mismatches"].append(f"{kind}{layer} on device {shard.device.id}")
        # Digests: the pages process 0 gathered (when it holds the whole source) vs those that landed (on the
        # process holding the whole destination), exchanged through the coordination service.
        src_procs = {devices[i].process_index for i in src_ids}
        dst_procs = {devices[i].process_index for i in dst_ids}
        if src_procs == {0}:
            if me == 0:
                got = [gather_kv_pages(c, np.asarray(src_pages, np.int32)) for c in src]
                sent = digest([a for g in got for a in g[0]] + [a for g in got for a in g[1]], 3)
                client.key_value_set(f"test/digest/{n}/sent", sent)
            if len(dst_procs) == 1 and me in dst_procs:
                landed = digest(list(staged.k) + list(staged.v), 3)
                sent = client.blocking_key_value_get(f"test/digest/{n}/sent", 60_000)
                case["digest_equal"] = landed == sent
        coord.barrier(f"case{n}")
        results["cases"].setdefault(name, []).append(case)
    coord.barrier("done")
    pathlib.Path(out_dir, f"p{me}.json").write_text(json.dumps(results))


# ------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_pages_land_exactly_between_tp_layouts_across_processes(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run_all([sys.executable, str(pathlib.Path(__file__).resolve()), str(out)], 2, tmp_path)
    p0, p1 = (json.loads((out / f"p{i}.json").read_text()) for i in (0, 1))
    assert p0["device_processes"] == [0] * 4 + [1] * 4
    for name in CASES:
        dst_procs = {0 if i < 4 else 1 for i in CASES[name][3]}
        for p in (p0, p1):
            assert len(p["cases"][name]) == 2, name
            for case in p["cases"][name]:
                assert case["route"] == EXPECTED_ROUTES[name], (name, case)
                assert case["mismatches"] == [], (name, p["process_id"], case)
                assert (case["checked_shards"] > 0) == (p["process_id"] in dst_procs), (name, case)
                if CASES[name][0][-1] < 4 and dst_procs == {p["process_id"]}:   # source on 0, destination on one
                    assert case["digest_equal"] is True, (name, case)


# ------------------------------------------------------------------------------------------------------------
TINY = ["--config=configs/serve.py", "--config.model.checkpoint=tiny-mha", "--config.model.attention_impl=reference",
        "--config.workload.num_requests=6", "--config.workload.rate=20", "--config.workload.max_output_len=6",
        "--config.scheduler.token_budget=32", "--config.scheduler.max_num_seqs=4",
        "--config.scheduler.max_model_len=64", "--config.scheduler.page_size=8", "--config.scheduler.num_pages=48",
        "--config.engine.compilation_cache=False"]
DISAGG_TP2_TP1 = ["--config.deployment.kind=disaggregated", "--config.deployment.prefill.tp=2",
                  "--config.deployment.prefill.devices=(2,3)", "--config.deployment.decode.devices=(4,)"]


def _serve_cmd(workdir, *extra):
    return [sys.executable, "-m", "experiments.serve", *TINY, *DISAGG_TP2_TP1, f"--workdir={workdir}", *extra]


@pytest.mark.slow
def test_disaggregated_tp2_to_tp1_across_processes_matches_single_process(tmp_path):
    single = tmp_path / "single"
    env = {**BASE_ENV, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run(_serve_cmd(single), cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT)
    assert out.returncode == 0, out.stderr[-3000:]
    workdir = tmp_path / "run"
    run_all(_serve_cmd(workdir, "--distributed_timeout_s=60"), 2, tmp_path)
    tokens = json.loads((workdir / "outputs.json").read_text())
    assert tokens and tokens == json.loads((single / "outputs.json").read_text())
    results = json.loads((workdir / "results.json").read_text())
    assert results["engine"]["num_processes"] == 2 and results["engine"]["kv_transfer"]["num_transfers"] > 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    worker(sys.argv[1])
