"""Pipeline parallelism with batches in flight: pp 1 / 2 / 4 on the same offline job, and a paper-scale table in
simulation. JSON to stdout.

    python -m experiments.bench_pipeline [--checkpoint=tiny-byte] [--requests=32] [--pp=1,2,4]
    python -m experiments.bench_pipeline --sim [--sim_requests=256] [--sim_rate=1.0]

Real (CPU): the model split into pp stages on fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8
is set before JAX is imported), ColocatedEngine with max_in_flight = pp (pdjax.scheduler.BatchQueue). Per pp:
tokens/s (generated and all processed), mean batches in flight (from the iteration records: their dispatch ->
collect spans), and each stage's busy fraction of the wall time, from its outputs' readiness: a watcher thread
blocks on every stage's output of every batch in turn and records when it became ready; stage s of batch k is
counted busy from max(dispatch of k, stage s-1 of k ready, stage s of k-1 ready) to its own readiness.
Ceiling: on fake CPU devices all stages share the host's cores, so a pipeline cannot be faster than pp=1 here
(the work is the same, only split); what the numbers show is overlap (two stages busy at once, batches in flight
> 1), not speed-up. Greedy tokens of every pp are checked equal to pp=1's.

Sim (--sim): Sarathi-Serve's cross-node pipeline setting, built from parts (no config keys): llama-2-70b on two
4-GPU A100-80GB nodes (an SXM node with devices_per_node=4: NVLink inside a node, 200 Gb/s HDR InfiniBand per
GPU between nodes), TP4 inside each node x PP2 across the nodes, the shipped A100 profile, chat lengths with
Poisson arrivals; vllm_v0 / orca vs sarathi (token budget 512), each with 2 batches in flight. Reports the
bubble fraction each scheduler leaves (idle stage time / total stage time while batches are in flight, from the
simulated stage schedule), latency percentiles and throughput.
"""
import json
import os
import threading
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import numpy as np
from absl import flags

from pdjax.config.model_specs import get_model_spec
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.experiment import cli
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

_SIM = flags.DEFINE_boolean("sim", False, "Run the paper-scale simulated table instead of the CPU benchmark.")
_CKPT = flags.DEFINE_string("checkpoint", "tiny-byte", "Checkpoint dir or registry spec name (CPU benchmark).")
_PP = flags.DEFINE_list("pp", ["1", "2", "4"], "Pipeline degrees to run (CPU benchmark).")
_REQUESTS = flags.DEFINE_integer("requests", 32, "Requests (offline, all at t=0; CPU benchmark).")
_PROMPT = flags.DEFINE_integer("prompt_len", 96, "Prompt tokens (CPU benchmark).")
_OUTPUT = flags.DEFINE_integer("output_len", 32, "Output tokens (CPU benchmark).")
_BUDGET = flags.DEFINE_integer("token_budget", 128, "Sarathi token budget (CPU benchmark).")
_SEQS = flags.DEFINE_integer("max_num_seqs", 16, "Max sequences per instance (CPU benchmark).")
_SIM_REQUESTS = flags.DEFINE_integer("sim_requests", 256, "Requests of the simulated table.")
_SIM_RATE = flags.DEFINE_float("sim_rate", 1.0, "Poisson arrival rate (req/s) of the simulated table.")


# ----------------------------------------------------------------------------------------------------- CPU
def _stage_watch(runner_cls):
    """A PipelineRunner subclass recording, per dispatched batch, its dispatch time and every stage's output; a
    watcher thread records when each became ready (module docstring)."""
    import jax  # noqa: PLC0415 (no JAX on the --sim path)

    class Watched(runner_cls):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.batches = []          # [dispatch time, [stage outputs], [ready times]]
            self._pending = []
            self._cv = threading.Condition()
            self._stop = False
            self._thread = threading.Thread(target=self._watch, daemon=True)
            self._thread.start()

        def _on_stage_outputs(self, outs):
            if self.recording:
                rec = [time.perf_counter(), list(outs), [None] * self.pp]
                self.batches.append(rec)
                with self._cv:
                    self._pending.append(rec)
                    self._cv.notify()

        recording = False

        def _watch(self):
            while True:
                with self._cv:
                    while not self._pending and not self._stop:
                        self._cv.wait()
                    if self._stop and not self._pending:
                        return
                    rec = self._pending.pop(0)
                for s, arr in enumerate(rec[1]):
                    jax.block_until_ready(arr)
                    rec[2][s] = time.perf_counter()
                rec[1] = None

        def drain(self):
            while True:
                with self._cv:
                    if not self._pending and all(r[1] is None for r in self.batches):
                        return
                time.sleep(0.001)

    return Watched


