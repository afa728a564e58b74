"""Offline throughput benchmark: the colocated engine on P prompts of L tokens, N greedy output tokens each.

The command line is experiments/bench_throughput.py; `run` here returns its JSON.

--backend=hf runs the same job on HF transformers (PyTorch eager, CPU; the optional extra `hf`) side by side in
the same run, as vLLM's benchmark_throughput --backend hf: the same weights (written as an HF checkpoint), the
same prompts, greedy, exactly N tokens each. The backends alternate `--repeats` times, HF under both OpenMP wait
policies (ACTIVE spins and collapses when another job holds a core; PASSIVE does not but is slower on a quiet
machine), each one's best kept, the 1-minute load average printed beside them (pdjax.runtime.hf_baseline).

Default model: a 4-layer Llama, hidden 256, 8 query / 2 KV heads (head_dim 32), MLP 768, vocab 512, float32,
dummy weights (`bench_spec`, defined here, not in the registry). --checkpoint takes a registry spec name (dummy
weights) or a checkpoint directory. Prompts are random token ids; every request runs to exactly N output
tokens (no stop token), all arriving at t=0.

Compile first: the scheduler is dry-run on the same requests (it is pure Python and the schedule does not depend
on token values when requests run to max_tokens), the (T, S, P) shapes it produces are precompiled
(`compile_s`), then the engine serves the requests (`serving_s`, the engine's wall time); `compiles_during_run`
should be 0. Right before every timed serving, one real batch of each shape runs untimed (`_warm`), as the HF side
runs a short generate right before its timed one.

Token counts (written down, checked by tests/test_bench_throughput.py):
    prompt_tokens    = P * L      (all prefilled; no prefix caching, no preemption at the default size)
    output_tokens    = P * N      (generated; the first of each request comes from its last prefill position)
    tokens           = P * (L + N) = prompt_tokens + output_tokens   -> tokens_per_s = tokens / serving_s
    fed_tokens       = sum over steps of the tokens fed = P * (L + N - 1) without preemption
                       (prefill_tokens_fed + decode_tokens_fed; the last output token is never fed back)
CPU time: `serving_cpu_s` is this process's CPU seconds (every thread) over the serving, `output_tokens_per_cpu_s`
= output_tokens / serving_cpu_s; with --backend=hf both backends' tokens per CPU second sit beside their tokens per
wall second (`cpu_speedup_vs_hf`). On a shared machine wall time counts the other jobs' share of the cores and CPU
time does not (HF's spinning OpenMP threads under ACTIVE count as CPU time: that is what they cost).
--async_scheduling: the engine's async scheduling (pdjax.serving.engine): the host schedules and builds step k+1
while step k runs.
Roofline: per executed step, max(FLOPs / matmul rate, bytes / copy bandwidth) with the ceilings measured in the
same run (`pdjax/runtime/ceilings.py`, before and after serving, the higher of the two: load from other jobs on a
shared machine only lowers a measurement), summed over the steps; ratio = roofline_s / serving_s (1.0 = at the
ceiling). FLOPs and bytes per step are the simulator cost model's counts (pdjax.experiment.roofline.step_counts:
the layers' GEMMs with their weights and activations, attention over each sequence's visible keys, the
element-wise kernels, the embedding and one LM-head row per sequence).
"""
from __future__ import annotations

import os
import tempfile
import time
from typing import List, Optional

import jax
import numpy as np

from pdjax.config.buckets import engine_buckets
from pdjax.config.model_specs import ModelSpec
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.experiment.roofline import step_counts
from pdjax.models.checkpoint import load_model, save_hf_checkpoint
from pdjax.models.llama import init_params
from pdjax.runtime.ceilings import measure_ceilings
from pdjax.runtime.hf_baseline import matching_outputs, require_hf, run_hf_subprocess
from pdjax.runtime.runner import ModelRunner
from pdjax.scheduler import Request, make_scheduler
from pdjax.serving.engine import ColocatedEngine
from pdjax.serving.run import resolve_checkpoint

BACKENDS = ("pdjax", "hf")


