"""No XLA compile after warm-up, counted by JAX itself (pdjax.runtime.compiles), in every mode the engine runs:
sync and async scheduling, recompute and swap preemption, the disaggregated engine's KV transfers. A compile that
escapes anyway is flagged on its iteration, or raises with fail_on_compile."""
import numpy as np
import pytest

from pdjax.config.buckets import Buckets
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.models.checkpoint import load_model
from pdjax.runtime import compiles
from pdjax.runtime.runner import SWAP_BUCKETS, ModelRunner, swap_chunks
from pdjax.scheduler import Request, make_scheduler
from pdjax.serving.engine import ColocatedEngine

MAX_LEN, PAGE = 128, 16


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-llama", seed=1)


def _runner(model, **kw):
    spec, params = model
    buckets = Buckets(tokens=(16, 64), seqs=(4, 8), pages=(MAX_LEN // PAGE,))
    return ModelRunner(spec, params, num_pages=kw.pop("num_pages", 14), page_size=PAGE, buckets=buckets,
                       max_model_len=MAX_LEN, **kw)


def _requests(n=6, max_tokens=10):
    rng = np.random.default_rng(0)
    return [Request(f"r{i}", list(map(int, rng.integers(1, 500, size=10 + 9 * i))),
                    SamplingParams(max_tokens=max_tokens), 0.0) for i in range(n)]


def _scheduler(preemption):
    return make_scheduler(SchedulerConfig(
        policy="sarathi", token_budget=64, max_num_seqs=8, max_model_len=MAX_LEN, page_size=PAGE, num_pages=14,
        preemption_mode=preemption, num_host_pages=64 if preemption == "swap" else 0))


def test_the_counter_sees_a_compile_that_reuses_a_trace():
    """A jit cache miss caused only by commitment recompiles without retracing; the counter must see it."""
    import jax
    import jax.numpy as jnp

    traces = []

    @jax.jit
    def f(x):
        traces.append(1)
        return x * 2

    committed = jax.device_put(jnp.ones(3), jax.devices()[0])
    mark = compiles.count()
    f(np.ones(3, np.float32)).block_until_ready()
    f(committed).block_until_ready()   # same avals, committed: a new executable from the same trace
    assert len(traces) == 1
    assert [e.fun_name for e in compiles.since(mark)] == ["jit(f)", "jit(f)"]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_no_compile_after_warmup(model, async_scheduling, preemption):
    runner = _runner(model)
    runner.warmup(swap=preemption == "swap")
    engine = ColocatedEngine(runner, _scheduler(preemption), async_scheduling=async_scheduling,
                             compile_counter=compiles.count, fail_on_compile=True)
    mark = compiles.count()
    result = engine.run(_requests())
    assert compiles.since(mark) == []
    assert all(it.num_compiles == 0 for it in result.iterations)
    assert sum(r.num_preemptions for r in result.requests) > 0, "the case must exercise preemption"
    assert all(r.finish_reason == "length" for r in result.requests)


def test_a_compile_after_warmup_is_flagged_or_raises(model):
    runner = _runner(model)      # no warm-up: the first iterations compile
    result = ColocatedEngine(runner, _scheduler("recompute"), compile_counter=compiles.count).run(_requests(2, 3))
    assert result.iterations[0].num_compiles >= 1
    assert sum(it.num_compiles for it in result.iterations) >= 1
    with pytest.raises(RuntimeError, match="XLA compile"):
        ColocatedEngine(_runner(model), _scheduler("recompute"), compile_counter=compiles.count,
                        fail_on_compile=True).run(_requests(2, 3))


def test_swap_chunks_cover_any_count_with_two_sizes():
    for n in (0, 1, 7, 8, 9, 64, 65, 200):
        chunks = swap_chunks(n)
        assert sum(b - a for a, b, _ in chunks) == n
        assert all(size in SWAP_BUCKETS and size >= b - a for a, b, size in chunks)
        assert [a for a, _, _ in chunks] == [sum(b - a for a, b, _ in chunks[:i]) for i in range(len(chunks))]


def test_swap_of_many_pages_round_trips(model):
    """More pages than the largest swap bucket move in several copies and come back intact."""
    runner = _runner(model, num_pages=80)
    k0 = np.asarray(runner.kv_cache.k[0]).copy()
    rng = np.random.default_rng(1)
    runner.kv_cache = runner.kv_cache.__class__(
        k=tuple(a + rng.normal(size=a.shape).astype(a.dtype) for a in runner.kv_cache.k), v=runner.kv_cache.v)
    before = np.asarray(runner.kv_cache.k[1]).copy()
    pages = list(range(70))
    runner.swap([(100 + p, p) for p in pages], [])
    runner.swap([], [(100 + p, 79 - p) for p in range(9)])   # 9 pages back, to other device pages
    after = np.asarray(runner.kv_cache.k[1])
    for p in range(9):
        np.testing.assert_array_equal(after[:, 79 - p], before[:, p])
    assert k0.shape == after.shape
