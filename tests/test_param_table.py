"""The one per-weight table (pdjax.models.params.param_table) and everything that reads it: init, checkpoint
checks, TP shardings and the pipeline split give exactly what the four separate copies gave before.

`_old_*` below are frozen copies of the code the table replaced (llama.init_params / _init_params_jit,
mesh.layer_shardings / lm_head_sharding / param_shardings, pipeline.split_params / _stage_param_shardings);
they pin "same params for the same seed" bitwise and "same shardings" spec for spec.
"""
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pdjax.config.model_specs import get_model_spec
from pdjax.config.pipeline import stage_layer_ranges
from pdjax.models import llama
from pdjax.models.checkpoint import load_model, params_to_hf_tensors, restore_params, save_params
from pdjax.models.llama import LayerParams, LlamaParams, init_params, jnp_dtype, param_shapes
from pdjax.models.params import (KV_CACHE_AXES, WeightInfo, check_params, flat_params, param_table,
                                 table_items)
from pdjax.runtime import mesh as mesh_lib
from pdjax.runtime.pipeline import StageParams, merge_params, split_params

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake CPU) devices")
SPECS = ["tiny-llama", "tiny-mha", "tiny-mqa", "tiny-qwen", "tiny-llama3", "tiny-byte"]


# ----------------------------------------------------------------------------------------------------------
# Frozen copies of the code before the table
# ----------------------------------------------------------------------------------------------------------

def _old_param_shapes(spec):
    h, i, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    nq, nkv = spec.num_heads, spec.num_kv_heads
    layer = {"attn_norm": (h,), "wq": (h, nq, d), "wk": (h, nkv, d), "wv": (h, nkv, d), "wo": (nq, d, h),
             "mlp_norm": (h,), "w_gate": (h, i), "w_up": (h, i), "w_down": (i, h)}
    if spec.qkv_bias:
        layer.update(bq=(nq, d), bk=(nkv, d), bv=(nkv, d))
    top = {"embed": (spec.vocab_size, h), "final_norm": (h,)}
    if not spec.tie_word_embeddings:
        top["lm_head"] = (h, spec.vocab_size)
    return {"layer": layer, "top": top}


def _old_init_host(spec, seed=0, dtype=None):
    dtype = jnp_dtype(dtype or spec.dtype)
    shapes = _old_param_shapes(spec)

    def make(name, shape, layer_idx):
        rng = np.random.default_rng([seed % (2 ** 32), layer_idx + 1, zlib.crc32(name.encode())])
        x = rng.standard_normal(shape, dtype=np.float32)
        if name.endswith("norm"):
            x = 1.0 + 0.1 * x
        elif name.startswith("b"):
            x = 0.1 * x
        else:
            x = x / np.float32(math.sqrt({"embed": 1, "wo": shape[0] * shape[1]}.get(name, shape[0])))
        return jnp.asarray(x, dtype=dtype)

    layers = tuple(LayerParams(**{n: make(n, s, li) for n, s in shapes["layer"].items()})
                   for li in range(spec.num_layers))
    return LlamaParams(layers=layers, **{n: make(n, s, -1) for n, s in shapes["top"].items()})


def _old_init_jit(spec, seed, dtype):
    shapes = _old_param_shapes(spec)

    def make(root, name, shape, layer_idx):
        key = jax.random.fold_in(jax.random.fold_in(root, layer_idx + 1), zlib.crc32(name.encode()) % (2 ** 31))
        if name.endswith("norm"):
            x = 1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)
        elif name.startswith("b"):
            x = 0.1 * jax.random.normal(key, shape, jnp.float32)
        else:
            fan_in = {"embed": 1, "wo": shape[0] * shape[1]}.get(name, shape[0])
            x = jax.random.normal(key, shape, jnp.float32) / math.sqrt(fan_in)
        return x.astype(dtype)

    def init(seed):
        root = jax.random.PRNGKey(seed)
        layers = tuple(LayerParams(**{n: make(root, n, s, li) for n, s in shapes["layer"].items()})
                       for li in range(spec.num_layers))
        return LlamaParams(layers=layers, **{n: make(root, n, s, -1) for n, s in shapes["top"].items()})

    return jax.jit(init)(jnp.uint32(seed % (2 ** 32)))


def _old_layer_shardings(layer, mesh):
    def ns(*axes):
        return NamedSharding(mesh, P(*axes))

    bias = None if layer.bq is None else ns("tensor", None)
    return LayerParams(attn_norm=ns(), wq=ns(None, "tensor", None), wk=ns(None, "tensor", None),
                       wv=ns(None, "tensor", None), wo=ns("tensor", None, None), mlp_norm=ns(),
                       w_gate=ns(None, "tensor"), w_up=ns(None, "tensor"), w_down=ns("tensor", None),
                       bq=bias, bk=bias, bv=bias)


def _old_lm_head_sharding(mesh, spec):
    return NamedSharding(mesh, P(None, "tensor") if spec.vocab_size % mesh.shape["tensor"] == 0 else P())


