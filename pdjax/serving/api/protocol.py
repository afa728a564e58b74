"""Request and response bodies of the OpenAI-compatible API (pydantic models), and the OpenAI error body.

Requests accept the fields load generators send (OpenAI's, plus vLLM's `ignore_eos`, `top_k`, `stop_token_ids`,
`return_token_ids`); unknown fields are ignored, as vLLM does. Types are strict (a string where a number belongs
is a 400, not coerced), except that an int is accepted where a float belongs. Responses are plain dicts in the
OpenAI shapes (`text_completion`, `chat.completion`, their stream chunks); choices carry `token_ids` when the
request asked for `return_token_ids` (vLLM's field: exact ids, as a byte-level text may not round-trip).
"""
from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

Number = Union[StrictInt, float]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _SamplingFields(_Body):
    model: Optional[StrictStr] = None
    temperature: Optional[Number] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[Number] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[StrictInt] = Field(default=None, ge=-1)      # vLLM: -1 or 0 = off
    seed: Optional[StrictInt] = None
    stop: Optional[Union[StrictStr, List[StrictStr]]] = None
    stop_token_ids: Optional[List[StrictInt]] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: StrictBool = False
    n: StrictInt = 1
    return_token_ids: StrictBool = False
    user: Optional[StrictStr] = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions: prompt as text, as token ids, or a one-element list of either."""
    prompt: Union[StrictStr, List[StrictInt], List[StrictStr], List[List[StrictInt]]]
    max_tokens: Optional[StrictInt] = 16


class ContentPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Body):
    role: StrictStr
    content: Union[StrictStr, List[ContentPart], None] = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions: messages rendered by the plain template (`render_chat`)."""
    messages: List[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None


def message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def render_chat(messages: List[ChatMessage]) -> str:
    """The plain chat template for models without one: one 'role: content' line per message, then 'assistant:'."""
    return "".join(f"{m.role}: {message_text(m)}\n" for m in messages) + "assistant:"


def error_body(message: str, *, type_: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[Union[int, str]] = None) -> Dict[str, Any]:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> Dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
