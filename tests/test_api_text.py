"""The API's text path for an HF-tokenized model (checkpoints/tiny-hf's tokenizer), over a scripted engine: the
app (pdjax.serving.api.app) in process, driven through httpx's ASGI transport by the `openai` client and raw
HTTP; the engine is replaced by a bridge that answers each request with token ids the test chose (CJK, emoji,
byte tokens inside a character, special tokens), so text, streaming and stop strings are checked exactly."""
import asyncio
import json
import pathlib

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("tokenizers")

from pdjax.serving.api.app import create_app  # noqa: E402
from pdjax.serving.api.bridge import EngineBridge  # noqa: E402
from pdjax.workload.chat_template import chat_prompt_ids  # noqa: E402
from pdjax.workload.tokenizer import HFTokenizer  # noqa: E402

CKPT = pathlib.Path(__file__).resolve().parents[1] / "checkpoints/tiny-hf"
MAX_LEN = 128
REPLY = "Hello 世界! 😀 naïve ok"
CHAT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say 你好"}]


class ScriptedBridge(EngineBridge):
    """An EngineBridge whose 'engine' answers every request with `self.script` (token ids), then 'length', or
    stops at the first of the request's stop_token_ids (finish 'stop'), as the engine does."""

    def __init__(self, tok, script):
        super().__init__()
        self.vocab_size, self.max_model_len, self.script = tok.vocab_size, MAX_LEN, list(script)
        self.stopped, self.submitted = [], []
        self.ready.set()

    def submit(self, prompt_token_ids, sampling, loop, prefix="cmpl"):
        live = super().submit(prompt_token_ids, sampling, loop, prefix)
        self.submitted.append(list(prompt_token_ids))
        out = self.script[:sampling.max_tokens]
        hit = next((i for i, t in enumerate(out) if t in sampling.stop_token_ids), None)
        out, last = (out[:hit + 1], "stop") if hit is not None else (out, "length")
        for i, t in enumerate(out):
            live.req.output_token_ids.append(t)
            live.push(("token", t, last if i == len(out) - 1 else None))
        live.done = True
        return live

    def stop(self, live, num_tokens):
        self.stopped.append(num_tokens)


@pytest.fixture(scope="module")
def tok():
    return HFTokenizer(CKPT)


def _app(tok, script, tokenizer="same"):
    bridge = ScriptedBridge(tok, script)
    return create_app(bridge, model_name="tiny-hf", tokenizer=tok if tokenizer == "same" else tokenizer), bridge


def _clients(app):
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)
    return http, client


async def _completion(client, stream, **kw):
    """(text, streamed pieces, finish reason, usage) of one completion (chat when kw has messages)."""
    chat = "messages" in kw
    create = client.chat.completions.create if chat else client.completions.create
    if not stream:
        r = await create(model="tiny-hf", **kw)
        c = r.choices[0]
        return (c.message.content if chat else c.text), None, c.finish_reason, r.usage
    pieces, finish, usage = [], None, None
    async for chunk in await create(model="tiny-hf", stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for c in chunk.choices:
            pieces.append((c.delta.content or "") if chat else c.text)
            finish = c.finish_reason or finish
    return "".join(pieces), pieces, finish, usage


def test_streamed_text_of_multibyte_tokens_equals_the_whole_text(tok):
    script = tok.encode(REPLY, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([t]) for t in script)        # some tokens carry part of a character
    app, _ = _app(tok, script)

    async def run():
        _, client = _clients(app)
        return [await _completion(client, s, prompt="The 中文 prompt", max_tokens=64) for s in (False, True)]

    (whole, _, finish, usage), (streamed, pieces, finish_s, usage_s) = asyncio.run(run())
    assert whole == streamed == REPLY
    assert all("\ufffd" not in p for p in pieces) and "" in pieces   # held back inside a character, never U+FFFD
    assert finish == finish_s == "length"
    n_prompt = len(tok.encode("The 中文 prompt"))
    assert (usage.prompt_tokens, usage.completion_tokens) == (usage_s.prompt_tokens, usage_s.completion_tokens) \
        == (n_prompt, len(script))


def test_chat_uses_the_template_and_stops_at_im_end(tok):
    im_end = tok.encode("<|im_end|>", add_special_tokens=False)
    script = tok.encode("你好 😀", add_special_tokens=False) + im_end + tok.encode("junk", add_special_tokens=False)
    app, bridge = _app(tok, script)

    async def run():
        _, client = _clients(app)
        return [await _completion(client, s, messages=CHAT, max_tokens=32, temperature=0) for s in (False, True)]

    (whole, _, finish, usage), (streamed, _, finish_s, _) = asyncio.run(run())
    assert whole == streamed == "你好 😀" and finish == finish_s == "stop"      # <|im_end|> is a stop id, not text
    assert bridge.submitted[0] == bridge.submitted[1] == chat_prompt_ids(tok, CHAT)
    assert usage.prompt_tokens == len(chat_prompt_ids(tok, CHAT))
    assert usage.completion_tokens == script.index(im_end[0]) + 1        # the stop token counts, as OpenAI's


def test_stop_string_across_tokens(tok):
    text = "alpha beta 世界 gamma"
    script = tok.encode(text, add_special_tokens=False)
    app, bridge = _app(tok, script)
    for stop in ("a be", "界 g", "世"):
        async def run(stop=stop):
            _, client = _clients(app)
            return [await _completion(client, s, prompt="x", max_tokens=64, stop=[stop]) for s in (False, True)]

        (whole, _, finish, usage), (streamed, pieces, _, _) = asyncio.run(run())
        assert whole == streamed == text[:text.index(stop)] and finish == "stop", stop
        first = next(i for i in range(1, len(script) + 1) if stop in tok.decode(script[:i]))
        assert usage.completion_tokens == first and bridge.stopped[-1] == first
        assert not any(stop in p for p in pieces)


def test_skip_special_tokens_false_shows_them(tok):
    script = tok.encode("hi", add_special_tokens=False) + tok.encode("<|endoftext|>", add_special_tokens=False)
    app, _ = _app(tok, script)
    http, _ = _clients(app)

    async def run():
        r1 = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "ignore_eos": True,
                                                      "skip_special_tokens": False})
        r2 = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "ignore_eos": True})
        return r1.json(), r2.json()

    shown, skipped = asyncio.run(run())
    assert shown["choices"][0]["text"] == "hi<|endoftext|>" and skipped["choices"][0]["text"] == "hi"


