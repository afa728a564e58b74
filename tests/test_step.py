"""The jitted step: sampling on device, batch building, buckets and the compile counter."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdjax.config.model_specs import get_model_spec
from pdjax.config.sampling import SamplingParams
from pdjax.models.llama import init_params
from pdjax.runtime.batch import Buckets, build_ragged_batch, empty_batch
from pdjax.runtime.runner import ModelRunner
from pdjax.runtime.sampling import sample_tokens
from test_model import sched

TINY = get_model_spec("tiny-llama")


@pytest.fixture(scope="module")
def params():
    return init_params(TINY, 0)


@pytest.fixture(scope="module")
def runner(params):
    """Shared by tests that write their pages before reading them (saves compiles)."""
    return make_runner(params)


def make_runner(params, buckets=None):
    return ModelRunner(TINY, params, num_pages=64, page_size=16, attention_impl="reference",
                       buckets=buckets or Buckets(tokens=(16, 64), seqs=(4,), pages=(4,)))


# ------------------------------------------------------------------------------------------------------------
# Batch builder
# ------------------------------------------------------------------------------------------------------------

def test_build_ragged_batch_layout():
    b = build_ragged_batch([[5, 6, 7], [9]], [14, 40], [[3, 8], [1, 2, 7]], [True, False], [None, None],
                           page_size=16, buckets=Buckets(tokens=(8,), seqs=(4,), pages=(4,)))
    np.testing.assert_array_equal(b.token_ids, [5, 6, 7, 9, 0, 0, 0, 0])
    np.testing.assert_array_equal(b.positions, [14, 15, 16, 40, 0, 0, 0, 0])
    # pos 14, 15 -> page 3 offsets 14, 15; pos 16 -> page 8 offset 0; pos 40 -> page 7 offset 8.
    np.testing.assert_array_equal(b.slot_mapping, [3 * 16 + 14, 3 * 16 + 15, 8 * 16, 7 * 16 + 8, -1, -1, -1, -1])
    np.testing.assert_array_equal(b.cu_q_lens, [0, 3, 4, 4, 4])
    np.testing.assert_array_equal(b.kv_lens, [17, 41, 0, 0])
    np.testing.assert_array_equal(b.page_indices[:2], [[3, 8, 0, 0], [1, 2, 7, 0]])
    np.testing.assert_array_equal(b.sample_indices[:2], [2, 3])
    assert int(b.num_seqs) == 2 and b.shape_key == (8, 4, 4)


@pytest.mark.parametrize("seed", range(4))
def test_build_ragged_batch_matches_a_per_token_loop(seed):
    """Random batches (decodes, chunks from mid-page, a page table longer than needed, a page-aligned context,
    sampling params, padding) against a per-token loop written from the RaggedBatch docstring."""
    rng = np.random.RandomState(seed)
    ps, n = 8, int(rng.randint(1, 7))
    q_lens = [int(rng.choice([1, 1, rng.randint(2, 20)])) for _ in range(n)]
    starts = [int(rng.choice([0, 8, rng.randint(0, 40)])) for _ in range(n)]
    tables = [list(rng.permutation(64)[:-(-(c + q) // ps) + int(rng.randint(0, 2))]) for c, q in zip(starts, q_lens)]
    tokens = [list(rng.randint(0, 100, q)) for q in q_lens]
    sampling = [None if rng.rand() < 0.5 else SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=2 ** 33 + i)
                for i in range(n)]
    b = build_ragged_batch(tokens, starts, tables, [True] * n, sampling, page_size=ps, num_pages=64, vocab_size=100,
                           buckets=Buckets(tokens=(128,), seqs=(8,), pages=(8,)))
    t = 0
    for i in range(n):
        for j in range(q_lens[i]):
            pos = starts[i] + j
            assert (b.token_ids[t], b.positions[t]) == (tokens[i][j], pos)
            assert b.slot_mapping[t] == tables[i][pos // ps] * ps + pos % ps
            t += 1
        used = -(-(starts[i] + q_lens[i]) // ps)
        assert list(b.page_indices[i, :used]) == tables[i][:used] and not b.page_indices[i, used:].any()
        sp = sampling[i] or SamplingParams()
        assert b.temperature[i] == np.float32(sp.temperature) and b.top_p[i] == np.float32(sp.top_p)
        assert b.top_k[i] == sp.top_k
        assert b.seed[i] == sp.seed % 2 ** 32 and b.kv_lens[i] == starts[i] + q_lens[i]
        assert b.cu_q_lens[i + 1] == t and b.sample_indices[i] == t - 1
    assert (b.slot_mapping[t:] == -1).all() and not b.token_ids[t:].any() and not b.kv_lens[n:].any()
    assert (b.cu_q_lens[n:] == t).all() and int(b.num_seqs) == n


def test_powers_of_two_buckets():
    b = Buckets.powers_of_two(max_tokens=300, max_seqs=8, max_pages=5, min_tokens=16, min_seqs=1, min_pages=2)
    assert b.tokens == (16, 32, 64, 128, 256, 300) and b.seqs == (1, 2, 4, 8) and b.pages == (2, 4, 5)
    assert b.pick(17, 3, 5) == (32, 4, 5)
    with pytest.raises(ValueError, match="pages per sequence=6 exceeds the largest bucket 5"):
        b.pick(1, 1, 6)


# ------------------------------------------------------------------------------------------------------------
# Sampling
# ------------------------------------------------------------------------------------------------------------

def _sample(logits, temperature, top_k=0, top_p=1.0, seed=0, position=0):
    s = logits.shape[0]
    full = lambda v, dt: np.full(s, v, dt)  # noqa: E731
    return np.asarray(sample_tokens(logits, full(position, np.int32), full(temperature, np.float32),
                                    full(top_k, np.int32), full(top_p, np.float32), full(seed, np.uint32)))


def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = np.random.RandomState(0).randn(16, 300).astype(np.float32)
    np.testing.assert_array_equal(_sample(logits, 0.0), logits.argmax(-1))
    np.testing.assert_array_equal(_sample(logits, 1.5, top_k=1, seed=3), logits.argmax(-1))


def test_top_k_and_top_p_restrict_support():
    rng = np.random.RandomState(1)
    logits = np.tile(rng.randn(1, 50).astype(np.float32) * 3, (400, 1))
    positions = np.arange(400, dtype=np.int32)
    ones = np.ones(400, np.float32)

    def draw(top_k, top_p):
        return np.asarray(sample_tokens(logits, positions, ones, np.full(400, top_k, np.int32),
                                        np.full(400, top_p, np.float32), np.full(400, 9, np.uint32)))

    top3 = set(np.argsort(logits[0])[-3:])
    got = draw(3, 1.0)
    assert set(got) == top3  # all three reached in 400 draws, nothing else
    probs = np.exp(logits[0] - logits[0].max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    nucleus = set(order[:np.searchsorted(np.cumsum(probs[order]), 0.6) + 1])
    got_p = set(draw(0, 0.6))
    assert got_p <= nucleus and len(got_p) >= 1
    assert len(set(draw(0, 1.0))) > len(nucleus)  # top_p off samples beyond the nucleus


def test_seed_and_position_determine_the_sample():
    logits = np.zeros((64, 1000), np.float32)  # uniform: samples depend only on the key
    a = _sample(logits, 1.0, seed=5, position=3)
    assert len(set(a)) == 1  # same seed, same position -> same token in every row
    b = _sample(logits, 1.0, seed=6, position=3)
    c = _sample(logits, 1.0, seed=5, position=4)
    assert a[0] != b[0] or a[0] != c[0]


def test_step_greedy_equals_argmax_of_logits(runner):
    rng = np.random.RandomState(3)
    prompts = [list(rng.randint(0, 512, n)) for n in (9, 20, 3)]
    tables = [[0], [1, 2], [3]]
    batch = sched([(p, 0, t, True) for p, t in zip(prompts, tables)])
    ids = runner.execute(batch)
    logits = runner.execute_logits(batch)
    np.testing.assert_array_equal(ids, logits.argmax(-1))


def test_same_seed_same_tokens_in_any_batch_composition(runner):
    rng = np.random.RandomState(4)
    target = list(rng.randint(0, 512, 12))
    others = [list(rng.randint(0, 512, n)) for n in (5, 30, 17)]
    sp = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=1234)
    greedy = SamplingParams()

    def run(position_in_batch, companions, sampling=sp):
        tokens, out = list(target), []
        for step in range(4):
            start = 0 if step == 0 else len(tokens) - 1
            feed = tokens[start:]
            seqs = [(o, 0, [20 + 3 * j, 21 + 3 * j], True, greedy) for j, o in enumerate(companions)]
            seqs.insert(position_in_batch, (feed, start, [0], True, sampling))
            ids = runner.execute(sched(seqs))
            tokens.append(int(ids[position_in_batch]))
            out.append(int(ids[position_in_batch]))
        return out

    alone = run(0, [])
    assert run(2, others) == alone
    assert run(1, others[:1]) == alone
    assert run(0, [], SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=99)) != alone


def test_do_sample_false_returns_minus_one(runner):
    ids = runner.execute(sched([([1, 2, 3], 0, [0], False), ([4, 5], 0, [1], True)]))
    assert ids[0] == -1 and 0 <= ids[1] < TINY.vocab_size and ids.dtype == np.int32


# ------------------------------------------------------------------------------------------------------------
# Buckets and compile count
# ------------------------------------------------------------------------------------------------------------

def test_random_batches_compile_at_most_once_per_bucket(params):
    buckets = Buckets(tokens=(16, 64), seqs=(2, 4), pages=(4,))
    runner = ModelRunner(TINY, params, num_pages=64, page_size=16, attention_impl="reference", buckets=buckets)
    rng = np.random.RandomState(7)
    seen = set()
    for step in range(100):
        n = rng.randint(1, 5)
        seqs, total = [], 0
        for i in range(n):
            start = int(rng.randint(0, 48))
            q = int(rng.randint(1, min(64 - total - (n - i - 1), 64 - start) + 1))
            q = min(q, 16)
            total += q
            table = [int(x) for x in rng.choice(64, 4, replace=False)]
            seqs.append((list(rng.randint(0, 512, q)), start, table, bool(rng.rand() < 0.8)))
        out = sched(seqs, step)
        seen.add(runner.build_batch(out).shape_key)
        ids = runner.execute(out)
        assert ids.shape == (n,)
    assert runner.compile_count == len(seen) <= buckets.num_shapes
    assert len(seen) > 1  # the test spans several buckets
    assert sorted(k for _, k in runner.traces) == sorted(seen)


def test_warmup_precompiles_every_bucket(params):
    buckets = Buckets(tokens=(16,), seqs=(2,), pages=(2, 4))
    runner = ModelRunner(TINY, params, num_pages=16, page_size=16, attention_impl="reference", buckets=buckets)
    seconds = runner.warmup()
    assert seconds > 0 and runner.compile_count == buckets.num_shapes
    runner.execute(sched([([1] * 15, 0, [0, 1, 2], True)]))
    assert runner.compile_count == buckets.num_shapes  # no new compile after warmup


def test_the_step_is_named_like_the_code():
    """jax.named_scope per layer part, so a device profile of the step reads like the model code."""
    import re

    from pdjax.runtime import aot
    from pdjax.runtime import mesh as mesh_lib
    from pdjax.runtime.runner import make_mesh_step
    spec = get_model_spec("tiny-llama")
    mesh = mesh_lib.make_mesh(jax.devices()[:1])
    step = make_mesh_step(spec, "blocked", mesh, max_seqs=4)
    params = aot.abstract_stage_params(spec, mesh, jnp.float32)
    kv = aot.abstract_kv_cache(spec, mesh, num_pages=8, page_size=16, dtype=jnp.float32, num_layers=2)
    text = step.trace(params, kv, empty_batch((16, 4, 4)), jnp.zeros(4, jnp.int32)).lower().as_text(debug_info=True)
    scopes = set(re.findall(r'"jit\(traced\)/([a-z_0-9]+(?:/[a-z_0-9]+)?)/', text))
    want = {f"layer{i}/{part}" for i in range(2) for part in ("qkv", "kv_write", "attention", "attn_out", "mlp")}
    assert want <= scopes, sorted(scopes)
    assert {"embed", "rope", "final_norm", "lm_head", "sampling"} <= {s.split("/")[0] for s in scopes}
