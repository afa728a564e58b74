"""End-to-end serving on the real CPU engine with a tiny model: policies change timing, never tokens; a long
prompt stalls decodes under vllm_v0 but not under Sarathi's budget; the serve entry point writes its outputs."""
import json
import os

import numpy as np
import pytest

from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.metrics import load_run, recompute_summary
from pdjax.models.checkpoint import load_model
from pdjax.runtime.batch import Buckets
from pdjax.runtime.generate import generate
from pdjax.runtime.runner import ModelRunner
from pdjax.scheduler import Request, make_scheduler
from pdjax.serving.engine import ColocatedEngine

MAX_LEN = 128
PAGE = 16


@pytest.fixture(scope="module")
def runner():
    """One runner shared by every policy (the step compiles once per bucket; stale pages are never read)."""
    spec, params = load_model("tiny-llama", seed=3)
    buckets = Buckets(tokens=(8, 32, 64, 128), seqs=(8,), pages=(MAX_LEN // PAGE,))
    return ModelRunner(spec, params, num_pages=64, page_size=PAGE, buckets=buckets, max_model_len=MAX_LEN)


def _prompts():
    rng = np.random.default_rng(0)
    return [list(map(int, rng.integers(1, 500, size=n))) for n in (5, 17, 33, 40, 64, 90)]


def _serve(runner, policy, budget, *, num_pages=48, preemption="recompute", max_tokens=6):
    cfg = SchedulerConfig(policy=policy, token_budget=budget, max_num_seqs=8, max_model_len=MAX_LEN,
                          page_size=PAGE, num_pages=num_pages, preemption_mode=preemption,
                          num_host_pages=64 if preemption == "swap" else 0)
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens), 0.0) for i, p in enumerate(_prompts())]
    result = ColocatedEngine(runner, make_scheduler(cfg)).run(reqs)
    assert all(r.finish_reason == "length" for r in result.requests)
    return result


CASES = [("vllm_v0", 128), ("orca", 128), ("decode_first", 128), ("sarathi", 32), ("sarathi", 64),
         ("chunked_only", 32), ("vllm_v1", 32)]


def test_greedy_tokens_identical_under_every_policy_budget_and_generate(runner):
    expected, _ = generate(runner, _prompts(), 6, chunk_size=32, token_budget=128)
    for policy, budget in CASES:
        result = _serve(runner, policy, budget)
        got = [result.output_tokens[f"r{i}"] for i in range(len(expected))]
        assert got == expected, f"{policy} budget={budget} changed the tokens"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_changes_timing_not_tokens(runner, mode):
    expected, _ = generate(runner, _prompts(), 12, chunk_size=32, token_budget=128)
    # 14 pages cannot hold all six requests (they need 17): preemption must happen.
    result = _serve(runner, "sarathi", 32, num_pages=14, preemption=mode, max_tokens=12)
    assert sum(r.num_preemptions for r in result.requests) > 0
    assert [result.output_tokens[f"r{i}"] for i in range(6)] == expected


class _TokenClock:
    """A deterministic engine clock: each executed step advances it by 1 ms plus 10 us per token (wall time on a
    shared machine is too noisy to compare the decoders' gaps of two runs)."""

    def __init__(self, runner):
        self.runner, self.t = runner, 0.0

    def clock(self):
        return self.t

    def sleep(self, seconds):
        self.t += seconds

    def dispatch(self, out, prev=None):
        return self.runner.dispatch(out, prev=prev), out.num_prefill_tokens + out.num_decode_tokens

    def collect(self, handle):
        ids = self.runner.collect(handle[0])
        self.t += 1e-3 + 1e-5 * handle[1]
        return ids


