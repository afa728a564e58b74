"""Pipeline parallelism on 8 fake CPU devices: the stage split, per-stage placement, logits and greedy tokens equal to
the single-device runner (mixed ragged batches, engine runs with swap preemption and async scheduling), errors."""
import dataclasses

import jax
import numpy as np
import pytest

from pdjax.config.model_specs import get_model_spec
from pdjax.config.pipeline import (check_pipeline_parallel, layer_to_stage, relayout_plan, stage_layer_counts,
                                   stage_layer_ranges)
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.models.llama import KVCache, init_params
from pdjax.runtime import compiles
from pdjax.runtime import mesh as mesh_lib
from pdjax.runtime.batch import Buckets
from pdjax.runtime.generate import generate
from pdjax.runtime.mesh import make_mesh
from pdjax.runtime.pipeline import PipelineRunner, merge_kv_cache, split_kv_cache
from pdjax.runtime.runner import ModelRunner
from pdjax.scheduler import Request, make_scheduler
from pdjax.scheduler.output import SchedulerOutput
from pdjax.serving.engine import ColocatedEngine
from test_model import sched

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake CPU) devices")

TINY = get_model_spec("tiny-llama")   # 2 layers, hidden 128, 4 heads, 2 kv heads


def layers(n, base=TINY):
    return dataclasses.replace(base, name=f"{base.name}-{n}l", num_layers=n)


# ------------------------------------------------------------------------------------------------------------
# The stage split (pure Python)
# ------------------------------------------------------------------------------------------------------------

def test_stage_split_follows_vllm_rule():
    assert stage_layer_counts(4, 2) == (2, 2)
    assert stage_layer_counts(3, 2) == (2, 1)          # remainder skips the last stage
    assert stage_layer_counts(5, 4) == (1, 1, 2, 1)    # remainder <= pp-2: middle stages only
    assert stage_layer_counts(7, 4) == (2, 2, 2, 1)
    assert stage_layer_counts(10, 4) == (2, 3, 3, 2)
    assert stage_layer_counts(32, 3) == (11, 11, 10)
    assert stage_layer_counts(3, 3) == (1, 1, 1) and stage_layer_counts(6, 1) == (6,)
    assert stage_layer_ranges(5, 4) == ((0, 1), (1, 2), (2, 4), (4, 5))
    assert layer_to_stage(5, 4) == (0, 1, 2, 2, 3)
    for n in range(1, 40):
        for pp in range(1, n + 1):
            ranges = stage_layer_ranges(n, pp)
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a < b for a, b in ranges) and all(r[1] == q[0] for r, q in zip(ranges, ranges[1:]))
            assert max(stage_layer_counts(n, pp)) - min(stage_layer_counts(n, pp)) <= 1


def test_relayout_plan_routes_every_layer():
    # prefill pp2 (3 layers: [2, 1]) -> decode pp1 and pp3
    assert relayout_plan(3, 2, 1) == ((0, 0, 0, 0, 0), (1, 0, 1, 0, 1), (2, 1, 0, 0, 2))
    assert relayout_plan(3, 2, 3) == ((0, 0, 0, 0, 0), (1, 0, 1, 1, 0), (2, 1, 0, 2, 0))
    assert relayout_plan(4, 1, 2) == ((0, 0, 0, 0, 0), (1, 0, 1, 0, 1), (2, 0, 2, 1, 0), (3, 0, 3, 1, 1))


def test_stage_split_errors():
    with pytest.raises(ValueError, match=r"^pp=5 exceeds num_layers=4: every pipeline stage needs at least one"):
        stage_layer_counts(4, 5)
    with pytest.raises(ValueError, match=r"^pp=0, expected a positive int"):
        stage_layer_ranges(4, 0)
    with pytest.raises(ValueError, match=r"^pp=2 x tp=4 needs 8 devices, only 4 given"):
        check_pipeline_parallel(4, 2, 4, num_devices=4)


@needs_8
def test_stage_mesh_is_the_stage_slice():
    mesh = make_mesh(pp=3, tp=2)
    subs = mesh_lib.stage_meshes(mesh)
    assert [list(m.devices.flat) for m in subs] == [jax.devices()[2 * s:2 * s + 2] for s in range(3)]
    assert all(m.axis_names == mesh_lib.MESH_AXES and dict(m.shape) == {"data": 1, "stage": 1, "tensor": 2}
               for m in subs)
    with pytest.raises(ValueError, match=r"stage=3 outside \[0, 3\)"):
        mesh_lib.stage_mesh(mesh, 3)


