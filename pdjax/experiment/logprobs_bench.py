"""Logprobs overhead benchmark (the command line is experiments/bench_logprobs.py; `run` returns its JSON).

What a step costs when requests ask for logprobs, and when none does. Decode steps (batch B, context C, one
sampled token per sequence) of a ModelRunner, timed as the engine runs them (`dispatch`, `collect` and, when
some sequence asked, `collect_logprobs`: host batch building, the device step and the host reads), in modes:
- `baseline`: the step as it was before logprobs (forward + `sampled_ids` only, its own donated KV cache), the
  cost a request that does not ask should still pay;
- `none`: the runner's step, nobody asks (the `lax.cond` skips the logprobs; nothing extra is read);
- `one`: one sequence asks (logprobs=20); `all`: every sequence asks.
The modes take turns call by call (load from other processes hits them alike); medians of --repeats. Each point
reports `overhead_*` = mode / none and `none_vs_baseline` = none / baseline, and `compiles`: the runner's step
compiles once per shape whichever mode runs (asking recompiles nothing). The ceiling: the machine's copy bandwidth
(pdjax/runtime/ceilings.py) and the roofline of the logprobs' own work (reading the [B, V] float32 logits three
times: log_softmax's max and sum, top-k) beside the measured extra time of `all`: `logprobs_roofline_s` and
`logprobs_ratio` = roofline / (all - none) (it can exceed 1: the ceiling is measured past the caches, while the
logits of a small batch fit in them).
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import numpy as np

from pdjax.config.model_specs import get_model_spec
from pdjax.config.sampling import MAX_LOGPROBS, SamplingParams
from pdjax.models.llama import init_params
from pdjax.runtime.batch import Buckets
from pdjax.runtime.ceilings import measure_ceilings
from pdjax.runtime.runner import ModelRunner
from pdjax.runtime.step import forward_logits, sampled_ids
from pdjax.scheduler.output import SchedulerOutput

MODES = ("baseline", "none", "one", "all")


def _decode_out(vocab: int, rng, batch: int, ctx: int, page_size: int, asking: int) -> SchedulerOutput:
    """One decode token for each of `batch` sequences at context `ctx`; the first `asking` ask for logprobs."""
    pages = ctx // page_size
    out = SchedulerOutput(step=0)
    for i in range(batch):
        out.req_ids.append(str(i))
        out.token_ids.append([int(rng.randint(vocab))])
        out.num_computed_tokens.append(ctx - 1)
        out.num_new_tokens.append(1)
        out.page_tables.append(list(range(i * pages, (i + 1) * pages)))
        out.do_sample.append(True)
        out.sampling.append(SamplingParams(logprobs=MAX_LOGPROBS if i < asking else None))
    return out


class _Baseline:
    """The pre-logprobs step (forward + sampled ids) on the runner's params, with its own donated KV cache."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.kv = jax.tree_util.tree_map(lambda a: a.copy(), runner.kv_cache)
        spec, attn, max_seqs = runner.spec, runner.attention_fn, runner.buckets.max_seqs

        def base_step(params, kv, batch, prev_ids):
            logits, kv = forward_logits(params, kv, batch, prev_ids, spec=spec, attention_fn=attn)
            return sampled_ids(logits, batch, max_seqs), kv

        self.fn = jax.jit(base_step, donate_argnums=(1,))

    def __call__(self, out: SchedulerOutput) -> None:
        batch = self.runner.build_batch(out)
        ids, self.kv = self.fn(self.runner.params, self.kv, batch, self.runner._no_prev_ids)
        np.asarray(ids)


def _point(runner: ModelRunner, baseline: _Baseline, outs: dict, repeats: int) -> dict:
    def engine_step(out):
        handle = runner.dispatch(out)
        runner.collect(handle)
        runner.collect_logprobs(handle)

    calls = {"baseline": lambda: baseline(outs["none"]), **{m: (lambda m=m: engine_step(outs[m])) for m in MODES[1:]}}
    for call in calls.values():          # compile (first shape) and warm
        call()
        call()
    compiles = runner.compile_count
    times = {m: [] for m in MODES}
    for _ in range(repeats):
        for mode, call in calls.items():
            start = time.perf_counter()
            call()
            times[mode].append(time.perf_counter() - start)
    med = {m: statistics.median(t) for m, t in times.items()}
    return {**{f"{m}_s": med[m] for m in MODES},
            **{f"overhead_{m}": med[m] / med["none"] for m in ("one", "all")},
            "none_vs_baseline": med["none"] / med["baseline"], "compiles_after_warmup": runner.compile_count - compiles}


def run(spec_name: str = "tiny-llama", vocab_size: int = 32000, batches=(1, 8, 32), context: int = 128,
        repeats: int = 20, page_size: int = 16) -> dict:
    """Every batch size of `batches` at `context`, on `spec_name` with its vocabulary set to `vocab_size` (0: the
    spec's own; dummy weights)."""
    spec = get_model_spec(spec_name)
    if vocab_size:
        spec = dataclasses.replace(spec, name=f"{spec.name}-v{vocab_size}", vocab_size=vocab_size)
    params = init_params(spec, 0)
    batches = tuple(sorted(batches))
    buckets = Buckets(tokens=tuple(sorted({max(8, b) for b in batches})), seqs=batches, pages=(context // page_size,))
    runner = ModelRunner(spec, params, num_pages=max(batches) * context // page_size, page_size=page_size,
                         buckets=buckets, attention_impl="auto", max_model_len=context)
    baseline = _Baseline(runner)
    ceilings = measure_ceilings(jax.default_backend())
    rng = np.random.RandomState(0)
    points = []
    for b in batches:
        outs = {mode: _decode_out(spec.vocab_size, rng, b, context, page_size, asking)
                for mode, asking in (("none", 0), ("one", 1), ("all", b))}
        point = {"batch": b, "context": context, **_point(runner, baseline, outs, repeats)}
        point["logprobs_roofline_s"] = 3 * b * spec.vocab_size * 4 / ceilings["copy_bandwidth_Bps"]
        extra = point["all_s"] - point["none_s"]
        point["logprobs_ratio"] = point["logprobs_roofline_s"] / extra if extra > 0 else None
        points.append(point)
    return {"spec": spec.name, "vocab_size": spec.vocab_size, "backend": jax.default_backend(),
            "device": str(jax.devices()[0]), "top_logprobs": MAX_LOGPROBS, "repeats": repeats,
            "memory_bandwidth_bytes_per_s": ceilings["copy_bandwidth_Bps"], "ceilings": ceilings,
            "compile_count": runner.compile_count, "points": points}
