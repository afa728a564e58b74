"""Step benchmark (the command line is experiments/bench_step.py; `run` returns its JSON).

Prints JSON: for each attention implementation in --impls (side by side, same run, same ceilings), decode step
time at batch 1/8/32/128 x context 128/1024 and prefill chunk time at 128/512/2048 tokens (one sequence from
position 0), beside the machine's measured memory bandwidth and f32 matmul rate (`pdjax/runtime/ceilings.py`, on
the JAX device, measured before and after the points; the higher of the two counts, since other jobs on a shared
machine only lower a measurement). Each entry has its roofline time and ratio = roofline / measured (1.0 = at
the ceiling): decode is bytes moved (all weights + the KV read for the context + the KV written) over
bandwidth; prefill is FLOPs (2 * non-embedding params * tokens + causal attention + one lm_head row) over the
matmul rate: the kernel targets' own definitions (a step's full count is pdjax.experiment.roofline's, the cost
model's). Times are whole `ModelRunner.execute` calls (host batch building and the device sync included),
median of --repeats after one compiling call and one warm call. The implementations take turns call by call
(one runner each), so load from other processes on a shared machine hits them alike.
`compile_s` per (T, S, P) shape: the first `ModelRunner.warmup` on that shape (trace + XLA compile + one
all-padding run) minus a second one (the run alone). `comparison` has per point the step time of each
implementation and its speedup over the first one; `targets` the issue's goals (prefill 512 / 2048 >= 0.3 of
the matmul roofline, decode batch 32 x context 1024 >= 0.6 of the bandwidth roofline) per implementation.
"""
from __future__ import annotations

import time

import jax
import numpy as np

from pdjax.config.model_specs import get_model_spec
from pdjax.errors import UserError
from pdjax.kernels import ATTENTION_IMPLS
from pdjax.models.llama import init_params
from pdjax.runtime.batch import Buckets
from pdjax.runtime.ceilings import measure_ceilings
from pdjax.runtime.runner import ModelRunner
from pdjax.scheduler.output import SchedulerOutput

DECODE_BATCHES = (1, 8, 32, 128)
DECODE_CONTEXTS = (128, 1024)
PREFILL_TOKENS = (128, 512, 2048)
TARGETS = {"prefill_512": 0.3, "prefill_2048": 0.3, "decode_32x1024": 0.6}


def _timed(runners: dict, out: SchedulerOutput, repeats: int) -> dict:
    """Median seconds of `execute(out)` per runner; the runners take turns call by call, so load from other
    processes on a shared machine hits every implementation alike."""
    for runner in runners.values():
        runner.execute(out)  # compile (already warm when the shape was precompiled)
        runner.execute(out)
    times = {name: [] for name in runners}
    for _ in range(repeats):
        for name, runner in runners.items():
            start = time.perf_counter()
            runner.execute(out)
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def _decode_out(spec, rng, batch: int, ctx: int, page_size: int) -> SchedulerOutput:
    pages = ctx // page_size
    out = SchedulerOutput(step=0)
    for i in range(batch):
        out.req_ids.append(str(i))
        out.token_ids.append([int(rng.randint(spec.vocab_size))])
        out.num_computed_tokens.append(ctx - 1)
        out.num_new_tokens.append(1)
        out.page_tables.append(list(range(i * pages, (i + 1) * pages)))
        out.do_sample.append(True)
    return out


