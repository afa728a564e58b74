"""Logprobs from the step (pdjax.runtime.sampling.token_logprobs, SampledTokens) against plain jnp
jax.nn.log_softmax over the dense float64 forward (tests/test_model.py), for greedy and random sampling, in
batches that mix requests asking and not asking with padding rows and prefill chunks; no recompile either way;
the same on a pipeline (pp=2) and a TP=2 runner; then through the colocated (sync and async scheduling) and the
disaggregated engines into Request.output_logprobs, the first token sampled on the prefill side."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdjax.config.model_specs import get_model_spec
from pdjax.config.sampling import MAX_LOGPROBS, SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.runtime.batch import Buckets
from pdjax.runtime.runner import ModelRunner
from pdjax.runtime.sampling import MAX_TOP_LOGPROBS, token_logprobs
from pdjax.scheduler import Request, make_scheduler
from test_model import dense_forward, model_case, sched

TINY = get_model_spec("tiny-llama")
ATOL = 2e-4     # float32 step vs float64 dense forward, logits of magnitude ~1 (tiny-llama's random init)
needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake CPU) devices")


def ref_logprobs(tensors, cfg, tokens):
    """float32 [len(tokens), V]: jax.nn.log_softmax of the dense forward's logits at every position."""
    return np.asarray(jax.nn.log_softmax(jnp.asarray(dense_forward(tensors, cfg, tokens), jnp.float32), axis=-1))


def check_row(got, ref_row, token_id, num_top):
    """One sequence's (logprob, top ids, top logprobs) against the reference row."""
    logprob, top_ids, top_lps = got
    np.testing.assert_allclose(logprob, ref_row[token_id], atol=ATOL, rtol=0)
    order = np.argsort(-ref_row, kind="stable")[:num_top]
    np.testing.assert_allclose(top_lps[:num_top], ref_row[order], atol=ATOL, rtol=0)
    np.testing.assert_allclose(ref_row[top_ids[:num_top]], ref_row[order], atol=ATOL, rtol=0)  # ties may swap
    assert list(top_lps[:num_top]) == sorted(top_lps[:num_top], reverse=True)


# ------------------------------------------------------------------------------------------- token_logprobs
@pytest.mark.parametrize("vocab", [7, 300])        # fewer ids than MAX_TOP_LOGPROBS, and more
def test_token_logprobs_matches_log_softmax(vocab):
    rng = np.random.RandomState(vocab)
    logits = jnp.asarray(rng.randn(5, vocab) * 3, jnp.float32)
    ids = jnp.asarray([0, vocab - 1, 3, 2, -2], jnp.int32)     # -2: a non-finite row's flag (clipped read)
    want = jnp.asarray([True, False, True, False, False])
    lp, top_ids, top_lps = (np.asarray(a) for a in token_logprobs(logits, ids, want, 8))
    k = min(vocab, MAX_TOP_LOGPROBS)
    assert lp.shape == (8,) and top_ids.shape == top_lps.shape == (8, k)
    ref = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for row in range(5):      # every row is computed once one asks; the host keeps the ones that asked
        np.testing.assert_allclose(lp[row], ref[row, max(int(ids[row]), 0)], atol=1e-6)
        np.testing.assert_allclose(top_lps[row], np.sort(ref[row])[::-1][:k], atol=1e-6)
        np.testing.assert_array_equal(top_ids[row], np.argsort(-ref[row], kind="stable")[:k])
    assert not lp[5:].any() and not top_ids[5:].any()           # padding rows
    none = token_logprobs(logits, ids, jnp.zeros(5, bool), 8)
    assert all(not np.asarray(a).any() for a in none)           # nobody asked: zeros, nothing computed


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 2.0, "3"])
def test_sampling_params_logprobs_range(bad):
    with pytest.raises(ValueError, match=rf"^logprobs={bad!r}, expected None or an int in \[0, 20\]$"):
        SamplingParams(logprobs=bad)
    assert SamplingParams(logprobs=0).logprobs == 0 and SamplingParams(logprobs=20).logprobs == 20


# ------------------------------------------------------------------------------------------- the step
@pytest.fixture(scope="module")
def case():
    return model_case(TINY)


def _runner(params, mesh=None, cls=ModelRunner):
    return cls(TINY, params, num_pages=64, page_size=16, attention_impl="reference", mesh=mesh,
               buckets=Buckets(tokens=(64,), seqs=(8,), pages=(4,)))


PROMPTS = [list(np.random.RandomState(i).randint(0, TINY.vocab_size, n)) for i, n in enumerate((21, 40, 9, 5))]
ASK = [SamplingParams(logprobs=5), SamplingParams(logprobs=3),
       SamplingParams(temperature=0.8, top_k=50, seed=3, logprobs=MAX_LOGPROBS), SamplingParams()]


