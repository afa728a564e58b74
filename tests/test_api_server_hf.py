"""experiments.api_server serving checkpoints/tiny-hf (an HF directory with its own tokenizer and ChatML template)
on loopback, driven by the official `openai` client: text prompts and chat answered with text, streamed and not,
the same text both ways and the same tokens as experiments.generate's; /tokenize round-trips; /v1/models says
max_model_len."""
import asyncio
import pathlib
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("tokenizers")

from pdjax.procs import free_port  # noqa: E402
from pdjax.workload.chat_template import chat_prompt_ids  # noqa: E402
from pdjax.workload.tokenizer import HFTokenizer  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
CKPT = "checkpoints/tiny-hf"
MAX_LEN = 256
NEW_TOKENS = 24
PROMPT = "The assert statement"
CHAT = [{"role": "user", "content": "What is assert?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("api_server_hf")
    port = free_port()
    log = open(workdir.parent / "api_server_hf.log", "w+")
    cmd = [sys.executable, "-m", "experiments.api_server", "--config=configs/serve.py", f"--port={port}",
           f"--workdir={workdir}", f"--config.model.checkpoint={CKPT}", "--config.scheduler.token_budget=64",
           "--config.scheduler.max_num_seqs=4", f"--config.scheduler.max_model_len={MAX_LEN}",
           "--config.scheduler.num_pages=96"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"api_server exited with {proc.returncode}:\n{log.read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.time() >= deadline:       # a hang guard, not a speed check
            pytest.fail("api_server not ready after 300 s")
        time.sleep(0.25)
    yield url
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
    log.close()


@pytest.fixture(scope="module")
def tok():
    return HFTokenizer(REPO / CKPT)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """experiments.generate's greedy tokens (its run_generate body) for PROMPT and the chat prompt."""
    from pdjax.runtime.generate import run_generate
    d = tmp_path_factory.mktemp("gen_hf")
    plain, _, _ = run_generate(str(REPO / CKPT), None, NEW_TOKENS, d / "plain.json", texts=[PROMPT],
                               chunk_size=16, token_budget=16)
    chat, _, _ = run_generate(str(REPO / CKPT), None, NEW_TOKENS, d / "chat.json", texts=[CHAT[0]["content"]],
                              chat=True, chunk_size=16, token_budget=16)
    return {"plain": plain[0], "chat": chat[0]}


def _until_stop(ids, tok):
    stop = next((i for i, t in enumerate(ids) if t in tok.stop_token_ids), len(ids) - 1)
    return ids[:stop + 1]


async def _both(url, chat: bool):
    """[(text, token ids, finish, usage)] of one greedy request, non-streamed then streamed."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    common = dict(model="tiny-hf", max_tokens=NEW_TOKENS, temperature=0, extra_body={"return_token_ids": True})
    create = client.chat.completions.create if chat else client.completions.create
    common.update(messages=CHAT) if chat else common.update(prompt=PROMPT)
    r = await create(**common)
    c = r.choices[0]
    out = [((c.message.content if chat else c.text), c.token_ids, c.finish_reason, r.usage)]
    text, ids, finish, usage = "", [], None, None
    async for chunk in await create(**common, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += (c.delta.content or "") if chat else c.text
            ids += getattr(c, "token_ids", None) or []
            finish = c.finish_reason or finish
    out.append((text, ids, finish, usage))
    return out


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_text_answers_streamed_and_not_are_identical_and_match_generate(server, tok, reference, chat):
    (text, ids, finish, usage), (s_text, s_ids, s_finish, s_usage) = asyncio.run(_both(server, chat))
    want = _until_stop(reference["chat" if chat else "plain"], tok)
    assert ids == s_ids == want
    assert text == s_text == tok.decode(want) and text.strip()
    assert finish == s_finish == ("stop" if want[-1] in tok.stop_token_ids else "length")
    n_prompt = len(chat_prompt_ids(tok, CHAT) if chat else tok.encode(PROMPT))
    assert (usage.prompt_tokens, usage.completion_tokens) == (s_usage.prompt_tokens, s_usage.completion_tokens) \
        == (n_prompt, len(want))


def test_tokenize_round_trip_and_models(server, tok):
    text = "def main(): return '中文 😀'"
    t = httpx.post(server + "/tokenize", json={"prompt": text}, timeout=30).json()
    assert t["tokens"] == tok.encode(text) and t["max_model_len"] == MAX_LEN
    assert httpx.post(server + "/detokenize", json={"tokens": t["tokens"]}, timeout=30).json() == {"prompt": text}
    c = httpx.post(server + "/tokenize", json={"messages": CHAT}, timeout=30).json()
    assert c["tokens"] == chat_prompt_ids(tok, CHAT)
    models = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0).models.list()
    assert [m.id for m in models.data] == ["tiny-hf"] and models.data[0].max_model_len == MAX_LEN


def test_logprobs_of_an_hf_model_streamed_and_not(server, tok, reference):
    """Logprobs with the model's own tokenizer: chat's token bytes join to the text (special tokens: bytes null),
    greedy tokens are their own top entry, and the streamed logprobs equal the whole answer's."""
    async def run():
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)
        chat = dict(model="tiny-hf", messages=CHAT, max_tokens=NEW_TOKENS, temperature=0, logprobs=True,
                    top_logprobs=3)
        plain = dict(model="tiny-hf", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0, logprobs=2)
        return (await client.chat.completions.create(**chat),
                [c async for c in await client.chat.completions.create(**chat, stream=True)],
                await client.completions.create(**plain),
                [c async for c in await client.completions.create(**plain, stream=True)])

    chat, chat_chunks, plain, plain_chunks = asyncio.run(run())
    want = _until_stop(reference["chat"], tok)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == len(want)
    assert bytes(b for x in content for b in (x.bytes or ())).decode() == chat.choices[0].message.content
    assert [x.bytes is None for x in content] == [t in tok.special_token_ids for t in want]
    for x in content:
        assert len(x.top_logprobs) == 3 and x.logprob == x.top_logprobs[0].logprob
    streamed = [x for c in chat_chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [x.model_dump() for x in streamed] == [x.model_dump() for x in content]
    lp = plain.choices[0].logprobs
    assert len(lp.tokens) == plain.usage.completion_tokens
    assert all(chosen == max(top.values()) for chosen, top in zip(lp.token_logprobs, lp.top_logprobs))
    parts = [c.choices[0].logprobs for c in plain_chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [t for p in parts for t in p.token_logprobs] == lp.token_logprobs
    assert [t for p in parts for t in p.text_offset] == lp.text_offset == sorted(lp.text_offset)