def _old_param_shardings(params, mesh, spec):
    rep = NamedSharding(mesh, P())
    lm_head = None if params.lm_head is None else _old_lm_head_sharding(mesh, spec)
    return LlamaParams(embed=rep, layers=tuple(_old_layer_shardings(l, mesh) for l in params.layers),
                       final_norm=rep, lm_head=lm_head)


def _old_split_params(params, ranges):
    last = len(ranges) - 1
    tied = params.lm_head is None
    return tuple(StageParams(layers=tuple(params.layers[a:b]),
                             embed=params.embed if s == 0 or (s == last and tied) else None,
                             final_norm=params.final_norm if s == last else None,
                             lm_head=params.lm_head if s == last else None)
                 for s, (a, b) in enumerate(ranges))


def _old_stage_param_shardings(sp, sub, spec):
    rep = NamedSharding(sub, P())
    return StageParams(layers=tuple(_old_layer_shardings(l, sub) for l in sp.layers),
                       embed=None if sp.embed is None else rep,
                       final_norm=None if sp.final_norm is None else rep,
                       lm_head=None if sp.lm_head is None else _old_lm_head_sharding(sub, spec))


def _assert_trees_equal(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))  # bitwise


def _assert_shardings_equal(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.mesh == y.mesh and x.spec == y.spec, (x, y)


# ----------------------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", SPECS)
def test_table_shapes_match_the_layouts(name):
    spec = get_model_spec(name)
    table = param_table(spec)
    assert param_shapes(spec) == _old_param_shapes(spec)
    items = table_items(table)
    n_layer = 12 if spec.qkv_bias else 9
    assert len(items) == spec.num_layers * n_layer + (2 if spec.tie_word_embeddings else 3)
    for path, info in items.items():
        assert isinstance(info, WeightInfo) and info.path == path
        assert len(info.logical_axes) == len(info.shape)
        assert info.init in ("norm", "bias", "fan_in") and info.dtype is None
    assert sum(math.prod(i.shape) for i in items.values() if i.init != "bias") == spec.num_params()
    assert items["layers.0.wq"].logical_axes == ("embed", "heads", "head_dim")
    assert items["layers.0.wk"].logical_axes == ("embed", "kv_heads", "head_dim")
    assert items["layers.0.wo"].logical_axes == ("heads", "head_dim", "embed")
    assert items["layers.0.wo"].fan_in == spec.num_heads * spec.head_dim
    assert items["layers.0.w_down"].logical_axes == ("mlp", "embed")
    assert items["embed"].logical_axes == ("vocab_in", "embed") and items["embed"].fan_in == 1
    assert items["final_norm"].placement == "last"
    if spec.tie_word_embeddings:
        assert table.lm_head is None and items["embed"].placement == "first+last"
    else:
        assert items["lm_head"].logical_axes == ("embed", "vocab") and items["embed"].placement == "first"
    assert (table.layers[0].bq is not None) == spec.qkv_bias
    assert KV_CACHE_AXES[0] == "kv_heads"


# ----------------------------------------------------------------------------------------------------------
# Init from the table: bitwise the params of the code before it
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,seed,dtype", [("tiny-llama", 0, None), ("tiny-qwen", 7, None),
                                              ("tiny-mqa", 3, "bfloat16"), ("tiny-llama3", 2 ** 33 + 5, None),
                                              ("tiny-byte", 1, "float16")])
def test_host_init_is_bitwise_unchanged(name, seed, dtype):
    spec = get_model_spec(name)
    _assert_trees_equal(init_params(spec, seed, dtype), _old_init_host(spec, seed, dtype))


@pytest.mark.parametrize("name,dtype", [("tiny-qwen", "float32"), ("tiny-llama", "bfloat16")])
def test_jit_init_is_bitwise_unchanged(monkeypatch, name, dtype):
    """The on-device path (specs over 50M params) on a tiny spec, by lowering the threshold."""
    spec = get_model_spec(name)
    monkeypatch.setattr(llama, "_HOST_INIT_MAX_PARAMS", 0)
    llama._init_params_jit.cache_clear()
    try:
        new = init_params(spec, 5, dtype)
    finally:
        llama._init_params_jit.cache_clear()
    _assert_trees_equal(new, _old_init_jit(spec, 5, jnp_dtype(dtype)))


# ----------------------------------------------------------------------------------------------------------
# Shardings from the table's logical axes: the same as before
# ----------------------------------------------------------------------------------------------------------

def test_partition_spec_rules():
    spec = get_model_spec("tiny-llama")          # vocab 512
    mesh = mesh_lib.make_mesh(jax.devices()[:1])
    rules = mesh_lib.logical_axis_rules(mesh, spec)
    assert rules == {"heads": "tensor", "kv_heads": "tensor", "mlp": "tensor", "vocab": "tensor"}
    assert mesh_lib.partition_spec(("embed",), rules) == P()
    assert mesh_lib.partition_spec(("embed", "heads", "head_dim"), rules) == P(None, "tensor", None)
    assert mesh_lib.partition_spec(KV_CACHE_AXES, rules) == P("tensor", None, None, None)


