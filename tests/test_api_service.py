"""pdjax.serving.api.app.CompletionService without HTTP or an engine: a bridge marked ready by hand, the engine's
token events put on the request's queue by the test. The checks, the event stream, stop strings and both answer
shapes; test_api_server.py drives the same service through FastAPI and a real engine."""
import asyncio
import json

import pytest

pytest.importorskip("fastapi")
from pdjax.serving.api import protocol
from pdjax.serving.api.app import ApiError, CompletionService, Reply, create_app
from pdjax.serving.api.bridge import EngineBridge
from pdjax.workload import byte_tokenizer


def _service(vocab_size=byte_tokenizer.VOCAB_SIZE, max_model_len=32, ready=True, eos=-1):
    bridge = EngineBridge(max_queued=2)
    bridge.vocab_size, bridge.max_model_len = vocab_size, max_model_len
    if ready:
        bridge.ready.set()
    return CompletionService(bridge, model_name="tiny", eos_token_id=eos)


def test_health_and_models_follow_the_bridge():
    s = _service(ready=False)
    assert s.health() == (503, {"status": "starting"})
    assert "max_model_len" not in s.models()["data"][0]
    s.bridge.ready.set()
    assert s.health() == (200, {"status": "ok", "num_requests": 0})
    assert s.models()["data"][0]["max_model_len"] == 32
    s.bridge.failed = "boom"
    assert s.health() == (503, {"status": "failed", "error": "boom"})


def test_prompt_and_sampling_checks_raise_api_errors():
    s = _service()
    assert s.prompt_ids("hi") == byte_tokenizer.encode("hi")
    assert s.prompt_ids([[5, 6]]) == [5, 6]
    for prompt, status in [([], 400), (["a", "b"], 400), ([999], 400)]:
        with pytest.raises(ApiError) as e:
            s.prompt_ids(prompt)
        assert e.value.status == status
    body = protocol.CompletionRequest(prompt="hi", max_tokens=4, stop=["x"], seed=3, temperature=0)
    params, stops = s.sampling_params(body, [1, 2], body.max_tokens)
    assert (params.max_tokens, params.seed, stops) == (4, 3, ["x"])
    assert s.sampling_params(protocol.CompletionRequest(prompt="hi"), [1, 2], None)[0].max_tokens == 30
    for bad, status in [(dict(model="other"), 404), (dict(n=2), 400), (dict(max_tokens=0), 400),
                        (dict(max_tokens=31), 400)]:
        with pytest.raises(ApiError) as e:
            s.sampling_params(protocol.CompletionRequest(prompt="hi", **bad), [1, 2], bad.get("max_tokens"))
        assert e.value.status == status
    with pytest.raises(ApiError, match="no tokenizer"):
        _service(vocab_size=1000).prompt_ids("hi")
    with pytest.raises(ApiError) as e:
        _service(ready=False).prompt_ids([1])
    assert e.value.status == 503


async def _never_disconnected():
    return False


def test_whole_answer_from_queued_events_and_a_stop_string():
    async def main():
        s = _service()
        body = protocol.CompletionRequest(prompt="ab", max_tokens=8, stop=["cd"], return_token_ids=True)
        ids = s.prompt_ids(body.prompt)
        params, stops = s.sampling_params(body, ids, body.max_tokens)
        live = s.submit(ids, params, "cmpl")
        for t in byte_tokenizer.encode("xycdz"):
            live.queue.put_nowait(("token", t, None))
        reply = Reply(live.req.request_id, s.model_name, chat=False, want_ids=True)
        return await s.whole(live, stops, reply, len(ids), _never_disconnected)

    out = asyncio.run(main())
    assert out["choices"][0]["text"] == "xy"
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["token_ids"] == byte_tokenizer.encode("xycd")
    assert out["usage"] == protocol.usage(2, 4)


def test_stream_lines_end_with_usage_and_done():
    async def main():
        s = _service()
        live = s.submit([1, 2], s.sampling_params(protocol.CompletionRequest(prompt=[1, 2]), [1, 2], 2)[0], "chatcmpl")
        live.queue.put_nowait(("token", byte_tokenizer.encode("o")[0], None))
        live.queue.put_nowait(("token", byte_tokenizer.encode("k")[0], "length"))
        reply = Reply(live.req.request_id, s.model_name, chat=True, want_ids=False)
        return [line async for line in s.stream(live, [], reply, 2, include_usage=True)]

    lines = asyncio.run(main())
    assert lines[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[1:3]) == "ok"
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert chunks[3]["usage"] == protocol.usage(2, 2)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}