def test_split_and_merge_kv_cache_round_trip():
    cache = KVCache(k=tuple(np.full((1, 2, 2, 1), i) for i in range(5)),
                    v=tuple(np.full((1, 2, 2, 1), 10 + i) for i in range(5)))
    parts = split_kv_cache(cache, stage_layer_ranges(5, 4))
    assert [len(p.k) for p in parts] == [1, 1, 2, 1]
    assert [int(a[0, 0, 0, 0]) for a in parts[2].v] == [12, 13]
    merged = merge_kv_cache(parts)
    assert all(a is b for a, b in zip(merged.k + merged.v, cache.k + cache.v))
    with pytest.raises(ValueError, match=r"do not cover a KV cache of 5 layers"):
        split_kv_cache(cache, stage_layer_ranges(4, 2))


# ------------------------------------------------------------------------------------------------------------
# Numerics: logits equal the single-device runner on mixed ragged batches over two steps
# ------------------------------------------------------------------------------------------------------------

BUCKETS = Buckets(tokens=(32,), seqs=(4,), pages=(4,))


def run_mixed(runner, vocab):
    """Two steps of mixed ragged batches (prefill chunks at offsets, a decode, an unsampled chunk, padding
    sequences and tokens; step 2 reads the KV step 1 wrote), then one sampled decode step."""
    rng = np.random.RandomState(0)
    a, b, c, d = (list(rng.randint(0, vocab, n)) for n in (30, 10, 11, 7))
    first = runner.execute_logits(sched([(a[:16], 0, [3, 5], True), (b[:9], 0, [7], True),
                                         (c[:6], 0, [9], False)]))
    second = runner.execute_logits(sched([(a[16:], 16, [3, 5], True), (b[9:], 9, [7], True),
                                          (c[6:], 6, [9], True), (d, 0, [11], True)]))
    ids = runner.execute(sched([([int(first[1].argmax())], 10, [7], True), (a[-1:], 29, [3, 5], True)]))
    return np.concatenate([first, second]), ids


_REFERENCE = {}


def reference(spec, params):
    if spec.name not in _REFERENCE:
        runner = ModelRunner(spec, params, num_pages=16, page_size=16, attention_impl="reference",
                             buckets=BUCKETS)
        _REFERENCE[spec.name] = run_mixed(runner, spec.vocab_size)
    return _REFERENCE[spec.name]


def check_placement(runner):
    """Each stage's params and KV live only on its sub-mesh; sub-meshes are disjoint; kv heads split on tp."""
    seen = set()
    for s, sub in enumerate(runner.stage_meshes):
        devices = set(sub.devices.flat)
        assert len(devices) == runner.tp and not devices & seen
        seen |= devices
        leaves = jax.tree_util.tree_leaves(runner.stage_params[s]) + jax.tree_util.tree_leaves(runner.kv_caches[s])
        assert leaves and all(leaf.sharding.device_set == devices for leaf in leaves)
        a, b = runner.layer_ranges[s]
        assert len(runner.stage_params[s].layers) == len(runner.kv_caches[s].k) == b - a
        k0 = runner.kv_caches[s].k[0]
        assert k0.addressable_shards[0].data.shape[0] == runner.spec.num_kv_heads // runner.tp
    assert (runner.stage_params[0].embed is not None) and runner.stage_params[-1].final_norm is not None
    if runner.pp > 1:
        assert runner.stage_params[0].final_norm is None and all(p.embed is None for p in runner.stage_params[1:-1])


@needs_8
@pytest.mark.parametrize("spec,pp,tp", [
    (TINY, 2, 1),
    (layers(4), 4, 1),
    (layers(3), 2, 1),                               # uneven: [2, 1]
    (TINY, 2, 2),                                    # tp2 x pp2
    (layers(5), 4, 2),                               # uneven [1, 1, 2, 1] on all 8 devices
    (get_model_spec("tiny-qwen"), 2, 2),             # tied embeddings (lm_head from embed on the last stage), biases
], ids=["pp2", "pp4", "pp2-uneven", "tp2xpp2", "tp2xpp4-uneven", "qwen-tied-tp2xpp2"])
def test_pipeline_logits_match_single_device(spec, pp, tp):
    params = init_params(spec, 1)
    want, want_ids = reference(spec, params)
    runner = PipelineRunner(spec, params, num_pages=16, page_size=16, attention_impl="reference",
                            buckets=BUCKETS, mesh=make_mesh(jax.devices()[:pp * tp], dp=1, pp=pp, tp=tp))
    got, ids = run_mixed(runner, spec.vocab_size)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_array_equal(ids, want_ids)
    check_placement(runner)
    # One compile per (function, bucket) as ModelRunner counts them; each stage compiled each shape once.
    assert sorted(runner.traces) == [("logits", (32, 4, 4)), ("step", (32, 4, 4))]
    assert len(runner.stage_traces) == len(set(runner.stage_traces)) == (pp - 1) + 2


