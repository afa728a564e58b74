"""Step benchmark: python -m experiments.bench_step [--spec=tiny-llama] [--repeats=5]

Prints JSON: decode step time at batch 1/8/32/128 x context 128/1024 and prefill chunk time at 128/512/2048
tokens (one sequence from position 0), beside the machine's measured memory bandwidth (large numpy copy) and
f32 matmul rate (jitted jnp matmul). Each entry has its roofline time and ratio = roofline / measured (1.0 =
at the ceiling): decode is bytes moved (all weights + the KV read for the context + the KV written) over
bandwidth; prefill is FLOPs (2 * non-embedding params * tokens + causal attention + one lm_head row) over the
matmul rate. Times are whole `ModelRunner.execute` calls (host batch building and the device sync included),
median of --repeats after one compiling call.
"""
from __future__ import annotations

import json
import time

import jax
import numpy as np
from absl import app, flags

from experiments.ceilings import measure_ceilings
from pdjax.config.model_specs import get_model_spec
from pdjax.models.llama import init_params
from pdjax.runtime.batch import Buckets
from pdjax.runtime.runner import ModelRunner
from pdjax.scheduler.output import SchedulerOutput

FLAGS = flags.FLAGS
flags.DEFINE_string("spec", "tiny-llama", "Registry spec (dummy weights).")
flags.DEFINE_integer("repeats", 5, "Timed calls per point (median reported).")
flags.DEFINE_integer("page_size", 16, "KV page size.")

DECODE_BATCHES = (1, 8, 32, 128)
DECODE_CONTEXTS = (128, 1024)
PREFILL_TOKENS = (128, 512, 2048)


def _timed(runner: ModelRunner, out: SchedulerOutput, repeats: int) -> float:
    runner.execute(out)  # compile
    runner.execute(out)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        runner.execute(out)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def run(spec_name: str = "tiny-llama", repeats: int = 5, page_size: int = 16) -> dict:
    spec = get_model_spec(spec_name)
    params = init_params(spec, 0)
    dtype_bytes = np.dtype(params.embed.dtype).itemsize
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params))
    embed_params = spec.vocab_size * spec.hidden_size
    body_params = sum(x.size for x in jax.tree_util.tree_leaves(params)) - embed_params * (
        1 if spec.tie_word_embeddings else 2)
    kv_token_bytes = spec.kv_bytes_per_token(dtype_bytes)
    max_pages_per_seq = max(DECODE_CONTEXTS + PREFILL_TOKENS) // page_size
    num_pages = max(DECODE_BATCHES) * max(DECODE_CONTEXTS) // page_size + max_pages_per_seq
    # Token buckets start at 8 (as runners do): a 1-token shape compiles to a slower XLA CPU program.
    buckets = Buckets(tokens=tuple(sorted({max(8, n) for n in DECODE_BATCHES + PREFILL_TOKENS})),
                      seqs=DECODE_BATCHES,
                      pages=tuple(sorted({c // page_size for c in DECODE_CONTEXTS + PREFILL_TOKENS})))
    runner = ModelRunner(spec, params, num_pages=num_pages, page_size=page_size, buckets=buckets,
                         attention_impl="reference", max_model_len=max_pages_per_seq * page_size)
    ceilings = measure_ceilings(jax.default_backend())
    bandwidth, matmul_rate = ceilings["copy_bandwidth_Bps"], ceilings["matmul_flops"]
    rng = np.random.RandomState(0)

    decode = []
    for ctx in DECODE_CONTEXTS:
        pages = ctx // page_size
        for batch in DECODE_BATCHES:
            out = SchedulerOutput(step=0)
            for i in range(batch):
                out.req_ids.append(str(i))
                out.token_ids.append([int(rng.randint(spec.vocab_size))])
                out.num_computed_tokens.append(ctx - 1)
                out.num_new_tokens.append(1)
                out.page_tables.append(list(range(i * pages, (i + 1) * pages)))
                out.do_sample.append(True)
            seconds = _timed(runner, out, repeats)
            moved = param_bytes + batch * ctx * kv_token_bytes + batch * kv_token_bytes
            roofline = moved / bandwidth
            decode.append({"batch": batch, "context": ctx, "step_s": seconds, "bytes_moved": moved,
                           "roofline_s": roofline, "ratio": roofline / seconds,
                           "tokens_per_s": batch / seconds})
    prefill = []
    for n in PREFILL_TOKENS:
        out = SchedulerOutput(step=0, req_ids=["p"], token_ids=[list(rng.randint(0, spec.vocab_size, n))],
                              num_computed_tokens=[0], num_new_tokens=[n],
                              page_tables=[list(range(-(-n // page_size)))], do_sample=[True])
        seconds = _timed(runner, out, repeats)
        attn_flops = 2 * 2 * spec.num_layers * spec.num_heads * spec.head_dim * n * (n + 1) / 2
        flops = 2 * body_params * n + attn_flops + 2 * embed_params
        roofline = flops / matmul_rate
        prefill.append({"tokens": n, "step_s": seconds, "flops": flops, "roofline_s": roofline,
                        "ratio": roofline / seconds, "tokens_per_s": n / seconds})
    return {"spec": spec.name, "dtype": str(params.embed.dtype), "backend": jax.default_backend(),
            "device": str(jax.devices()[0]), "page_size": page_size, "attention_impl": "reference",
            "memory_bandwidth_bytes_per_s": bandwidth, "matmul_flops_per_s": matmul_rate,
            "param_bytes": param_bytes, "kv_bytes_per_token": kv_token_bytes,
            "compile_count": runner.compile_count, "decode": decode, "prefill": prefill}


def main(argv):
    del argv
    print(json.dumps(run(FLAGS.spec, FLAGS.repeats, FLAGS.page_size), indent=1))


if __name__ == "__main__":
    app.run(main)
