"""The OpenAI-compatible HTTP app (FastAPI) over an EngineBridge.

Endpoints: POST /v1/completions, POST /v1/chat/completions (plain template, protocol.render_chat), GET /v1/models,
GET /health (200 once the engine is warm, 503 before and after a failure), GET /metrics (Prometheus).

Input checks answer 400 with OpenAI's error body before the request reaches the engine (bad JSON, a wrong field
type, n != 1, several prompts, an empty prompt, token ids outside the vocabulary, text without a tokenizer,
max_tokens <= 0, prompt + max_tokens beyond max_model_len, stop tokens under async scheduling); an unknown model
is 404; the queue bound is 429; not ready / shutting down is 503. Streaming (`stream: true`): one SSE chunk per
output token, the last carrying the finish reason, then (stream_options.include_usage) a usage chunk, then
`data: [DONE]`. A client that disconnects (stream cancelled, or a non-streaming request's connection closed)
aborts its request in the engine at once. Stop strings are matched on the decoded text; the text streamed holds
back what could still become a stop string and never includes it (OpenAI's rule); usage counts the tokens up to
the one that completed it. Byte-level models (vocab 259, pdjax.workload.byte_tokenizer) take and return text;
other models take token-id prompts and return `token_ids` only (text is empty).
"""
from __future__ import annotations

import asyncio
import codecs
import json
import secrets
import time
from typing import List, Optional, Sequence, Tuple

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdjax.config.sampling import SamplingParams
from pdjax.workload import byte_tokenizer
from pdjax.serving.api import protocol
from pdjax.serving.api.bridge import Busy, EngineBridge, Unavailable

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


class TextStream:
    """Incremental detokenization with stop strings: add(token) -> (text to send, stop string hit)."""

    def __init__(self, byte_level: bool, stops: Sequence[str]):
        self.byte_level = byte_level
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0

    def add(self, token_id: int) -> Tuple[str, bool]:
        if self.byte_level and 0 <= token_id < byte_tokenizer.NUM_BYTES:
            self.text += self.decoder.decode(bytes([token_id]))
        if self.stops:
            hits = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
            if hits:
                end = min(hits)
                piece, self.sent = self.text[self.sent:end], end
                self.text = self.text[:end]
                return piece, True
        upto = len(self.text) - self.hold
        if upto <= self.sent:
            return "", False
        piece, self.sent = self.text[self.sent:upto], upto
        return piece, False

    def flush(self) -> str:
        """The held-back text, at the end of a request that no stop string ended."""
        self.text += self.decoder.decode(b"", final=True)
        piece, self.sent = self.text[self.sent:], len(self.text)
        return piece


