"""The OpenAI shapes of per-token logprobs, from the engine's `TokenLogprobs` (pdjax.scheduler.logprobs).

Completions (OpenAI's legacy object, `logprobs: n`, n in 0..5):
    {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float} of the n most likely],
     "text_offset": [int: where each token's text starts in the choice's text]}
Chat (`logprobs: true`, `top_logprobs: n`, n in 0..20):
    {"content": [{"token": str, "logprob": float, "bytes": [int] | null,
                  "top_logprobs": [{"token", "logprob", "bytes"} of the n most likely]}]}
A streamed chunk carries the object of its own token (text_offset continues across chunks). Logprobs are of the
raw model logits (before temperature / top-k / top-p, as vLLM's default), clamped at -9999.0 as vLLM does (JSON
has no -inf). Token strings and bytes come from the service (`CompletionService.token_text` / `token_bytes`);
text offsets count the characters the token's bytes complete in an incremental UTF-8 decode, so a character split
over byte tokens starts at the token that completes it.
"""
from __future__ import annotations

import codecs
from typing import Callable, List, Optional, Sequence

from pdjax.scheduler.logprobs import TokenLogprobs

LOGPROB_FLOOR = -9999.0


def _clamp(value: Optional[float]) -> Optional[float]:
    return None if value is None else max(float(value), LOGPROB_FLOOR)


class LogprobsFormat:
    """One request's logprobs in its endpoint's shape (module docstring). chat: the chat shape, else the
    completions one; token_text(id) -> str, token_bytes(id) -> list of ints or None."""

    def __init__(self, *, chat: bool, token_text: Callable[[int], str],
                 token_bytes: Callable[[int], Optional[List[int]]], text_offset: int = 0):
        self.chat, self.token_text, self.token_bytes = chat, token_text, token_bytes
        self.offset = text_offset
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _next_offset(self, token_id: int) -> int:
        start = self.offset
        self.offset += len(self._decoder.decode(bytes(self.token_bytes(token_id) or ())))
        return start

    def _chat_entry(self, token_id: int, logprob: Optional[float]) -> dict:
        return {"token": self.token_text(token_id), "logprob": _clamp(logprob), "bytes": self.token_bytes(token_id)}

    def of(self, token_ids: Sequence[int], entries: Sequence[Optional[TokenLogprobs]]) -> dict:
        """The logprobs object of `token_ids` (a choice's, or a chunk's one token); entries[i] belongs to
        token_ids[i] (None where the engine has none: logprob null)."""
        if self.chat:
            content = []
            for tok, e in zip(token_ids, entries):
                item = self._chat_entry(tok, None if e is None else e.logprob)
                item["top_logprobs"] = [self._chat_entry(i, v) for i, v in (e.top if e is not None else ())]
                content.append(item)
            return {"content": content}
        return {"tokens": [self.token_text(t) for t in token_ids],
                "token_logprobs": [None if e is None else _clamp(e.logprob) for e in entries],
                "top_logprobs": [{self.token_text(i): _clamp(v) for i, v in (e.top if e is not None else ())}
                                 for e in entries],
                "text_offset": [self._next_offset(t) for t in token_ids]}


def entries_of(req, count: int) -> List[Optional[TokenLogprobs]]:
    """The engine's TokenLogprobs of the first `count` output tokens of scheduler Request `req` (None where missing)."""
    held = req.output_logprobs or ()
    return [held[i] if i < len(held) else None for i in range(count)]
