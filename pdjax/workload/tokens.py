"""Deterministic synthetic token ids.

A token id is a pure function of (seed, stream, key, position): a splitmix64 hash, reduced modulo the vocab
size (or indexed into an `allowed` list, e.g. printable bytes for a byte-level model). Counter-based hashing
instead of a sequential RNG makes a prompt independent of every other request's length, and lets two requests
share a prefix exactly by using the same (stream, key) for it (a shared system prompt, a Mooncake hash block).
The modulo bias is below vocab_size / 2^64, nothing a workload can notice.

Real-text prompts (`text_token_ids`): for byte-level models, a prompt is a window of a text's bytes (ids =
byte values) whose start is the same kind of hash of (seed, stream, key), so it is deterministic and
independent of other requests too. The default text is the stdlib's pydoc topics as CPython 3.11.7 has them
(`pinned_topics`: a snapshot in pdjax/workload/data, since the stdlib's copy changes between Python versions and a
seeded workload must give the same prompts on every interpreter; also the training text of the `tiny-byte`
checkpoint).
"""
from __future__ import annotations

import functools
import json
import lzma
import pathlib
from typing import List, Optional, Sequence, Tuple

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)

# Streams keep the different uses of one seed apart.
STREAM_BODY = 1        # key: request index (or session*1000+turn stand-ins, see generate.py)
STREAM_PREFIX = 2      # key: prefix group
STREAM_ANSWER = 3      # key: stand-in for the model's answer in multi-turn sessions
STREAM_BLOCK = 4       # key: trace hash id (Mooncake prefix blocks)


def _mix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def hashed_token_ids(seed: int, stream: int, key: int, length: int, vocab_size: int,
                     allowed: Optional[Sequence[int]] = None) -> List[int]:
    """[length] token ids in [0, vocab_size), or drawn from `allowed` when given."""
    if length < 0:
        raise ValueError(f"length={length!r}, expected >= 0")
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size!r}, expected >= 1")
    # one-element arrays, not numpy scalars: integer arrays wrap mod 2**64 without an overflow warning
    base = _mix(np.array([seed & (2**64 - 1)], dtype=np.uint64) * _GOLDEN + np.uint64(stream))
    base = _mix(base ^ (np.array([key & (2**64 - 1)], dtype=np.uint64) * _GOLDEN))
    x = _mix(base + (np.arange(1, length + 1, dtype=np.uint64) * _GOLDEN))
    if allowed:
        table = np.asarray(allowed, dtype=np.int64)
        return table[(x % np.uint64(len(table))).astype(np.int64)].tolist()
    return (x % np.uint64(vocab_size)).astype(np.int64).tolist()


PINNED_TOPICS = pathlib.Path(__file__).with_name("data") / "pydoc_topics.json.xz"


@functools.lru_cache(maxsize=1)
def pinned_topics() -> Tuple[Tuple[str, str], ...]:
    """((key, text), ...) of every stdlib pydoc topic as CPython 3.11.7 has them (Lib/pydoc_data/topics.py, the
    Python documentation under the PSF License), in sorted key order, each text stripped of leading and trailing
    newlines: the same on every interpreter (the stdlib's own copy differs between Python versions)."""
    with lzma.open(PINNED_TOPICS, "rt", encoding="utf-8") as f:
        return tuple((key, text) for key, text in json.load(f)["topics"])


def default_text_bytes() -> bytes:
    """The pinned pydoc topics (`pinned_topics`) as UTF-8 bytes, separated by a blank line (466,194 bytes)."""
    return "\n\n".join(text for _, text in pinned_topics()).encode("utf-8")


@functools.lru_cache(maxsize=4)
def load_text_bytes(path: str = "") -> bytes:
    """The bytes of the text file at `path`, or `default_text_bytes()` for ''."""
    if not path:
        return default_text_bytes()
    file = pathlib.Path(path)
    if not file.is_file():
        raise ValueError(f"text_path={path!r} is not a file; expected a text file (or '' for the stdlib "
                         "pydoc topics text)")
    data = file.read_bytes()
    if not data:
        raise ValueError(f"text_path={path!r} is empty; expected a non-empty text file")
    return data


def text_token_ids(text: bytes, seed: int, stream: int, key: int, length: int) -> List[int]:
    """[length] byte ids: a window of `text` starting at a hash of (seed, stream, key); wraps around the end
    (the text joined to itself) when the window does not fit."""
    if length < 0:
        raise ValueError(f"length={length!r}, expected >= 0")
    if not text:
        raise ValueError("text is empty; expected at least one byte")
    if length == 0:
        return []
    (start,) = hashed_token_ids(seed, stream, key, 1, len(text))
    if start + length <= len(text):
        return list(text[start:start + length])
    reps = -(-(start + length) // len(text))
    return list((text * reps)[start:start + length])
