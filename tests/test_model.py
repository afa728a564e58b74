"""Model numerics: chunked prefill, decode, mixed batches, GQA ratios, page sizes, head dims, vs a dense reference.

`dense_forward` below is an independent numpy (float64) Llama forward over HF-named tensors ([out, in] Linear
weights) and an HF config dict: plain causal attention over the whole sequence, no paging, no JAX. Other test
files import it.
"""
import math

import numpy as np
import pytest

from pdjax.config.model_specs import ModelSpec, get_model_spec
from pdjax.models.checkpoint import params_to_hf_tensors, spec_to_hf_config
from pdjax.models.llama import init_params
from pdjax.runtime.batch import Buckets, build_ragged_batch
from pdjax.runtime.runner import ModelRunner
from pdjax.scheduler.output import SchedulerOutput


# ------------------------------------------------------------------------------------------------------------
# Independent dense reference
# ------------------------------------------------------------------------------------------------------------

def _reference_inv_freq(cfg, d):
    rope = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    freqs = [1.0 / theta ** (2 * j / d) for j in range(d // 2)]
    scaling = cfg.get("rope_scaling") or rope
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        orig = scaling["original_max_position_embeddings"]
        out = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            if wavelen < orig / hi:
                out.append(f)
            elif wavelen > orig / lo:
                out.append(f / factor)
            else:
                smooth = (orig / wavelen - lo) / (hi - lo)
                out.append((1 - smooth) * f / factor + smooth * f)
        freqs = out
    return np.array(freqs, np.float64)


def dense_forward(tensors, cfg, tokens):
    """float64 logits [L, V] of token list `tokens` (positions 0..L-1)."""
    t = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
    nq, hid = cfg["num_attention_heads"], cfg["hidden_size"]
    nkv = cfg.get("num_key_value_heads", nq)
    d = cfg.get("head_dim") or hid // nq
    eps = cfg.get("rms_norm_eps", 1e-5)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    L = len(tokens)

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    ang = np.arange(L)[:, None] * _reference_inv_freq(cfg, d)[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(x):  # [L, N, D]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return x * cos[:, None] + np.concatenate([-x2, x1], -1) * sin[:, None]

    i_idx, j_idx = np.arange(L)[:, None], np.arange(L)[None, :]
    mask = j_idx <= i_idx
    if window:
        mask &= j_idx > i_idx - window
    x = t["model.embed_tokens.weight"][np.asarray(tokens)]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        h = rms(x, t[p + "input_layernorm.weight"])
        proj = {}
        for name in "qkv":
            y = h @ t[p + f"self_attn.{name}_proj.weight"].T
            if p + f"self_attn.{name}_proj.bias" in t:
                y = y + t[p + f"self_attn.{name}_proj.bias"]
            proj[name] = y.reshape(L, -1, d)
        q, k, v = rope(proj["q"]), rope(proj["k"]), proj["v"]
        out = np.zeros((L, nq, d))
        for head in range(nq):
            kv = head // (nq // nkv)
            s = q[:, head] @ k[:, kv].T / math.sqrt(d)
            s = np.where(mask, s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + out.reshape(L, nq * d) @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        gate = h @ t[p + "mlp.gate_proj.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
    x = rms(x, t["model.norm.weight"])
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return x @ head.T


# ------------------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------------------

def sched(seqs, step=0):
    """SchedulerOutput from [(tokens, num_computed, page_table, do_sample[, sampling]), ...]."""
    out = SchedulerOutput(step=step)
    for s in seqs:
        tokens, start, table, sample = s[:4]
        out.req_ids.append(str(len(out.req_ids)))
        out.token_ids.append(list(tokens))
        out.num_computed_tokens.append(start)
        out.num_new_tokens.append(len(tokens))
        out.page_tables.append(list(table))
        out.do_sample.append(sample)
        if len(s) > 4:
            out.sampling.append(s[4])
    if any(len(s) > 4 for s in seqs) and len(out.sampling) != len(seqs):
        raise ValueError("give sampling for all sequences or none")
    return out


def prefill_in_chunks(runner, prompt, chunk, table):
    """Last-position logits after feeding `prompt` in chunks of `chunk` tokens."""
    done, logits = 0, None
    while done < len(prompt):
        n = min(chunk, len(prompt) - done)
        logits = runner.execute_logits(sched([(prompt[done:done + n], done, table, True)]))[0]
        done += n
    return logits


def model_case(spec, seed=0):
    params = init_params(spec, seed)
    return params, params_to_hf_tensors(params, spec), spec_to_hf_config(spec)


def cache_slots(runner, table, length):
    """K and V of the first `length` positions of a sequence: [layers, kv_heads, length, head_dim] each."""
    ps = runner.page_size
    pos = np.arange(length)
    pages, offs = np.asarray(table)[pos // ps], pos % ps
    k = np.stack([np.asarray(a)[:, pages, offs] for a in runner.kv_cache.k])
    v = np.stack([np.asarray(a)[:, pages, offs] for a in runner.kv_cache.v])
    return k, v


def assert_logits_close(got, want, rtol=1e-4):
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, atol=rtol * scale, rtol=0)


TINY = get_model_spec("tiny-llama")
PROMPT = list(np.random.RandomState(0).randint(0, TINY.vocab_size, 101))  # 6 full pages of 16 + 5


@pytest.fixture(scope="module")
def tiny_case():
    return model_case(TINY)


def tiny_runner(params, page_size=16, num_pages=64):
    return ModelRunner(TINY, params, num_pages=num_pages, page_size=page_size, attention_impl="reference",
                       buckets=Buckets(tokens=(8, 16, 32, 64, 128), seqs=(1, 4), pages=(8, 16)))


@pytest.fixture(scope="module")
def runner16(tiny_case):
    """One runner shared by the page_size-16 tests (saves compiles); each test writes its own pages first."""
    return tiny_runner(tiny_case[0])


@pytest.fixture(scope="module")
def one_shot(tiny_case, runner16):
    params, tensors, cfg = tiny_case
    runner = runner16
    table = list(range(40, 47))  # non-contiguous with page 0 on purpose
    logits = prefill_in_chunks(runner, PROMPT, len(PROMPT), table)
    return logits, cache_slots(runner, table, len(PROMPT)), dense_forward(tensors, cfg, PROMPT)


# ------------------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------------------

def test_one_shot_prefill_matches_dense_reference(one_shot):
    logits, _, dense = one_shot
    assert_logits_close(logits, dense[-1])


@pytest.mark.parametrize("chunk", [1, 7, 16, 33, 100])
def test_chunked_prefill_matches_one_shot(runner16, one_shot, chunk):
    ref_logits, (ref_k, ref_v), _ = one_shot
    runner = runner16
    table = [3, 9, 1, 30, 12, 5, 22]  # scattered pages
    logits = prefill_in_chunks(runner, PROMPT, chunk, table)
    assert_logits_close(logits, ref_logits, rtol=2e-5)
    k, v = cache_slots(runner, table, len(PROMPT))
    np.testing.assert_allclose(k, ref_k, atol=1e-5, rtol=0)
    np.testing.assert_allclose(v, ref_v, atol=1e-5, rtol=0)


def test_decode_k_tokens_matches_full_forward(tiny_case):
    params, tensors, cfg = tiny_case
    runner = tiny_runner(params, page_size=8)
    seq = list(np.random.RandomState(1).randint(0, TINY.vocab_size, 30))
    table = [7, 2, 11, 4]
    prefill_len = 17  # decode crosses the page boundary at 24
    got = [prefill_in_chunks(runner, seq[:prefill_len], 16, table)]
    for pos in range(prefill_len, len(seq)):
        got.append(runner.execute_logits(sched([([seq[pos]], pos, table, True)]))[0])
    dense = dense_forward(tensors, cfg, seq)
    assert_logits_close(np.stack(got), dense[prefill_len - 1:])


def test_mixed_batch_matches_each_sequence_alone(tiny_case, runner16):
    params, tensors, cfg = tiny_case
    runner = runner16
    rng = np.random.RandomState(2)
    seqs = [list(rng.randint(0, TINY.vocab_size, n)) for n in (13, 45, 41, 8)]
    tables = [[0, 1], [2, 3, 4], [5, 6, 7], [8]]
    # Earlier context: seq1 has 21 tokens cached, seq2 40, seq3 7; seq0 starts fresh.
    history = [(1, 21), (2, 40), (3, 7)]
    runner.execute(sched([(seqs[i][:n], 0, tables[i], False) for i, n in history]))
    logits = runner.execute_logits(sched([
        (seqs[0][:13], 0, tables[0], True),        # prefill chunk at offset 0
        (seqs[1][21:45], 21, tables[1], True),     # prefill chunk at offset 21, crossing pages
        (seqs[2][40:41], 40, tables[2], True),     # decode at context 41
        (seqs[3][7:8], 7, tables[3], True),        # decode at context 8 (fills page exactly)
    ]))
    assert runner.traces[-1][1] == (64, 4, 8)  # 39 tokens padded to 64; padding tokens and no padded seqs
    expect = [dense_forward(tensors, cfg, seqs[0][:13])[-1], dense_forward(tensors, cfg, seqs[1][:45])[-1],
              dense_forward(tensors, cfg, seqs[2][:41])[-1], dense_forward(tensors, cfg, seqs[3][:8])[-1]]
    assert_logits_close(logits, np.stack(expect))


_SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, max_position_embeddings=256,
              dtype="float32")


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,page_size", [
    (4, 4, 64, 8),      # GQA ratio 1 (MHA)
    (4, 2, 128, 16),    # ratio 2
    (8, 2, 64, 32),     # ratio 4
    (8, 1, 128, 16),    # ratio 8 (MQA)
])
def test_gqa_head_dim_page_size_vs_dense(num_heads, num_kv_heads, head_dim, page_size):
    spec = ModelSpec(name="t", num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, **_SMALL)
    params, tensors, cfg = model_case(spec, seed=3)
    runner = ModelRunner(spec, params, num_pages=16, page_size=page_size, attention_impl="reference",
                         buckets=Buckets(tokens=(16, 32), seqs=(2,), pages=(4, 8)))
    rng = np.random.RandomState(4)
    a, b = list(rng.randint(0, 96, 37)), list(rng.randint(0, 96, 11))  # partial last pages
    ta, tb = [5, 0, 9, 2, 7], [3, 11]
    got_a = [prefill_in_chunks(runner, a[:20], 20, ta)]
    got_b = runner.execute_logits(sched([(b, 0, tb, True), (a[20:35], 20, ta, True)]))
    got_a.append(got_b[1])
    for pos in (35, 36):
        got_a.append(runner.execute_logits(sched([(a[pos:pos + 1], pos, ta, True)]))[0])
    dense_a = dense_forward(tensors, cfg, a)
    assert_logits_close(np.stack(got_a), dense_a[[19, 34, 35, 36]])
    assert_logits_close(got_b[0], dense_forward(tensors, cfg, b)[-1])


@pytest.mark.parametrize("name,window", [("tiny-qwen", None), ("tiny-llama3", None), ("tiny-mqa", 6)])
def test_variants_vs_dense(name, window):
    """Qwen2 biases + tied embeddings; Llama-3 rope scaling; a sliding window."""
    spec = get_model_spec(name).replace(sliding_window=window)
    params, tensors, cfg = model_case(spec, seed=5)
    runner = ModelRunner(spec, params, num_pages=8, page_size=16, attention_impl="reference",
                         buckets=Buckets(tokens=(32,), seqs=(1,), pages=(4,)))
    prompt = list(np.random.RandomState(6).randint(0, spec.vocab_size, 40))
    # Positions far past original_max_position_embeddings would matter for llama3; 40 tokens exercise all bands.
    got = prefill_in_chunks(runner, prompt, 13, list(range(3)))
    assert_logits_close(got, dense_forward(tensors, cfg, prompt)[-1])


def test_bf16_close_to_dense():
    spec = TINY.replace(dtype="bfloat16")
    params, tensors, cfg = model_case(spec, seed=0)
    runner = ModelRunner(spec, params, num_pages=8, page_size=16, attention_impl="reference",
                         buckets=Buckets(tokens=(32,), seqs=(1,), pages=(4,)))
    prompt = PROMPT[:40]
    got = prefill_in_chunks(runner, prompt, 32, [0, 1, 2])
    assert str(runner.kv_cache.k[0].dtype) == "bfloat16"
    want = dense_forward(tensors, cfg, prompt)[-1]
    np.testing.assert_allclose(got, want, atol=0.1 * np.abs(want).max())
    assert np.argsort(got)[-1] in np.argsort(want)[-3:]


# ------------------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------------------

BUCKETS = Buckets(tokens=(16, 32), seqs=(2,), pages=(4,))


def test_sequence_beyond_max_model_len_fails():
    with pytest.raises(ValueError, match=r"sequence 1: length 40 .*max_model_len=32"):
        build_ragged_batch([[1], [2] * 10], [3, 30], [[0], [1, 2, 3]], [True, True], [None, None],
                           page_size=16, buckets=BUCKETS, max_model_len=32)


def test_page_table_too_short_fails():
    with pytest.raises(ValueError, match=r"sequence 0: page table has 1 pages, needs 2 for 17 tokens"):
        build_ragged_batch([[1] * 17], [0], [[0]], [True], [None], page_size=16, buckets=BUCKETS)


def test_page_id_out_of_range_fails():
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        build_ragged_batch([[1] * 3], [0], [[4]], [True], [None], page_size=16, buckets=BUCKETS, num_pages=4)


def test_too_many_tokens_for_buckets_fails():
    with pytest.raises(ValueError, match=r"number of tokens=33 exceeds the largest bucket 32"):
        build_ragged_batch([[1] * 33], [0], [[0, 1, 2]], [True], [None], page_size=16, buckets=BUCKETS)


def test_token_id_out_of_vocab_fails():
    with pytest.raises(ValueError, match=r"token id 600 outside \[0, 512\)"):
        build_ragged_batch([[1, 600]], [0], [[0]], [True], [None], page_size=16, buckets=BUCKETS,
                           vocab_size=512)


def test_runner_rejects_beyond_max_model_len(tiny_case):
    runner = ModelRunner(TINY, tiny_case[0], num_pages=8, page_size=16, max_model_len=32,
                         buckets=Buckets(tokens=(16,), seqs=(1,), pages=(2, 4)))
    with pytest.raises(ValueError, match="exceeds max_model_len=32"):
        runner.execute(sched([([1] * 3, 30, [0, 1, 2], True)]))
    assert runner.compile_count == 0


def test_heads_that_do_not_divide_fail():
    with pytest.raises(ValueError, match=r"num_heads=6 is not a multiple of num_kv_heads=4"):
        ModelSpec(name="bad", num_heads=6, num_kv_heads=4, head_dim=16, **_SMALL)


def test_unknown_spec_name_fails():
    from pdjax.models.checkpoint import load_model
    with pytest.raises(ValueError, match=r"unknown model spec 'llama-9-1b'"):
        load_model("llama-9-1b")


def test_opt_spec_is_not_runnable():
    from pdjax.models.checkpoint import load_model
    with pytest.raises(ValueError, match=r"arch='opt'"):
        load_model("opt-13b")
