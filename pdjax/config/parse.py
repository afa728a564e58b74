"""Config dicts (from ml_collections files) to frozen dataclasses: unknown keys, wrong types and failed checks
are reported with the dotted key path (e.g. `deployment.prefill.tp`). No JAX."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping, Optional


def coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is tuple or tp is tuple:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise ValueError(f"{where}={value!r}, expected a sequence")
        return tuple(value)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        return coerce(inner, value, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and not isinstance(value, tp):
        raise ValueError(f"{where}={value!r}, expected {tp.__name__}")
    if tp is int and isinstance(value, bool):
        raise ValueError(f"{where}={value!r}, expected int")
    return value


def dataclass_from_dict(cls, values: Optional[Mapping[str, Any]], where: str):
    """Build dataclass `cls` from a mapping; unknown keys and wrongly typed values fail naming `where.key`."""
    values = dict(values or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"unknown config key(s) {', '.join(where + '.' + k for k in unknown)}; "
                         f"known keys of {where}: {', '.join(sorted(fields))}")
    kwargs = {}
    for key, value in values.items():
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = dataclass_from_dict(tp, value, f"{where}.{key}")
        else:
            kwargs[key] = coerce(tp, value, f"{where}.{key}")
    try:
        return cls(**kwargs)
    except ValueError as e:   # a dataclass's own check: make sure the message says which block failed
        message = str(e)
        raise ValueError(message if where in message else f"{where}: {message}") from None