def bench_spec() -> ModelSpec:
    """The default model: 4 layers, hidden 256, 8 query / 2 KV heads, vocab 512, float32."""
    return ModelSpec(name="bench-llama-4l", vocab_size=512, hidden_size=256, intermediate_size=768, num_layers=4,
                     num_heads=8, num_kv_heads=2, head_dim=32, max_position_embeddings=2048, dtype="float32")


def validate(num_prompts: int, prompt_len: int, output_len: int, token_budget: int, page_size: int) -> None:
    """Raise ValueError with a one-line message naming the flag."""
    for name, value in (("num_prompts", num_prompts), ("prompt_len", prompt_len), ("output_len", output_len),
                        ("token_budget", token_budget), ("page_size", page_size)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"--{name}={value!r}: expected an integer >= 1")


def _load(checkpoint: str, seed: int):
    if not checkpoint:
        spec = bench_spec()
        return spec, init_params(spec, seed)
    return load_model(resolve_checkpoint(checkpoint), seed=seed)


def _requests(vocab: int, num_prompts: int, prompt_len: int, output_len: int, seed: int) -> List[Request]:
    rng = np.random.default_rng(seed)
    return [Request(f"r{i}", [int(t) for t in rng.integers(0, vocab, prompt_len)],
                    SamplingParams(max_tokens=output_len), 0.0) for i in range(num_prompts)]


def _dry_run(cfg: SchedulerConfig, requests: List[Request], runner: ModelRunner) -> dict:
    """(T, S, P) bucket -> the first SchedulerOutput of that bucket the engine will run, from the scheduler alone
    (placeholder sampled tokens)."""
    sched = make_scheduler(cfg)
    for req in requests:
        sched.add_request(req)
    first_of_shape, step = {}, 0
    while sched.has_unfinished():
        out = sched.schedule(float(step))
        if out.is_empty:
            raise RuntimeError("the scheduler returned an empty batch with requests left (too few KV pages?)")
        first_of_shape.setdefault(tuple(runner.build_batch(out).shape_key), out)
        sched.update(out, [0 if s else -1 for s in out.do_sample], float(step))
        step += 1
    return dict(sorted(first_of_shape.items()))


def _warm(runner: ModelRunner, batches: dict) -> None:
    """Run one real batch of every bucket, untimed, right before a timed serving (as the HF side runs a short
    generate right before its timed one). Warm-up compiles on empty batches, whose key loops run no step; the
    first real pass, or the first after the process sat idle while HF ran, was up to 1.5x slower (memory and code
    touched again). The KV it writes is overwritten before anything reads it."""
    for out in batches.values():
        runner.execute(out)


def _serve(runner: ModelRunner, cfg: SchedulerConfig, requests: List[Request], async_scheduling: bool = False):
    """(engine result, the executed SchedulerOutputs, wall seconds, CPU seconds of this process (all threads))
    of one serving of `requests`."""
    sched = make_scheduler(cfg)
    recorded = []
    schedule = sched.schedule
    sched.schedule = lambda now: recorded.append(schedule(now)) or recorded[-1]
    engine = ColocatedEngine(runner, sched, async_scheduling=async_scheduling)
    start, cpu_start = time.perf_counter(), time.process_time()
    result = engine.run(requests)
    return result, recorded, time.perf_counter() - start, time.process_time() - cpu_start


