"""Pipeline parallelism with batches in flight: pp 1 / 2 / 4 on the same offline job, and a paper-scale table in
simulation. JSON to stdout.

The command line is experiments/bench_pipeline.py (`run_cpu` and `sim_table` return its JSON).

Real (CPU, `run_cpu`): the model split into pp stages on fake CPU devices (the entry point sets
XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX is imported), ColocatedEngine with max_in_flight = pp
(pdjax.scheduler.BatchQueue). Per pp: tokens/s (generated and all processed), mean batches in flight (from the
iteration records: their dispatch -> collect spans), and each stage's busy fraction of the wall time, from its
outputs' readiness (the runner's `stage_watch` hook, pdjax.runtime.stage_watch: a watcher thread stamps when each
stage's output became ready). Ceiling: on fake CPU devices all stages share the host's cores, so a pipeline cannot
be faster than pp=1 here (the work is the same, only split); what the numbers show is overlap (two stages busy at
once, batches in flight > 1), not speed-up. Greedy tokens of every pp are checked equal to pp=1's.

Sim (--sim, `sim_table`): Sarathi-Serve's cross-node pipeline setting, built from parts (no config keys):
llama-2-70b on two 4-GPU A100-80GB nodes (an SXM node with devices_per_node=4: NVLink inside a node, 200 Gb/s HDR
InfiniBand per GPU between nodes), TP4 inside each node x PP2 across the nodes, the shipped A100 profile, chat
lengths with Poisson arrivals; vllm_v0 / orca vs sarathi (token budget 512), each with 2 batches in flight. Reports
the bubble fraction each scheduler leaves (idle stage time / total stage time while batches are in flight, from the
simulated stage schedule), latency percentiles and throughput.
"""
from __future__ import annotations

import os
import time
from typing import Sequence

import numpy as np

from pdjax.config.model_specs import get_model_spec
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.errors import UserError
from pdjax.experiment.cli import one_line
from pdjax.metrics import summarize_run
from pdjax.scheduler import Request, make_scheduler, request_from_workload
from pdjax.scheduler.batch_queue import mean_in_flight
from pdjax.serving.engine import ColocatedEngine
from pdjax.sim.cost_model import kv_cache_capacity_tokens
from pdjax.sim.hardware import get_hardware_spec
from pdjax.sim.profile import load_profile
from pdjax.sim.simulator import SimInstance, simulate
from pdjax.sim.step_cost import make_step_time
from pdjax.workload import make_workload

