"""Loading ml_collections config files by path (config files build on each other: a sweep on configs/serve.py)."""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Optional


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