def test_create_app_mounts_every_endpoint():
    app = create_app(_service().bridge, model_name="tiny")
    paths = set(app.openapi()["paths"])
    assert {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"} <= paths
    assert app.state.service.model_name == "tiny"


@pytest.mark.parametrize("field, value", [("best_of", 3), ("presence_penalty", 0.5), ("prompt_logprobs", 1),
                                          ("frequency_penalty", -1.0), ("logit_bias", {"5": 10}), ("top_logprobs", 2)])
def test_openai_fields_this_server_does_not_implement_are_refused_by_name(field, value):
    """issue 27 item 4: such fields were accepted, dropped, and answered 200 as if honoured."""
    s = _service()
    with pytest.raises(ApiError) as e:
        s.sampling_params(protocol.CompletionRequest(prompt="hi", **{field: value}), [1, 2], None)
    assert e.value.status == 400 and e.value.param == field and field in str(e.value)
    # the values that ask for nothing, and unknown fields, still pass (as vLLM ignores unknown fields)
    body = protocol.CompletionRequest(prompt="hi", logprobs=None, echo=False, best_of=1, presence_penalty=0.0,
                                      frequency_penalty=0, logit_bias={}, unknown_field="x")
    assert s.sampling_params(body, [1, 2], None)[0].max_tokens == 30


# ---------------------------------------------------------------------------------------------- logprobs, echo
def _entry(token, logprob, top):
    from pdjax.scheduler.logprobs import TokenLogprobs
    return TokenLogprobs(token, logprob, tuple(top))


# the engine's entries for the output "a", then the two bytes of "é" (0xc3 0xa9), then EOS (special, no text)
_OUT = [ord("a"), 0xC3, 0xA9, byte_tokenizer.EOS_ID]
_ENTRIES = [_entry(ord("a"), -0.5, [(ord("a"), -0.5), (ord("b"), -1.5), (0xC3, -2.0)]),
            _entry(0xC3, -0.25, [(0xC3, -0.25), (ord("a"), -3.0), (ord("b"), -4.0)]),
            _entry(0xA9, -float("inf"), [(ord("a"), -0.1), (0xA9, -1e9), (ord("b"), -5.0)]),
            _entry(byte_tokenizer.EOS_ID, -0.75, [(byte_tokenizer.EOS_ID, -0.75), (ord("a"), -1.0), (ord("b"), -2.0)])]


def _run(s, body, *, chat: bool, stream: bool):
    """The service's answer to `body` with the engine's tokens _OUT and their logprobs _ENTRIES[:n_top] put by hand."""
    async def main():
        ids = [1, 2]
        params, stops = s.sampling_params(body, ids, 4)
        live = s.submit(ids, params, "chatcmpl" if chat else "cmpl")
        live.req.output_logprobs = [_entry(e.token_id, e.logprob, e.top[:params.logprobs]) for e in _ENTRIES]
        for i, t in enumerate(_OUT):
            live.queue.put_nowait(("token", t, "length" if i == len(_OUT) - 1 else None))
        echo = s.prompt_text(body, ids) if getattr(body, "echo", False) else ""
        reply = Reply(live.req.request_id, s.model_name, chat=chat, want_ids=False,
                      logprobs=s.logprobs_format(params, chat, len(echo)), echo=echo)
        if stream:
            lines = [line async for line in s.stream(live, [], reply, 2, include_usage=False)]
            return [json.loads(line[len("data: "):]) for line in lines[:-1]]
        return await s.whole(live, stops, reply, 2, _never_disconnected)

    return asyncio.run(main())


def test_completion_logprobs_in_openais_legacy_shape_streamed_and_whole():
    s = _service()
    body = protocol.CompletionRequest(prompt=[1, 2], max_tokens=4, logprobs=2)
    assert s.sampling_params(body, [1, 2], 4)[0].logprobs == 2
    whole = _run(_service(), body, chat=False, stream=False)["choices"][0]
    assert whole["text"] == "a\u00e9"
    assert whole["logprobs"] == {
        "tokens": ["a", "bytes:\\xc3", "bytes:\\xa9", "<eos>"], "token_logprobs": [-0.5, -0.25, -9999.0, -0.75],
        "top_logprobs": [{"a": -0.5, "b": -1.5}, {"bytes:\\xc3": -0.25, "a": -3.0}, {"a": -0.1, "bytes:\\xa9": -9999.0},
                         {"<eos>": -0.75, "a": -1.0}],
        "text_offset": [0, 1, 1, 2]}     # "é" starts where its last byte completes it; EOS adds no text
    chunks = _run(_service(), body, chat=False, stream=True)
    streamed = [c["choices"][0]["logprobs"] for c in chunks]
    assert all(len(lp["tokens"]) == 1 for lp in streamed)
    assert {k: [x for lp in streamed for x in lp[k]] for k in whole["logprobs"]} == whole["logprobs"]
    json.dumps(chunks, allow_nan=False)      # -inf clamped: valid JSON


def test_chat_logprobs_content_list_streamed_and_whole():
    s = _service()
    body = protocol.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=1)
    whole = _run(_service(), body, chat=True, stream=False)["choices"][0]["logprobs"]["content"]
    assert whole[0] == {"token": "a", "logprob": -0.5, "bytes": [97],
                        "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}]}
    assert [c["bytes"] for c in whole] == [[97], [0xC3], [0xA9], None]
    assert bytes(b for c in whole for b in (c["bytes"] or ())).decode() == "a\u00e9"
    chunks = _run(_service(), body, chat=True, stream=True)
    assert chunks[0]["choices"][0]["logprobs"] is None                       # the role chunk
    assert [x for c in chunks[1:] for x in c["choices"][0]["logprobs"]["content"]] == whole
    no_top = protocol.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], logprobs=True)
    content = _run(_service(), no_top, chat=True, stream=False)["choices"][0]["logprobs"]["content"]
    assert content[1]["top_logprobs"] == []
    plain = protocol.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert _run(_service(), plain, chat=True, stream=False)["choices"][0]["logprobs"] is None
    assert s.sampling_params(plain, [1, 2], 4)[0].logprobs is None