def test_long_prompt_stalls_decodes_under_vllm_v0_not_sarathi():
    """Four requests decode; a 1000-token prompt arrives. vllm_v0 runs it as one prefill-only iteration (a
    generation stall); sarathi with a 64-token budget keeps decoding every iteration."""
    spec, params = load_model("tiny-llama", seed=0)
    max_len = 1024 + 64
    buckets = Buckets(tokens=(8, 64, max_len), seqs=(8,), pages=(max_len // PAGE,))
    runner = ModelRunner(spec, params, num_pages=256, page_size=PAGE, buckets=buckets, max_model_len=max_len)
    max_gap = {}
    for policy, budget in (("vllm_v0", max_len), ("sarathi", 64)):
        cfg = SchedulerConfig(policy=policy, token_budget=budget, max_num_seqs=8, max_model_len=max_len,
                              page_size=PAGE, num_pages=256)
        decoders = [Request(f"d{i}", [i + 1] * 8, SamplingParams(max_tokens=48), 0.0) for i in range(4)]
        long = Request("long", [i % 500 + 1 for i in range(1000)], SamplingParams(max_tokens=2), 0.01)
        timed = _TokenClock(runner)
        result = ColocatedEngine(timed, make_scheduler(cfg), clock=timed.clock, sleep=timed.sleep).run(
            decoders + [long])
        gaps = [b - a for r in result.requests if r.request_id.startswith("d")
                for a, b in zip(r.token_times, r.token_times[1:])]
        max_gap[policy] = max(gaps)
        biggest = max(result.iterations, key=lambda it: it.num_tokens)
        if policy == "vllm_v0":
            assert biggest.num_prefill_tokens == 1000 and biggest.num_decode_tokens == 0
        else:
            assert biggest.num_tokens <= 64
        decoding = [t for r in result.requests if r.request_id.startswith("d") for t in r.token_times]
        stalled = [it for it in result.iterations if it.num_prefill_tokens and not it.num_decode_tokens
                   and min(decoding) <= it.start_time < max(decoding)]   # a prefill-only step mid-decode
        assert bool(stalled) == (policy == "vllm_v0"), (policy, stalled)
    assert max_gap["vllm_v0"] > 1.5 * max_gap["sarathi"], max_gap


def test_out_of_vocabulary_prompt_is_rejected_and_the_others_finish(runner):
    cfg = SchedulerConfig(policy="sarathi", token_budget=32, max_num_seqs=8, max_model_len=MAX_LEN,
                          page_size=PAGE, num_pages=48, vocab_size=runner.spec.vocab_size)
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=3), 0.0) for i, p in enumerate(_prompts()[:3])]
    reqs.append(Request("bad", [1, 2, runner.spec.vocab_size + 7], SamplingParams(max_tokens=3), 0.0))
    result = ColocatedEngine(runner, make_scheduler(cfg)).run(reqs)
    reasons = {r.request_id: r.finish_reason for r in result.requests}
    assert reasons == {"r0": "length", "r1": "length", "r2": "length", "bad": "rejected"}


def test_serve_entry_point_writes_consistent_outputs(tmp_path):
    from pdjax.experiment.run import run_experiment
    config = {
        "backend": "real",
        "model": {"checkpoint": "tiny-llama"},
        "engine": {"mode": "offline", "progress": False, "token_buckets": (16, 64), "seq_buckets": (8,),
                   "page_buckets": (8,)},
        "scheduler": {"policy": "sarathi", "token_budget": 64, "max_num_seqs": 8, "max_model_len": 128,
                      "page_size": 16, "num_pages": 64},
        "workload": {"kind": "synthetic", "preset": "chat", "arrival": "offline", "num_requests": 6,
                     "vocab_size": 512, "fit_to_model": True, "max_output_len": 8},
        "slo": {"ttft": 5.0, "tbt": 1.0},
    }
    summary = run_experiment(config, str(tmp_path))
    for name in ("config.json", "results.json", "requests.csv", "token_times.csv", "iterations.csv",
                 "ttft_cdf.png", "tbt_cdf.png", "iteration_timeline.png"):
        assert os.path.exists(tmp_path / name), name
    with open(tmp_path / "results.json") as f:
        on_disk = json.load(f)
    assert on_disk["engine"]["compiles_during_run"] == 0
    assert on_disk["num_requests"] == 6 if "num_requests" in on_disk else True
    run = load_run(str(tmp_path))
    assert len(run.requests) == 6 and all(r.arrival_time == 0.0 for r in run.requests)
    again = recompute_summary(str(tmp_path))
    for metric in ("ttft", "tbt", "e2e"):
        assert again[metric]["p50"] == pytest.approx(summary[metric]["p50"], rel=1e-9)


def test_invalid_config_fails_at_start_up(tmp_path):
    from pdjax.experiment.run import run_experiment
    with pytest.raises(ValueError, match="scheduler.token_budgt"):
        run_experiment({"scheduler": {"token_budgt": 5}}, str(tmp_path))
    with pytest.raises(ValueError, match="backend"):
        run_experiment({"backend": "gpu"}, str(tmp_path))
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_async_scheduling_gives_the_same_tokens_and_timeline_shape(runner, mode):
    """Step k+1 is scheduled and dispatched before step k's ids reach the host; its decode inputs come from
    step k's device output. Tokens must equal the synchronous engine's, with and without preemption."""
    expected, _ = generate(runner, _prompts(), 12, chunk_size=32, token_budget=128)
    for num_pages in (48, 14):
        cfg = SchedulerConfig(policy="sarathi", token_budget=32, max_num_seqs=8, max_model_len=MAX_LEN,
                              page_size=PAGE, num_pages=num_pages, preemption_mode=mode,
                              num_host_pages=64 if mode == "swap" else 0)
        reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=12), 0.0) for i, p in enumerate(_prompts())]
        tokens = []
        engine = ColocatedEngine(runner, make_scheduler(cfg), async_scheduling=True,
                                 on_token=lambda rid, tok, t, out=tokens: out.append((rid, tok)))
        result = engine.run(reqs)
        assert [result.output_tokens[f"r{i}"] for i in range(6)] == expected
        assert sorted(tokens) == sorted((f"r{i}", t) for i in range(6) for t in expected[i])
        for rec in result.requests:
            assert rec.finish_reason == "length" and len(rec.token_times) == 12
            assert rec.token_times == sorted(rec.token_times)
            assert rec.first_token_time == rec.token_times[0] and rec.finish_time == rec.token_times[-1]
        if num_pages == 14:
            assert sum(r.num_preemptions for r in result.requests) > 0