@needs_8
def test_kv_moves_between_pipeline_layouts_by_layer():
    """Prefill on pp2 (3 layers as [2, 1]), route every layer's KV to the stage holding it on pp1 and on pp3
    (relayout_plan), decode there: the logits equal decoding on the prefill runner."""
    spec = layers(3)
    params = init_params(spec, 4)
    buckets = Buckets(tokens=(32,), seqs=(2,), pages=(4,))

    def make(pp, devices):
        return PipelineRunner(spec, params, num_pages=8, page_size=16, attention_impl="reference",
                              buckets=buckets, mesh=make_mesh(devices, pp=pp))

    prompt = list(np.random.RandomState(5).randint(0, spec.vocab_size, 21))
    src = make(2, jax.devices()[:2])
    src.execute(sched([(prompt[:20], 0, [2, 6], False)]))
    decode = sched([(prompt[20:], 20, [2, 6], True)])
    for dst_pp, devices in ((1, jax.devices()[2:3]), (3, jax.devices()[3:6])):
        dst = make(dst_pp, devices)
        with pytest.raises(ValueError, match=r"^KV of layer 0 is placed as .*, expected stage 0's"):
            dst.kv_cache = src.kv_cache      # not moved: still on the prefill runner's devices
        moved_k, moved_v = [], []
        for _, ss, si, ds, _ in relayout_plan(spec.num_layers, 2, dst_pp):
            target = mesh_lib.kv_cache_sharding(dst.stage_meshes[ds], spec)
            moved_k.append(jax.device_put(src.kv_caches[ss].k[si], target))
            moved_v.append(jax.device_put(src.kv_caches[ss].v[si], target))
        dst.kv_cache = KVCache(k=tuple(moved_k), v=tuple(moved_v))
        check_placement(dst)
        got = dst.execute_logits(decode)
        want = src.execute_logits(decode)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# ------------------------------------------------------------------------------------------------------------
# Greedy tokens: generate and the colocated engine (policies, swap preemption, async scheduling)
# ------------------------------------------------------------------------------------------------------------

MAX_LEN, PAGE = 64, 16
ENGINE_BUCKETS = Buckets(tokens=(16, 64), seqs=(4,), pages=(MAX_LEN // PAGE,))


def _prompts():
    rng = np.random.default_rng(0)
    return [list(map(int, rng.integers(1, 500, size=n))) for n in (5, 17, 33, 40)]


@pytest.fixture(scope="module")
def engine_case():
    params = init_params(TINY, 3)
    single = ModelRunner(TINY, params, num_pages=32, page_size=PAGE, buckets=ENGINE_BUCKETS, max_model_len=MAX_LEN,
                         attention_impl="reference")
    expected, _ = generate(single, _prompts(), 12, chunk_size=16, token_budget=64)
    pipe = PipelineRunner(TINY, params, num_pages=32, page_size=PAGE, buckets=ENGINE_BUCKETS,
                          max_model_len=MAX_LEN, attention_impl="reference",
                          mesh=make_mesh(jax.devices()[:4], pp=2, tp=2))
    return pipe, expected


def _serve(runner, policy, budget, *, num_pages=32, preemption="recompute", async_scheduling=False):
    cfg = SchedulerConfig(policy=policy, token_budget=budget, max_num_seqs=4, max_model_len=MAX_LEN, page_size=PAGE,
                          num_pages=num_pages, preemption_mode=preemption,
                          num_host_pages=32 if preemption == "swap" else 0)
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=12), 0.0) for i, p in enumerate(_prompts())]
    result = ColocatedEngine(runner, make_scheduler(cfg), async_scheduling=async_scheduling).run(reqs)
    assert all(r.finish_reason == "length" for r in result.requests)
    return result, [result.output_tokens[f"r{i}"] for i in range(len(reqs))]


@needs_8
def test_generate_on_pipeline_matches_single_device(engine_case):
    pipe, expected = engine_case
    got, _ = generate(pipe, _prompts(), 12, chunk_size=16, token_budget=64)
    assert got == expected


@needs_8
@pytest.mark.parametrize("policy,budget,preemption,async_scheduling", [
    ("sarathi", 16, "recompute", False),
    ("vllm_v0", 64, "recompute", False),
    ("sarathi", 16, "recompute", True),      # next tokens fed from the last stage's device output (prev)
])
def test_engine_on_pipeline_matches_single_device(engine_case, policy, budget, preemption, async_scheduling):
    pipe, expected = engine_case
    _, got = _serve(pipe, policy, budget, preemption=preemption, async_scheduling=async_scheduling)
    assert got == expected


