"""Disaggregated engine on 8 fake CPU devices (tiny-mha, dummy weights): greedy outputs equal the colocated
engine and `generate`, across TP and pipeline layouts (prefill tp2 x pp2 -> decode tp1 x pp2, pp2 -> pp1,
pp1 -> pp2), N instances, decode backpressure and decode-side rejection, with no page leaks and (after warm-up)
no compiles; plus the deployment config's start-up validation (no JAX needed there)."""
import numpy as np
import pytest

from pdjax.config.deployment import (DeploymentConfig, InstanceGroupConfig, deployment_from_dict,
                                     instance_scheduler_config, validate_deployment)
from pdjax.config.model_specs import get_model_spec
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.config.serving import serve_config_from_dict

PAGE_SIZE = 8
MAX_LEN = 64
BUDGET = 32
PROMPT_LENS = (5, 8, 16, 17, 33, 40)   # partial pages, exact page boundaries, multi-chunk prompts
MAX_TOKENS = (4, 1, 6, 3, 5, 2)         # max_tokens=1 finishes on the prefill side (no transfer)
EXPECTED_LENGTHS = {f"r{i}": m for i, m in enumerate(MAX_TOKENS)}


# ---------------------------------------------------------------------------------------------- config (no JAX)
def test_deployment_default_is_colocated_and_parses_from_a_config_dict():
    base = {"model": {"checkpoint": "tiny-mha"}, "workload": {"preset": "chat"}}
    assert serve_config_from_dict(base).deployment.kind == "colocated"
    cfg = serve_config_from_dict({**base, "deployment": {
        "kind": "disaggregated", "router": "least_loaded",
        "prefill": {"tp": 2, "token_budget": 128}, "decode": {"num_instances": 2, "tp": 1, "devices": [6, 7]}}})
    dep = cfg.deployment
    assert (dep.kind, dep.prefill.tp, dep.decode.devices) == ("disaggregated", 2, (6, 7))
    assert dep.device_assignment(8) == {"prefill0": (0, 1), "decode0": (6,), "decode1": (7,)}
    sched = instance_scheduler_config(SchedulerConfig(token_budget=64, max_num_seqs=16), dep.prefill, "prefill")
    assert (sched.policy, sched.token_budget, sched.max_num_seqs) == ("prefill_only", 128, 16)
    assert instance_scheduler_config(SchedulerConfig(), dep.decode, "decode").policy == "decode_only"


@pytest.mark.parametrize("block,message", [
    ({"kind": "split"}, "deployment.kind='split'"),
    ({"router": "random"}, "deployment.router='random'"),
    ({"prefill": {"tp": 0}}, "deployment.prefill.tp=0, expected a positive int"),
    ({"decode": {"num_pages": -1}}, "deployment.decode.num_pages=-1"),
    ({"decode": {"tp": 2, "devices": [1]}}, "has 1 entries, expected"),
    ({"decode": {"devices": [1, 1], "num_instances": 2}}, "lists a device twice"),
    ({"prefill": {"chips": 2}}, "unknown config key.*deployment.prefill.chips"),
])
def test_bad_deployment_blocks_fail_naming_the_key(block, message):
    with pytest.raises(ValueError, match=message):
        deployment_from_dict(block)


def test_start_up_validation_against_model_and_machine():
    spec = get_model_spec("tiny-mha")   # 4 heads, 4 kv heads
    disagg = lambda **kw: DeploymentConfig(kind="disaggregated", **kw)  # noqa: E731
    with pytest.raises(ValueError, match="needs 10 devices.*only 8 available"):
        validate_deployment(disagg(prefill=InstanceGroupConfig(tp=4, num_instances=2),
                                   decode=InstanceGroupConfig(tp=2)), spec, 8)
    with pytest.raises(ValueError, match="device 1 is in both deployment.prefill.devices and deployment.decode"):
        validate_deployment(disagg(prefill=InstanceGroupConfig(tp=2, devices=(0, 1)),
                                   decode=InstanceGroupConfig(devices=(1,))), spec, 8)
    with pytest.raises(ValueError, match="lists device 9, only 8 available"):
        validate_deployment(disagg(decode=InstanceGroupConfig(devices=(9,))), spec, 8)
    with pytest.raises(ValueError, match="deployment.decode.tp=3 does not divide num_heads=4"):
        validate_deployment(disagg(decode=InstanceGroupConfig(tp=3)), spec, 8)
    # Automatic placement fills the devices explicit groups left free, in order.
    ok = validate_deployment(disagg(prefill=InstanceGroupConfig(num_instances=2, devices=(0, 5)),
                                    decode=InstanceGroupConfig(tp=4)), spec, 8)
    assert ok == {"prefill0": (0,), "prefill1": (5,), "decode0": (1, 2, 3, 4)}


