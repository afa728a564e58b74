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


@pytest.mark.parametrize("field, value", [("logprobs", 5), ("echo", True), ("best_of", 3), ("presence_penalty", 0.5),
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
