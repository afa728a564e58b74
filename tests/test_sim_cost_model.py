"""Cost-model sanity: first-principles counts, monotonicity, roofline regimes, tiles, TP/PP, memory, CLI."""
import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdjax.config import get_model_spec
from pdjax.sim import cost_model as cm
from pdjax.sim.profile import load_profile
from pdjax.sim.cost_model import BatchComposition, CostParams, iteration_time, kv_bytes, kv_cache_capacity_tokens
from pdjax.sim.hardware import get_hardware_spec

A100 = get_hardware_spec("a100-80gb-sxm")
PCIE_BOX = get_hardware_spec("a100-80gb-pcie")
FITTED = load_profile("a100").params
SETUPS = [("llama-2-7b", A100, 1, FITTED), ("llama-3-8b", get_hardware_spec("h100-sxm"), 2, FITTED),
          ("yi-34b", PCIE_BOX, 2, FITTED), ("llama-2-70b", A100, 4, CostParams()),
          ("mistral-7b", get_hardware_spec("tpu-v5e"), 4, CostParams())]


def total(batch, model="llama-2-7b", hw=A100, tp=1, pp=1, params=FITTED, **kw):
    return iteration_time(batch, get_model_spec(model), hw, tp, pp, params, **kw)


def prefill(tokens, context=0):
    return BatchComposition(((tokens, context),))


def decode(count, context):
    return BatchComposition((), ((count, context),))


# ------------------------------------------------------------------------------------------------ KV bytes
def test_opt66b_kv_of_512_tokens_is_1_125_gib():
    got = kv_bytes(get_model_spec("opt-66b"), 512, dtype_bytes=2)
    assert abs(got / 2**30 - 1.125) / 1.125 < 0.01


def test_kv_bytes_counts_kv_heads_not_query_heads():
    # Llama-2-70B: 80 layers, 8 KV heads of 128 (GQA), bf16: 2 * 80 * 8 * 128 * 2 bytes per token.
    m = get_model_spec("llama-2-70b")
    assert kv_bytes(m, 1000) == 1000 * 2 * 80 * 8 * 128 * 2
    assert kv_bytes(m, 1000) * 8 == kv_bytes(m.replace(num_kv_heads=64), 1000)
    with pytest.raises(ValueError, match="tokens=-1"):
        kv_bytes(m, -1)


# ------------------------------------------------------------------------------------------------ first principles
def test_single_decode_linear_time_is_weight_bytes_over_bandwidth():
    """Independent count: a 1-token decode reads every weight once (params from ModelSpec.num_params)."""
    m = get_model_spec("llama-2-7b")
    params = CostParams(gemm_bandwidth_efficiency=0.8, kernel_fixed_s=0.0)
    got = total(decode(1, 0), params=params)
    # Linear weights = all params minus the input embedding (a gather, not a GEMM) and the norm weights.
    gemm_params = m.num_params() - m.vocab_size * m.hidden_size - (2 * m.num_layers + 1) * m.hidden_size
    expected = gemm_params * 2 / (A100.hbm_bandwidth * 0.8)
    assert got.linear == pytest.approx(expected, rel=0.01)
    # The FLOPs term is of the tile-padded GEMM (64 rows), still well under the weight reads.
    assert got.linear_memory_s > 1.2 * got.linear_flops_s


def test_long_prefill_linear_time_is_flops_over_peak():
    m = get_model_spec("llama-2-7b")
    params = CostParams(gemm_flops_efficiency=0.5, kernel_fixed_s=0.0, gemm_token_tile=1)
    got = total(prefill(8192), params=params)
    layer_gemm_params = m.num_params() - 2 * m.vocab_size * m.hidden_size - (2 * m.num_layers + 1) * m.hidden_size
    expected = 2 * 8192 * layer_gemm_params / (A100.peak_flops_bf16 * 0.5)
    lm_head = 2 * 1 * m.vocab_size * m.hidden_size * 2 / (A100.hbm_bandwidth * params.gemm_bandwidth_efficiency)
    assert got.linear == pytest.approx(expected + lm_head, rel=0.01)
    assert got.linear_flops_s > 3 * got.linear_memory_s