# ----------------------------------------------------------------------------------------------------- CPU
def _cpu_setup(checkpoint: str, pps: Sequence[int], requests: int, prompt_len: int, output_len: int,
               token_budget: int, max_num_seqs: int):
    """(spec, params, prompts, buckets, max_len, page, num_pages) of the CPU benchmark; UserError for a bad
    argument."""
    import jax  # noqa: PLC0415 (no JAX on the --sim path)

    from pdjax.models.checkpoint import load_model  # noqa: PLC0415 (loads JAX; --sim does not)
    from pdjax.runtime.batch import Buckets  # noqa: PLC0415 (loads JAX; --sim does not)

    try:
        spec, params = load_model(checkpoint)
    except (ValueError, OSError) as e:
        raise UserError(one_line(e)) from None
    bad = [p for p in pps if p < 1 or p > spec.num_layers or p > jax.device_count()]
    if bad:
        raise UserError(f"--pp={','.join(map(str, pps))}: {bad} not in [1, min(num_layers={spec.num_layers}, "
                        f"devices={jax.device_count()})]")
    max_len, page = 256, 16
    if prompt_len + output_len > max_len:
        raise UserError(f"--prompt_len + --output_len = {prompt_len + output_len} > {max_len}")
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, spec.vocab_size, prompt_len))) for _ in range(requests)]
    tokens = tuple(sorted({t for t in (16, 32, 64) if t < token_budget} | {token_budget}))   # none above the budget
    buckets = Buckets(tokens=tokens, seqs=(max_num_seqs,), pages=(max_len // page,))
    return spec, params, prompts, buckets, max_len, page, max_num_seqs * max_len // page + 8


def _cpu_run(pp: int, spec, params, prompts, buckets, max_len: int, page: int, num_pages: int, output_len: int,
             token_budget: int, max_num_seqs: int):
    """(result row without tokens_equal_pp1, greedy tokens) of one pp (module docstring)."""
    import jax  # noqa: PLC0415 (no JAX on the --sim path)

    from pdjax.runtime.mesh import make_mesh  # noqa: PLC0415 (loads JAX; --sim does not)
    from pdjax.runtime.pipeline import PipelineRunner  # noqa: PLC0415 (loads JAX; --sim does not)
    from pdjax.runtime.stage_watch import StageWatch, stage_busy  # noqa: PLC0415 (loads JAX; --sim does not)

    runner = PipelineRunner(spec, params, num_pages=num_pages, page_size=page, buckets=buckets,
                            max_model_len=max_len, mesh=make_mesh(jax.devices()[:pp], pp=pp, tp=1))
    watch = runner.stage_watch = StageWatch(pp)
    compile_s = runner.warmup()
    cfg = SchedulerConfig(policy="sarathi", token_budget=token_budget, max_num_seqs=max_num_seqs,
                          max_model_len=max_len, page_size=page, num_pages=num_pages)
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=output_len), 0.0) for i, p in enumerate(prompts)]
    engine = ColocatedEngine(runner, make_scheduler(cfg), max_in_flight=pp)
    watch.batches.clear()
    watch.recording = True
    t0 = time.perf_counter()
    result = engine.run(reqs)
    watch.drain()
    watch.recording = False
    watch.stop()
    wall = result.duration_s
    tokens = [result.output_tokens[f"r{i}"] for i in range(len(reqs))]
    generated = sum(len(t) for t in tokens)
    processed = sum(it.num_tokens for it in result.iterations)
    mean_flight, active = mean_in_flight((it.start_time, it.end_time) for it in result.iterations)
    busy = stage_busy([(b[0] - t0, b[1], [r - t0 for r in b[2]]) for b in watch.batches], pp)
    # the watcher thread may stamp a stage's readiness after the engine's clock stopped (a loaded machine): busy
    # fractions are over the span both clocks cover, so each stage's disjoint busy intervals fit in it
    span = max([wall] + [r - t0 for b in watch.batches for r in b[2]])
    return {
        "pp": pp, "max_in_flight": pp, "layers_per_stage": [b - a for a, b in runner.layer_ranges],
        "compile_s": round(compile_s, 2), "wall_s": round(wall, 3), "iterations": len(result.iterations),
        "generated_tokens_per_s": round(generated / wall, 1), "processed_tokens_per_s": round(processed / wall, 1),
        "mean_batches_in_flight": round(mean_flight, 3),
        "stage_busy_fraction": [round(b / span, 3) for b in busy],
        "stage_overlap": round(sum(busy) / span, 3),     # > 1: stages busy at the same time
    }, tokens


def run_cpu(checkpoint: str = "tiny-byte", pps: Sequence[int] = (1, 2, 4), requests: int = 32,
            prompt_len: int = 96, output_len: int = 32, token_budget: int = 128, max_num_seqs: int = 16) -> dict:
    """The CPU benchmark's JSON (module docstring)."""
    import jax  # noqa: PLC0415 (no JAX on the --sim path)

    spec, params, prompts, buckets, max_len, page, num_pages = _cpu_setup(
        checkpoint, pps, requests, prompt_len, output_len, token_budget, max_num_seqs)
    results, reference = [], None
    for pp in pps:
        row, tokens = _cpu_run(pp, spec, params, prompts, buckets, max_len, page, num_pages, output_len,
                               token_budget, max_num_seqs)
        if reference is None:
            reference = tokens
        results.append({**row, "tokens_equal_pp1": tokens == reference})
    return {"benchmark": "pipeline_cpu", "checkpoint": checkpoint, "requests": requests,
            "prompt_len": prompt_len, "output_len": output_len, "token_budget": token_budget,
            "devices": f"{jax.device_count()} fake CPU devices on {os.cpu_count()} cores",
            "ceiling": "stages share the host's cores: pp > 1 cannot beat pp = 1 here; read overlap, not speed-up",
            "runs": results}