def _steps(runner, sampling):
    """Two steps over PROMPTS: (1) seq0 whole prompt, seq1 its first chunk of 16 (no sample), seq2 whole,
    seq3 whole; (2) seq1 the chunk ending its prompt, seq0 one decode of its first token. Returns per step the
    (ids, logprob rows or None)."""
    tables = [[4 * i + j for j in range(4)] for i in range(4)]
    first = sched([(PROMPTS[0], 0, tables[0], True, sampling[0]), (PROMPTS[1][:16], 0, tables[1], False, sampling[1]),
                   (PROMPTS[2], 0, tables[2], True, sampling[2]), (PROMPTS[3], 0, tables[3], True, sampling[3])])
    handle = runner.dispatch(first)
    ids1, rows1 = runner.collect(handle), runner.collect_logprobs(handle)
    second = sched([(PROMPTS[1][16:], 16, tables[1], True, sampling[1]),
                    ([int(ids1[0])], len(PROMPTS[0]), tables[0], True, sampling[0])], step=1)
    handle = runner.dispatch(second)
    return [(ids1, rows1), (runner.collect(handle), runner.collect_logprobs(handle))]


@pytest.fixture(scope="module")
def single(case):
    params = case[0]
    runner = _runner(params)
    plain = _steps(runner, [SamplingParams(temperature=sp.temperature, top_k=sp.top_k, seed=sp.seed) for sp in ASK])
    n = runner.compile_count
    asked = _steps(runner, ASK)
    return runner, plain, asked, n


def test_step_logprobs_match_dense_forward(case, single):
    _, tensors, cfg = case
    _, _, asked, _ = single
    (ids1, rows1), (ids2, rows2) = asked
    ref0 = ref_logprobs(tensors, cfg, PROMPTS[0] + [int(ids1[0])])
    row = lambda rows, j: tuple(a[j] for a in rows)  # noqa: E731
    check_row(row(rows1, 0), ref0[len(PROMPTS[0]) - 1], ids1[0], 5)                 # greedy, whole prompt
    assert ids1[0] == np.argmax(ref0[len(PROMPTS[0]) - 1])
    check_row(row(rows1, 2), ref_logprobs(tensors, cfg, PROMPTS[2])[-1], ids1[2], MAX_LOGPROBS)   # random
    check_row(row(rows2, 0), ref_logprobs(tensors, cfg, PROMPTS[1])[-1], ids2[0], 3)  # prefill chunk end
    check_row(row(rows2, 1), ref0[-1], ids2[1], 5)                                    # decode
    assert ids1[1] == -1 and rows1[0].shape == (4,) and rows1[1].shape == (4, MAX_TOP_LOGPROBS)


def test_asking_changes_no_token_and_compiles_nothing(single):
    runner, plain, asked, n = single
    for (ids_plain, rows_plain), (ids_asked, rows_asked) in zip(plain, asked):
        np.testing.assert_array_equal(ids_plain, ids_asked)
        assert rows_plain is None and rows_asked is not None    # nobody asked: nothing read from the device
    assert runner.compile_count == n == 1                      # one bucket, asked or not


@needs_8
def test_pipeline_and_tensor_parallel_logprobs_equal_one_device(case, single):
    from pdjax.runtime.mesh import make_mesh
    from pdjax.runtime.pipeline import PipelineRunner
    devs = jax.devices()
    _, _, want, _ = single
    for runner in (_runner(case[0], make_mesh(devs[:2], pp=2), PipelineRunner),
                   _runner(case[0], make_mesh(devs[2:4], tp=2))):
        got = _steps(runner, ASK)
        for (ids_g, rows_g), (ids_w, rows_w) in zip(got, want):
            np.testing.assert_array_equal(ids_g, ids_w)
            np.testing.assert_allclose(rows_g[0], rows_w[0], atol=1e-5)
            np.testing.assert_allclose(rows_g[2], rows_w[2], atol=1e-5)


# ------------------------------------------------------------------------------------------- engines
MAX_LEN, BUDGET = 64, 32
ENGINE_PROMPTS = [PROMPTS[0], PROMPTS[1], PROMPTS[2][:7], PROMPTS[3]]      # 21, 40 (two chunks), 7, 5 tokens
ENGINE_SAMPLING = [SamplingParams(max_tokens=5, logprobs=2), SamplingParams(max_tokens=4),
                   SamplingParams(max_tokens=6, temperature=1.0, seed=11, logprobs=0),
                   SamplingParams(max_tokens=3, logprobs=MAX_LOGPROBS)]


def _requests():
    return [Request(f"r{i}", p, sp, 0.0) for i, (p, sp) in enumerate(zip(ENGINE_PROMPTS, ENGINE_SAMPLING))]


def _sched(policy):
    return make_scheduler(SchedulerConfig(policy=policy, token_budget=BUDGET, max_num_seqs=8, max_model_len=MAX_LEN,
                                          page_size=16, num_pages=64, watermark=0.0))