def _hf_side_by_side(spec, params, requests: List[Request], output_len: int, repeats: int, threads: int,
                     serve_pdjax) -> dict:
    """Alternate pdjax and HF runs `repeats` times (HF under both OpenMP wait policies, each in a fresh
    process) and keep each one's best output tokens/s; the machine's load average beside the numbers."""
    prompts = [r.prompt_token_ids for r in requests]
    num_output = len(prompts) * output_len
    pdjax_tok_s, hf_tok_s = [], {"ACTIVE": [], "PASSIVE": []}
    pdjax_cpu, hf_cpu = [], {"ACTIVE": [], "PASSIVE": []}   # output tokens per CPU second
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as hf_dir:
        save_hf_checkpoint(hf_dir, spec, params)
        for _ in range(repeats):
            result, cpu_s = serve_pdjax()
            pdjax_tok_s.append(num_output / result.duration_s)
            pdjax_cpu.append(num_output / cpu_s)
            for policy in hf_tok_s:
                hf = run_hf_subprocess(hf_dir, prompts, output_len, threads, policy)
                hf_tok_s[policy].append(num_output / hf["generate_s"])
                hf_cpu[policy].append(num_output / hf["generate_cpu_s"])
            load.append(os.getloadavg()[0])
    ids = [r.request_id for r in requests]
    best_hf = max(max(v) for v in hf_tok_s.values())
    return {"repeats": repeats, "threads": threads, "torch": hf["torch"], "transformers": hf["transformers"],
            "pdjax_output_tokens_per_s": pdjax_tok_s, "hf_output_tokens_per_s": hf_tok_s,
            "pdjax_best": max(pdjax_tok_s), "hf_best": best_hf,
            "hf_best_policy": max(hf_tok_s, key=lambda k: max(hf_tok_s[k])),
            "speedup_vs_hf": max(pdjax_tok_s) / best_hf,
            "pdjax_output_tokens_per_cpu_s": pdjax_cpu, "hf_output_tokens_per_cpu_s": hf_cpu,
            "cpu_speedup_vs_hf": max(pdjax_cpu) / max(max(v) for v in hf_cpu.values()),
            "requests_with_equal_tokens": matching_outputs(result.output_tokens, ids, hf["output_tokens"]),
            "num_requests": len(ids), "load_avg_1min": load}


