"""Chat prompts: a model's Jinja `chat_template` rendered as transformers renders it, or the plain template.

    chat_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=True) -> ids

Rendering (`render`): jinja2's ImmutableSandboxedEnvironment (templates from a model directory are untrusted
code) with trim_blocks, lstrip_blocks, the loopcontrols extension and transformers' `{% generation %}` block; the
template sees `messages`,
`add_generation_prompt`, the tokenizer's special tokens (`bos_token`, `eos_token`, `pad_token`, `unk_token`),
`tools=None`, `documents=None`, and the globals `raise_exception(msg)` and `strftime_now(fmt)`; `tojson` dumps
without HTML escaping (ensure_ascii=False), all as transformers' apply_chat_template. The rendered text is
tokenized with add_special_tokens=False (the template writes its own BOS).

One difference on purpose: a variable the template prints but nobody defined (`{{ system }}`) raises instead of
rendering as '' (a silently wrong prompt); testing it (`is defined`, `if x`) still works.

Errors: a template that does not compile raises ChatTemplateError at load (`compile_template`, naming
tokenizer_config.json's chat_template); one that raises while rendering (raise_exception, an undefined variable,
a type error) raises ChatTemplateError with the template's message, which the API answers as a 400.
A model without a template uses `plain_chat`: one 'role: content' line per message, then 'assistant:'.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any, Dict, List, Sequence

JINJA_OPTIONS = {"trim_blocks": True, "lstrip_blocks": True}


class ChatTemplateError(ValueError):
    """The chat template failed to compile or to render (one line)."""


def plain_chat(messages: Sequence[Dict[str, Any]]) -> str:
    """The plain chat text for models without a template: 'role: content' lines, then 'assistant:'."""
    return "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages) + "assistant:"


def _raise_exception(message):
    import jinja2  # noqa: PLC0415 (optional until a template is used)
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    """The compiled jinja2 Template of `source` (cached); ChatTemplateError naming the line on a syntax error."""
    import jinja2  # noqa: PLC0415 (optional until a template is used)
    import jinja2.ext  # noqa: PLC0415 (as above)
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415 (as above)

    class PrintingUndefined(jinja2.Undefined):
        """Undefined that may be tested but not printed (module docstring)."""
        __slots__ = ()

        def __str__(self):
            self._fail_with_undefined_error()

    class GenerationBlock(jinja2.ext.Extension):
        """transformers' `{% generation %}...{% endgeneration %}` (marks the assistant's tokens): renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols", GenerationBlock],
                                        undefined=PrintingUndefined, **JINJA_OPTIONS)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat_template does not compile: {e.message} (template line {e.lineno})") from None


def _plain_messages(messages: Sequence[Any]) -> List[Dict[str, Any]]:
    """Messages as plain dicts (role, content as text: a list of text parts is joined)."""
    out = []
    for m in messages:
        m = dict(m) if isinstance(m, dict) else dict(m.model_dump(exclude_none=True))
        content = m.get("content")
        if isinstance(content, list):
            m["content"] = "".join(p["text"] if isinstance(p, dict) else p.text for p in content)
        out.append(m)
    return out


def render(tokenizer, messages: Sequence[Any], *, add_generation_prompt: bool = True) -> str:
    """The chat text of `messages` under the tokenizer's template (module docstring); ChatTemplateError if the
    template raises."""
    import jinja2  # noqa: PLC0415 (optional until a template is used)
    template = compile_template(tokenizer.chat_template)
    specials = {k: v for k, v in tokenizer.special_tokens.items() if v is not None}
    try:
        return template.render(messages=_plain_messages(messages), add_generation_prompt=add_generation_prompt,
                               tools=None, documents=None, **specials)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat_template raised: {e.message or type(e).__name__}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise ChatTemplateError(f"chat_template failed: {type(e).__name__}: {e}") from None


def chat_prompt_ids(tokenizer, messages: Sequence[Any], *, add_generation_prompt: bool = True) -> List[int]:
    """Token ids of the chat prompt: the model's template (tokenized without added special tokens), else the
    plain one."""
    if tokenizer.chat_template:
        return tokenizer.encode(render(tokenizer, messages, add_generation_prompt=add_generation_prompt),
                                add_special_tokens=False)
    return tokenizer.encode(plain_chat(_plain_messages(messages)))
