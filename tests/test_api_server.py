"""experiments.api_server end to end on loopback: one server (the tiny byte-level model, a small config) for the
module, driven by the `openai` client and raw HTTP. Tokens equal experiments.generate's; usage is exact; bad
inputs are 400s that leave other requests untouched; the queue bound answers 429; a client that disconnects
aborts its request and its pages return to the idle count; SIGTERM drains, exits 0 and writes the run's files."""
import asyncio
import csv
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families

from pdjax.procs import free_port
from pdjax.workload import byte_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]
MAX_LEN = 256
BOUND = 8          # server.max_queued_requests
NEW_TOKENS = 24
# Four reference prompts of at most 64 - NEW_TOKENS tokens: generate's step then has one shape (a short compile).
PROMPTS = ["def main(argv):\n    ", "The string module", "import os\nimport sys\n"]
CHAT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi?"}]
CHAT_TEXT = "system: Be terse.\nuser: Hi?\nassistant:"     # protocol.render_chat's template


class Server:
    def __init__(self, proc, port, workdir, log):
        self.proc, self.port, self.workdir, self.log = proc, port, workdir, log
        self.url = f"http://127.0.0.1:{port}"

    def metrics(self) -> dict:
        """{(name, instance, finish_reason): value} of the /metrics samples."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, s.labels.get("instance", ""), s.labels.get("finish_reason", ""))] = s.value
        return out

    def finished(self, reason: str) -> float:
        return self.metrics().get(("pdjax_requests_finished_total", "replica0", reason), 0.0)

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """Metrics once nothing runs or waits and no KV page is used (fails after `timeout`)."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            busy = [m[(k, "replica0", "")] for k in ("pdjax_kv_pages_used", "pdjax_num_requests_running",
                                                      "pdjax_num_requests_waiting")]
            if busy == [0, 0, 0]:
                return m
            if time.time() >= deadline:   # a hang guard, not a speed check
                pytest.fail(f"server not idle after {timeout} s: pages, running, waiting = {busy}")
            time.sleep(0.05)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("api_server")
    port = free_port()
    log = open(workdir.parent / "api_server.log", "w+")
    cmd = [sys.executable, "-m", "experiments.api_server", "--config=configs/serve.py", f"--port={port}",
           f"--workdir={workdir}", "--config.scheduler.token_budget=64", "--config.scheduler.max_num_seqs=8",
           f"--config.scheduler.max_model_len={MAX_LEN}", "--config.scheduler.num_pages=160",
           f"--config.server.max_queued_requests={BOUND}", "--config.server.drain_timeout_s=30"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    srv = Server(proc, port, workdir, log)
    deadline = time.time() + 300
    while True:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"api_server exited with {proc.returncode}:\n{log.read()[-3000:]}")
        try:
            if httpx.get(srv.url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.time() >= deadline:       # a hang guard, not a speed check
            pytest.fail("api_server not ready after 300 s")
        time.sleep(0.25)
    yield srv
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)
    log.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """experiments.generate's greedy tokens (its run_generate body) for PROMPTS and the rendered chat prompt."""
    from pdjax.runtime.generate import run_generate
    d = tmp_path_factory.mktemp("generate")
    texts = PROMPTS + [CHAT_TEXT]
    (d / "prompts.json").write_text(json.dumps([byte_tokenizer.encode(t) for t in texts]))
    tokens, _, _ = run_generate(str(REPO / "checkpoints/tiny-byte"), d / "prompts.json", NEW_TOKENS, d / "out.json",
                                chunk_size=16, token_budget=16)
    return dict(zip(texts, tokens))


