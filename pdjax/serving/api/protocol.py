"""Request and response bodies of the OpenAI-compatible API (pydantic models), and the OpenAI error body.

Requests accept the fields load generators send (OpenAI's, plus vLLM's `ignore_eos`, `top_k`, `stop_token_ids`,
`return_token_ids`); unknown fields are ignored, as vLLM does, except OpenAI's and vLLM's own fields this server
does not implement (UNSUPPORTED_FIELDS: best_of, penalties, prompt_logprobs, ...), refused with a 400 naming the
field unless their value asks for nothing. Types are strict (a string where a number belongs
is a 400, not coerced), except that an int is accepted where a float belongs. Responses are plain dicts in the
OpenAI shapes (`text_completion`, `chat.completion`, their stream chunks); choices carry `token_ids` when the
request asked for `return_token_ids` (vLLM's field: exact ids, as a byte-level text may not round-trip).

Text fields (vLLM's): `skip_special_tokens` (both), `add_special_tokens` (completions), `add_generation_prompt`
(chat); /tokenize and /detokenize take vLLM's bodies (TokenizeRequest, DetokenizeRequest).
"""
from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from pdjax.workload.chat_template import plain_chat

Number = Union[StrictInt, float]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: StrictBool = False


# OpenAI / vLLM request fields this server does not implement -> the values that ask for nothing (a request that sends
# one of these with another value gets a 400 naming it, never an answer that silently ignored it). Only extras are
# checked: `top_logprobs` (a ChatCompletionRequest field) and `echo` (a CompletionRequest field) stay refused on the
# other endpoint, where they are not implemented; `logprobs` is a field of both.
UNSUPPORTED_FIELDS = {
    "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "logit_bias": (None, {}), "suffix": (None, ""), "min_tokens": (None, 0), "tools": (None, []),
    "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "prompt_logprobs": (None, 0), "use_beam_search": (None, False),
}


def unsupported_fields(body: BaseModel) -> List[str]:
    """The UNSUPPORTED_FIELDS a request sets to something other than a value that asks for nothing."""
    extra = body.model_extra or {}
    return [name for name, neutral in UNSUPPORTED_FIELDS.items()
            if name in extra and not any(extra[name] == v and isinstance(extra[name], bool) == isinstance(v, bool)
                                         for v in neutral)]


class _SamplingFields(_Body):
    model_config = ConfigDict(extra="allow", strict=True)   # to see UNSUPPORTED_FIELDS; other extras are ignored
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
    skip_special_tokens: StrictBool = True     # vLLM's: the text leaves special tokens out
    user: Optional[StrictStr] = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions: prompt as text, as token ids, or a one-element list of either. logprobs: the n most
    likely tokens per output token (OpenAI's legacy 0..5); echo: the prompt's text before the completion's."""
    prompt: Union[StrictStr, List[StrictInt], List[StrictStr], List[List[StrictInt]]]
    max_tokens: Optional[StrictInt] = 16
    add_special_tokens: StrictBool = True      # vLLM's: the tokenizer's BOS etc. around a text prompt
    logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=5)
    echo: StrictBool = False


class ContentPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Body):
    role: StrictStr
    content: Union[StrictStr, List[ContentPart], None] = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions: messages rendered by the model's chat template (pdjax.workload.chat_template),
    or the plain one (`render_chat`) for a model without one."""
    messages: List[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None
    add_generation_prompt: StrictBool = True   # vLLM's: end the prompt where the assistant's answer starts
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=20)     # needs logprobs=true


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's): a text `prompt`, or chat `messages` rendered by the chat template."""
    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[List[ChatMessage]] = None
    add_special_tokens: Optional[StrictBool] = None    # default: True for a prompt, False for messages
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's): token ids -> {"prompt": text}."""
    model: Optional[StrictStr] = None
    tokens: List[StrictInt]


def message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def render_chat(messages: List[ChatMessage]) -> str:
    """The plain chat template for models without one: one 'role: content' line per message, then 'assistant:'."""
    return plain_chat([{"role": m.role, "content": message_text(m)} for m in messages])


def error_body(message: str, *, type_: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[Union[int, str]] = None) -> Dict[str, Any]:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> Dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
