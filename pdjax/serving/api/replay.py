"""Replay a workload against an OpenAI-compatible server with the `openai` client, as a load generator does
(vLLM's `vllm bench serve --backend openai`: one streaming /v1/completions request per workload request, sent at
its arrival time, `ignore_eos`, greedy), and measure what the client sees.

Each request sends the workload's own prompt token ids and max_tokens, so the server runs exactly the requests
experiments.serve runs for the same config. Client-side timeline per request: arrival = when it was sent, a token
time per streamed chunk (one chunk per token); the usage chunk gives the exact output count. Records are
pdjax.metrics RequestRecords on the client's clock, summarized by pdjax.metrics.summarize_run, so TTFT, TBT, TPOT
and E2E have the definitions of every pdjax result (DESIGN.md) and the two sides compare directly.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Dict, List, Optional, Sequence

from pdjax.metrics import RequestRecord, summarize_run


async def _one(client, model: str, w, t0: float) -> RequestRecord:
    await asyncio.sleep(max(0.0, t0 + w.arrival_time - time.perf_counter()))
    sent = time.perf_counter() - t0
    times: List[float] = []
    completion = None
    stream = await client.completions.create(
        model=model, prompt=list(w.prompt_token_ids), max_tokens=int(w.max_tokens), temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices:
            times.append(time.perf_counter() - t0)
        if chunk.usage is not None:
            completion = chunk.usage.completion_tokens
    n = completion if completion is not None else len(times)
    return RequestRecord(request_id=str(w.request_id), arrival_time=sent, first_scheduled_time=sent,
                         first_token_time=times[0] if times else None, finish_time=times[-1] if times else None,
                         num_prompt_tokens=len(w.prompt_token_ids), num_output_tokens=n,
                         finish_reason="length" if n == len(times) else "unfinished", token_times=times)


async def replay(base_url: str, model: str, workload: Sequence, *, timeout_s: float = 600.0) -> List[RequestRecord]:
    """Send every request of `workload` (WorkloadRequests) at its arrival time; returns the client's records."""
    import openai  # noqa: PLC0415 (optional serve extra)
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=timeout_s)
    t0 = time.perf_counter()
    try:
        return list(await asyncio.gather(*[_one(client, model, w, t0) for w in workload]))
    finally:
        await client.close()


def replay_summary(base_url: str, model: str, workload: Sequence, slos: Optional[Dict[str, float]] = None,
                   **kwargs) -> Dict[str, Any]:
    """replay() and the pdjax summary of the client's records (results.json's keys)."""
    return summarize_run(asyncio.run(replay(base_url, model, workload, **kwargs)), (), slos)
