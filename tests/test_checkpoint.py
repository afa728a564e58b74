"""Weights: HF safetensors checkpoints built here from random numpy tensors, orbax round trip, load_model."""
import json

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from pdjax.models.checkpoint import load_model, restore_params, save_params, spec_from_hf_config
from pdjax.models.llama import init_params
from pdjax.config.model_specs import get_model_spec
from pdjax.runtime.batch import Buckets
from pdjax.runtime.runner import ModelRunner
from test_model import assert_logits_close, dense_forward, prefill_in_chunks, sched

LLAMA3_CFG = {  # newer transformers layout: rope settings nested in rope_parameters
    "model_type": "llama", "vocab_size": 120, "hidden_size": 64, "intermediate_size": 112,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512, "tie_word_embeddings": False, "torch_dtype": "float32",
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}
QWEN2_CFG = {  # older layout: top-level rope_theta; qkv biases; tied embeddings; explicit head_dim
    "model_type": "qwen2", "vocab_size": 100, "hidden_size": 48, "intermediate_size": 80,
    "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "tie_word_embeddings": True,
    "sliding_window": 32, "use_sliding_window": False, "torch_dtype": "float32",
}


def random_hf_tensors(cfg, seed=0):
    """HF-named float32 tensors, Linear weights [out, in]."""
    rng = np.random.RandomState(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // nq
    lin = lambda o, n: (rng.randn(o, n) / np.sqrt(n)).astype(np.float32)  # noqa: E731
    norm = lambda: (1 + 0.1 * rng.randn(h)).astype(np.float32)  # noqa: E731
    t = {"model.embed_tokens.weight": rng.randn(v, h).astype(np.float32), "model.norm.weight": norm()}
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = lin(v, h)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        t[p + "input_layernorm.weight"] = norm()
        t[p + "post_attention_layernorm.weight"] = norm()
        t[p + "self_attn.q_proj.weight"] = lin(nq * d, h)
        t[p + "self_attn.k_proj.weight"] = lin(nkv * d, h)
        t[p + "self_attn.v_proj.weight"] = lin(nkv * d, h)
        t[p + "self_attn.o_proj.weight"] = lin(h, nq * d)
        t[p + "mlp.gate_proj.weight"] = lin(i, h)
        t[p + "mlp.up_proj.weight"] = lin(i, h)
        t[p + "mlp.down_proj.weight"] = lin(h, i)
        if cfg["model_type"] == "qwen2":
            for name, n in (("q", nq), ("k", nkv), ("v", nkv)):
                t[p + f"self_attn.{name}_proj.bias"] = (0.1 * rng.randn(n * d)).astype(np.float32)
    return t


def write_hf(directory, cfg, tensors, shards=1):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
        return directory
    names, weight_map = sorted(tensors), {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in names[s::shards]}, str(directory / fname))
        weight_map.update({n: fname for n in names[s::shards]})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


@pytest.mark.parametrize("cfg,shards", [(LLAMA3_CFG, 3), (QWEN2_CFG, 1)], ids=["llama3-sharded", "qwen2-single"])
def test_hf_checkpoint_matches_dense_reference(tmp_path, cfg, shards):
    tensors = random_hf_tensors(cfg)
    spec, params = load_model(str(write_hf(tmp_path / "ckpt", cfg, tensors, shards)))
    assert spec.num_kv_heads == cfg["num_key_value_heads"] and spec.sliding_window is None
    runner = ModelRunner(spec, params, num_pages=8, page_size=8, attention_impl="reference",
                         buckets=Buckets(tokens=(16,), seqs=(2,), pages=(8,)))
    prompt = list(np.random.RandomState(1).randint(0, cfg["vocab_size"], 45))
    dense = dense_forward(tensors, cfg, prompt)
    assert_logits_close(prefill_in_chunks(runner, prompt[:44], 16, [6, 1, 4, 0, 3, 7]), dense[43])
    decode = runner.execute_logits(sched([(prompt[44:], 44, [6, 1, 4, 0, 3, 7], True)]))[0]
    assert_logits_close(decode, dense[44])


def test_spec_from_config_reads_rope_variants():
    s3 = spec_from_hf_config(LLAMA3_CFG)
    assert s3.rope_theta == 500000.0 and s3.rope_scaling.original_max_position_embeddings == 64
    sq = spec_from_hf_config(QWEN2_CFG)
    assert sq.rope_theta == 1e6 and sq.rope_scaling is None and sq.qkv_bias and sq.tie_word_embeddings
    mistral = dict(LLAMA3_CFG, model_type="mistral", sliding_window=4096, rope_parameters=None, rope_theta=1e4)
    sm = spec_from_hf_config(mistral)
    assert sm.sliding_window == 4096 and sm.rope_theta == 1e4 and sm.rope_scaling is None
    with pytest.raises(ValueError, match="rope scaling type 'yarn' is not supported"):
        spec_from_hf_config(dict(LLAMA3_CFG, rope_parameters={"rope_type": "yarn", "factor": 4.0}))


def test_mismatched_tensor_names_it_and_both_shapes(tmp_path):
    tensors = random_hf_tensors(LLAMA3_CFG)
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((64, 64), np.float32)
    path = write_hf(tmp_path / "bad", LLAMA3_CFG, tensors)
    with pytest.raises(ValueError, match=r"tensor 'model.layers.1.self_attn.k_proj.weight' has shape "
                                         r"\(64, 64\), expected \(32, 64\)"):
        load_model(str(path))


def test_missing_tensor_is_named(tmp_path):
    tensors = random_hf_tensors(LLAMA3_CFG)
    del tensors["lm_head.weight"]
    with pytest.raises(ValueError, match=r"checkpoint lacks tensor 'lm_head.weight'"):
        load_model(str(write_hf(tmp_path / "bad", LLAMA3_CFG, tensors)))


@pytest.mark.parametrize("name,dtype", [("tiny-qwen", "float32"), ("tiny-llama", "bfloat16")])
def test_orbax_round_trip_is_exact(tmp_path, name, dtype):
    spec = get_model_spec(name)
    params = init_params(spec, seed=11, dtype=dtype)
    save_params(tmp_path / "ckpt", spec, params)
    spec2, params2 = restore_params(tmp_path / "ckpt")
    assert spec2 == spec
    assert jax.tree_util.tree_structure(params2) == jax.tree_util.tree_structure(params)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params2)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    spec3, params3 = load_model(str(tmp_path / "ckpt"))
    assert spec3 == spec and np.array_equal(np.asarray(params3.embed), np.asarray(params.embed))


def test_load_model_registry_name_gives_dummy_weights_of_spec_shapes():
    spec, params = load_model("tiny-mqa", seed=3)
    assert params.layers[0].wk.shape == (spec.hidden_size, 1, 64) and len(params.layers) == spec.num_layers
    _, again = load_model("tiny-mqa", seed=3)
    _, other = load_model("tiny-mqa", seed=4)
    assert np.array_equal(np.asarray(params.embed), np.asarray(again.embed))
    assert not np.array_equal(np.asarray(params.embed), np.asarray(other.embed))


def test_load_model_bad_directory(tmp_path):
    with pytest.raises(ValueError, match="has neither pdjax_spec.json"):
        load_model(str(tmp_path))
    with pytest.raises(ValueError, match="is not a directory"):
        load_model(str(tmp_path / "nope"))