def test_echo_prepends_the_prompt_text():
    s = _service()
    body = protocol.CompletionRequest(prompt="hi", max_tokens=4, echo=True)
    body_ids = s.prompt_ids(body.prompt)
    assert s.prompt_text(body, body_ids) == "hi"
    ids_body = protocol.CompletionRequest(prompt=[byte_tokenizer.encode("h\u00e9")], echo=True)   # ids: decoded
    assert s.prompt_text(ids_body, byte_tokenizer.encode("h\u00e9")) == "h\u00e9"
    async def main():
        params, _ = s.sampling_params(body, body_ids, 4)
        live = s.submit(body_ids, params, "cmpl")
        for i, t in enumerate(byte_tokenizer.encode("!?")):
            live.queue.put_nowait(("token", t, "length" if i == 1 else None))
        reply = Reply(live.req.request_id, s.model_name, chat=False, want_ids=False, echo="hi")
        return [json.loads(x[6:]) for x in [line async for line in s.stream(live, [], reply, 2, False)][:-1]]
    chunks = asyncio.run(main())
    assert [c["choices"][0]["text"] for c in chunks] == ["hi", "!", "?"]


def test_logprob_request_errors():
    from pydantic import ValidationError
    s = _service()
    with pytest.raises(ApiError, match=r"^echo: echo=true with logprobs") as e:
        s.sampling_params(protocol.CompletionRequest(prompt="hi", echo=True, logprobs=0), [1, 2], 4)
    assert e.value.status == 400 and e.value.param == "echo"
    with pytest.raises(ApiError, match=r"^top_logprobs: 2 needs logprobs=true") as e:
        s.sampling_params(protocol.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=2),
                          [1, 2], 4)
    assert e.value.param == "top_logprobs"
    for bad in (dict(logprobs=6), dict(logprobs=-1), dict(logprobs=True)):
        with pytest.raises(ValidationError):
            protocol.CompletionRequest(prompt="hi", **bad)
    with pytest.raises(ValidationError):
        protocol.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=21)
    with pytest.raises(ApiError, match="^echo: True is not supported"):      # chat has no echo here
        s.sampling_params(protocol.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], echo=True),
                          [1, 2], 4)
    assert s.token_text(ord("a")) == "a" and _service(vocab_size=1000).token_text(7) == "token_id:7"