def test_prefill_attention_counts_earlier_chunks():
    """A later chunk attends to (and re-reads the KV of) everything before it; per query tile the KV read is
    the visible context, so MHA reads kv_heads/q_per_kv times more than GQA."""
    s = cm.sharded_shapes(get_model_spec("llama-3-8b"))
    params = CostParams(attn_causal_skip=1.0, attn_query_tile=128)
    args = (s.heads, s.kv_heads, s.head_dim, 2, A100.peak_flops_bf16, A100.hbm_bandwidth, params)
    first = cm.prefill_attention_terms(1024, 0, *args)
    second = cm.prefill_attention_terms(1024, 1024, *args)
    whole = cm.prefill_attention_terms(2048, 0, *args)
    assert second[0] == pytest.approx(3 * first[0])   # visible keys per row: 1024 + 512 vs 512
    assert second[1] > first[1]
    assert first[0] + second[0] == pytest.approx(whole[0], rel=1e-9)   # causal: chunking adds no FLOPs
    # Independent KV-read count for chunk 2: 8 query tiles x 1536 mean visible keys x 8 KV heads x 128 x 2 (K,V)
    # x 2 bytes, plus q in and out.
    kv_read = 8 * 1536 * 8 * 128 * 2 * 2 + 2 * 1024 * 32 * 128 * 2
    assert second[1] == pytest.approx(kv_read / (A100.hbm_bandwidth * params.attn_bandwidth_efficiency))
    mha = cm.sharded_shapes(get_model_spec("llama-2-7b"))
    mha_second = cm.prefill_attention_terms(1024, 1024, mha.heads, mha.kv_heads, 128, 2, A100.peak_flops_bf16,
                                            A100.hbm_bandwidth, params)
    assert mha_second[0] == pytest.approx(second[0]) and mha_second[1] > 3 * second[1]
    # Decode attention reads KV: memory-bound on any GPU.
    c, mem, _ = cm.decode_attention_terms(64, 4096, *args)
    assert mem > 10 * c


@pytest.mark.parametrize("chunk", [256, 512, 1024, 2048])
def test_chunked_prefill_costs_more_than_unchunked(chunk):
    """Sarathi-Serve's chunking overhead: each chunk re-reads the weights and earlier chunks' KV, and pays fixed
    costs, so the chunks of an 8k prompt together take longer than one 8k iteration (smaller chunks, more)."""
    prompt = 8192
    whole = total(prefill(prompt), "yi-34b", PCIE_BOX, 2).total
    chunks = sum(total(prefill(chunk, start), "yi-34b", PCIE_BOX, 2).total for start in range(0, prompt, chunk))
    assert chunks > whole
    if chunk < 2048:
        bigger = sum(total(prefill(2 * chunk, start), "yi-34b", PCIE_BOX, 2).total
                     for start in range(0, prompt, 2 * chunk))
        assert chunks > bigger


# ------------------------------------------------------------------------------------------------ monotonicity
@pytest.mark.parametrize("model,hw,tp,params", SETUPS)
def test_monotone_in_prefill_tokens_and_context(model, hw, tp, params):
    times = [total(prefill(t), model, hw, tp, params=params).total for t in range(1, 4200, 37)]
    assert all(b >= a for a, b in zip(times, times[1:]))
    ctx = [total(prefill(512, c), model, hw, tp, params=params).total for c in range(0, 16000, 500)]
    assert all(b > a for a, b in zip(ctx, ctx[1:]))


@pytest.mark.parametrize("model,hw,tp,params", SETUPS)
def test_monotone_in_decode_count_and_context(model, hw, tp, params):
    counts = [total(decode(n, 1024), model, hw, tp, params=params).total for n in range(1, 300, 7)]
    assert all(b >= a for a, b in zip(counts, counts[1:]))
    ctx = [total(decode(32, c), model, hw, tp, params=params).total for c in range(0, 32000, 800)]
    assert all(b > a for a, b in zip(ctx, ctx[1:]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 2048), st.integers(0, 8192)), max_size=4),
       st.lists(st.tuples(st.integers(1, 64), st.integers(0, 8192)), max_size=4),
       st.sampled_from(["prefill", "decode"]), st.integers(1, 512))