# ---------------------------------------------------------------------------------------------- real engine
@pytest.fixture(scope="module")
def model(tiny_mha):
    return tiny_mha


@pytest.fixture(scope="module")
def prompts(model):
    spec, _ = model
    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(0, spec.vocab_size, n)] for n in PROMPT_LENS]


def _buckets():
    from pdjax.runtime.batch import Buckets
    return Buckets(tokens=(BUDGET,), seqs=(8,), pages=(MAX_LEN // PAGE_SIZE,))   # one compiled shape per runner


@pytest.fixture(scope="module")
def runners(model):
    """Runners reused by every engine test (their caches keep stale KV from earlier tests: harmless, the
    engine must overwrite or mask it). Keys: (role-ish name) -> runner on its own devices."""
    import jax
    from pdjax.runtime.mesh import make_mesh
    from pdjax.runtime.runner import ModelRunner
    spec, params = model
    devs = jax.devices()

    def make(ids=None, tp=1):
        mesh = None if ids is None else make_mesh([devs[i] for i in ids], tp=tp)
        return ModelRunner(spec, params, num_pages=48, page_size=PAGE_SIZE, buckets=_buckets(),
                           attention_impl="reference", mesh=mesh, max_model_len=MAX_LEN)

    return {"plain": make(), "p_tp2": make((0, 1), 2), "d_tp1": make((2,), 1), "p_tp1": make((3,), 1),
            "d_tp2": make((4, 5), 2)}


@pytest.fixture(scope="module")
def pipeline_runners(model):
    """PipelineRunners (pp > 1) for transfers between pipeline layouts; devices disjoint within each pairing
    below (and from runners["d_tp1"] on device 2 only where paired with it)."""
    import jax
    from pdjax.runtime.mesh import make_mesh
    from pdjax.runtime.pipeline import PipelineRunner
    spec, params = model
    devs = jax.devices()

    def make(ids, pp, tp):
        return PipelineRunner(spec, params, num_pages=48, page_size=PAGE_SIZE, buckets=_buckets(),
                              attention_impl="reference", mesh=make_mesh([devs[i] for i in ids], pp=pp, tp=tp),
                              max_model_len=MAX_LEN)

    return {"p_tp2_pp2": make((4, 5, 6, 7), 2, 2), "d_tp1_pp2": make((0, 1), 2, 1), "p_pp2": make((6, 7), 2, 1)}


@pytest.fixture(scope="module")
def reference(runners, prompts):
    from pdjax.runtime.generate import generate
    tokens, _ = generate(runners["plain"], prompts, max(MAX_TOKENS), chunk_size=16, token_budget=BUDGET)
    return {f"r{i}": tokens[i][:m] for i, m in enumerate(MAX_TOKENS)}


def _requests(prompts, gap=0.0):
    from pdjax.scheduler import Request
    return [Request(f"r{i}", p, SamplingParams(max_tokens=m), i * gap)
            for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS))]


def _sched(policy, **kw):
    from pdjax.scheduler import make_scheduler
    base = dict(policy=policy, token_budget=BUDGET, max_num_seqs=8, max_model_len=MAX_LEN, page_size=PAGE_SIZE,
                num_pages=48, watermark=0.0)
    return make_scheduler(SchedulerConfig(**{**base, **kw}))


def _instance(name, runner, **sched_kw):
    from pdjax.serving.disagg import Instance
    role = name.rstrip("0123456789")
    return Instance(name, role, runner, _sched(f"{role}_only", **sched_kw))


