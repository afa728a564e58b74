"""Colocated replicas and pipelined instances on the real engines (8 fake CPU devices, tiny-llama, dummy weights):
each replica its own runner (own devices), scheduler and KV cache behind the router, on the multi-instance loop
(pdjax.serving.cluster.ClusterEngine); one pipelined instance through run_real; greedy tokens equal one device."""
import json

import numpy as np
import pytest

from pdjax.config.sampling import SamplingParams
from pdjax.config.serving import serve_config_from_dict

PAGE_SIZE, MAX_LEN, BUDGET, NUM_PAGES = 8, 64, 32, 48
PROMPT_LENS = (5, 8, 16, 17, 33, 40)
MAX_TOKENS = (4, 1, 6, 3, 5, 2)


def _config(deployment, **engine):
    return {
        "model": {"checkpoint": "tiny-llama", "attention_impl": "reference"},
        "engine": {"mode": "offline", "progress": False, "compilation_cache": False, "token_buckets": [BUDGET],
                   "seq_buckets": [8], "page_buckets": [MAX_LEN // PAGE_SIZE], **engine},
        "scheduler": {"policy": "sarathi", "token_budget": BUDGET, "max_num_seqs": 8, "max_model_len": MAX_LEN,
                      "page_size": PAGE_SIZE, "num_pages": NUM_PAGES},
        "workload": {"kind": "synthetic", "prompt_len": {"kind": "fixed", "value": 20},
                     "output_len": {"kind": "fixed", "value": 4}, "num_requests": 4, "vocab_size": 256},
        "deployment": deployment}


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def single(model):
    """A one-device runner: the reference every layout must reproduce."""
    from pdjax.runtime.batch import Buckets
    from pdjax.runtime.runner import ModelRunner
    spec, params = model
    return ModelRunner(spec, params, num_pages=NUM_PAGES, page_size=PAGE_SIZE, attention_impl="reference",
                       buckets=Buckets(tokens=(BUDGET,), seqs=(8,), pages=(MAX_LEN // PAGE_SIZE,)),
                       max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def prompts(model):
    rng = np.random.default_rng(3)
    return [[int(t) for t in rng.integers(0, model[0].vocab_size, n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(single, prompts):
    from pdjax.runtime.generate import generate
    tokens, _ = generate(single, prompts, max(MAX_TOKENS), chunk_size=16, token_budget=BUDGET)
    return {f"r{i}": tokens[i][:m] for i, m in enumerate(MAX_TOKENS)}


def _requests(prompts, gap=0.0):
    from pdjax.scheduler import Request
    return [Request(f"r{i}", p, SamplingParams(max_tokens=m), i * gap)
            for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS))]


def _ints(tokens):
    return {rid: [int(t) for t in toks] for rid, toks in tokens.items()}


def _no_leaks(instances):
    for inst in instances:
        assert inst.scheduler.block_manager.num_free_pages == inst.scheduler.config.num_pages, inst.name
        assert not inst.scheduler.has_unfinished()


@pytest.mark.parametrize("router", ["round_robin", "least_loaded"])
def test_two_tp2_replicas_match_one_device(model, prompts, reference, router):
    """deployment.colocated.num_instances=2 x tp2: two replicas on devices (0, 1) and (2, 3), each its own
    scheduler and KV cache behind the router; both do work, tokens equal one device, no page leaks."""
    from pdjax.runtime import compiles
    from pdjax.serving.build import build_engine
    from pdjax.serving.cluster import ClusterEngine
    spec, params = model
    cfg = serve_config_from_dict(_config({"kind": "colocated", "router": router,
                                          "colocated": {"num_instances": 2, "tp": 2}}))
    engine = build_engine(cfg, params=params, spec=spec, compile_counter=compiles.count)
    assert isinstance(engine, ClusterEngine)
    assert [(i.name, i.role) for i in engine.instances] == [("replica0", "colocated"), ("replica1", "colocated")]
    assert [[d.id for d in i.runner.mesh.devices.flat] for i in engine.instances] == [[0, 1], [2, 3]]
    assert all(dict(i.runner.mesh.shape) == {"data": 1, "stage": 1, "tensor": 2} for i in engine.instances)
    result = engine.run(_requests(prompts, gap=0.005))
    assert _ints(result.output_tokens) == reference
    assert all(r.finish_reason == "length" for r in result.requests)
    assert {it.instance for it in result.iterations} == {"replica0", "replica1"}
    assert all(i.num_steps > 0 for i in engine.instances)
    assert result.transfers == [] and result.transfer_summary()["num_transfers"] == 0
    _no_leaks(engine.instances)


def test_pipelined_replicas_behind_the_router(model, prompts, reference):
    """Two replicas, each pp2 x tp2 (all 8 devices, every one running a stage's TP shard)."""
    from pdjax.serving.build import build_engine
    from pdjax.runtime.pipeline import PipelineRunner
    spec, params = model
    cfg = serve_config_from_dict(_config({"kind": "colocated", "router": "least_loaded",
                                          "colocated": {"num_instances": 2, "pp": 2, "tp": 2}}))
    engine = build_engine(cfg, params=params, spec=spec)
    assert all(isinstance(i.runner, PipelineRunner) and i.runner.pp == 2 for i in engine.instances)
    assert [[d.id for d in i.runner.mesh.devices.flat] for i in engine.instances] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    result = engine.run(_requests(prompts))
    assert _ints(result.output_tokens) == reference
    assert {it.instance for it in result.iterations} == {"replica0", "replica1"}
    _no_leaks(engine.instances)


@pytest.mark.parametrize("group,expected", [
    ({"pp": 2}, {"replica0": ([0, 1], 1, 2)}),
    ({"num_instances": 2, "tp": 2, "devices": [4, 5, 6, 7]}, {"replica0": ([4, 5], 2, 1), "replica1": ([6, 7], 2, 1)}),
], ids=["one-pp2-instance", "two-tp2-replicas"])
def test_run_real_colocated_layouts(tmp_path, model, group, expected):
    """Through run_real from a config dict: completes, tokens equal one device, nothing compiles after warm-up,
    and the engine block lists every instance (role, devices, tp, pp, num_iterations)."""
    from pdjax.runtime.generate import generate
    from pdjax.serving.build import build_requests
    from pdjax.serving.run import run_real
    config = _config({"kind": "colocated", "colocated": group}, warmup=True)
    cfg = serve_config_from_dict(config)
    summary = run_real(cfg, config, str(tmp_path))
    info = summary["engine"]
    assert summary["num_completed"] == 4 and info["compiles_during_run"] == 0, info["compiled_during_run"]
    assert {n: (i["devices"], i["tp"], i["pp"]) for n, i in info["instances"].items()} == expected
    assert all(i["role"] == "colocated" and i["num_iterations"] > 0 for i in info["instances"].values())
    assert sum(i["num_iterations"] for i in info["instances"].values()) == info["num_iterations"]
    # The same requests on one device (the run's dummy weights: tiny-llama at cfg.seed).
    from pdjax.runtime.batch import Buckets
    from pdjax.runtime.runner import ModelRunner
    from pdjax.serving.build import load_weights
    spec, params = load_weights(cfg)
    one = ModelRunner(spec, params, num_pages=NUM_PAGES, page_size=PAGE_SIZE, attention_impl="reference",
                      buckets=Buckets(tokens=(BUDGET,), seqs=(8,), pages=(MAX_LEN // PAGE_SIZE,)),
                      max_model_len=MAX_LEN)
    reqs = build_requests(cfg)
    want, _ = generate(one, [r.prompt_token_ids for r in reqs], 4, chunk_size=16, token_budget=BUDGET)
    got = json.loads((tmp_path / "outputs.json").read_text())
    assert {r.request_id: w for r, w in zip(reqs, want)} == got


def test_bad_wiring_is_refused(model):
    from pdjax.config.scheduler import SchedulerConfig
    from pdjax.scheduler import make_scheduler
    from pdjax.serving.build import build_engine
    from pdjax.serving.cluster import ClusterEngine, Instance
    spec, params = model
    sched = lambda policy: make_scheduler(SchedulerConfig(policy=policy, page_size=PAGE_SIZE))  # noqa: E731
    with pytest.raises(ValueError, match="'replica0' \\(colocated\\) needs a colocated policy, got 'prefill_only'"):
        Instance("replica0", "colocated", None, sched("prefill_only"))
    with pytest.raises(ValueError, match="cannot share a cluster with prefill/decode"):
        ClusterEngine([Instance("replica0", "colocated", None, sched("sarathi")),
                       Instance("prefill0", "prefill", None, sched("prefill_only")),
                       Instance("decode0", "decode", None, sched("decode_only"))])
    with pytest.raises(ValueError, match="needs at least one decode instance"):
        ClusterEngine([Instance("prefill0", "prefill", None, sched("prefill_only"))])
    with pytest.raises(ValueError, match="async_scheduling=True runs one colocated instance"):   # at config time
        serve_config_from_dict(_config({"kind": "colocated", "colocated": {"num_instances": 2}},
                                       async_scheduling=True))
    cfg = serve_config_from_dict(_config({"kind": "colocated", "colocated": {"pp": 3}}))
    with pytest.raises(ValueError, match="deployment.colocated.pp=3"):
        build_engine(cfg, params=params, spec=spec)