def _prefill_out(spec, rng, n: int, page_size: int) -> SchedulerOutput:
    return SchedulerOutput(step=0, req_ids=["p"], token_ids=[list(rng.randint(0, spec.vocab_size, n))],
                           num_computed_tokens=[0], num_new_tokens=[n],
                           page_tables=[list(range(-(-n // page_size)))], do_sample=[True])


def _model_sizes(spec, params) -> dict:
    dtype_bytes = np.dtype(params.embed.dtype).itemsize
    embed_params = spec.vocab_size * spec.hidden_size
    return {"param_bytes": sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)),
            "embed_params": embed_params,
            "body_params": sum(x.size for x in jax.tree_util.tree_leaves(params)) - embed_params * (
                1 if spec.tie_word_embeddings else 2),
            "kv_bytes_per_token": spec.kv_bytes_per_token(dtype_bytes)}


def run_impls(impls, spec, params, repeats: int, page_size: int, decode_batches=DECODE_BATCHES,
              decode_contexts=DECODE_CONTEXTS, prefill_tokens=PREFILL_TOKENS) -> dict:
    """All points (decode_batches x decode_contexts, prefill_tokens) for every attention implementation (one
    runner each, timed in turns); rooflines are added by `_add_rooflines`."""
    decode_batches, decode_contexts = tuple(decode_batches), tuple(decode_contexts)
    prefill_tokens = tuple(prefill_tokens)
    sizes = _model_sizes(spec, params)
    param_bytes, kv_token_bytes = sizes["param_bytes"], sizes["kv_bytes_per_token"]
    max_pages_per_seq = -(-max(decode_contexts + prefill_tokens) // page_size)
    num_pages = max(decode_batches) * max(decode_contexts) // page_size + max_pages_per_seq
    # Token buckets start at 8 (as runners do): a 1-token shape compiles to a slower XLA CPU program.
    buckets = Buckets(tokens=tuple(sorted({max(8, n) for n in decode_batches + prefill_tokens})),
                      seqs=tuple(sorted(set(decode_batches))),
                      pages=tuple(sorted({-(-c // page_size) for c in decode_contexts + prefill_tokens})))
    runners = {impl: ModelRunner(spec, params, num_pages=num_pages, page_size=page_size, buckets=buckets,
                                 attention_impl=impl, max_model_len=max_pages_per_seq * page_size)
               for impl in impls}
    rng = np.random.RandomState(0)
    results = {impl: {"attention_impl": impl, **sizes, "compile_s": {}, "decode": [], "prefill": []}
               for impl in impls}

    def measure(out: SchedulerOutput) -> dict:
        shape = next(iter(runners.values())).build_batch(out).shape_key
        key = "x".join(map(str, shape))
        for impl, runner in runners.items():
            first = runner.warmup([shape])  # trace + compile + one all-padding run
            results[impl]["compile_s"][key] = max(0.0, first - runner.warmup([shape]))
        return _timed(runners, out, repeats)

    for ctx in decode_contexts:
        for batch in decode_batches:
            seconds = measure(_decode_out(spec, rng, batch, ctx, page_size))
            moved = param_bytes + batch * ctx * kv_token_bytes + batch * kv_token_bytes
            for impl in impls:
                results[impl]["decode"].append({"batch": batch, "context": ctx, "step_s": seconds[impl],
                                                "bytes_moved": moved, "tokens_per_s": batch / seconds[impl]})
    for n in prefill_tokens:
        seconds = measure(_prefill_out(spec, rng, n, page_size))
        attn_flops = 2 * 2 * spec.num_layers * spec.num_heads * spec.head_dim * n * (n + 1) / 2
        flops = 2 * sizes["body_params"] * n + attn_flops + 2 * sizes["embed_params"]
        for impl in impls:
            results[impl]["prefill"].append({"tokens": n, "step_s": seconds[impl], "flops": flops,
                                             "tokens_per_s": n / seconds[impl]})
    for impl, res in results.items():
        res["compile_count"] = runners[impl].compile_count
        res["compile_s_total"] = sum(res["compile_s"].values())
    return results


def _add_rooflines(results: dict, ceilings: dict) -> None:
    """Roofline time, ratio and the targets of every point, for `ceilings`."""
    bandwidth, matmul_rate = ceilings["copy_bandwidth_Bps"], ceilings["matmul_flops"]
    for res in results.values():
        for point in res["decode"]:
            point["roofline_s"] = point["bytes_moved"] / bandwidth
            point["ratio"] = point["roofline_s"] / point["step_s"]
        for point in res["prefill"]:
            point["roofline_s"] = point["flops"] / matmul_rate
            point["ratio"] = point["roofline_s"] / point["step_s"]
        by_key = {f"decode_{d['batch']}x{d['context']}": d["ratio"] for d in res["decode"]}
        by_key.update({f"prefill_{p['tokens']}": p["ratio"] for p in res["prefill"]})
        res["targets"] = {k: {"target": t, "ratio": by_key[k], "met": by_key[k] >= t} for k, t in TARGETS.items()
                          if k in by_key}     # (a smaller grid than the default has some of them)


def _compare(results: dict, impls) -> dict:
    """Per point: step time of each implementation and its speedup over impls[0]."""
    base = results[impls[0]]
    out = {}
    for kind, key in (("decode", lambda d: f"decode_{d['batch']}x{d['context']}"),
                      ("prefill", lambda p: f"prefill_{p['tokens']}")):
        for i, point in enumerate(base[kind]):
            row = {f"{impl}_s": results[impl][kind][i]["step_s"] for impl in impls}
            row.update({f"{impl}_speedup": point["step_s"] / results[impl][kind][i]["step_s"]
                        for impl in impls[1:]})
            out[key(point)] = row
    out["compile_s"] = {shape: {impl: results[impl]["compile_s"].get(shape) for impl in impls}
                        for shape in base["compile_s"]}
    return out


def run(spec_name: str = "tiny-llama", repeats: int = 5, page_size: int = 16,
        impls=("reference", "blocked"), decode_batches=DECODE_BATCHES, decode_contexts=DECODE_CONTEXTS,
        prefill_tokens=PREFILL_TOKENS) -> dict:
    impls = list(impls)
    for impl in impls:
        if impl not in ATTENTION_IMPLS:
            raise UserError(f"--impls: {impl!r} is not one of {ATTENTION_IMPLS}")
    spec = get_model_spec(spec_name)
    params = init_params(spec, 0)
    # Best of a measurement before and after the points: other jobs on a shared machine only lower a ceiling.
    before = measure_ceilings(jax.default_backend())
    results = run_impls(impls, spec, params, repeats, page_size, decode_batches, decode_contexts, prefill_tokens)
    after = measure_ceilings(jax.default_backend())
    ceilings = {**before, **{k: max(before[k], after[k]) for k in ("matmul_flops", "copy_bandwidth_Bps")}}
    _add_rooflines(results, ceilings)
    return {"spec": spec.name, "dtype": str(params.embed.dtype), "backend": jax.default_backend(),
            "device": str(jax.devices()[0]), "page_size": page_size, "impls": impls,
            "memory_bandwidth_bytes_per_s": ceilings["copy_bandwidth_Bps"],
            "matmul_flops_per_s": ceilings["matmul_flops"], "ceilings": ceilings,
            "ceilings_measured": {"before": before, "after": after},
            "results": results, "comparison": _compare(results, impls)}
