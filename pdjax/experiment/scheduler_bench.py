"""Scheduler overhead benchmark: drive one policy with a fake runner until all requests finish (the command line is
experiments/bench_scheduler.py; `run` returns its JSON).

The fake runner samples one token (id 1) for every entry with do_sample (a completed prefill or a decode) and
nothing for a partial chunk. Only schedule() and update() are timed; request construction is not. All
requests arrive at t=0. prefill_only releases each handed-off request at once; decode_only starts from
handed-off requests (prompt computed elsewhere, first token sampled) whose KV has all arrived.

JSON: steps, total_s (minimum over repeats), mean_us_per_step, p99_us_per_step, preemptions,
generated_tokens, us_per_scheduled_request (time per request-in-a-batch per step), and the yardsticks:
the machine's bare Python loop rate (`python_loop_ns_per_item`: one attribute read + one list append per
item, what any per-request Python loop costs at least), the vLLM V1 scheduler's ~17 us per running request
per step, and a ~5 ms GPU decode step of an 8B model on an H100.
"""
from __future__ import annotations

import gc
import platform
import time

from pdjax.config import SamplingParams, SchedulerConfig
from pdjax.errors import user_errors
from pdjax.scheduler import Request, RequestStatus, make_scheduler

VLLM_V1_US_PER_RUNNING_REQUEST = 17.0
GPU_STEP_S = 5e-3


def python_loop_ns_per_item(n: int = 200_000, repeat: int = 5) -> float:
    """Machine ceiling for per-request Python work: ns per item of a loop reading an attribute and appending."""
    class Item:
        __slots__ = ("x",)

        def __init__(self, x):
            self.x = x
    items = [Item(i) for i in range(n)]
    best = float("inf")
    for _ in range(repeat):
        out = []
        append = out.append
        t0 = time.perf_counter()
        for it in items:
            append(it.x)
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e9


def build_requests(policy: str, num: int, prompt_len: int, output_len: int):
    reqs = []
    for i in range(num):
        prompt = [(i * 31 + j) % 30000 + 2 for j in range(prompt_len)]
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=output_len), 0.0)
        if policy == "decode_only":     # as a prefill_only instance hands it over
            r.num_computed_tokens = prompt_len
            r.output_token_ids.append(1)
            r.all_token_ids.append(1)
            r.token_times.append(0.0)
            r.first_token_time = 0.0
            r.status = RequestStatus.FINISHED
            r.finish_reason = "handoff"
        reqs.append(r)
    return reqs


def run_once(cfg: SchedulerConfig, requests: int, prompt_len: int, output_len: int):
    """(per-step seconds of schedule + update, scheduled sequences, preemptions, generated tokens) of one run."""
    sched = make_scheduler(cfg)
    reqs = build_requests(cfg.policy, requests, prompt_len, output_len)
    for r in reqs:
        if cfg.policy == "decode_only":
            sched.add_handoff(r, 0.0)
            sched.mark_kv_arrived(r.request_id)
        else:
            sched.add_request(r)
    step_s = []
    seqs = 0
    perf = time.perf_counter
    gc.collect()
    now = 0.0
    while sched.has_unfinished():
        t0 = perf()
        out = sched.schedule(now)
        t1 = perf()
        sampled = [1 if s else -1 for s in out.do_sample]
        t2 = perf()
        finished = sched.update(out, sampled, now)
        t3 = perf()
        if cfg.policy == "prefill_only":
            for r in finished:
                if r.finish_reason == "handoff":
                    sched.release(r.request_id)
        step_s.append((t1 - t0) + (t3 - t2))
        seqs += out.num_seqs
        now += GPU_STEP_S
        if len(step_s) > 10_000_000:
            raise RuntimeError("no progress")
    generated = sum(r.num_output_tokens for r in reqs)
    if cfg.policy == "decode_only":
        generated -= len(reqs)      # the first token came from the prefill instance
    return step_s, seqs, sched.num_preemptions, generated


def run(policy: str = "sarathi", requests: int = 256, prompt_len: int = 512, output_len: int = 128,
        token_budget: int = 2048, max_num_seqs: int = 64, page_size: int = 16, num_pages: int = 0,
        prefix_caching: bool = False, repeat: int = 5) -> dict:
    """The benchmark's JSON (module docstring); the best of `repeat` runs. num_pages 0: enough for max_num_seqs
    full requests. UserError for a combination the scheduler config refuses."""
    max_len = prompt_len + output_len
    per_req = -(-max_len // page_size)
    num_pages = num_pages or int(max_num_seqs * per_req / 0.99) + 2
    with user_errors():      # combinations the flags cannot check one by one (e.g. a policy's own rules)
        cfg = SchedulerConfig(policy=policy, token_budget=token_budget, max_num_seqs=max_num_seqs,
                              max_model_len=max_len, page_size=page_size, num_pages=num_pages,
                              enable_prefix_caching=prefix_caching)
    best = None
    for _ in range(repeat):
        res = run_once(cfg, requests, prompt_len, output_len)
        if best is None or sum(res[0]) < sum(best[0]):
            best = res
    step_s, seqs, preemptions, generated = best
    total = sum(step_s)
    srt = sorted(step_s)
    p99 = srt[min(len(srt) - 1, int(0.99 * len(srt)))]
    us_per_req = total / max(seqs, 1) * 1e6
    loop_ns = python_loop_ns_per_item()
    return {
        "policy": policy, "requests": requests, "prompt_len": prompt_len,
        "output_len": output_len, "token_budget": token_budget, "max_num_seqs": max_num_seqs,
        "page_size": page_size, "num_pages": num_pages, "prefix_caching": prefix_caching,
        "repeat": repeat,
        "steps": len(step_s),
        "total_s": round(total, 6),
        "mean_us_per_step": round(total / len(step_s) * 1e6, 2),
        "p99_us_per_step": round(p99 * 1e6, 2),
        "preemptions": preemptions,
        "generated_tokens": generated,
        "mean_seqs_per_step": round(seqs / len(step_s), 2),
        "us_per_scheduled_request": round(us_per_req, 3),
        "machine": {"python": platform.python_version(), "processor": platform.processor() or platform.machine(),
                    "python_loop_ns_per_item": round(loop_ns, 2)},
        "ratios": {
            "scheduled_request_cost_in_python_loop_items": round(us_per_req * 1e3 / loop_ns, 1),
            "speedup_vs_vllm_v1_17us_per_request": round(VLLM_V1_US_PER_RUNNING_REQUEST / us_per_req, 2),
            "mean_step_over_5ms_gpu_step": round(total / len(step_s) / GPU_STEP_S, 4),
        },
    }