@needs_8
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_engine_preemption_on_pipeline_keeps_tokens(engine_case, mode):
    pipe, expected = engine_case
    # 8 pages cannot hold the four requests at once (they need 11): preemption must happen.
    result, got = _serve(pipe, "sarathi", 16, num_pages=8, preemption=mode)
    assert sum(r.num_preemptions for r in result.requests) > 0
    assert got == expected


@needs_8
def test_swap_out_then_in_elsewhere_on_pipeline(engine_case):
    pipe, _ = engine_case
    seq = list(np.random.RandomState(0).randint(0, TINY.vocab_size, 21))
    pipe.execute(sched([(seq[:20], 0, [1, 2], False)]))
    want = pipe.execute_logits(sched([(seq[20:], 20, [1, 2], True)]))
    pipe.execute(sched([(seq[:20], 0, [4, 5], False)]))
    assert pipe.execute(SchedulerOutput(step=1, swap_out=[(0, 4), (1, 5)])).shape == (0,)
    assert pipe.host_pages[0][0].shape == (TINY.num_layers, TINY.num_kv_heads, PAGE, TINY.head_dim)
    pipe.execute(sched([(list(range(30)), 0, [4, 5], False)]))   # clobber the device pages
    swap_in = sched([(seq[20:], 20, [9, 12], True)])
    swap_in.swap_in = [(0, 9), (1, 12)]
    got = pipe.execute_logits(swap_in)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    pipe.free_host_slots([0, 1])
    assert not pipe.host_pages


@needs_8
def test_batches_in_flight_equal_sequential(engine_case):
    pipe, _ = engine_case
    rng = np.random.RandomState(9)
    outs = [sched([(list(rng.randint(0, 500, 10)), 0, [2 * i], True)]) for i in range(4)]
    want = [pipe.execute(o) for o in outs]
    handles = [pipe.dispatch(o) for o in outs]       # four batches in flight through two stages
    assert [pipe.collect(h).tolist() for h in handles] == [w.tolist() for w in want]


@needs_8
def test_no_compile_after_warmup(engine_case):
    pipe, expected = engine_case
    assert pipe.warmup(swap=True) > 0
    n = pipe.compile_count
    assert n <= 2 * ENGINE_BUCKETS.num_shapes            # step and logits functions, one entry per bucket
    assert sorted(k for kind, k in pipe.traces if kind == "step") == sorted(ENGINE_BUCKETS.all_shapes())
    assert {(s, k) for s, kind, k in pipe.stage_traces if kind != "logits"} == \
        {(s, k) for s in range(pipe.pp) for k in ENGINE_BUCKETS.all_shapes()}
    mark = compiles.count()
    # Swap preemption and async scheduling (sampled ids fed back from the last stage to stage 0).
    result, got = _serve(pipe, "sarathi", 16, num_pages=8, preemption="swap", async_scheduling=True)
    assert sum(r.num_preemptions for r in result.requests) > 0 and got == expected
    assert compiles.since(mark) == [] and pipe.compile_count == n


# ------------------------------------------------------------------------------------------------------------
# Bad configurations
# ------------------------------------------------------------------------------------------------------------

def _make(spec, mesh):
    return PipelineRunner(spec, init_params(TINY, 0), num_pages=4, page_size=16, attention_impl="reference",
                          mesh=mesh)


@needs_8
def test_bad_pipeline_configs_fail_with_one_line_errors():
    def fails(pattern, spec, mesh_fn):
        with pytest.raises(ValueError, match=pattern) as info:
            _make(spec, mesh_fn())
        assert "\n" not in str(info.value)

    fails(r"^pp=4 exceeds num_layers=2", TINY, lambda: make_mesh(pp=4))
    fails(r"num_kv_heads=2 does not divide by tensor parallelism tp=4", TINY, lambda: make_mesh(pp=2, tp=4))
    fails(r"num_heads=6 does not divide by tensor parallelism tp=4",
          dataclasses.replace(TINY, num_heads=6, num_kv_heads=6), lambda: make_mesh(pp=2, tp=4))
    fails(r"intermediate_size=390 does not divide by tensor parallelism tp=4",
          dataclasses.replace(TINY, num_kv_heads=4, intermediate_size=390), lambda: make_mesh(pp=2, tp=4))
    fails(r"^mesh data=2: a PipelineRunner is one replica", TINY, lambda: make_mesh(dp=2, pp=2))
    fails(r"^mesh dp=1 x pp=4 x tp=4 needs 16 devices, only 8 given", TINY, lambda: make_mesh(pp=4, tp=4))
    fails(r"^params have 2 layers, spec 'tiny-llama-3l' has num_layers=3", layers(3), lambda: make_mesh(pp=2))
