"""Byte-level tokenizer of the `tiny-byte` model: token id = byte value, plus three special ids.

    0..255  the bytes of the UTF-8 text        BOS = 256   EOS = 257   PAD = 258   (vocab 259)

No download, no merges: any text round-trips exactly (`decode(encode(t)) == t`). `decode` drops the special
ids and replaces invalid UTF-8 (a model can emit a lone continuation byte) with U+FFFD, so it never raises
on model output. Pure Python, no JAX: workloads and reports may use it too.
"""
from __future__ import annotations

from typing import Iterable, List, Union

NUM_BYTES = 256
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259
SPECIAL_IDS = (BOS_ID, EOS_ID, PAD_ID)


def encode(text: Union[str, bytes], *, add_bos: bool = False, add_eos: bool = False) -> List[int]:
    """Token ids of `text` (str is UTF-8 encoded first), optionally wrapped in BOS ... EOS."""
    if isinstance(text, str):
        data = text.encode("utf-8")
    elif isinstance(text, (bytes, bytearray)):
        data = bytes(text)
    else:
        raise TypeError(f"text={text!r:.60}: expected str or bytes, got {type(text).__name__}")
    return ([BOS_ID] if add_bos else []) + list(data) + ([EOS_ID] if add_eos else [])


def decode_bytes(ids: Iterable[int]) -> bytes:
    """The bytes of `ids`, special ids dropped; ValueError on an id outside [0, VOCAB_SIZE)."""
    out = bytearray()
    for i, t in enumerate(ids):
        t = int(t)
        if not 0 <= t < VOCAB_SIZE:
            raise ValueError(f"token id {t} at index {i} is outside [0, {VOCAB_SIZE}) (byte vocab)")
        if t < NUM_BYTES:
            out.append(t)
    return bytes(out)


def decode(ids: Iterable[int]) -> str:
    """Text of `ids`: special ids dropped, invalid UTF-8 replaced with U+FFFD."""
    return decode_bytes(ids).decode("utf-8", errors="replace")