def create_app(bridge: EngineBridge, *, model_name: str, eos_token_id: int = -1) -> FastAPI:
    app = FastAPI(title="pdjax OpenAI-compatible server")
    metrics = bridge.metrics
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        metrics.http_rejected.labels("400").inc()
        return _error_response(400, message, param=param)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        metrics.http_rejected.labels(str(exc.status)).inc()
        return _error_response(exc.status, exc.message, exc.type_, exc.param)

    @app.get("/health")
    async def health():
        if bridge.failed is not None:
            return JSONResponse({"status": "failed", "error": bridge.failed}, status_code=503)
        if not bridge.ready.is_set():
            return JSONResponse({"status": "starting"}, status_code=503)
        return {"status": "ok", "num_requests": bridge.num_live}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "pdjax"}
        if bridge.ready.is_set():
            card["max_model_len"] = bridge.max_model_len
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    def byte_level() -> bool:
        return bridge.vocab_size == byte_tokenizer.VOCAB_SIZE

    def check_ready() -> None:
        if bridge.failed is not None:
            raise ApiError(503, f"the engine failed: {bridge.failed}", type_="service_unavailable")
        if not bridge.ready.is_set():
            raise ApiError(503, "the engine is still warming up; retry when /health answers 200",
                           type_="service_unavailable")

    def prompt_ids(prompt) -> List[int]:
        check_ready()
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: {len(prompt)} prompts in one request; send one prompt per request",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not byte_level():
                raise ApiError(400, "prompt: this model has no tokenizer; send the prompt as token ids",
                               param="prompt")
            ids = byte_tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < bridge.vocab_size]
            if bad:
                raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary [0, {bridge.vocab_size})",
                               param="prompt")
        if not ids:
            raise ApiError(400, "prompt: empty prompt, expected at least one token", param="prompt")
        return ids

    def sampling_params(body, ids: List[int], max_tokens: Optional[int]) -> Tuple[SamplingParams, List[str]]:
        if body.model is not None and body.model != model_name:
            raise ApiError(404, f"The model `{body.model}` does not exist (this server serves `{model_name}`)",
                           type_="NotFoundError", param="model")
        if body.n != 1:
            raise ApiError(400, f"n: {body.n} choices; this server returns n=1 only", param="n")
        limit = bridge.max_model_len
        if max_tokens is None:
            max_tokens = limit - len(ids)
        elif max_tokens <= 0:
            raise ApiError(400, f"max_tokens: {max_tokens}, expected a positive number of tokens", param="max_tokens")
        if len(ids) + max(max_tokens, 1) > limit:
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{len(ids) + max(max_tokens, 1)} tokens ({len(ids)} in the prompt, {max(max_tokens, 1)} "
                           "for the completion). Please reduce the prompt or max_tokens.", param="max_tokens")
        stop_ids = list(body.stop_token_ids or ())
        if eos_token_id >= 0 and not body.ignore_eos:
            stop_ids.append(eos_token_id)
        if stop_ids and bridge.async_scheduling:
            raise ApiError(400, "stop_token_ids / EOS under engine.async_scheduling=True: requests must run to "
                           "max_tokens (send ignore_eos=true, no stop_token_ids)", param="stop_token_ids")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
        if stops and not byte_level():
            raise ApiError(400, "stop: this model has no tokenizer; use stop_token_ids", param="stop")
        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
        seed = body.seed if body.seed is not None else secrets.randbits(31)
        try:
            params = SamplingParams(
                temperature=float(1.0 if body.temperature is None else body.temperature), top_k=top_k,
                top_p=float(1.0 if body.top_p is None else body.top_p), seed=int(seed), max_tokens=int(max_tokens),
                stop_token_ids=tuple(dict.fromkeys(stop_ids)))
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return params, stops

    def submit(ids, params, prefix):
        try:
            return bridge.submit(ids, params, asyncio.get_running_loop(), prefix=prefix)
        except Busy as e:
            raise ApiError(429, str(e), type_="rate_limit_error") from None
        except Unavailable as e:
            raise ApiError(503, str(e), type_="service_unavailable") from None

    async def events(live, stops):
        """(text piece, token id or None, openai finish reason or None) per event, ending at the finish."""
        detok = TextStream(byte_level(), stops)
        count = 0
        while True:
            kind, value, reason = await live.queue.get()
            if kind == "error":
                raise ApiError(500 if bridge.failed else 400, value, type_="engine_error")
            if kind == "finish":
                yield detok.flush(), None, OPENAI_FINISH.get(value, value), count
                return
            count += 1
            piece, hit = detok.add(value)
            if hit:
                bridge.stop(live, count)
                yield piece, value, "stop", count
                return
            if reason is not None:
                piece += detok.flush()
            yield piece, value, OPENAI_FINISH.get(reason, reason) if reason else None, count
            if reason is not None:
                return

    async def generate(raw: Request, body, ids: List[int], max_tokens: Optional[int], chat: bool):
        params, stops = sampling_params(body, ids, max_tokens)
        live = submit(ids, params, "chatcmpl" if chat else "cmpl")
        rid, now = live.req.request_id, int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        want_ids = body.return_token_ids

        def choice(text, token_ids, finish, stream):
            if chat:
                c = {"index": 0, ("delta" if stream else "message"): (
                    {"content": text} if stream else {"role": "assistant", "content": text}),
                     "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            if want_ids:
                c["token_ids"] = token_ids
            return c

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def sse(payload) -> str:
                return f"data: {json.dumps(payload)}\n\n"

            async def stream():
                chunk = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": now, "model": model_name}
                over = False
                count = 0
                try:
                    if chat:
                        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}
                        yield sse({**chunk, "choices": [first]})
                    try:
                        async for piece, tok, finish, count in events(live, stops):  # noqa: B007 (count: read after)
                            yield sse({**chunk, "choices": [choice(piece, [] if tok is None else [tok], finish,
                                                                   True)]})
                    except ApiError as e:
                        over = True
                        yield sse(protocol.error_body(e.message, type_=e.type_, code=e.status))
                        yield "data: [DONE]\n\n"
                        return
                    over = True
                    if include_usage:
                        yield sse({**chunk, "choices": [], "usage": protocol.usage(len(ids), count)})
                    yield "data: [DONE]\n\n"
                finally:
                    if not over:          # cancelled: the client went away
                        bridge.abort(live)

            return StreamingResponse(stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        async def collect():
            text, tokens, finish = [], [], None
            async for piece, tok, finish, _ in events(live, stops):  # noqa: B007 (finish: the last one is returned)
                text.append(piece)
                if tok is not None:
                    tokens.append(tok)
            return "".join(text), tokens, finish

        task = asyncio.ensure_future(collect())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    break
                if await raw.is_disconnected():
                    task.cancel()
                    bridge.abort(live)
                    return Response(status_code=499)
        except asyncio.CancelledError:
            task.cancel()
            bridge.abort(live)
            raise
        text, tokens, finish = task.result()
        return {"id": rid, "object": obj, "created": now, "model": model_name,
                "choices": [choice(text, tokens, finish, False)], "usage": protocol.usage(len(ids), len(tokens))}

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest, raw: Request):
        return await generate(raw, body, prompt_ids(body.prompt), body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: protocol.ChatCompletionRequest, raw: Request):
        if not byte_level():
            raise ApiError(400, "messages: this model has no tokenizer for chat; use /v1/completions with token ids",
                           param="messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await generate(raw, body, prompt_ids(protocol.render_chat(body.messages)), max_tokens, chat=True)

    return app