def test_adding_work_never_makes_a_batch_cheaper(prefills, decodes, kind, amount):
    if not prefills and not decodes:
        return
    base = BatchComposition(tuple(prefills), tuple(decodes))
    more = (BatchComposition(tuple(prefills) + ((amount, 0),), tuple(decodes)) if kind == "prefill"
            else BatchComposition(tuple(prefills), tuple(decodes) + ((1, amount),)))
    for model, hw, tp, params in SETUPS[:3]:
        assert total(more, model, hw, tp, params=params).total >= total(base, model, hw, tp, params=params).total


@pytest.mark.parametrize("model,hw,tp,params", SETUPS)
@pytest.mark.parametrize("tokens", [64, 128, 256, 512, 1024, 2048])
def test_257_never_cheaper_than_256(model, hw, tp, params, tokens):
    assert total(prefill(tokens + 1), model, hw, tp, params=params).total >= \
        total(prefill(tokens), model, hw, tp, params=params).total


def test_tile_quantization_makes_a_visible_step():
    """Compute-bound: 257 tokens pay a whole extra tile, so the step 256->257 dwarfs the step 255->256."""
    t = {n: total(prefill(n), "yi-34b", PCIE_BOX, 2).total for n in (255, 256, 257)}
    assert t[257] - t[256] > 20 * (t[256] - t[255])
    assert t[257] / t[256] > 1.1


# ------------------------------------------------------------------------------------------------ regimes
@pytest.mark.parametrize("model,hw,tp,params", SETUPS)
def test_small_decode_is_bandwidth_bound_long_prefill_flop_bound(model, hw, tp, params):
    small = total(decode(4, 1024), model, hw, tp, params=params)
    assert small.linear_memory_s > 1.2 * small.linear_flops_s
    long = total(prefill(8192), model, hw, tp, params=params)
    assert long.linear_flops_s > 2 * long.linear_memory_s


def test_decode_time_is_nearly_flat_in_batch_size_while_bandwidth_bound():
    one, many = total(decode(1, 64)), total(decode(32, 64))
    assert many.total < 1.5 * one.total          # weights dominate, read once for the whole batch
    assert many.linear < 1.1 * one.linear
    assert total(prefill(4096)).total > 5 * one.total


# ------------------------------------------------------------------------------------------------ parallelism
@pytest.mark.parametrize("model", ["llama-2-7b", "yi-34b", "llama-2-70b"])
def test_tp_cuts_per_gpu_compute_and_adds_communication(model):
    batch = BatchComposition(((1024, 0),), ((16, 1024),))
    t1 = total(batch, model, A100, 1)
    t2 = total(batch, model, A100, 2)
    t4 = total(batch, model, A100, 4)
    assert t1.communication == 0
    assert 0 < t2.communication < t4.communication
    assert t4.linear < t2.linear < t1.linear
    assert t2.linear < 0.6 * t1.linear
    assert t4.attention < t2.attention < t1.attention


def test_tp_communication_uses_the_slowest_link():
    batch = prefill(2048)
    pair = total(batch, "llama-2-13b", PCIE_BOX, 2).communication
    quad = total(batch, "llama-2-13b", PCIE_BOX, 4).communication
    # 4 GPUs on a pairwise box cross PCIe (~10x slower than the bridge) for 1.5x the ring volume.
    assert quad > 5 * pair
    switch_quad = total(batch, "llama-2-13b", A100, 4).communication
    assert switch_quad < quad / 5