# ----------------------------------------------------------------------------------------------------- sim
SIM_POLICIES = {   # policy -> token budget (vllm_v0 / orca: a whole max-length prompt fits, as in the paper)
    "vllm_v0": 4096, "orca": 4096 + 128, "sarathi": 512,
}


def sim_table(num_requests: int = 256, rate: float = 1.0, seed: int = 0) -> dict:
    """Llama-2-70B, TP4 x PP2 over two 4-GPU A100 nodes, each policy with 2 batches in flight (module docstring)."""
    model = get_model_spec("llama-2-70b")
    hw = get_hardware_spec("a100-80gb-sxm").replace(name="a100-80gb-sxm-4gpu-node", devices_per_node=4)
    tp, pp, max_len, max_seqs, page = 4, 2, 4096, 128, 16
    params = load_profile("a100").params
    workload = make_workload({"preset": "chat", "num_requests": num_requests, "rate": rate, "arrival": "poisson",
                              "vocab_size": 32000, "max_model_len": max_len}, seed)
    rows = {}
    for policy, budget in SIM_POLICIES.items():
        capacity = kv_cache_capacity_tokens(model, hw, tp, pp, 0.9, max_num_batched_tokens=budget,
                                            max_num_seqs=max_seqs)
        cfg = SchedulerConfig(policy=policy, token_budget=budget, max_num_seqs=max_seqs, max_model_len=max_len,
                              page_size=page, num_pages=capacity // page)
        step = make_step_time(model, hw, tp, pp, params)
        inst = SimInstance("replica0", make_scheduler(cfg), step)     # max_in_flight = pp = 2
        reqs = [request_from_workload(wr) for wr in workload]
        res = simulate(reqs, [inst])
        summary = summarize_run(res.requests, res.iterations)
        p = res.pipeline
        one = p["instances"]["replica0"]

        def ms(key, q, summary=summary):
            v = summary.get(key, {})
            return round(1e3 * v[q], 1) if isinstance(v, dict) and v.get(q) is not None else None
        rows[policy] = {
            "token_budget": budget, "bubble_fraction": round(p["bubble_fraction"], 4),
            "stage_busy_fraction": [round(x, 4) for x in one["stage_busy_fraction"]],
            "mean_batches_in_flight": round(p["mean_batches_in_flight"], 3),
            "iterations": res.num_iterations, "duration_s": round(res.duration_s, 2),
            "output_tokens_per_s": round(sum(r.num_output_tokens for r in res.requests) / res.duration_s, 1),
            "ttft_p50_ms": ms("ttft", "p50"), "ttft_p99_ms": ms("ttft", "p99"),
            "tbt_p50_ms": ms("tbt", "p50"), "tbt_p99_ms": ms("tbt", "p99"),
            "preempted": sum(r.num_preemptions for r in res.requests),
            "sim_wall_s": round(res.wall_s, 2),
        }
    return {"benchmark": "pipeline_sim", "model": model.name, "hardware": hw.name, "nodes": 2,
            "devices_per_node": hw.devices_per_node, "tp": tp, "pp": pp, "max_in_flight": pp,
            "stage_send_link": "inter-node (HDR InfiniBand, 25 GB/s per GPU per direction)",
            "profile": "a100", "workload": {"preset": "chat", "requests": num_requests, "rate": rate},
            "policies": rows}
