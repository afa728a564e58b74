"""Config dicts (from ml_collections files) to frozen dataclasses, and the per-field checks they declare: unknown
keys, wrong types and failed checks are reported with the dotted key path (e.g. `deployment.prefill.tp`). No JAX.

A field's own bounds and choices are declared where the field is, as dataclass field metadata (`positive_int`,
`nonneg_int`, `number`, `one_of`, `flag`, `text`: each a `dataclasses.field` carrying a `Check`), and enforced by
one function, `check_fields`, which a config dataclass calls first in `__post_init__` (so a config built directly,
or by `dataclasses.replace`, is checked too); only rules that relate several fields are written out after it. A
failed field check raises `FieldError` (a ValueError), whose key `dataclass_from_dict` prefixes with the block's path.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
import typing
from typing import Any, Mapping, Optional, Tuple

from pdjax.config.registry import Registry

CHECK = "pdjax_check"     # the field-metadata key holding a field's Check


class FieldError(ValueError):
    """A value that failed its field's check: `key=value, expected ...`; `key` is dotted (`scheduler.token_budget`)
    once the parser knows the block."""

    def __init__(self, key: str, value: Any, expected: str):
        self.key, self.value, self.expected = key, value, expected
        super().__init__(f"{key}={value!r}, expected {expected}")

    def under(self, where: str) -> "FieldError":
        """The same error with its key inside block `where` (unchanged when the key already names it)."""
        if not where or self.key == where or self.key.startswith(where + "."):
            return self
        return FieldError(f"{where}.{self.key}", self.value, self.expected)


def is_int(v) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """A real number (int, float, numpy scalar) that is not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class Check:
    """What one field's value must be. kind: 'int' | 'number' | 'bool' | 'str' | 'choice'. low / high: inclusive
    bounds unless low_open / high_open. optional: None is allowed. expected: the message's "expected ..." text
    (default: derived from the rest, plus `note`)."""
    kind: str
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    choices: Tuple[Any, ...] = ()
    optional: bool = False
    note: str = ""
    expected: str = ""

    def describe(self) -> str:
        if self.expected:
            return self.expected
        if self.kind == "choice":
            text = f"one of {self.choices}"
        elif self.kind == "bool":
            text = "a bool"
        elif self.kind == "str":
            text = "a string"
        elif self.kind == "int" and self.high is None:
            text = "a positive int" if self.low == 1 else f"an int >= {self.low}"
        else:
            noun = "an int" if self.kind == "int" else "a number"
            if self.low is not None and self.high is not None:
                left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
                text = f"{noun} in {left}{self.low}, {self.high}{right}"
            elif self.low is not None:
                text = f"{noun} {'>' if self.low_open else '>='} {self.low}"
            else:
                text = noun
        return f"{text} {self.note}" if self.note else text

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if self.kind == "choice":
            return value in self.choices
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "str":
            return isinstance(value, str)
        if not (is_int(value) if self.kind == "int" else is_number(value)):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)


def checked(default: Any = dataclasses.MISSING, check: Optional[Check] = None, **field_kw) -> Any:
    """A dataclass field (default `default`) whose value `check_fields` checks against `check`."""
    return dataclasses.field(default=default, metadata={CHECK: check}, **field_kw)


def positive_int(default: Any = dataclasses.MISSING, *, note: str = "", expected: str = "") -> Any:
    """An int field >= 1 ("expected a positive int")."""
    return checked(default, Check("int", low=1, note=note, expected=expected))


def nonneg_int(default: Any = 0, *, note: str = "", expected: str = "") -> Any:
    """An int field >= 0; `note` says what 0 means, e.g. "(0 = off)"."""
    return checked(default, Check("int", low=0, note=note, expected=expected))


def number(default: Any = dataclasses.MISSING, *, low: Optional[float] = None, high: Optional[float] = None,
           low_open: bool = False, high_open: bool = False, optional: bool = False, note: str = "",
           expected: str = "") -> Any:
    """A number field (int or float, not bool) within the given bounds (inclusive unless *_open)."""
    return checked(default, Check("number", low=low, high=high, low_open=low_open, high_open=high_open,
                                  optional=optional, note=note, expected=expected))


def one_of(default: Any, choices, *, expected: str = "") -> Any:
    """A field whose value is one of `choices` (a pdjax.config.registry.Registry stays live: a name registered later
    is accepted, and the error lists the names registered by then)."""
    return checked(default, Check("choice", choices=choices if isinstance(choices, Registry) else tuple(choices),
                                  expected=expected))


def flag(default: bool) -> Any:
    """A bool field (1 or 'yes' are not bools)."""
    return checked(default, Check("bool"))


def text(default: str = "", *, expected: str = "") -> Any:
    """A str field."""
    return checked(default, Check("str", expected=expected))


@functools.lru_cache(maxsize=None)
def _field_checks(cls) -> Tuple[Tuple[str, Check], ...]:
    return tuple((f.name, f.metadata[CHECK]) for f in dataclasses.fields(cls) if f.metadata.get(CHECK) is not None)


def check_fields(obj: Any, where: str = "") -> None:
    """Check every field of dataclass instance `obj` that declares a Check; FieldError (key `where.field`, or the
    bare field name when `where` is '') for the first that fails, in field order."""
    for name, check in _field_checks(type(obj)):
        value = getattr(obj, name)
        if not check.accepts(value):
            raise FieldError(f"{where}.{name}" if where else name, value, check.describe())


def coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is tuple or tp is tuple:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise FieldError(where, value, "a sequence")
        return tuple(value)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        return coerce(inner, value, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and not isinstance(value, tp):
        raise FieldError(where, value, tp.__name__)
    if tp is int and isinstance(value, bool):
        raise FieldError(where, value, "int")
    return value


def dataclass_from_dict(cls, values: Optional[Mapping[str, Any]], where: str):
    """Build dataclass `cls` from a mapping; unknown keys, wrongly typed values and failed field checks fail
    naming `where.key`; a failed cross-field rule fails naming the block `where`. The one alias rule: a class's
    `KEY_ALIASES` ({alias: field}) lets a key be spelled either way, not both ("given twice")."""
    values = dict(values or {})
    for alias, name in getattr(cls, "KEY_ALIASES", {}).items():
        if alias in values:
            if name in values:
                raise ValueError(f"{where}: {alias!r} given twice (as {name!r} and its alias {alias!r})")
            values[name] = values.pop(alias)
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
    except FieldError as e:
        raise e.under(where) from None
    except ValueError as e:   # a dataclass's cross-field rule: make sure the message says which block failed
        message = str(e)
        raise ValueError(message if where in message else f"{where}: {message}") from None
