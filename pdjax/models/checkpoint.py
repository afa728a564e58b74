"""Weights: Hugging Face Llama-format checkpoints, orbax save/restore, and `load_model`.

HF layout: `config.json` + `model.safetensors` or shards listed in `model.safetensors.index.json`; tensor
names `model.embed_tokens.weight`, `model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}`,
`model.layers.{i}.mlp.{gate,up,down}_proj.weight`, `model.layers.{i}.{input,post_attention}_layernorm.weight`,
`model.norm.weight`, `lm_head.weight`; Linear weights stored [out, in]. One HF tensor per entry of the weight
table `pdjax.models.params.param_table(spec)`: each is checked against the table's shape (an error names the
tensor and both shapes) and converted to the layouts of `pdjax.models.llama`.
The spec comes from config.json (top-level `rope_theta` or nested `rope_parameters`, `rope_scaling` of type
llama3, Qwen2 biases, tied embeddings, sliding window).

Orbax: `save_params` writes `<dir>/params` (an orbax StandardCheckpointer tree of plain dicts, so the format
does not depend on the dataclass types) and `<dir>/pdjax_spec.json`; `restore_params` reads both back exactly,
after checking every restored tensor against the spec's table (missing, unexpected or mis-shaped tensors are named).

A file that cannot be read back (truncated or corrupt: bad JSON, a safetensors header or tensor that does not
fit its file, an orbax/TensorStore read error) raises CheckpointCorruptError, one line naming the checkpoint, the
file or step that failed and the reader's own first line; the reader's exception is kept as __cause__.
A file that reads back but holds NaN or inf weights (flipped bytes that still decode) raises NonFiniteWeightsError
(a CheckpointCorruptError) from `load_model`, naming the tensor (`check_finite`, after every checkpoint loader).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
from typing import Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from pdjax.config.model_specs import DTYPE_BYTES, ModelSpec, RopeScaling, get_model_spec
from pdjax.errors import UserError
from pdjax.metrics.report import atomic_write_text
from pdjax.models.llama import check_runnable, init_params, jnp_dtype
from pdjax.models.params import (LayerParams, LlamaParams, WeightInfo, check_params, check_shapes, flat_params,
                                 param_table, table_items)

SPEC_FILE = "pdjax_spec.json"
ORBAX_SUBDIR = "params"


class CheckpointCorruptError(UserError):
    """A checkpoint file could not be read: truncated or corrupt (the reader's error is the __cause__)."""


def _reader_message(e: BaseException) -> str:
    """The first line of the innermost explicit cause (TensorStore wraps the useful line in a long dump)."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = str(e).strip().splitlines()
    line = f"{type(e).__name__}: {lines[0] if lines else ''}"
    return line if len(line) <= 300 else line[:297] + "..."


def _corrupt(checkpoint, what: str, e: BaseException) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"checkpoint {str(checkpoint)!r} is truncated or corrupt: {what} failed "
                                  f"({_reader_message(e)})")


def _read_json(checkpoint, path: pathlib.Path):
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(checkpoint, f"reading {path.name}", e) from e

# Our weight (a `param_table` entry's name) -> (HF tensor name, kind); `{i}` is the layer index. kind:
# "in_heads" Linear [N*D, H] -> [H, N, D]; "out_heads" Linear [H, N*D] -> [N, D, H]; "linear" [out, in] -> [in, out];
# "bias" [N*D] -> [N, D]; "vec" as is.
_HF_TENSORS = {
    "embed": ("model.embed_tokens.weight", "vec"),
    "final_norm": ("model.norm.weight", "vec"),
    "lm_head": ("lm_head.weight", "linear"),
    "attn_norm": ("model.layers.{i}.input_layernorm.weight", "vec"),
    "wq": ("model.layers.{i}.self_attn.q_proj.weight", "in_heads"),
    "wk": ("model.layers.{i}.self_attn.k_proj.weight", "in_heads"),
    "wv": ("model.layers.{i}.self_attn.v_proj.weight", "in_heads"),
    "wo": ("model.layers.{i}.self_attn.o_proj.weight", "out_heads"),
    "bq": ("model.layers.{i}.self_attn.q_proj.bias", "bias"),
    "bk": ("model.layers.{i}.self_attn.k_proj.bias", "bias"),
    "bv": ("model.layers.{i}.self_attn.v_proj.bias", "bias"),
    "mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", "vec"),
    "w_gate": ("model.layers.{i}.mlp.gate_proj.weight", "linear"),
    "w_up": ("model.layers.{i}.mlp.up_proj.weight", "linear"),
    "w_down": ("model.layers.{i}.mlp.down_proj.weight", "linear"),
}


def _hf_name(info: WeightInfo) -> Tuple[str, str]:
    """(HF tensor name, kind) of one table entry."""
    template, kind = _HF_TENSORS[info.name]
    return template.format(i=info.layer), kind


_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# ------------------------------------------------------------------------------------------------------------
# config.json <-> ModelSpec
# ------------------------------------------------------------------------------------------------------------

def _rope_scaling_from(cfg: Optional[dict]) -> Optional[RopeScaling]:
    if not cfg:
        return None
    kind = cfg.get("rope_type", cfg.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"rope scaling type {kind!r} is not supported (supported: 'default', 'llama3')")
    return RopeScaling(factor=float(cfg["factor"]), low_freq_factor=float(cfg.get("low_freq_factor", 1.0)),
                       high_freq_factor=float(cfg.get("high_freq_factor", 4.0)),
                       original_max_position_embeddings=int(cfg.get("original_max_position_embeddings", 8192)))


def spec_from_hf_config(config: dict, name: str = "hf-model") -> ModelSpec:
    """ModelSpec of an HF Llama/Mistral/Qwen2 config.json dict."""
    model_type = config.get("model_type", "llama")
    if model_type not in ("llama", "mistral", "qwen2", "yi"):
        raise ValueError(f"config.json model_type={model_type!r}; supported: llama, mistral, qwen2")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in config:
            raise ValueError(f"config.json lacks {key!r}")
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    rope_params = config.get("rope_parameters") or {}
    rope_theta = config.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    scaling = _rope_scaling_from(config.get("rope_scaling") or rope_params or None)
    sliding = config.get("sliding_window")
    if model_type == "qwen2" and not config.get("use_sliding_window", False):
        sliding = None
    dtype = config.get("torch_dtype", config.get("dtype", "bfloat16"))
    if dtype not in DTYPE_BYTES:
        dtype = "bfloat16"
    return ModelSpec(
        name=name, vocab_size=int(config["vocab_size"]), hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]), num_layers=int(config["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads), rope_theta=float(rope_theta),
        rope_scaling=scaling, rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=bool(config.get("attention_bias", model_type == "qwen2")),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        sliding_window=int(sliding) if sliding else None, dtype=dtype)


def spec_to_hf_config(spec: ModelSpec) -> dict:
    """An HF config.json dict for `spec` (model_type llama, or qwen2 when it has qkv biases)."""
    check_runnable(spec)
    cfg = {"architectures": ["Qwen2ForCausalLM" if spec.qkv_bias else "LlamaForCausalLM"],
           "model_type": "qwen2" if spec.qkv_bias else "llama",
           "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
           "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
           "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
           "head_dim": spec.head_dim, "rope_theta": spec.rope_theta, "rms_norm_eps": spec.rms_norm_eps,
           "tie_word_embeddings": spec.tie_word_embeddings, "attention_bias": spec.qkv_bias,
           "max_position_embeddings": spec.max_position_embeddings, "torch_dtype": spec.dtype,
           "hidden_act": "silu"}
    if spec.rope_scaling is not None:
        cfg["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(spec.rope_scaling)}
    if spec.sliding_window is not None:
        cfg["sliding_window"] = spec.sliding_window
        cfg["use_sliding_window"] = True
    return cfg


# ------------------------------------------------------------------------------------------------------------
# HF tensors <-> params
# ------------------------------------------------------------------------------------------------------------

def _hf_shape(kind: str, our_shape: Tuple[int, ...]) -> Tuple[int, ...]:
    if kind == "in_heads":
        return (our_shape[1] * our_shape[2], our_shape[0])
    if kind == "out_heads":
        return (our_shape[2], our_shape[0] * our_shape[1])
    if kind == "linear":
        return (our_shape[1], our_shape[0])
    if kind == "bias":
        return (our_shape[0] * our_shape[1],)
    return our_shape


def _from_hf(x: np.ndarray, kind: str, our_shape: Tuple[int, ...]) -> np.ndarray:
    if kind == "in_heads":
        return x.T.reshape(our_shape)
    if kind == "out_heads":
        return x.T.reshape(our_shape)
    if kind == "linear":
        return x.T
    return x.reshape(our_shape)


def _to_hf(x: np.ndarray, kind: str) -> np.ndarray:
    if kind == "in_heads":
        return x.reshape(x.shape[0], -1).T
    if kind == "out_heads":
        return x.reshape(-1, x.shape[-1]).T
    if kind == "linear":
        return x.T
    return x.reshape(-1) if kind == "bias" else x


def params_from_hf_tensors(spec: ModelSpec, get_tensor, names, dtype=None) -> LlamaParams:
    """Build params from HF tensors, one per entry of `param_table(spec)`, each checked against the table's
    shape. get_tensor(name) -> np.ndarray; names: the available tensor names."""
    check_runnable(spec)
    dtype = jnp_dtype(dtype or spec.dtype)
    names = set(names)

    def fetch(info: WeightInfo):
        hf_name, kind = _hf_name(info)
        want = _hf_shape(kind, info.shape)
        if hf_name not in names:
            raise ValueError(f"checkpoint lacks tensor {hf_name!r} (expected shape {want})")
        x = np.asarray(get_tensor(hf_name))
        if tuple(x.shape) != tuple(want):
            raise ValueError(f"tensor {hf_name!r} has shape {tuple(x.shape)}, expected {tuple(want)} "
                             f"for spec {spec.name!r} (pdjax {info.path} {info.shape}, axes {info.logical_axes})")
        names.discard(hf_name)
        wdtype = dtype if info.dtype is None else jnp_dtype(info.dtype)
        return jnp.asarray(_from_hf(x, kind, info.shape).astype(np.float32)).astype(wdtype)

    params = jax.tree_util.tree_map(fetch, param_table(spec))
    names.discard("lm_head.weight")  # tied checkpoints sometimes store a copy
    leftover = sorted(n for n in names if not n.endswith(_IGNORED_SUFFIXES))
    if leftover:
        logging.warning("checkpoint tensors not used by spec %s: %s", spec.name, leftover[:10])
    return params


def params_to_hf_tensors(params: LlamaParams, spec: ModelSpec) -> Dict[str, np.ndarray]:
    """HF-named numpy tensors ([out, in] Linear weights) of params (checked against `param_table(spec)`)."""
    check_params(params, spec)
    table, out = table_items(param_table(spec)), {}
    for path, x in flat_params(params).items():
        hf_name, kind = _hf_name(table[path])
        out[hf_name] = np.ascontiguousarray(_to_hf(np.asarray(x), kind))
    return out


CHECKSUM_FILE = "pdjax_checksums.json"   # {relative path: sha256} of every file of a checkpoint, written last


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_checksums(directory) -> None:
    """Record the SHA-256 of every file under `directory` (its checkpoint) in CHECKSUM_FILE, atomically."""
    directory = pathlib.Path(directory)
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != CHECKSUM_FILE)
    atomic_write_text(directory / CHECKSUM_FILE, json.dumps(
        {str(p.relative_to(directory)): _sha256(p) for p in files}, indent=1, sort_keys=True))


def verify_checksums_of(directory) -> None:
    """Check every file CHECKSUM_FILE lists against its SHA-256 (a checkpoint saved without one is not checked).
    CheckpointCorruptError naming the first file that is missing or differs: a flipped bit may still decode."""
    directory = pathlib.Path(directory)
    manifest = directory / CHECKSUM_FILE
    if not manifest.is_file():
        return
    for name, want in _read_json(directory, manifest).items():
        path = directory / name
        if not path.is_file():
            raise CheckpointCorruptError(f"checkpoint {str(directory)!r} lacks {name!r}, which its {CHECKSUM_FILE} "
                                         f"lists")
        if _sha256(path) != want:
            raise CheckpointCorruptError(f"checkpoint {str(directory)!r}: {name!r} does not match its SHA-256 in "
                                         f"{CHECKSUM_FILE} (the file changed since it was saved; "
                                         f"model.verify_checksums=False loads it anyway)")


def save_hf_checkpoint(directory, spec: ModelSpec, params: LlamaParams, *, num_shards: int = 1) -> None:
    """Write config.json + safetensors (sharded with an index when num_shards > 1)."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(spec_to_hf_config(spec), indent=1))
    tensors = params_to_hf_tensors(params, spec)
    if num_shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
        write_checksums(directory)
        return
    names = sorted(tensors)
    weight_map = {}
    for s in range(num_shards):
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::num_shards]}
        save_file(part, str(directory / fname))
        weight_map.update({n: fname for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    write_checksums(directory)


def load_hf_checkpoint(directory, dtype=None) -> Tuple[ModelSpec, LlamaParams]:
    """(spec, params) from an HF Llama-format directory (config.json + safetensors, sharded or single)."""
    directory = pathlib.Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise UserError(f"{directory} has no config.json (not an HF checkpoint directory)")
    spec = spec_from_hf_config(_read_json(directory, config_path), name=directory.name)
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = _read_json(directory, index_path)["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
        if not files:
            raise UserError(f"{directory} has no *.safetensors files")
    handles = {}
    for f in files:
        try:
            handles[f] = safe_open(str(directory / f), framework="np")
        except SafetensorError as e:
            raise _corrupt(directory, f"opening {f}", e) from e
    where = {}
    for f, h in handles.items():
        for name in h.keys():
            where[name] = f

    def get_tensor(name):
        try:
            return handles[where[name]].get_tensor(name)
        except SafetensorError as e:
            raise _corrupt(directory, f"reading tensor {name!r} of {where[name]}", e) from e

    params = params_from_hf_tensors(spec, get_tensor, where.keys(), dtype)
    return spec, params


# ------------------------------------------------------------------------------------------------------------
# orbax
# ------------------------------------------------------------------------------------------------------------

def params_to_dict(params: LlamaParams) -> dict:
    def strip(dc):
        return {f.name: getattr(dc, f.name) for f in dataclasses.fields(dc) if getattr(dc, f.name) is not None
                and f.name != "layers"}
    out = strip(params)
    out["layers"] = {str(i): strip(layer) for i, layer in enumerate(params.layers)}
    return out


def _dict_shapes(d: dict) -> Dict[str, Tuple[int, ...]]:
    """path -> shape of a `params_to_dict` tree ('layers.0.wq', ...; the paths of `param_table`)."""
    out = {}
    for k, v in d.items():
        if k == "layers":
            out.update({f"layers.{i}.{n}": tuple(x.shape) for i, layer in v.items() for n, x in layer.items()})
        else:
            out[k] = tuple(v.shape)
    return out


def params_from_dict(d: dict) -> LlamaParams:
    layers = tuple(LayerParams(**d["layers"][str(i)]) for i in range(len(d["layers"])))
    return LlamaParams(layers=layers, **{k: v for k, v in d.items() if k != "layers"})


def spec_to_json(spec: ModelSpec) -> str:
    return json.dumps(dataclasses.asdict(spec), indent=1)


def spec_from_json(text: str) -> ModelSpec:
    d = json.loads(text)
    if d.get("rope_scaling") is not None:
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    return ModelSpec(**d)


def save_params(directory, spec: ModelSpec, params: LlamaParams) -> None:
    """Write params with orbax to <directory>/params and the spec to <directory>/pdjax_spec.json."""
    directory = pathlib.Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory / ORBAX_SUBDIR, params_to_dict(params), force=True)
    atomic_write_text(directory / SPEC_FILE, spec_to_json(spec))
    write_checksums(directory)


def restore_params(directory) -> Tuple[ModelSpec, LlamaParams]:
    """(spec, params) written by `save_params`, restored exactly (same dtypes and values) as host numpy arrays
    (the runner places them on its mesh)."""
    directory = pathlib.Path(directory).absolute()
    try:
        spec = spec_from_json((directory / SPEC_FILE).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, AttributeError) as e:   # not JSON / not a spec
        raise _corrupt(directory, f"reading {SPEC_FILE}", e) from e
    try:
        with ocp.StandardCheckpointer() as ckptr:
            meta = ckptr.metadata(directory / ORBAX_SUBDIR)
            tree = getattr(meta, "item_metadata", meta)
            # Host-side numpy arrays (a numpy target), never device arrays: the runner's device_put then fills each
            # process's own shards of any mesh from its copy, even a mesh this process holds no device of (a TP
            # group on another process of a multi-process run: a committed device array cannot be put there), and a
            # model larger than one device is never placed whole on one. (The sharding stored at save time names
            # the saver's devices, which another process does not have.)
            target = jax.tree_util.tree_map(lambda m: np.empty(m.shape, m.dtype), tree)
            restored = ckptr.restore(directory / ORBAX_SUBDIR, target)
    except Exception as e:  # orbax/TensorStore raise plain Exception, ValueError, JSON errors
        raise _corrupt(directory, f"restoring {ORBAX_SUBDIR}/ with orbax", e) from e
    check_shapes(_dict_shapes(restored), spec, where=f"checkpoint {str(directory)!r}")
    return spec, params_from_dict(restored)


class NonFiniteWeightsError(CheckpointCorruptError):
    """A checkpoint's weights hold NaN or inf values (a corrupt file that still decodes, or diverged training)."""


def _display_path(path: str) -> str:
    """'layers.2.w_gate' -> 'layers[2].w_gate' (as the tensor is reached in LlamaParams)."""
    parts = path.split(".")
    return f"layers[{parts[1]}].{parts[2]}" if parts[0] == "layers" else path


def check_finite(checkpoint, spec: ModelSpec, params: LlamaParams, *, hf: bool = False) -> None:
    """Raise NonFiniteWeightsError, one line naming the checkpoint, the first tensor (in table order) holding NaN
    or inf values and how many, unless every weight is finite. hf: also name the HF tensor it was read from.
    One reduction per tensor on the weights' device and one transfer of the counts."""
    flat = flat_params(params)
    counts = jax.device_get([jnp.sum(~jnp.isfinite(x)) for x in flat.values()])
    bad = [(path, int(n)) for path, n in zip(flat, counts) if n]
    if not bad:
        return
    path, n = bad[0]
    name = _display_path(path)
    if hf:
        name += f" ({_hf_name(table_items(param_table(spec))[path])[0]})"
    more = f" (and {len(bad) - 1} more tensor(s) with non-finite values)" if len(bad) > 1 else ""
    raise NonFiniteWeightsError(f"checkpoint {str(checkpoint)!r}: params {name} has {n} non-finite values (NaN or "
                                f"inf) of {flat[path].size}{more}: the file is corrupt or the weights diverged")


def load_model(checkpoint: str, *, dtype=None, seed: int = 0, verify_checksums: bool = True
               ) -> Tuple[ModelSpec, LlamaParams]:
    """(spec, params) from an orbax dir written by `save_params`, an HF directory, or a registry spec name
    (random dummy weights with `seed`). A checkpoint's files are checked against the SHA-256s recorded at save
    (`verify_checksums`; skipped with verify_checksums=False) and its weights to be finite (`check_finite`)."""
    path = pathlib.Path(checkpoint)
    if path.is_dir():
        if verify_checksums:
            verify_checksums_of(path)
        if (path / SPEC_FILE).is_file():
            spec, params = restore_params(path)
            check_finite(checkpoint, spec, params)
            if dtype is not None:
                params = jax.tree_util.tree_map(lambda x: x.astype(jnp_dtype(dtype)), params)
            return spec, params
        if (path / "config.json").is_file():
            spec, params = load_hf_checkpoint(path, dtype)
            check_finite(checkpoint, spec, params, hf=True)
            return spec, params
        raise UserError(f"checkpoint directory {checkpoint!r} has neither {SPEC_FILE} (orbax) nor "
                         f"config.json (HF)")
    if os.sep in checkpoint or checkpoint.startswith("."):
        raise UserError(f"checkpoint {checkpoint!r} is not a directory (and not a registry spec name)")
    spec = get_model_spec(checkpoint)
    check_runnable(spec)
    return spec, init_params(spec, seed, dtype)
