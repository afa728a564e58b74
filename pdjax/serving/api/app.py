"""The OpenAI-compatible HTTP app (FastAPI) over an EngineBridge.

Endpoints: POST /v1/completions, POST /v1/chat/completions (the model's chat template, pdjax.workload.chat_template;
the plain one without), POST /tokenize and /detokenize (vLLM's), GET /v1/models (with max_model_len), GET /health
(200 once the engine is warm, 503 before and after a failure), GET /metrics (Prometheus).

Text: the model's Tokenizer (pdjax.workload.tokenizer.load_tokenizer, given to `create_app`; the byte tokenizer
for a byte-vocabulary model when none is given) encodes text prompts and decodes outputs; its stop ids
(generation_config.json's eos ids) end every request unless `ignore_eos`. A model without one takes token-id
prompts and returns `token_ids` only (text is empty). Outputs are detokenized incrementally
(pdjax.workload.detokenize: a streamed piece never ends inside a character, and the pieces join to the
non-streamed text, which is built from the same stream).

Input checks answer 400 with OpenAI's error body before the request reaches the engine (bad JSON, a wrong field
type, n != 1, several prompts, an empty prompt, token ids outside the vocabulary, text without a tokenizer, a chat
template that raises, max_tokens <= 0, prompt + max_tokens beyond max_model_len, stop tokens under async
scheduling); an unknown model is 404; the queue bound is 429; not ready / shutting down is 503. Streaming
(`stream: true`): one SSE chunk per output token, the last carrying the finish reason, then
(stream_options.include_usage) a usage chunk, then `data: [DONE]`. A client that disconnects (stream cancelled, or a
non-streaming request's connection closed) aborts its request in the engine at once. Stop strings are matched on
the decoded text (so they may span tokens); the text streamed holds back what could still become a stop string and
never includes it (OpenAI's rule); usage counts the tokens up to the one that completed it. Logprobs (completions:
`logprobs` 0..5, OpenAI's legacy object; chat: `logprobs` and `top_logprobs` 0..20, the content list) come per output
token from the engine (`Request.output_logprobs`, shaped by `logprob_format.LogprobsFormat`, token strings and bytes
from the tokenizer: `token_text`, `token_bytes`), in each streamed chunk or the whole answer; `echo` (completions)
prepends the prompt's text, and is a 400 with logprobs (prompt logprobs are not computed).

Layout: `CompletionService` holds every check and the generation flow (tests call it without HTTP); the routers
(`status_router`: /health and /metrics, `models_router`: /v1/models, `completions_router`: both completions) are
thin async functions that find the service on `request.app.state.service` (`tokenize_router`: /tokenize and
/detokenize); `create_app` wires them.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Awaitable, Callable, List, Optional, Sequence, Tuple

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdjax.config.sampling import SamplingParams
from pdjax.workload import byte_tokenizer
from pdjax.serving.api import protocol
from pdjax.serving.api.bridge import Busy, EngineBridge, Unavailable, _Live
from pdjax.serving.api.logprob_format import LogprobsFormat, entries_of
from pdjax.workload.chat_template import ChatTemplateError, chat_prompt_ids
from pdjax.workload.detokenize import TextStream
from pdjax.workload.tokenizer import ByteTokenizer

OPENAI_FINISH = {"length": "length", "stop": "stop", "aborted": "abort"}
DISCONNECT_POLL_S = 0.05    # a non-streaming request checks this often whether its client went away


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type_, self.param = status, message, type_, param


def _error_response(status: int, message: str, type_: str = "invalid_request_error",
                    param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(protocol.error_body(message, type_=type_, param=param, code=status), status_code=status)


def _validation_message(exc: RequestValidationError) -> Tuple[str, Optional[str]]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    if e.get("type") == "json_invalid":
        return f"the body is not valid JSON: {e.get('msg', '')}".strip(), None
    param = ".".join(loc) or None
    value = e.get("input")
    shown = json.dumps(value)[:60] if isinstance(value, (str, int, float, bool, list, dict, type(None))) else "?"
    return f"{param or 'body'}: {e.get('msg', 'invalid value')} (got {shown})", param


class Reply:
    """The OpenAI shape of one request's answer: completion or chat, with or without token ids."""

    def __init__(self, request_id: str, model_name: str, *, chat: bool, want_ids: bool,
                 logprobs: Optional[LogprobsFormat] = None, echo: str = ""):
        self.request_id, self.model_name, self.chat, self.want_ids = request_id, model_name, chat, want_ids
        self.logprobs, self.echo = logprobs, echo    # logprobs: None unless asked; echo: prompt text to prepend
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def choice(self, text: str, token_ids: List[int], finish: Optional[str], stream: bool) -> dict:
        if self.chat:
            c = {"index": 0, ("delta" if stream else "message"): (
                {"content": text} if stream else {"role": "assistant", "content": text}),
                 "logprobs": None, "finish_reason": finish}
        else:
            c = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if self.want_ids:
            c["token_ids"] = token_ids
        return c

    def chunk(self) -> dict:
        """The fields every streamed chunk carries."""
        return {"id": self.request_id, "object": self.object + ".chunk" if self.chat else self.object,
                "created": self.created, "model": self.model_name}

    def whole(self, text: str, tokens: List[int], finish: Optional[str], num_prompt: int) -> dict:
        return {"id": self.request_id, "object": self.object, "created": self.created, "model": self.model_name,
                "choices": [self.choice(text, tokens, finish, False)],
                "usage": protocol.usage(num_prompt, len(tokens))}