def _setup(checkpoint: str, num_prompts: int, prompt_len: int, output_len: int, *, policy: str,
           token_budget: int, page_size: int, attention_impl: str, seed: int):
    """(spec, params, scheduler config, runner) of the benchmark's model and KV cache; ValueError for a length
    beyond the model's positions."""
    spec, params = _load(checkpoint, seed)
    max_model_len = prompt_len + output_len
    if max_model_len > spec.max_position_embeddings:
        raise ValueError(f"--prompt_len + --output_len = {max_model_len} exceeds the model's "
                         f"max_position_embeddings={spec.max_position_embeddings}")
    pages_per_seq = -(-max_model_len // page_size)
    num_pages = num_prompts * pages_per_seq + 1
    cfg = SchedulerConfig(policy=policy, token_budget=max(token_budget, 1), max_num_seqs=num_prompts,
                          max_model_len=max_model_len, page_size=page_size, num_pages=num_pages)
    buckets = engine_buckets(cfg.token_budget, cfg.max_num_seqs, max_model_len, page_size)
    runner = ModelRunner(spec, params, num_pages=num_pages, page_size=page_size, buckets=buckets,
                         attention_impl=attention_impl, max_model_len=max_model_len)
    return spec, params, cfg, runner


def _roofline(recorded, spec: ModelSpec, measured: list) -> dict:
    """The run's roofline terms over its executed steps, for the best of the `measured` ceilings."""
    ceilings = {k: max(c[k] for c in measured) for k in ("matmul_flops", "copy_bandwidth_Bps")}
    ceilings.update({k: measured[0].get(k) for k in ("matmul", "copy_bytes")})
    costs = [step_counts(out, spec) for out in recorded if not out.is_empty]
    rate, bandwidth = ceilings["matmul_flops"], ceilings["copy_bandwidth_Bps"]
    return {"roofline_s": sum(max(f / rate, b / bandwidth) for f, b in costs),
            "roofline_compute_s": sum(f / rate for f, _ in costs),
            "roofline_memory_s": sum(b / bandwidth for _, b in costs),
            "ceilings": {"matmul_flops_per_s": rate, "memory_bandwidth_bytes_per_s": bandwidth,
                         "matmul": ceilings.get("matmul"), "copy_bytes": ceilings.get("copy_bytes")},
            "total_flops": sum(f for f, _ in costs), "total_bytes": sum(b for _, b in costs)}


def _token_counts(result, requests: List[Request], serving_s: float, cpu_s: float) -> dict:
    """The token counts of the module docstring and their rates."""
    output_tokens = sum(len(t) for t in result.output_tokens.values())
    prefill_fed = sum(it.num_prefill_tokens for it in result.iterations)
    decode_fed = sum(it.num_decode_tokens for it in result.iterations)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    tokens = prompt_tokens + output_tokens
    return {
        "completed": sum(r.finish_time is not None for r in requests),
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "tokens": tokens,
        "prefill_tokens_fed": prefill_fed, "decode_tokens_fed": decode_fed, "fed_tokens": prefill_fed + decode_fed,
        "tokens_per_s": tokens / serving_s, "output_tokens_per_s": output_tokens / serving_s,
        "fed_tokens_per_s": (prefill_fed + decode_fed) / serving_s,
        "output_tokens_per_cpu_s": output_tokens / cpu_s}


def run(checkpoint: str = "", num_prompts: int = 32, prompt_len: int = 128, output_len: int = 64, *,
        policy: str = "sarathi", token_budget: int = 2048, page_size: int = 16, attention_impl: str = "auto",
        seed: int = 0, ceilings: Optional[dict] = None, backend: str = "pdjax", repeats: int = 3,
        hf_threads: int = 0, async_scheduling: bool = False) -> dict:
    """The benchmark's JSON (module docstring); ValueError / MissingExtraError for a bad argument."""
    validate(num_prompts, prompt_len, output_len, token_budget, page_size)
    if backend not in BACKENDS:
        raise ValueError(f"--backend={backend!r}, expected one of {BACKENDS}")
    if backend == "hf":
        require_hf()
    spec, params, cfg, runner = _setup(checkpoint, num_prompts, prompt_len, output_len, policy=policy,
                                       token_budget=token_budget, page_size=page_size,
                                       attention_impl=attention_impl, seed=seed)
    measured = [ceilings or measure_ceilings(jax.default_backend())]
    batches = _dry_run(cfg, _requests(spec.vocab_size, num_prompts, prompt_len, output_len, seed), runner)
    shapes = list(batches)
    compile_s = runner.warmup(shapes)
    compiled = runner.compile_count

    def timed_serve(requests):
        _warm(runner, batches)
        return _serve(runner, cfg, requests, async_scheduling)

    requests = _requests(spec.vocab_size, num_prompts, prompt_len, output_len, seed)
    result, recorded, wall_s, cpu_s = timed_serve(requests)
    serving_s = result.duration_s
    side_by_side = None
    if backend == "hf":
        side_by_side = _hf_side_by_side(
            spec, params, requests, output_len, repeats, hf_threads or os.cpu_count(),
            lambda: timed_serve(_requests(spec.vocab_size, num_prompts, prompt_len, output_len, seed))[::3])
    if ceilings is None:  # the best of before and after the run: other jobs on a shared machine only lower it
        measured.append(measure_ceilings(jax.default_backend()))
    roofline = _roofline(recorded, spec, measured)
    return {
        "model": spec.name, "checkpoint": checkpoint or None, "dtype": str(params.embed.dtype),
        "backend": jax.default_backend(), "device": str(jax.devices()[0]),
        "attention_impl": attention_impl, "policy": policy, "token_budget": cfg.token_budget,
        "page_size": page_size, "num_prompts": num_prompts, "prompt_len": prompt_len, "output_len": output_len,
        "compile_s": compile_s, "num_compiled_shapes": compiled, "shapes": ["x".join(map(str, s)) for s in shapes],
        "compiles_during_run": runner.compile_count - compiled,
        "async_scheduling": async_scheduling,
        "serving_s": serving_s, "wall_s": wall_s, "serving_cpu_s": cpu_s, "num_steps": len(result.iterations),
        **_token_counts(result, requests, serving_s, cpu_s),
        "step_s": {"mean": float(np.mean([it.step_time for it in result.iterations])),
                   "max": float(np.max([it.step_time for it in result.iterations]))},
        "roofline_s": roofline["roofline_s"], "roofline_compute_s": roofline["roofline_compute_s"],
        "roofline_memory_s": roofline["roofline_memory_s"], "ratio": roofline["roofline_s"] / serving_s,
        "ceilings": roofline["ceilings"], "total_flops": roofline["total_flops"],
        "total_bytes": roofline["total_bytes"],
        **({"hf": side_by_side} if side_by_side is not None else {}),
    }