def _ints(tokens):
    return {rid: [int(t) for t in toks] for rid, toks in tokens.items()}


def _check_records(result, lengths):
    for rec in result.requests:
        assert rec.finish_reason == "length"
        assert rec.num_output_tokens == lengths[rec.request_id] == len(rec.token_times)
        assert rec.first_token_time == rec.token_times[0] >= rec.first_scheduled_time >= rec.arrival_time
        assert rec.token_times == sorted(rec.token_times)


def test_colocated_engine_matches_generate(runners, prompts, reference):
    from pdjax.serving.engine import ColocatedEngine
    result = ColocatedEngine(runners["plain"], _sched("sarathi")).run(_requests(prompts, gap=0.01))
    assert _ints(result.output_tokens) == reference


@pytest.mark.parametrize("src,dst", [("p_tp2", "d_tp1"), ("p_tp1", "d_tp2")])
def test_disaggregated_matches_generate_across_tp_layouts(runners, prompts, reference, src, dst, model):
    from pdjax.serving.disagg import DisaggregatedEngine
    spec, _ = model
    prefill, decode = _instance("prefill0", runners[src]), _instance("decode0", runners[dst])
    seen = []
    engine = DisaggregatedEngine([prefill], [decode], on_token=lambda rid, tok, t: seen.append((rid, tok)))
    result = engine.run(_requests(prompts, gap=0.01))
    assert _ints(result.output_tokens) == reference
    _check_records(result, EXPECTED_LENGTHS)
    # The first token comes from the prefill instance, the rest from the decode instance.
    by_instance = {it.instance for it in result.iterations}
    assert by_instance == {"prefill0", "decode0"}
    assert all(it.num_decode_tokens == 0 for it in result.iterations if it.instance == "prefill0")
    assert all(it.num_prefill_tokens == 0 for it in result.iterations if it.instance == "decode0")
    assert sum(it.num_prefill_tokens for it in result.iterations) == sum(PROMPT_LENS)
    assert sum(it.num_decode_tokens for it in result.iterations) == sum(m - 1 for m in MAX_TOKENS)
    assert len(seen) == sum(MAX_TOKENS)
    # One transfer per request that needs more than its first token; bytes by the KV formula.
    moved = {t.request_id: t for t in result.transfers}
    assert sorted(moved) == [f"r{i}" for i, m in enumerate(MAX_TOKENS) if m > 1]
    for t in result.transfers:
        n = PROMPT_LENS[int(t.request_id[1:])]
        assert t.num_tokens == n and t.num_pages == -(-n // PAGE_SIZE)
        assert t.kv_bytes == 2 * spec.num_layers * n * spec.num_kv_heads * spec.head_dim * 4
        assert t.moved_bytes >= t.num_pages * PAGE_SIZE * t.kv_bytes // n
        assert (t.src, t.dst) == ("prefill0", "decode0")
    # Nothing held or leaked on either side.
    assert prefill.scheduler.num_held == 0 and not engine._staged
    for inst in (prefill, decode):
        bm = inst.scheduler.block_manager
        assert bm.num_free_pages == inst.scheduler.config.num_pages


@pytest.mark.parametrize("src,dst", [("p_tp2_pp2", "d_tp1_pp2"), ("p_pp2", "d_tp1"), ("p_tp1", "d_tp1_pp2")],
                         ids=["tp2xpp2->tp1xpp2", "pp2->pp1", "pp1->pp2"])
def test_disaggregated_matches_generate_across_pipeline_layouts(runners, pipeline_runners, prompts, reference,
                                                               src, dst):
    """Every layer's KV goes to the decode stage holding it, resharded to that stage's TP layout; greedy tokens
    equal generate on one device (and the colocated engine, test above); no page leaks on either side."""
    from pdjax.runtime import compiles
    from pdjax.serving.disagg import DisaggregatedEngine
    pick = lambda key: pipeline_runners.get(key) or runners[key]  # noqa: E731
    prefill, decode = _instance("prefill0", pick(src)), _instance("decode0", pick(dst))
    engine = DisaggregatedEngine([prefill], [decode], compile_counter=compiles.count, fail_on_compile=True)
    for inst in engine.instances:
        inst.runner.warmup()
    engine.warmup_transfers(MAX_LEN)
    result = engine.run(_requests(prompts, gap=0.01))     # fail_on_compile: nothing compiles mid-run
    assert _ints(result.output_tokens) == reference
    _check_records(result, EXPECTED_LENGTHS)
    assert sorted(t.request_id for t in result.transfers) == [f"r{i}" for i, m in enumerate(MAX_TOKENS) if m > 1]
    assert {it.instance for it in result.iterations} == {"prefill0", "decode0"}
    assert prefill.scheduler.num_held == 0 and not engine._staged
    for inst in (prefill, decode):
        assert inst.scheduler.block_manager.num_free_pages == inst.scheduler.config.num_pages


def test_two_prefill_and_two_decode_instances_round_robin(runners, prompts, reference):
    from pdjax.serving.disagg import DisaggregatedEngine
    prefill = [_instance("prefill0", runners["p_tp2"]), _instance("prefill1", runners["p_tp1"])]
    decode = [_instance("decode0", runners["d_tp1"]), _instance("decode1", runners["d_tp2"])]
    result = DisaggregatedEngine(prefill, decode, router="round_robin").run(_requests(prompts))
    assert _ints(result.output_tokens) == reference
    assert {it.instance for it in result.iterations} == {"prefill0", "prefill1", "decode0", "decode1"}
    assert {t.src for t in result.transfers} == {"prefill0", "prefill1"}
    assert {t.dst for t in result.transfers} == {"decode0", "decode1"}


def test_small_decode_pool_backpressure_finishes_everything(runners, prompts, reference):
    from pdjax.serving.disagg import DisaggregatedEngine
    decode_pages = 8   # 64 tokens: at most ~2 of the 5 handed-off requests fit at once
    prefill = _instance("prefill0", runners["p_tp2"])
    decode = _instance("decode0", runners["d_tp1"], num_pages=decode_pages)
    waiting = []
    engine = DisaggregatedEngine([prefill], [decode], overlap=False,   # the non-overlapped loop, too
                                 on_token=lambda rid, tok, t: waiting.append(decode.scheduler.num_waiting))
    result = engine.run(_requests(prompts))
    assert _ints(result.output_tokens) == reference
    _check_records(result, EXPECTED_LENGTHS)
    assert max(waiting) > 0, "the decode pool never pushed back: the test does not exercise backpressure"
    assert max(it.num_seqs for it in result.iterations if it.instance == "decode0") < 5
    assert decode.scheduler.block_manager.num_free_pages == decode_pages and prefill.scheduler.num_held == 0


def test_decode_side_rejection_frees_prefill_pages(runners, prompts):
    from pdjax.serving.disagg import DisaggregatedEngine
    prefill = _instance("prefill0", runners["p_tp1"])
    decode = _instance("decode0", runners["d_tp1"], max_model_len=20)   # 33 + 1 tokens do not fit
    reqs = _requests(prompts)
    result = DisaggregatedEngine([prefill], [decode]).run([reqs[0], reqs[4]])
    recs = {r.request_id: r for r in result.requests}
    assert recs["r0"].finish_reason == "length" and recs["r4"].finish_reason == "rejected"
    assert "max_model_len=20" in reqs[4].reject_reason
    assert [t.request_id for t in result.transfers] == ["r0"]
    assert prefill.scheduler.num_held == 0
    assert prefill.scheduler.block_manager.num_free_pages == prefill.scheduler.config.num_pages


def test_engine_rejects_bad_wiring(runners):
    from pdjax.serving.disagg import DisaggregatedEngine, Instance
    with pytest.raises(ValueError, match="needs a 'decode_only' scheduler"):
        Instance("decode0", "decode", runners["d_tp1"], _sched("sarathi"))
    with pytest.raises(ValueError, match="at least one decode instance"):
        DisaggregatedEngine([_instance("prefill0", runners["p_tp1"])], [])
    with pytest.raises(ValueError, match="same page_size"):
        DisaggregatedEngine([_instance("prefill0", runners["p_tp1"])],
                            [_instance("decode0", runners["d_tp1"], page_size=16)])


def test_build_from_serve_config(model, prompts, reference):
    """The config path: deployment block -> validated device assignment -> runners on their meshes."""
    from pdjax.serving.build import build_disaggregated_engine
    spec, params = model
    cfg = serve_config_from_dict({
        "model": {"checkpoint": "tiny-mha", "attention_impl": "reference"}, "workload": {"preset": "chat"},
        "engine": {"token_buckets": [BUDGET], "seq_buckets": [8], "page_buckets": [MAX_LEN // PAGE_SIZE]},
        "scheduler": {"token_budget": BUDGET, "max_num_seqs": 8, "max_model_len": MAX_LEN,
                      "page_size": PAGE_SIZE, "num_pages": 48},
        "deployment": {"kind": "disaggregated", "prefill": {"tp": 4, "devices": [4, 5, 6, 7]},
                       "decode": {"tp": 2, "num_pages": 40}}})
    engine = build_disaggregated_engine(cfg, params=params, spec=spec)
    (p,), (d,) = engine.prefill, engine.decode
    assert [x.id for x in p.runner.mesh.devices.flat] == [4, 5, 6, 7]
    assert [x.id for x in d.runner.mesh.devices.flat] == [0, 1]
    assert d.scheduler.config.num_pages == 40 and d.runner.num_pages == 40
    result = engine.run(_requests(prompts))
    assert _ints(result.output_tokens) == reference


def test_transfer_warmup_compiles_every_size_up_front_and_is_harmless(runners, prompts, reference):
    from pdjax.serving import kv_transfer
    from pdjax.serving.disagg import DisaggregatedEngine
    engine = DisaggregatedEngine([_instance("prefill0", runners["p_tp1"])], [_instance("decode0", runners["d_tp2"])])
    assert engine.warmup_transfers(MAX_LEN) > 0
    compiled = (kv_transfer.gather_kv_pages._cache_size(), kv_transfer._scatter_donated._cache_size())
    result = engine.run(_requests(prompts))
    assert _ints(result.output_tokens) == reference     # the junk warm-up pages never leak into outputs
    assert (kv_transfer.gather_kv_pages._cache_size(), kv_transfer._scatter_donated._cache_size()) == compiled


def test_least_loaded_router_picks_the_emptiest_instance():
    from pdjax.scheduler import Request
    from pdjax.scheduler.routing import InstanceRouter as Router
    from pdjax.serving.disagg import Instance
    prefill = [Instance(f"prefill{i}", "prefill", None, _sched("prefill_only")) for i in range(2)]
    router = Router("least_loaded", prefill)
    req = lambda rid, n: Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=2), 0.0)  # noqa: E731
    assert router.pick() is prefill[0]                    # ties: the first
    prefill[0].scheduler.add_request(req("a", 40))
    assert router.pick() is prefill[1]
    prefill[1].scheduler.add_request(req("b", 20))
    assert router.pick() is prefill[1]                    # 20 prompt tokens to prefill < 40
    prefill[1].scheduler.add_request(req("c", 30))
    assert router.pick() is prefill[0]                    # 50 > 40
    rr = Router("round_robin", prefill)
    assert [rr.pick().name for _ in range(3)] == ["prefill0", "prefill1", "prefill0"]
    with pytest.raises(ValueError, match="router='random'"):
        Router("random", prefill)


def test_run_real_with_a_disaggregated_deployment_writes_the_run_outputs(tmp_path):
    import csv
    import json
    from pdjax.serving.run import run_real
    config = {
        "model": {"checkpoint": "tiny-mha", "attention_impl": "reference"},
        "engine": {"mode": "offline", "warmup": False, "progress": False, "token_buckets": [BUDGET],
                   "seq_buckets": [8], "page_buckets": [MAX_LEN // PAGE_SIZE]},
        "scheduler": {"token_budget": BUDGET, "max_num_seqs": 8, "max_model_len": MAX_LEN, "page_size": PAGE_SIZE,
                      "num_pages": 48},
        "workload": {"kind": "synthetic", "prompt_len": {"kind": "fixed", "value": 20},
                     "output_len": {"kind": "fixed", "value": 3}, "num_requests": 3, "vocab_size": 256},
        "deployment": {"kind": "disaggregated", "prefill": {"devices": [6]}, "decode": {"devices": [7]}}}
    summary = run_real(serve_config_from_dict(config), config, str(tmp_path))
    engine = summary["engine"]
    assert engine["deployment"] == "disaggregated" and summary["num_completed"] == 3
    assert {n: i["devices"] for n, i in engine["instances"].items()} == {"prefill0": [6], "decode0": [7]}
    assert engine["kv_transfer"]["num_transfers"] == 3
    with open(tmp_path / "iterations.csv") as f:
        assert {row["instance"] for row in csv.DictReader(f)} == {"prefill0", "decode0"}
    assert json.loads((tmp_path / "results.json").read_text())["num_completed"] == 3
    # The generated ids per request, as a colocated run writes them (they were missing for disaggregated runs).
    outputs = json.loads((tmp_path / "outputs.json").read_text())
    with open(tmp_path / "requests.csv") as f:
        produced = {row["request_id"]: int(row["num_output_tokens"]) for row in csv.DictReader(f)}
    assert {rid: len(ids) for rid, ids in outputs.items()} == produced == {"r0": 3, "r1": 3, "r2": 3}


def test_run_real_disaggregated_pipeline_layouts_compile_nothing_after_warm_up(tmp_path):
    """prefill tp2 x pp2 -> decode tp1 x pp2 through run_real with warm-up: every step shape of every stage and
    every transfer (per-stage gathers, per-layer copies, per-stage scatters) compiled up front; tokens equal
    generate on one device."""
    import json
    from pdjax.runtime.generate import generate
    from pdjax.runtime.runner import ModelRunner
    from pdjax.serving.build import build_requests, load_weights
    from pdjax.serving.run import run_real
    config = {
        "model": {"checkpoint": "tiny-mha", "attention_impl": "reference"},
        "engine": {"mode": "offline", "warmup": True, "progress": False, "compilation_cache": False,
                   "token_buckets": [BUDGET], "seq_buckets": [8], "page_buckets": [MAX_LEN // PAGE_SIZE]},
        "scheduler": {"token_budget": BUDGET, "max_num_seqs": 8, "max_model_len": MAX_LEN, "page_size": PAGE_SIZE,
                      "num_pages": 48},
        "workload": {"kind": "synthetic", "prompt_len": {"kind": "fixed", "value": 20},
                     "output_len": {"kind": "fixed", "value": 3}, "num_requests": 3, "vocab_size": 256},
        "deployment": {"kind": "disaggregated", "prefill": {"pp": 2, "tp": 2}, "decode": {"pp": 2}}}
    cfg = serve_config_from_dict(config)
    summary = run_real(cfg, config, str(tmp_path))
    engine = summary["engine"]
    assert summary["num_completed"] == 3
    assert engine["compiles_during_run"] == 0, engine["compiled_during_run"]
    assert {n: (i["role"], i["devices"], i["pp"], i["tp"]) for n, i in engine["instances"].items()} == {
        "prefill0": ("prefill", [0, 1, 2, 3], 2, 2), "decode0": ("decode", [4, 5], 2, 1)}
    assert all(i["num_iterations"] > 0 for i in engine["instances"].values())
    assert engine["kv_transfer"]["num_transfers"] == 3
    spec, params = load_weights(cfg)
    one = ModelRunner(spec, params, num_pages=48, page_size=PAGE_SIZE, buckets=_buckets(),
                      attention_impl="reference", max_model_len=MAX_LEN)
    reqs = build_requests(cfg)
    want, _ = generate(one, [r.prompt_token_ids for r in reqs], 3, chunk_size=16, token_budget=BUDGET)
    assert json.loads((tmp_path / "outputs.json").read_text()) == {r.request_id: w for r, w in zip(reqs, want)}
