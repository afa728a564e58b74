"""Loading ml_collections config files by path (config files build on each other: a sweep on configs/serve.py)."""
from __future__ import annotations

import dataclasses

import importlib.util
import os
import typing
from typing import Any, Optional

import ml_collections
from ml_collections import config_dict


def config_file(anchor_file: str, rel_path: str, arg: Optional[str] = None) -> Any:
    """`get_config(arg)` (or `get_config()` when arg is None) of the config file at `rel_path`, relative to the
    directory of `anchor_file` (pass `__file__`)."""
    path = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(anchor_file)), rel_path))
    if not os.path.isfile(path):
        raise ValueError(f"config file {path!r} does not exist")
    name = "_pdjax_config_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config() if arg is None else module.get_config(arg)


def config_block(cls, *, exclude=(), **values) -> Any:
    """An ml_collections ConfigDict holding every field of dataclass `cls` (nested dataclasses as nested blocks),
    at its default unless given in `values`, so every field can be set from the command line
    (`--config.block.field=...`). A field whose default is None becomes a typed placeholder (settable, None
    until set); `exclude` names fields the block leaves out (set elsewhere)."""
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"config_block({cls.__name__}): unknown field(s) {unknown}")
    block = ml_collections.ConfigDict()
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        if f.name in values:
            value = values[f.name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        else:
            value = f.default_factory()
        if dataclasses.is_dataclass(value):
            value = config_block(type(value), **{k.name: getattr(value, k.name) for k in dataclasses.fields(value)})
        elif value is None:
            args = [a for a in typing.get_args(hints[f.name]) if a is not type(None)]
            simple = [a for a in args if a in (int, float, str, bool)]
            value = config_dict.placeholder(simple[0]) if simple else ""
        block[f.name] = value
    return block


REPO_ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir))
SHARED_TRACES_DIR = os.path.normpath(os.path.join(REPO_ROOT, os.pardir, "shared", "data", "traces"))


def shared_trace(name: str) -> str:
    """Absolute path of a trace in the team's shared folder (../shared/data/traces beside the repository), so
    config files that replay one work from any working directory."""
    return os.path.join(SHARED_TRACES_DIR, name)


def replay_trace_lengths(workload, path: str, num_requests: int) -> None:
    """Set a config's `workload` block to replay the first `num_requests` rows of the trace at `path` with their
    own prompt and output lengths (random token ids from a 32000-token vocabulary, nothing rescaled or capped).
    Arrivals stay the caller's choice (`workload.arrival`: the trace's own times, or Poisson at a rate)."""
    workload.kind = "trace"
    workload.preset = ""
    workload.trace_path = path
    workload.trace_start = 0
    workload.num_requests = num_requests
    workload.vocab_size = 32000
    workload.prompt_source = "random"
    workload.fit_to_model = False
    workload.scale = 1.0
    workload.max_output_len = 0
