"""Incremental detokenization: output tokens arrive one at a time, text goes out as soon as it is final.

    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
    piece = detok.add(token_id)      # '' while the tokens so far end inside a character
    rest = detok.flush()             # at the end: whatever was held back

The method of vLLM's incremental detokenizer (prefix and read offsets), written for any `Tokenizer`:
`read_offset` is where the text already sent ends, `prefix_offset` a few tokens before it. Each new token
decodes ids[prefix_offset:] and ids[prefix_offset:read_offset]; what the first adds to the second is new text,
sent only when it does not end in U+FFFD (the tokens so far end inside a multi-byte character: a byte-level or
byte-fallback token carrying part of a CJK character or an emoji), then both offsets move up. Decoding a
window rather than one token keeps what a token means in context (a Metaspace '▁' becomes a space only after
something); the window starts in the prompt's last tokens (PROMPT_CONTEXT), as vLLM's does, unless the prompt
itself ends inside a character. The sum of the pieces is the text of the whole output: the API streams them
and joins them for a non-streamed answer, so both are equal by construction.

`TextStream` adds stop strings on top: text that could still be the start of a stop string is held back, and
a stop string is never sent (OpenAI's rule); it may span tokens.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 5      # prompt tokens decoded with the first output tokens (as vLLM)


class IncrementalDetokenizer:
    """Text of output tokens as they come (module docstring)."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        context = list(prompt_ids[-PROMPT_CONTEXT:])
        if context and self._decode(context).endswith(REPLACEMENT):
            context = []
        self.ids: List[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _step(self, final: bool) -> str:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) and not final:
            return ""
        if full.endswith(REPLACEMENT) and not final:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]

    def add(self, token_id: int) -> str:
        """The new text once `token_id` is appended ('' while a character is incomplete)."""
        self.ids.append(int(token_id))
        return self._step(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end is decoded as U+FFFD)."""
        return self._step(final=True) if self.read_offset < len(self.ids) else ""


class TextStream:
    """Detokenized text with stop strings: add(token) -> (text to send, a stop string was hit). With no
    tokenizer there is no text (token-id models) and no stop string can match."""

    def __init__(self, tokenizer, stops: Sequence[str], prompt_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True):
        self.detok = None if tokenizer is None else IncrementalDetokenizer(
            tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0

    def _release(self, final: bool) -> Tuple[str, bool]:
        if self.stops:
            hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
            if hits:
                end = min(hits)
                piece, self.sent = self.text[self.sent:end], end
                self.text = self.text[:end]
                return piece, True
        upto = len(self.text) if final else len(self.text) - self.hold
        if upto <= self.sent:
            return "", False
        piece, self.sent = self.text[self.sent:upto], upto
        return piece, False

    def add(self, token_id: int) -> Tuple[str, bool]:
        if self.detok is not None:
            self.text += self.detok.add(token_id)
        return self._release(final=False)

    def flush(self) -> Tuple[str, bool]:
        """At the end of the request: the held-back text, unless the end completes a stop string."""
        if self.detok is not None:
            self.text += self.detok.flush()
        return self._release(final=True)
