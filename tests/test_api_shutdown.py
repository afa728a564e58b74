"""The API server's shutdown (issue 27): past server.drain_timeout_s every open stream ends with a last chunk
carrying finish_reason "abort" and `data: [DONE]` (no broken connection, no CancelledError traceback), and a
SIGTERM during warm-up stops the warm-up instead of waiting for it. One server process per test."""
import asyncio
import csv
import json
import pathlib
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import httpx
from pdjax.config.sampling import SamplingParams
from pdjax.procs import free_port
from pdjax.serving.api.bridge import EngineBridge

REPO = pathlib.Path(__file__).resolve().parents[1]
NUM_STREAMS = 3
MAX_TOKENS = 200


def _start(tmp_path, *flags):
    port = free_port()
    log = open(tmp_path / "server.log", "w+")
    cmd = [sys.executable, "-m", "experiments.api_server", "--config=configs/serve.py", f"--port={port}",
           f"--workdir={tmp_path / 'run'}", "--config.scheduler.max_model_len=256", *flags]
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}", log


def _health(url):
    try:
        return httpx.get(url + "/health", timeout=2).json().get("status")
    except (httpx.TransportError, ValueError):
        return None


def _wait_for(proc, url, log, status, timeout=300.0):
    deadline = time.time() + timeout
    while _health(url) != status:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"api_server exited with {proc.returncode}:\n{log.read()[-3000:]}")
        if time.time() >= deadline:      # a hang guard, not a speed check
            pytest.fail(f"api_server not {status!r} after {timeout} s")
        time.sleep(0.1)


def _ended(proc, log) -> str:
    """The server's whole output once it exited with status 0."""
    status = proc.wait(120)
    log.seek(0)
    output = log.read()
    assert status == 0, output[-3000:]
    return output


async def _stream_lines(url, prompt, on_first):
    """The SSE data lines of one streamed completion; on_first() after its first token chunk."""
    lines = []
    async with httpx.AsyncClient(timeout=120) as client:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line[len("data: "):])
                    if len(lines) == 1:
                        on_first()
    return lines


def test_streams_past_the_drain_deadline_end_with_abort_and_done(tmp_path):
    proc, url, log = _start(tmp_path, "--config.server.drain_timeout_s=0")
    try:
        _wait_for(proc, url, log, "ok")
        started = []

        def on_first():          # SIGTERM once every stream has its first chunk
            started.append(1)
            if len(started) == NUM_STREAMS:
                proc.send_signal(signal.SIGTERM)

        async def run():
            return await asyncio.gather(*[_stream_lines(url, f"def f{i}(x):\n    ", on_first)
                                          for i in range(NUM_STREAMS)])

        streams = asyncio.run(run())
        output = _ended(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in output and "CancelledError" not in output, output[-3000:]
    for lines in streams:
        assert lines[-1] == "[DONE]"
        last = json.loads(lines[-2])["choices"][0]
        assert last["finish_reason"] == "abort", lines[-3:]
        assert len(lines) - 1 < MAX_TOKENS          # ended early, not run to max_tokens
    with open(tmp_path / "run" / "requests.csv") as f:
        reasons = [r["finish_reason"] for r in csv.DictReader(f)]
    assert reasons == ["aborted"] * NUM_STREAMS


def test_sigterm_during_warm_up_stops_the_warm_up(tmp_path):
    proc, url, log = _start(tmp_path, "--config.engine.compilation_cache=False")
    try:
        _wait_for(proc, url, log, "starting")
        proc.send_signal(signal.SIGTERM)
        output = _ended(proc, log)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "stopped during warm-up" in output and "Traceback" not in output, output[-3000:]
    assert "serving 'tiny-byte'" not in output         # it never served


def test_end_all_ends_every_live_request_once():
    """Without HTTP: end_all posts ('finish', 'aborted') to each live request's queue, aborts it in the engine's
    source and counts it once, even when the engine finishes it at the same time."""
    bridge = EngineBridge()
    bridge.ready.set()
    loop = asyncio.new_event_loop()
    try:
        lives = [bridge.submit([1, 2, 3], SamplingParams(max_tokens=4), loop) for _ in range(2)]
        assert bridge.end_all() == 2 and bridge.num_live == 0
        bridge._finished(lives[0], "length")          # the engine's own end, arriving late, is ignored
        loop.run_until_complete(asyncio.sleep(0))
        assert [live.queue.get_nowait() for live in lives] == [("finish", "aborted", None)] * 2
        assert bridge.source.closed
        finished = {s.labels["finish_reason"]: s.value for m in bridge.metrics.finished.collect()
                    for s in m.samples if s.name.endswith("_total")}
        assert finished == {"aborted": 2.0}
        kinds = [cmd[0] for cmd in bridge.source._inbox]
        assert kinds == ["add", "add", "abort", "abort"]
    finally:
        loop.close()