def test_tokenize_detokenize_round_trip(tok):
    app, _ = _app(tok, [])
    http, _ = _clients(app)
    text = "def f(x): return '中文 😀'"

    async def run():
        t = (await http.post("/tokenize", json={"prompt": text, "return_token_strs": True})).json()
        d = (await http.post("/detokenize", json={"tokens": t["tokens"]})).json()
        c = (await http.post("/tokenize", json={"messages": CHAT})).json()
        models = (await http.get("/v1/models")).json()
        return t, d, c, models

    t, d, c, models = asyncio.run(run())
    assert t["tokens"] == tok.encode(text) and t["count"] == len(t["tokens"]) and t["max_model_len"] == MAX_LEN
    assert t["token_strs"] == [tok.id_to_token(i) for i in t["tokens"]]
    assert d == {"prompt": text}
    assert c["tokens"] == chat_prompt_ids(tok, CHAT)
    assert models["data"][0]["max_model_len"] == MAX_LEN


BAD = [
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "roles must be system, user or "
     "assistant, got tool"),
    ("/v1/completions", {"prompt": "word " * MAX_LEN, "max_tokens": 4}, "maximum context length"),
    ("/v1/completions", {"prompt": [1, 2, 99999], "max_tokens": 4}, "token id 99999 is outside the vocabulary"),
    ("/v1/completions", {"prompt": "abc", "n": 2}, "n: 2 choices"),
    ("/detokenize", {"tokens": [5, -1]}, "token id -1 is outside the vocabulary"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "exactly one of prompt"),
]


def test_bad_requests_are_400s(tok):
    app, _ = _app(tok, tok.encode("fine", add_special_tokens=False))
    http, _ = _clients(app)

    async def run():
        return [await http.post(path, json=body) for path, body, _ in BAD]

    for (path, body, needle), r in zip(BAD, asyncio.run(run())):
        assert r.status_code == 400, (path, body, r.text)
        assert needle in r.json()["error"]["message"], (path, r.json())


def test_a_model_without_tokenizer_takes_ids_only(tok):
    app, _ = _app(tok, tok.encode("ok", add_special_tokens=False), tokenizer=None)
    http, _ = _clients(app)

    async def run():
        return (await http.post("/v1/completions", json={"prompt": "abc"}),
                await http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "return_token_ids": True}),
                await http.post("/tokenize", json={"prompt": "abc"}))

    text, ids, tokenize = asyncio.run(run())
    assert text.status_code == 400 and "has no tokenizer" in text.json()["error"]["message"]
    assert ids.status_code == 200 and ids.json()["choices"][0]["text"] == ""
    assert ids.json()["choices"][0]["token_ids"] == tok.encode("ok", add_special_tokens=False)
    assert tokenize.status_code == 400
    assert json.loads(tokenize.text)["error"]["message"].startswith("this model has no tokenizer")