def test_pipeline_bubbles_and_microbatches():
    batch = BatchComposition((), ((64, 1024),))
    one = total(batch, "llama-2-70b", A100, 4, pp=1)
    pp2 = total(batch, "llama-2-70b", A100, 4, pp=2)
    assert one.pipeline_bubble == 0 and pp2.pipeline_bubble > 0
    # One microbatch: each stage runs half the layers, the other stage idles -> about as slow as pp=1.
    assert pp2.total == pytest.approx(one.total, rel=0.15)
    # Compute-bound prefills: 4 microbatches shrink the bubble from (pp-1) whole stages to (pp-1) quarter stages.
    prefills = BatchComposition(tuple((2048, 0) for _ in range(4)))
    m1 = total(prefills, "llama-2-70b", A100, 4, pp=2)
    m4 = total(prefills, "llama-2-70b", A100, 4, pp=2, num_microbatches=4)
    assert m4.pipeline_bubble < m1.pipeline_bubble / 3
    assert m4.total < 0.8 * m1.total
    # Bandwidth-bound decodes: every microbatch re-reads the stage's weights, so splitting costs time.
    assert total(batch, "llama-2-70b", A100, 4, pp=2, num_microbatches=4).total > pp2.total
    with pytest.raises(ValueError, match="num_microbatches=0"):
        total(batch, "llama-2-70b", A100, 4, pp=2, num_microbatches=0)


def test_bad_parallel_degrees_are_named():
    with pytest.raises(ValueError, match="tp=3"):
        total(prefill(8), "llama-2-7b", A100, 3)
    with pytest.raises(ValueError, match="pp=100"):
        total(prefill(8), "llama-2-7b", A100, 1, pp=100)


def test_empty_batch_costs_only_overhead():
    got = total(BatchComposition())
    assert got.total == got.overhead == FITTED.iteration_overhead_s


# ------------------------------------------------------------------------------------------------ capacity
def test_capacity_from_memory():
    m = get_model_spec("llama-2-13b")
    base = kv_cache_capacity_tokens(m, A100, 1, 1, max_num_batched_tokens=2048)
    # Independent: (0.9 * 80 GiB - params - activations) / (2 * 40 layers * 40 heads * 128 * 2 bytes).
    act = cm.activation_bytes(m, 1, 2048, 256)
    expected = (0.9 * 80 * 2**30 - m.num_params() * 2 - act) / (2 * 40 * 40 * 128 * 2)
    assert base == math.floor(expected)
    assert kv_cache_capacity_tokens(m, A100, 1, 1, max_num_batched_tokens=16384) < base
    assert kv_cache_capacity_tokens(m, A100, 1, 1, mem_util=0.8, max_num_batched_tokens=2048) < base
    assert kv_cache_capacity_tokens(m, A100, 2, 1, max_num_batched_tokens=2048) > 2 * base
    assert kv_cache_capacity_tokens(m, A100, 1, 2, max_num_batched_tokens=2048) > 2 * base


def test_capacity_gqa_and_replicated_kv_heads():
    mha = get_model_spec("llama-2-7b")
    gqa = get_model_spec("llama-3-8b").replace(vocab_size=mha.vocab_size, intermediate_size=mha.intermediate_size)
    a = kv_cache_capacity_tokens(mha, A100, activation_reserve=0)
    b = kv_cache_capacity_tokens(gqa, A100, activation_reserve=0)
    for model, got in ((mha, a), (gqa, b)):
        free = 0.9 * A100.hbm_capacity - 2 * model.num_params()
        assert got == math.floor(free / (2 * 32 * model.num_kv_heads * 128 * 2))
    assert b > 3.9 * a
    # Llama-2-70B has 8 KV heads: at TP16 each device still holds a whole KV head, so capacity stops growing
    # from KV-head sharding beyond TP8.
    m70 = get_model_spec("llama-2-70b")
    assert cm.sharded_shapes(m70, 8).kv_heads == 1 and cm.sharded_shapes(m70, 16).kv_heads == 1


def test_capacity_errors_when_model_does_not_fit():
    with pytest.raises(ValueError, match="llama-2-70b does not fit on l4"):
        kv_cache_capacity_tokens(get_model_spec("llama-2-70b"), get_hardware_spec("l4"))
    with pytest.raises(ValueError, match="mem_util=1.5"):
        kv_cache_capacity_tokens(get_model_spec("llama-2-7b"), A100, mem_util=1.5)


