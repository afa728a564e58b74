"""OPT in the cost model: parameter count, shapes, biases and KV from the architecture; a simulator run."""
import pytest

from pdjax.config import get_model_spec
from pdjax.sim import cost_model as cm
from pdjax.sim.cost_model import BatchComposition, CostParams, iteration_time, kv_bytes, param_count
from pdjax.sim.hardware import get_hardware_spec

A100 = get_hardware_spec("a100-80gb-sxm")


def _opt_params(h, layers, vocab=50272, positions=2048):
    # Independent count (HF OPTForCausalLM): per layer q/k/v/out (h x h + h each), fc1 (h x 4h + 4h), fc2
    # (4h x h + h), two LayerNorms (2h each); tied embeddings; learned positions with 2 offset rows; final LN.
    per_layer = 4 * (h * h + h) + (h * 4 * h + 4 * h) + (4 * h * h + h) + 2 * 2 * h
    return layers * per_layer + vocab * h + (positions + 2) * h + 2 * h


def test_opt_parameter_counts_match_the_architecture():
    assert param_count(get_model_spec("opt-13b")) == _opt_params(5120, 40) == 12_853_473_280
    assert param_count(get_model_spec("opt-66b")) == _opt_params(9216, 64) == 65_719_701_504
    assert abs(param_count(get_model_spec("opt-13b")) / 1e9 - 12.85) < 0.01     # published 12.85B
    assert abs(param_count(get_model_spec("opt-66b")) / 1e9 - 65.7) < 0.05      # published "66B"
    # Llama has no biases: the same count as the spec's own.
    for name in ("llama-2-7b", "llama-2-70b", "llama-3-8b"):
        assert param_count(get_model_spec(name)) == get_model_spec(name).num_params()


def test_opt66b_kv_bytes():
    m = get_model_spec("opt-66b")
    assert kv_bytes(m, 512) == 512 * 2 * 64 * 72 * 128 * 2
    assert kv_bytes(m, 512) / 2**30 == pytest.approx(1.125)


def test_opt_shapes_two_gemm_relu_mlp_mha_biases_no_rope():
    m = get_model_spec("opt-13b")
    s = cm.sharded_shapes(m, 2)
    h = 5120
    assert s.gemms == ((h, 3 * h // 2), (h // 2, h), (h, 4 * h // 2), (4 * h // 2, h))
    assert s.kv_heads == s.heads == 20                      # full multi-head attention
    assert s.gemm_bias == (True, True, True, True)
    kinds = [k for k, _ in s.layer_elementwise]
    assert "rope" not in kinds and kinds.count("norm") == 2
    assert dict(s.layer_elementwise)["activation"] == 2 * (4 * h // 2) * 2     # ReLU: read fc1 out, write
    assert s.embedding_bytes_per_token == 3 * h * 2                           # token row + position row + sum
    llama = cm.sharded_shapes(get_model_spec("llama-2-13b"), 2)
    assert llama.gemm_bias == (False,) * 4 and "rope" in [k for k, _ in llama.layer_elementwise]


def test_opt_decode_reads_its_own_weights():
    """A 1-token decode reads every GEMM weight and bias once: bytes from param_count, not a Llama stand-in."""
    m = get_model_spec("opt-13b")
    p = CostParams(gemm_bandwidth_efficiency=0.8, kernel_fixed_s=0.0, gemm_token_tile=1)
    got = iteration_time(BatchComposition((), ((1, 0),)), m, A100, 1, 1, p)
    h = m.hidden_size
    non_gemm = (m.max_position_embeddings + 2) * h + m.num_layers * 4 * h + 2 * h   # positions, LayerNorms
    gemm_weights = param_count(m) - non_gemm       # layers' GEMM weights + biases + the tied LM head
    assert got.linear == pytest.approx(gemm_weights * 2 / (A100.hbm_bandwidth * 0.8), rel=0.01)
    # Prefill FLOPs: 2 x tokens x (QKV 3h^2 + out h^2 + fc1 4h^2 + fc2 4h^2) + the bias adds (tokens x 9h) per
    # layer, plus the LM head's one row: a SwiGLU MLP of the same width would be 12h^2 instead of 8h^2.
    q = CostParams(gemm_flops_efficiency=0.5, kernel_fixed_s=0.0, gemm_token_tile=1)
    long = iteration_time(BatchComposition(((4096, 0),)), m, A100, 1, 1, q)
    flops = m.num_layers * (2 * 4096 * 12 * h * h + 4096 * 9 * h) + 2 * h * m.vocab_size + m.vocab_size
    assert long.linear_flops_s == pytest.approx(flops / (A100.peak_flops_fp16 * 0.5), rel=1e-4)  # LM head occupancy


def test_opt_capacity_uses_exact_params():
    m = get_model_spec("opt-66b")
    cap = cm.kv_cache_capacity_tokens(m, A100, 4, 1, activation_reserve=0)
    free = 0.9 * A100.hbm_capacity - param_count(m) * 2 / 4
    assert cap == int(free // (2 * 64 * 18 * 128 * 2))


def test_simulator_runs_an_opt_model():
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.sim.run import simulate_config
    cfg = serve_config_from_dict({
        "backend": "sim", "model": {"checkpoint": "opt-13b"},
        "scheduler": {"policy": "sarathi", "token_budget": 512, "max_num_seqs": 32, "max_model_len": 2048},
        "workload": {"preset": "chat", "num_requests": 12, "rate": 2.0},
        "sim": {"hardware": "a100-80gb-sxm"}, "deployment": {"colocated": {"tp": 2}}})
    result, setup = simulate_config(cfg)
    assert setup.model.name == "opt-13b" and setup.model.arch == "opt"
    assert len(result.requests) == 12 and all(r.completed for r in result.requests)
    assert result.num_iterations > 0
