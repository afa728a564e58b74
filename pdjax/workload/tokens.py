"""Deterministic synthetic token ids.

A token id is a pure function of (seed, stream, key, position): a splitmix64 hash, reduced modulo the vocab
size (or indexed into an `allowed` list, e.g. printable bytes for a byte-level model). Counter-based hashing
instead of a sequential RNG makes a prompt independent of every other request's length, and lets two requests
share a prefix exactly by using the same (stream, key) for it (a shared system prompt, a Mooncake hash block).
The modulo bias is below vocab_size / 2^64, nothing a workload can notice.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

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
    with np.errstate(over="ignore"):
        base = _mix(np.array([seed & (2**64 - 1)], dtype=np.uint64) * _GOLDEN + np.uint64(stream))
        base = _mix(base ^ (np.uint64(key & (2**64 - 1)) * _GOLDEN))
        x = _mix(base + (np.arange(1, length + 1, dtype=np.uint64) * _GOLDEN))
    if allowed:
        table = np.asarray(allowed, dtype=np.int64)
        return table[(x % np.uint64(len(table))).astype(np.int64)].tolist()
    return (x % np.uint64(vocab_size)).astype(np.int64).tolist()