# ------------------------------------------------------------------------------------------------ parsing, params
def test_batch_parse_and_errors():
    b = BatchComposition.parse("prefill:1021@0, decode:3@2048,prefill:5@7")
    assert b.prefills == ((1021, 0), (5, 7)) and b.decodes == ((3, 2048),)
    assert b.num_tokens == 1021 + 3 + 5 and b.num_seqs == 5
    for bad, item in [("prefill:10", "prefill:10"), ("decode:3@2048,oops", "oops"), ("prefill:0@5", "prefill:0@5"),
                      ("decode:-1@5", "decode:-1@5")]:
        with pytest.raises(ValueError, match=f"bad batch item '{item}'"):
            BatchComposition.parse(bad)
    with pytest.raises(ValueError, match="empty batch"):
        BatchComposition.parse(" ")


def test_from_scheduler_output_and_step_time_fn():
    from pdjax.scheduler.output import SchedulerOutput
    out = SchedulerOutput(step=0, req_ids=["a", "b", "c"], num_computed_tokens=[0, 512, 99],
                          num_new_tokens=[256, 256, 1], is_prefill=[True, True, False])
    b = BatchComposition.from_scheduler_output(out)
    assert b.prefills == ((256, 0), (256, 512)) and b.decodes == ((1, 99),)
    step = cm.step_time_fn(get_model_spec("llama-2-7b"), A100, params=FITTED)
    assert step(out) == total(b).total
    with pytest.raises(ValueError, match="tp=5"):
        cm.step_time_fn(get_model_spec("llama-2-7b"), A100, tp=5)


def test_round_robin_split_keeps_every_sequence():
    b = BatchComposition(((100, 0), (50, 10)), ((5, 7), (2, 9)))
    parts = b.split_round_robin(3)
    assert sum(p.num_tokens for p in parts) == b.num_tokens
    assert sum(p.num_seqs for p in parts) == b.num_seqs


def test_cost_params_json_round_trip_and_validation():
    p = CostParams(gemm_flops_efficiency=0.5, gemm_token_tile=128)
    assert CostParams.from_json(p.to_json()) == p
    with pytest.raises(ValueError, match=r"unknown config key\(s\) CostParams\.bogus;"):
        CostParams.from_dict({"bogus": 1})
    with pytest.raises(ValueError, match="kernel_fixed_s=-1"):
        CostParams(kernel_fixed_s=-1)
    with pytest.raises(ValueError, match="attn_causal_skip=2"):
        CostParams(attn_causal_skip=2)


# ------------------------------------------------------------------------------------------------ layering, CLI
def test_importing_pdjax_sim_does_not_import_jax():
    code = ("import sys; import pdjax.sim, pdjax.sim.cost_model, pdjax.sim.hardware, pdjax.sim.calibration; "
            "import pdjax.experiment.cost; print('jax' in sys.modules, 'flax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_cost_cli_prints_breakdown_json():
    out = subprocess.run([sys.executable, "-m", "experiments.cost", "--model=yi-34b", "--hardware=a100-80gb-pcie",
                          "--tp=2", "--pp=1", "--batch=prefill:1021@0,decode:3@2048", "--batch=decode:8@100"],
                         capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    assert [b["batch"] for b in data["batches"]] == ["prefill:1021@0,decode:3@2048", "decode:8@100"]
    for b in data["batches"]:
        parts = b["breakdown"]
        assert math.isclose(b["time_s"], sum(parts.values()), rel_tol=1e-9)
        assert {"linear", "attention", "communication", "overhead"} <= set(parts)
    assert data["batches"][0]["time_s"] > data["batches"][1]["time_s"]


def test_cost_cli_bad_batch_names_the_item():
    out = subprocess.run([sys.executable, "-m", "experiments.cost", "--batch=prefill:12@0,decod:3@1"],
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert "bad batch item 'decod:3@1'" in out.stderr