def check_engine_logprobs(case, reqs):
    """Each request that asked has one entry per output token, equal to the dense forward's log_softmax."""
    _, tensors, cfg = case
    for req, sp in zip(reqs, ENGINE_SAMPLING):
        assert len(req.output_token_ids) == sp.max_tokens
        if sp.logprobs is None:
            assert req.output_logprobs is None
            continue
        assert [e.token_id for e in req.output_logprobs] == req.output_token_ids
        ref = ref_logprobs(tensors, cfg, req.prompt_token_ids + req.output_token_ids)
        for i, entry in enumerate(req.output_logprobs):
            row = ref[len(req.prompt_token_ids) - 1 + i]
            assert len(entry.top) == sp.logprobs
            check_row((entry.logprob, [t for t, _ in entry.top], np.array([v for _, v in entry.top])), row,
                      entry.token_id, sp.logprobs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_colocated_engine_attaches_logprobs(case, single, async_scheduling):
    from pdjax.serving.engine import ColocatedEngine
    runner = single[0]
    reqs = _requests()
    seen = []       # at each token's report: (asked, outputs so far, logprobs entries so far)

    def on_token(rid, tok, t):
        req = reqs[int(rid[1:])]
        seen.append((req.sampling.logprobs is not None, len(req.output_token_ids), len(req.output_logprobs or ())))

    ColocatedEngine(runner, _sched("sarathi"), async_scheduling=async_scheduling, on_token=on_token).run(reqs)
    check_engine_logprobs(case, reqs)
    assert len(seen) == sum(sp.max_tokens for sp in ENGINE_SAMPLING)
    assert all(n_lp == (n_out if asked else 0) for asked, n_out, n_lp in seen)   # entries come before the report


@needs_8
def test_disaggregated_engine_carries_the_prefill_sides_first_logprob(case):
    from pdjax.runtime.mesh import make_mesh
    from pdjax.serving.disagg import DisaggregatedEngine, Instance
    devs = jax.devices()
    prefill = Instance("prefill0", "prefill", _runner(case[0], make_mesh(devs[4:5])), _sched("prefill_only"))
    decode = Instance("decode0", "decode", _runner(case[0], make_mesh(devs[5:7], tp=2)), _sched("decode_only"))
    reqs = _requests()
    DisaggregatedEngine([prefill], [decode]).run(reqs)
    check_engine_logprobs(case, reqs)


def test_scheduler_logprobs_module_imports_no_jax():
    import subprocess
    import sys
    code = ("import sys, pdjax.scheduler.logprobs; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')); "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_logprobs_reach_processes_without_the_output_devices():
    """Multi-controller: the lowest process holding the runner's output devices reads the logprobs, the others
    get its values through the coordinator; a step where nobody asked agrees nothing."""
    from types import SimpleNamespace

    from pdjax.serving.logprobs import collect_logprobs
    rows = (np.array([-0.5], np.float32), np.array([[3, 4]], np.int32), np.array([[-0.5, -1.0]], np.float32))
    board = {}

    class Coord:
        num_processes = 2

        def __init__(self, pid):
            self.process_id, self.calls = pid, 0

        def agree(self, value, source=0):
            self.calls += 1
            if self.process_id == source:
                board["v"] = value
            return board["v"]

    class Runner:
        output_devices = (SimpleNamespace(process_index=0),)
        logprobs_asked = staticmethod(lambda handle: handle)
        read_by = []

        def collect_logprobs(self, handle):
            self.read_by.append(handle)
            return rows

    owner, other = Coord(0), Coord(1)
    got = [collect_logprobs(c, Runner(), True) for c in (owner, other)]
    for g in got:
        for a, b in zip(g, rows):
            np.testing.assert_array_equal(a, b)
            assert a.dtype == b.dtype
    assert len(Runner.read_by) == 1                       # only the owner read the device
    assert collect_logprobs(other, Runner(), False) is None and other.calls == 1


@needs_8
def test_replicas_one_of_them_a_pipeline_attach_logprobs(case):
    """Colocated replicas behind the router (ClusterEngine), one a pp=2 PipelineRunner with 2 batches in flight."""
    from pdjax.runtime.mesh import make_mesh
    from pdjax.runtime.pipeline import PipelineRunner
    from pdjax.serving.cluster import ClusterEngine, Instance
    devs = jax.devices()
    replicas = [Instance("replica0", "colocated", _runner(case[0], make_mesh(devs[7:8])), _sched("sarathi")),
                Instance("replica1", "colocated", _runner(case[0], make_mesh(devs[5:7], pp=2), PipelineRunner),
                         _sched("sarathi"))]
    reqs = _requests()
    result = ClusterEngine(replicas, router="round_robin").run(reqs)
    assert {it.instance for it in result.iterations} == {"replica0", "replica1"}
    check_engine_logprobs(case, reqs)