def _sse(payload) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class CompletionService:
    """What the endpoints do, without HTTP: input checks (raising ApiError), submitting to the bridge, the event
    stream of a request, its streamed or whole answer."""

    def __init__(self, bridge: EngineBridge, *, model_name: str, eos_token_id: int = -1, tokenizer=None):
        self.bridge, self.model_name, self.eos_token_id = bridge, model_name, eos_token_id
        self._tokenizer = tokenizer
        self.created = int(time.time())

    @property
    def tokenizer(self):
        """The model's Tokenizer (pdjax.workload.tokenizer), the byte one for a byte-vocabulary model when none
        was given, or None (token ids only)."""
        if self._tokenizer is None and self.bridge.vocab_size == byte_tokenizer.VOCAB_SIZE:
            self._tokenizer = ByteTokenizer()
        return self._tokenizer

    # ---- status
    def health(self) -> Tuple[int, dict]:
        """(HTTP status, body) of /health."""
        bridge = self.bridge
        if bridge.failed is not None:
            return 503, {"status": "failed", "error": bridge.failed}
        if not bridge.ready.is_set():
            return 503, {"status": "starting"}
        return 200, {"status": "ok", "num_requests": bridge.num_live}

    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "pdjax"}
        if self.bridge.ready.is_set():
            card["max_model_len"] = self.bridge.max_model_len
        return {"object": "list", "data": [card]}

    # ---- input checks
    def check_ready(self) -> None:
        if self.bridge.failed is not None:
            raise ApiError(503, f"the engine failed: {self.bridge.failed}", type_="service_unavailable")
        if not self.bridge.ready.is_set():
            raise ApiError(503, "the engine is still warming up; retry when /health answers 200",
                           type_="service_unavailable")

    def prompt_ids(self, prompt, add_special_tokens: bool = True) -> List[int]:
        self.check_ready()
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: {len(prompt)} prompts in one request; send one prompt per request",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ApiError(400, "prompt: this model has no tokenizer; send the prompt as token ids",
                               param="prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = self.check_ids(list(prompt), "prompt")
        if not ids:
            raise ApiError(400, "prompt: empty prompt, expected at least one token", param="prompt")
        return ids

    def check_ids(self, ids: List[int], param: str) -> List[int]:
        vocab = self.bridge.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"{param}: token id {bad[0]} is outside the vocabulary [0, {vocab})", param=param)
        return ids

    def chat_prompt_ids(self, body, add_generation_prompt: bool = True) -> List[int]:
        """Token ids of a chat request's messages under the model's chat template (or the plain one)."""
        self.check_ready()
        if self.tokenizer is None:
            raise ApiError(400, "messages: this model has no tokenizer for chat; use /v1/completions with token ids",
                           param="messages")
        try:
            ids = chat_prompt_ids(self.tokenizer, body.messages, add_generation_prompt=add_generation_prompt)
        except ChatTemplateError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from None
        if not ids:
            raise ApiError(400, "messages: the chat template rendered an empty prompt", param="messages")
        return ids

    def _check_lengths(self, body, ids: List[int], max_tokens: Optional[int]) -> int:
        """The request's model, n and length checks; returns max_tokens (the rest of the context if not given)."""
        self._check_model(body.model)
        if body.n != 1:
            raise ApiError(400, f"n: {body.n} choices; this server returns n=1 only", param="n")
        for name in protocol.unsupported_fields(body):
            raise ApiError(400, f"{name}: {body.model_extra[name]!r} is not supported by this server; leave it unset",
                           param=name)
        limit = self.bridge.max_model_len
        if max_tokens is None:
            max_tokens = limit - len(ids)
        elif max_tokens <= 0:
            raise ApiError(400, f"max_tokens: {max_tokens}, expected a positive number of tokens", param="max_tokens")
        if len(ids) + max(max_tokens, 1) > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{len(ids) + max(max_tokens, 1)} tokens ({len(ids)} in the prompt, {max(max_tokens, 1)} "
                           "for the completion). Please reduce the prompt or max_tokens.", param="max_tokens")
        return max_tokens

    def sampling_params(self, body, ids: List[int], max_tokens: Optional[int]) -> Tuple[SamplingParams, List[str]]:
        max_tokens = self._check_lengths(body, ids, max_tokens)
        stop_ids = list(body.stop_token_ids or ())
        if not body.ignore_eos:
            stop_ids += [t for t in (self.eos_token_id,) if t >= 0]
            stop_ids += list(self.tokenizer.stop_token_ids if self.tokenizer is not None else ())
        if stop_ids and self.bridge.async_scheduling:
            raise ApiError(400, "stop_token_ids / EOS under engine.async_scheduling=True: requests must run to "
                           "max_tokens (send ignore_eos=true, no stop_token_ids)", param="stop_token_ids")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
        if stops and self.tokenizer is None:
            raise ApiError(400, "stop: this model has no tokenizer; use stop_token_ids", param="stop")
        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
        seed = body.seed if body.seed is not None else secrets.randbits(31)
        try:
            params = SamplingParams(
                temperature=float(1.0 if body.temperature is None else body.temperature), top_k=top_k,
                top_p=float(1.0 if body.top_p is None else body.top_p), seed=int(seed), max_tokens=int(max_tokens),
                stop_token_ids=tuple(dict.fromkeys(stop_ids)), logprobs=self.requested_logprobs(body))
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return params, stops

    # ---- /tokenize, /detokenize (vLLM's)
    def _check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist (this server serves `{self.model_name}`)",
                           type_="NotFoundError", param="model")

    def tokenize(self, body: protocol.TokenizeRequest) -> dict:
        """{count, max_model_len, tokens[, token_strs]} of a prompt or of chat messages."""
        self.check_ready()
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "tokenize: send exactly one of prompt (text) and messages (chat)", param="prompt")
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer (its directory has no tokenizer.json)", param="prompt")
        if body.prompt is not None:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = self.tokenizer.encode(body.prompt, add_special_tokens=add)
        else:
            ids = self.chat_prompt_ids(body, body.add_generation_prompt)
        out = {"count": len(ids), "max_model_len": self.bridge.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [self.tokenizer.id_to_token(t) for t in ids]
        return out

    def detokenize(self, body: protocol.DetokenizeRequest) -> dict:
        self.check_ready()
        self._check_model(body.model)
        if self.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer (its directory has no tokenizer.json)", param="tokens")
        return {"prompt": self.tokenizer.decode(self.check_ids(list(body.tokens), "tokens"))}

    # ---- logprobs and echo
    @staticmethod
    def requested_logprobs(body) -> Optional[int]:
        """SamplingParams.logprobs of a request (the top count; None: no logprobs). 400 for chat's top_logprobs
        without logprobs=true, and for echo with logprobs (the prompt's logprobs, not computed here)."""
        if isinstance(body, protocol.ChatCompletionRequest):
            if body.top_logprobs and not body.logprobs:
                raise ApiError(400, f"top_logprobs: {body.top_logprobs} needs logprobs=true", param="top_logprobs")
            return (body.top_logprobs or 0) if body.logprobs else None
        logprobs = getattr(body, "logprobs", None)
        if logprobs is not None and getattr(body, "echo", False):
            raise ApiError(400, "echo: echo=true with logprobs asks for the prompt's logprobs, which this server does "
                           "not compute (the step makes logits only where it samples); send echo or logprobs, not both",
                           param="echo")
        return logprobs

    def token_text(self, token_id: int) -> str:
        """A token's string in logprobs: the text of its bytes, 'bytes:\\xNN...' where they are not UTF-8 on their
        own (OpenAI's form), a special token's name; vLLM's 'token_id:N' for a model with no tokenizer."""
        tok = self.tokenizer
        if tok is None:
            return f"token_id:{token_id}"
        if token_id in tok.special_token_ids:
            return tok.id_to_token(token_id)
        data = tok.token_bytes(token_id)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    def token_bytes(self, token_id: int) -> Optional[List[int]]:
        """A token's UTF-8 bytes (chat logprobs' `bytes`); None for a special token (no text in the output) or a
        model with no tokenizer."""
        tok = self.tokenizer
        if tok is None or token_id in tok.special_token_ids:
            return None
        return list(tok.token_bytes(token_id))

    def prompt_text(self, body, ids: Sequence[int]) -> str:
        """The prompt's text for echo: a text prompt as sent; token ids decoded ('' with no tokenizer)."""
        prompt = body.prompt[0] if isinstance(body.prompt, list) and body.prompt and isinstance(
            body.prompt[0], (str, list)) else body.prompt
        if isinstance(prompt, str):
            return prompt
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens)

    def logprobs_format(self, params: SamplingParams, chat: bool, text_offset: int = 0) -> Optional[LogprobsFormat]:
        """The shape a request's logprobs are answered in; None when it asked for none."""
        if params.logprobs is None:
            return None
        return LogprobsFormat(chat=chat, token_text=self.token_text, token_bytes=self.token_bytes,
                              text_offset=text_offset)

    # ---- generation
    def submit(self, ids: List[int], params: SamplingParams, prefix: str) -> _Live:
        try:
            return self.bridge.submit(ids, params, asyncio.get_running_loop(), prefix=prefix)
        except Busy as e:
            raise ApiError(429, str(e), type_="rate_limit_error") from None
        except Unavailable as e:
            raise ApiError(503, str(e), type_="service_unavailable") from None

    async def events(self, live: _Live, stops: Sequence[str]):
        """(text piece, token id or None, openai finish reason or None, tokens so far) per event, ending at the
        finish."""
        detok = TextStream(self.tokenizer, stops, live.req.prompt_token_ids,
                           skip_special_tokens=live.skip_special_tokens)
        count = 0
        while True:
            kind, value, reason = await live.queue.get()
            if kind == "error":
                raise ApiError(500 if self.bridge.failed else 400, value, type_="engine_error")
            if kind == "finish":
                piece, hit = detok.flush()
                yield piece, None, "stop" if hit else OPENAI_FINISH.get(value, value), count
                return
            count += 1
            piece, hit = detok.add(value)
            if hit:
                self.bridge.stop(live, count)
                yield piece, value, "stop", count
                return
            if reason is not None:
                rest, hit = detok.flush()
                piece, reason = piece + rest, "stop" if hit else reason
            yield piece, value, OPENAI_FINISH.get(reason, reason) if reason else None, count
            if reason is not None:
                return

    async def collect(self, live: _Live, stops: Sequence[str]) -> Tuple[str, List[int], Optional[str]]:
        """(text, token ids, finish reason) of the whole request."""
        text, tokens, finish = [], [], None
        async for piece, tok, finish, _ in self.events(live, stops):  # noqa: B007 (finish: the last one is returned)
            text.append(piece)
            if tok is not None:
                tokens.append(tok)
        return "".join(text), tokens, finish

    async def stream(self, live: _Live, stops: Sequence[str], reply: Reply, num_prompt: int, include_usage: bool):
        """The SSE lines of a streamed request; a cancelled stream (the client went away) aborts it."""
        chunk = reply.chunk()
        over = False
        count = 0
        try:
            if reply.chat:
                first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                yield _sse({**chunk, "choices": [first]})
            elif reply.echo:
                yield _sse({**chunk, "choices": [reply.choice(reply.echo, [], None, True)]})
            try:
                async for piece, tok, finish, count in self.events(live, stops):
                    toks = [] if tok is None else [tok]
                    choice = _with_logprobs(reply.choice(piece, toks, finish, True), reply, live, toks, count - 1)
                    yield _sse({**chunk, "choices": [choice]})
            except ApiError as e:
                over = True
                yield _sse(protocol.error_body(e.message, type_=e.type_, code=e.status))
                yield "data: [DONE]\n\n"
                return
            over = True
            if include_usage:
                yield _sse({**chunk, "choices": [], "usage": protocol.usage(num_prompt, count)})
            yield "data: [DONE]\n\n"
        finally:
            if not over:          # cancelled: the client went away
                self.bridge.abort(live)

    async def whole(self, live: _Live, stops: Sequence[str], reply: Reply, num_prompt: int,
                    is_disconnected: Callable[[], Awaitable[bool]]):
        """The whole answer of a non-streamed request, or a 499 once `is_disconnected()` (the request is
        aborted then)."""
        task = asyncio.ensure_future(self.collect(live, stops))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    break
                if await is_disconnected():
                    task.cancel()
                    self.bridge.abort(live)
                    return Response(status_code=499)
        except asyncio.CancelledError:
            task.cancel()
            self.bridge.abort(live)
            raise
        text, tokens, finish = task.result()
        answer = reply.whole(text, tokens, finish, num_prompt)
        if reply.echo:
            answer["choices"][0]["text"] = reply.echo + answer["choices"][0]["text"]
        _with_logprobs(answer["choices"][0], reply, live, tokens, 0)
        return answer

    async def generate(self, body, ids: List[int], max_tokens: Optional[int], *, chat: bool,
                       is_disconnected: Callable[[], Awaitable[bool]]):
        """Check, submit and answer one request: a StreamingResponse (`body.stream`) or the whole answer."""
        params, stops = self.sampling_params(body, ids, max_tokens)
        live = self.submit(ids, params, "chatcmpl" if chat else "cmpl")
        live.skip_special_tokens = body.skip_special_tokens
        echo = self.prompt_text(body, ids) if getattr(body, "echo", False) else ""
        reply = Reply(live.req.request_id, self.model_name, chat=chat, want_ids=body.return_token_ids,
                      logprobs=self.logprobs_format(params, chat, len(echo)), echo=echo)
        if not body.stream:
            return await self.whole(live, stops, reply, len(ids), is_disconnected)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(self.stream(live, stops, reply, len(ids), include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _with_logprobs(choice: dict, reply: Reply, live: _Live, token_ids: List[int], first: int) -> dict:
    """`choice` with the logprobs of `token_ids` (output tokens first, first + 1, ... of the request) when the
    request asked for logprobs and there are tokens (a chunk without a token keeps null)."""
    if reply.logprobs is not None and token_ids:
        choice["logprobs"] = reply.logprobs.of(token_ids, entries_of(live.req, first + len(token_ids))[first:])
    return choice


def _service(request: Request) -> CompletionService:
    return request.app.state.service


status_router = APIRouter()
models_router = APIRouter()
completions_router = APIRouter()
tokenize_router = APIRouter()


@status_router.get("/health")
async def health(request: Request):
    status, body = _service(request).health()
    return body if status == 200 else JSONResponse(body, status_code=status)


@status_router.get("/metrics")
async def prometheus(request: Request):
    metrics = _service(request).bridge.metrics
    return Response(metrics.render(), media_type=metrics.content_type)


@models_router.get("/v1/models")
async def models(request: Request):
    return _service(request).models()


@completions_router.post("/v1/completions")
async def completions(body: protocol.CompletionRequest, raw: Request):
    service = _service(raw)
    return await service.generate(body, service.prompt_ids(body.prompt, body.add_special_tokens), body.max_tokens,
                                  chat=False,
                                  is_disconnected=raw.is_disconnected)


@completions_router.post("/v1/chat/completions")
async def chat_completions(body: protocol.ChatCompletionRequest, raw: Request):
    service = _service(raw)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return await service.generate(body, service.chat_prompt_ids(body, body.add_generation_prompt), max_tokens,
                                  chat=True,
                                  is_disconnected=raw.is_disconnected)


@tokenize_router.post("/tokenize")
async def tokenize(body: protocol.TokenizeRequest, raw: Request):
    return _service(raw).tokenize(body)


@tokenize_router.post("/detokenize")
async def detokenize(body: protocol.DetokenizeRequest, raw: Request):
    return _service(raw).detokenize(body)


async def _bad_request(request: Request, exc: RequestValidationError):
    message, param = _validation_message(exc)
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("application/json"):   # FastAPI then reads no JSON: say why, not "(got ?)"
        message, param = (f"the body must be JSON sent with Content-Type: application/json (got "
                          f"{'no Content-Type' if not content_type else 'Content-Type: ' + content_type})"), None
    _service(request).bridge.metrics.http_rejected.labels("400").inc()
    return _error_response(400, message, param=param)


async def _api_error(request: Request, exc: ApiError):
    _service(request).bridge.metrics.http_rejected.labels(str(exc.status)).inc()
    return _error_response(exc.status, exc.message, exc.type_, exc.param)


def create_app(bridge: EngineBridge, *, model_name: str, eos_token_id: int = -1, tokenizer=None) -> FastAPI:
    """The app; tokenizer: the model's (pdjax.workload.tokenizer.load_tokenizer), None for token ids only (the
    byte tokenizer is still used for a byte-vocabulary model)."""
    app = FastAPI(title="pdjax OpenAI-compatible server")
    app.state.service = CompletionService(bridge, model_name=model_name, eos_token_id=eos_token_id,
                                          tokenizer=tokenizer)
    app.add_exception_handler(RequestValidationError, _bad_request)
    app.add_exception_handler(ApiError, _api_error)
    for router in (status_router, models_router, completions_router, tokenize_router):
        app.include_router(router)
    return app