@needs_8
@pytest.mark.parametrize("name,tp", [("tiny-llama", 1), ("tiny-llama", 2), ("tiny-mha", 4), ("tiny-qwen", 2),
                                     ("tiny-byte", 2)])
def test_param_shardings_unchanged(name, tp):
    """tiny-byte: vocab 259 does not divide by 2, so its lm_head stays replicated."""
    spec = get_model_spec(name)
    params = init_params(spec, 0)
    mesh = mesh_lib.make_mesh(jax.devices()[:tp], tp=tp)
    _assert_shardings_equal(mesh_lib.param_shardings(params, mesh, spec), _old_param_shardings(params, mesh, spec))
    assert mesh_lib.kv_cache_sharding(mesh, spec).spec == P("tensor", None, None, None)
    if name == "tiny-byte":
        assert mesh_lib.param_shardings(params, mesh, spec).lm_head.spec == P()


@needs_8
@pytest.mark.parametrize("name,pp,tp", [("tiny-byte", 2, 2), ("tiny-qwen", 2, 1), ("tiny-llama", 2, 4)])
def test_stage_split_and_shardings_unchanged(name, pp, tp):
    spec = get_model_spec(name)
    params = init_params(spec, 0)
    mesh = mesh_lib.make_mesh(jax.devices()[:pp * tp], pp=pp, tp=tp)
    ranges = stage_layer_ranges(spec.num_layers, pp)
    new, old = split_params(params, ranges, spec), _old_split_params(params, ranges)
    assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(old)
    assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(old)))
    merged = merge_params(new)
    assert all(a is b for a, b in zip(jax.tree_util.tree_leaves(merged), jax.tree_util.tree_leaves(params)))
    assert jax.tree_util.tree_structure(merged) == jax.tree_util.tree_structure(params)
    stage_tables = split_params(param_table(spec), ranges, spec)
    for s, sub in enumerate(mesh_lib.stage_meshes(mesh)):
        _assert_shardings_equal(mesh_lib.table_shardings(stage_tables[s], sub, spec),
                                _old_stage_param_shardings(old[s], sub, spec))
    # The table's own split says which stage holds what.
    assert stage_tables[0].embed is not None and stage_tables[0].final_norm is None
    assert stage_tables[-1].final_norm is not None
    assert (stage_tables[-1].embed is not None) == spec.tie_word_embeddings
    assert [i.layer for i in jax.tree_util.tree_leaves(stage_tables[1].layers)][0] == ranges[1][0]


def test_param_shardings_reject_params_off_the_table():
    spec = get_model_spec("tiny-llama")
    params = init_params(spec, 0)
    bad = params.replace(layers=(params.layers[0].replace(w_up=params.layers[0].w_up[:, :5]),) + params.layers[1:])
    mesh = mesh_lib.make_mesh(jax.devices()[:1])
    with pytest.raises(ValueError, match=r"tensor 'layers.0.w_up' has shape \(128, 5\), expected \(128, 384\)"):
        mesh_lib.param_shardings(bad, mesh, spec)
    with pytest.raises(ValueError, match=r"params lacks tensor 'lm_head'"):
        check_params(params.replace(lm_head=None), spec)


# ----------------------------------------------------------------------------------------------------------
# Checkpoint checks read the table
# ----------------------------------------------------------------------------------------------------------

def test_hf_names_cover_the_table():
    spec = get_model_spec("tiny-qwen")
    params = init_params(spec, 0)
    tensors = params_to_hf_tensors(params, spec)
    assert len(tensors) == len(table_items(param_table(spec)))
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (spec.num_kv_heads * spec.head_dim,
                                                                       spec.hidden_size)
    assert "lm_head.weight" not in tensors       # tied


def test_orbax_restore_checks_shapes_against_the_table(tmp_path):
    spec = get_model_spec("tiny-llama")
    params = init_params(spec, 0)
    save_params(tmp_path / "ok", spec, params)
    _, back = restore_params(tmp_path / "ok")
    assert set(flat_params(back)) == set(table_items(param_table(spec)))
    # Same params saved under a spec with another MLP width: the restore names the tensor and both shapes.
    other = spec.replace(intermediate_size=256)
    save_params(tmp_path / "bad", other, params)
    with pytest.raises(ValueError, match=r"tensor 'layers.0.w_gate' has shape \(128, 384\), expected \(128, 256\)"):
        load_model(str(tmp_path / "bad"))
    # An untied spec whose checkpoint has no lm_head: named as missing.
    tied = spec.replace(tie_word_embeddings=True)
    save_params(tmp_path / "tied", tied, params.replace(lm_head=None))
    save_params(tmp_path / "untied", spec, params.replace(lm_head=None))
    assert restore_params(tmp_path / "tied")[1].lm_head is None
    with pytest.raises(ValueError, match=r"lacks tensor 'lm_head' \(expected shape \(128, 512\)"):
        restore_params(tmp_path / "untied")