def _stage_busy(batches, pp):
    busy = [0.0] * pp
    prev_end = [0.0] * pp
    for t0, _, ready in batches:
        upstream = t0
        for s in range(pp):
            start = max(upstream, prev_end[s], t0)
            busy[s] += max(0.0, ready[s] - start)
            prev_end[s] = ready[s]
            upstream = ready[s]
    return busy


def run_cpu() -> dict:
    import jax  # noqa: PLC0415 (no JAX on the --sim path)

    from pdjax.models.checkpoint import load_model  # noqa: PLC0415 (loads JAX; --sim does not)
    from pdjax.runtime.batch import Buckets  # noqa: PLC0415 (loads JAX; --sim does not)
    from pdjax.runtime.mesh import make_mesh  # noqa: PLC0415 (loads JAX; --sim does not)
    from pdjax.runtime.pipeline import PipelineRunner  # noqa: PLC0415 (loads JAX; --sim does not)

    try:
        spec, params = load_model(_CKPT.value)
    except (ValueError, OSError) as e:
        raise cli.UserError(cli.one_line(e)) from None
    pps = [int(p) for p in _PP.value]
    bad = [p for p in pps if p < 1 or p > spec.num_layers or p > jax.device_count()]
    if bad:
        raise cli.UserError(f"--pp={_PP.value}: {bad} not in [1, min(num_layers={spec.num_layers}, "
                            f"devices={jax.device_count()})]")
    max_len, page = 256, 16
    if _PROMPT.value + _OUTPUT.value > max_len:
        raise cli.UserError(f"--prompt_len + --output_len = {_PROMPT.value + _OUTPUT.value} > {max_len}")
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, spec.vocab_size, _PROMPT.value))) for _ in range(_REQUESTS.value)]
    tokens = tuple(sorted({t for t in (16, 32, 64) if t < _BUDGET.value} | {_BUDGET.value}))   # none above the budget
    buckets = Buckets(tokens=tokens, seqs=(_SEQS.value,), pages=(max_len // page,))
    num_pages = _SEQS.value * max_len // page + 8
    results, reference = [], None
    for pp in pps:
        runner = _stage_watch(PipelineRunner)(spec, params, num_pages=num_pages, page_size=page, buckets=buckets,
                                              max_model_len=max_len, mesh=make_mesh(jax.devices()[:pp], pp=pp, tp=1))
        compile_s = runner.warmup()
        cfg = SchedulerConfig(policy="sarathi", token_budget=_BUDGET.value, max_num_seqs=_SEQS.value,
                              max_model_len=max_len, page_size=page, num_pages=num_pages)
        reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=_OUTPUT.value), 0.0) for i, p in enumerate(prompts)]
        engine = ColocatedEngine(runner, make_scheduler(cfg), max_in_flight=pp)
        runner.batches.clear()
        runner.recording = True
        t0 = time.perf_counter()
        result = engine.run(reqs)
        runner.drain()
        runner.recording = False
        wall = result.duration_s
        tokens = [result.output_tokens[f"r{i}"] for i in range(len(reqs))]
        if reference is None:
            reference = tokens
        generated = sum(len(t) for t in tokens)
        processed = sum(it.num_tokens for it in result.iterations)
        mean_flight, active = mean_in_flight((it.start_time, it.end_time) for it in result.iterations)
        batches = [(b[0] - t0, b[1], [r - t0 for r in b[2]]) for b in runner.batches]
        busy = _stage_busy(batches, pp)
        results.append({
            "pp": pp, "max_in_flight": pp, "layers_per_stage": [b - a for a, b in runner.layer_ranges],
            "compile_s": round(compile_s, 2), "wall_s": round(wall, 3), "iterations": len(result.iterations),
            "generated_tokens_per_s": round(generated / wall, 1), "processed_tokens_per_s": round(processed / wall, 1),
            "mean_batches_in_flight": round(mean_flight, 3),
            "stage_busy_fraction": [round(b / wall, 3) for b in busy],
            "stage_overlap": round(sum(busy) / wall, 3),     # > 1: stages busy at the same time
            "tokens_equal_pp1": tokens == reference,
        })
        runner._stop = True
    return {"benchmark": "pipeline_cpu", "checkpoint": _CKPT.value, "requests": _REQUESTS.value,
            "prompt_len": _PROMPT.value, "output_len": _OUTPUT.value, "token_budget": _BUDGET.value,
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


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    if _SIM.value:
        print(json.dumps(sim_table(_SIM_REQUESTS.value, _SIM_RATE.value), indent=2))
    else:
        print(json.dumps(run_cpu(), indent=2))


if __name__ == "__main__":
    cli.run(main)