def _client(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


async def _complete(client, prompt, stream: bool):
    """(token ids, text, finish reason, usage) of one greedy completion."""
    common = dict(model="tiny-byte", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                  extra_body={"return_token_ids": True})
    if not stream:
        r = await client.completions.create(**common)
        c = r.choices[0]
        return c.token_ids, c.text, c.finish_reason, r.usage
    ids, text, finish, usage = [], "", None, None
    async for chunk in await client.completions.create(**common, stream=True,
                                                       stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            ids += c.token_ids
            text += c.text
            finish = c.finish_reason or finish
    return ids, text, finish, usage


def test_health_and_models(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    models = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0).models.list()
    assert [m.id for m in models.data] == ["tiny-byte"]


def test_concurrent_streaming_and_plain_requests_match_offline_generation(server, reference):
    async def run():
        client = _client(server)
        jobs = [_complete(client, p, stream=i % 2 == 0) for i, p in enumerate(PROMPTS)]
        jobs.append(_complete(client, byte_tokenizer.encode(PROMPTS[0]), stream=True))   # token-id prompt
        return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    for prompt, (ids, text, finish, usage) in zip(PROMPTS + [PROMPTS[0]], results):
        want = reference[prompt]
        assert ids == want, prompt
        assert text == byte_tokenizer.decode(want)
        assert finish == "length"
        n = len(byte_tokenizer.encode(prompt))
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (n, NEW_TOKENS, n + NEW_TOKENS)


def test_chat_completions_plain_template(server, reference):
    async def run():
        client = _client(server)
        plain = await client.chat.completions.create(model="tiny-byte", messages=CHAT, max_tokens=NEW_TOKENS,
                                                     temperature=0)
        text = ""
        async for chunk in await client.chat.completions.create(
                model="tiny-byte", messages=CHAT, max_tokens=NEW_TOKENS, temperature=0, stream=True):
            text += "".join(c.delta.content or "" for c in chunk.choices)
        return plain, text

    plain, streamed = asyncio.run(run())
    want = byte_tokenizer.decode(reference[CHAT_TEXT])
    assert plain.choices[0].message.content == want == streamed
    assert plain.usage.prompt_tokens == len(CHAT_TEXT) and plain.usage.completion_tokens == NEW_TOKENS


def test_stop_string_ends_the_request_and_counts_its_tokens(server, reference):
    want = reference[PROMPTS[1]]
    text = byte_tokenizer.decode(want)
    stop = text[6:9]
    cut = text.find(stop)
    r = httpx.post(server.url + "/v1/completions", json={
        "prompt": PROMPTS[1], "max_tokens": NEW_TOKENS, "temperature": 0, "stop": [stop]}, timeout=60).json()
    assert r["choices"][0]["text"] == text[:cut]
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == cut + len(stop)     # byte-level: one token per (ASCII) character
    server.wait_idle()


# ---------------------------------------------------------------------------------------------- logprobs, echo
def _reference_logprobs(prompt: str):
    """float32 [V] log_softmax of the checkpoint's logits after `prompt` (its own runner, reference attention)."""
    import jax
    from pdjax.models.checkpoint import load_model
    from pdjax.runtime.runner import ModelRunner
    from test_model import sched
    spec, params = load_model(str(REPO / "checkpoints/tiny-byte"), dtype="float32")
    runner = ModelRunner(spec, params, num_pages=8, page_size=16, attention_impl="reference", max_model_len=64)
    ids = byte_tokenizer.encode(prompt)
    logits = runner.execute_logits(sched([(ids, 0, list(range(-(-len(ids) // 16))), True)]))[0]
    return np.asarray(jax.nn.log_softmax(logits))


def test_completion_logprobs_streamed_and_not_through_the_openai_client(server, reference):
    common = dict(model="tiny-byte", prompt=PROMPTS[0], max_tokens=NEW_TOKENS, temperature=0, logprobs=3,
                  extra_body={"return_token_ids": True})

    async def run():
        client = _client(server)
        whole = await client.completions.create(**common)
        chunks = [c async for c in await client.completions.create(**common, stream=True)]
        return whole, chunks

    whole, chunks = asyncio.run(run())
    c = whole.choices[0]
    assert c.token_ids == reference[PROMPTS[0]]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == NEW_TOKENS
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen == max(top.values()) <= 0       # greedy: the sampled token is the top one
        assert sum(np.exp(v) for v in top.values()) <= 1 + 1e-5
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(c.text)
    streamed = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
    assert [t for x in streamed for t in x.token_logprobs] == lp.token_logprobs
    assert [t for x in streamed for t in x.top_logprobs] == lp.top_logprobs
    assert [t for x in streamed for t in x.text_offset] == lp.text_offset
    # The first token's numbers are the checkpoint's: log_softmax of its logits after the prompt.
    ref = _reference_logprobs(PROMPTS[0])
    assert abs(lp.token_logprobs[0] - ref[c.token_ids[0]]) < 1e-4
    assert np.allclose(sorted(lp.top_logprobs[0].values(), reverse=True), np.sort(ref)[::-1][:3], atol=1e-4)


def test_chat_logprobs_and_random_sampling_through_the_openai_client(server, reference):
    async def run():
        client = _client(server)
        common = dict(model="tiny-byte", messages=CHAT, max_tokens=NEW_TOKENS, logprobs=True, top_logprobs=2)
        plain = await client.chat.completions.create(**common, temperature=0)
        streamed = [c async for c in await client.chat.completions.create(**common, temperature=0, stream=True)]
        drawn = await client.completions.create(model="tiny-byte", prompt=PROMPTS[1], max_tokens=NEW_TOKENS,
                                                temperature=1.0, seed=5, logprobs=5)
        return plain, streamed, drawn

    plain, streamed, drawn = asyncio.run(run())
    content = plain.choices[0].logprobs.content
    assert len(content) == plain.usage.completion_tokens == NEW_TOKENS
    text = plain.choices[0].message.content
    assert text == byte_tokenizer.decode(reference[CHAT_TEXT])
    assert bytes(b for x in content for b in x.bytes).decode("utf-8", errors="replace") == text
    for x in content:
        assert len(x.top_logprobs) == 2 and x.logprob == x.top_logprobs[0].logprob >= x.top_logprobs[1].logprob
    again = [x for c in streamed if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [x.model_dump() for x in again] == [x.model_dump() for x in content]
    # Random sampling: the drawn token's logprob is the raw model's (before temperature), equal to its entry in
    # the top 5 whenever it is among them.
    lp = drawn.choices[0].logprobs
    assert len(lp.token_logprobs) == NEW_TOKENS
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert chosen <= max(top.values())
        if tok in top:
            assert top[tok] == chosen


def test_echo_prepends_the_prompt_streamed_and_not(server, reference):
    want = PROMPTS[1] + byte_tokenizer.decode(reference[PROMPTS[1]][:6])

    async def run():
        client = _client(server)
        common = dict(model="tiny-byte", prompt=PROMPTS[1], max_tokens=6, temperature=0, echo=True)
        whole = await client.completions.create(**common)
        text = "".join([c.choices[0].text async for c in await client.completions.create(**common, stream=True)
                        if c.choices])
        try:
            await client.completions.create(**common, logprobs=1)
        except openai.BadRequestError as e:
            return whole, text, e
        return whole, text, None

    whole, text, error = asyncio.run(run())
    assert whole.choices[0].text == want == text
    assert whole.usage.completion_tokens == 6
    assert error is not None and error.status_code == 400 and "echo" in str(error)


BAD_BODIES = [
    ('{"prompt": "abc", "max_tokens": 4', "not valid JSON"),
    ({"prompt": "abc", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "abc", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "abc", "max_tokens": "4"}, "max_tokens"),
    ({"prompt": "abc", "temperature": "hot"}, "temperature"),
    ({"prompt": 7, "max_tokens": 4}, "prompt"),
    ({"prompt": "y" * (MAX_LEN + 1), "max_tokens": 4}, "maximum context length"),
    ({"prompt": "y" * (MAX_LEN - 2), "max_tokens": 8}, "maximum context length"),
    ({"prompt": [1, 2, 999], "max_tokens": 4}, "vocabulary"),
    ({"prompt": "", "max_tokens": 4}, "empty prompt"),
    ({"prompt": "abc", "n": 2}, "n"),
    ({"prompt": "abc", "logprobs": 6}, "logprobs"),
    ({"prompt": "abc", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "abc", "top_logprobs": 2}, "top_logprobs"),
]


def test_bad_inputs_are_400s_and_leave_other_requests_untouched(server, reference):
    async def run():
        good = asyncio.ensure_future(_complete(_client(server), PROMPTS[2], stream=True))
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            answers = []
            for body, _ in BAD_BODIES:
                kw = {"content": body} if isinstance(body, str) else {"json": body}
                answers.append(await http.post("/v1/completions", headers={"Content-Type": "application/json"},
                                               **kw))
        return answers, await good

    answers, (ids, _, finish, usage) = asyncio.run(run())
    for (body, needle), r in zip(BAD_BODIES, answers):
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert needle in err["message"] and err["type"] == "invalid_request_error", (body, err)
    assert ids == reference[PROMPTS[2]] and finish == "length" and usage.completion_tokens == NEW_TOKENS
    assert httpx.post(server.url + "/v1/completions", json={"model": "gpt-4", "prompt": "a"}).status_code == 404
    # issue 27: a JSON body without its Content-Type was answered "(got ?)"
    for headers, said in (({}, "no Content-Type"), ({"Content-Type": "text/plain"}, "Content-Type: text/plain")):
        r = httpx.post(server.url + "/v1/completions", content='{"prompt": "a"}', headers=headers)
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            f"the body must be JSON sent with Content-Type: application/json (got {said})"), r.text


async def _open_streams(server, n, max_tokens):
    """n streaming requests, each read up to its first token: (clients, line iterators)."""
    clients = [httpx.AsyncClient(base_url=server.url, timeout=60) for _ in range(n)]

    async def one(client, i):
        req = client.build_request("POST", "/v1/completions", json={
            "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0, "stream": True})
        resp = await client.send(req, stream=True)
        assert resp.status_code == 200
        lines = resp.aiter_lines()
        async for line in lines:
            if line.startswith("data: {"):
                break
        return resp, lines

    return clients, await asyncio.gather(*[one(c, i) for i, c in enumerate(clients)])


def test_disconnected_stream_is_aborted_and_frees_its_pages(server):
    idle = server.wait_idle()
    aborted = server.finished("aborted")

    async def run():
        clients, streams = await _open_streams(server, 1, MAX_LEN - 40)
        resp, lines = streams[0]
        for _ in range(3):
            await lines.__anext__()
        during = server.metrics()[("pdjax_kv_pages_used", "replica0", "")]
        await resp.aclose()
        await clients[0].aclose()
        return during

    assert asyncio.run(run()) > 0                 # the request held pages while it streamed
    after = server.wait_idle()
    assert after[("pdjax_kv_pages_used", "replica0", "")] == idle[("pdjax_kv_pages_used", "replica0", "")]
    assert server.finished("aborted") == aborted + 1


def test_non_streaming_client_that_gives_up_aborts_its_request(server):
    server.wait_idle()
    aborted = server.finished("aborted")

    async def run():
        clients, streams = await _open_streams(server, 4, MAX_LEN - 40)   # company: slower steps
        async with httpx.AsyncClient(base_url=server.url, timeout=0.2) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/v1/completions", json={"prompt": "a", "max_tokens": MAX_LEN - 40})
        for (resp, _), client in zip(streams, clients):
            await resp.aclose()
            await client.aclose()

    asyncio.run(run())
    server.wait_idle()
    assert server.finished("aborted") == aborted + 5


def test_queue_bound_answers_429_and_a_burst_of_aborts_leaks_no_pages(server):
    server.wait_idle()
    aborted = server.finished("aborted")

    async def run():
        clients, streams = await _open_streams(server, BOUND, MAX_LEN - 40)
        over = await clients[0].post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
        also = await clients[0].post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
        for k, ((resp, lines), client) in enumerate(zip(streams, clients)):
            for _ in range(k):                     # close them at different points
                await lines.__anext__()
            await resp.aclose()
            await client.aclose()
        return over, also

    over, also = asyncio.run(run())
    for r in (over, also):
        assert r.status_code == 429, r.text
        assert "max_queued_requests" in r.json()["error"]["message"]
    m = server.wait_idle()
    assert m[("pdjax_kv_pages_used", "replica0", "")] == 0
    assert server.finished("aborted") == aborted + BOUND
    # the server serves again once below the bound
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_bench_api_server_replays_the_config_workload(server):
    """experiments.bench_api_server at its smallest: the config's workload, replayed with the openai client."""
    out = subprocess.run(
        [sys.executable, "-m", "experiments.bench_api_server", "--config=configs/serve.py",
         f"--base_url={server.url}/v1", "--config.workload.num_requests=3", "--config.workload.rate=20",
         f"--config.scheduler.max_model_len={MAX_LEN}", "--config.workload.max_output_len=8"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    client = json.loads(out.stdout)["client"]
    assert client["num_requests"] == client["num_completed"] == 3
    assert 3 <= client["total_output_tokens"] <= 24 and client["ttft"]["p50"] > 0


def test_sigterm_drains_in_flight_requests_and_writes_the_run(server, reference):
    """Last test of the module: it stops the server."""
    seen = sum(v for (name, _, _), v in server.metrics().items() if name == "pdjax_requests_finished_total")

    async def run():
        client = _client(server)
        stream = await client.completions.create(model="tiny-byte", prompt=PROMPTS[2], max_tokens=NEW_TOKENS,
                                                 temperature=0, stream=True, extra_body={"return_token_ids": True})
        ids, rid = [], None
        async for chunk in stream:
            rid = chunk.id
            ids += chunk.choices[0].token_ids
            if len(ids) == 1:
                server.proc.send_signal(signal.SIGTERM)    # in flight: it is drained, not cut
        return rid, ids

    rid, ids = asyncio.run(run())
    assert ids == reference[PROMPTS[2]]
    assert server.proc.wait(120) == 0
    wd = server.workdir
    summary = json.loads((wd / "results.json").read_text())
    assert summary["server"]["model_name"] == "tiny-byte"
    with open(wd / "requests.csv") as f:
        rows = {r["request_id"]: r for r in csv.DictReader(f)}
    assert len(rows) == seen + 1               # every request the engine saw, the drained one included
    assert rows[rid]["finish_reason"] == "length" and int(rows[rid]["num_output_tokens"]) == NEW_TOKENS
    reasons = [r["finish_reason"] for r in rows.values()]
    assert reasons.count("aborted") == BOUND + 1 + 5 and "stop" in reasons
    assert json.loads((wd / "outputs.json").read_text())[rid] == ids
    assert all(os.path.exists(wd / f) for f in ("iterations.csv", "token_times.csv", "config.json"))
