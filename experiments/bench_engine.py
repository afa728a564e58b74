"""Engine loop overhead: synchronous vs async scheduling on the same offline workload, side by side.

    python -m experiments.bench_engine [--checkpoint=tiny-byte] [--requests=32] [--repeat=2]

Ceiling: the device-only time of the very same batches (every SchedulerOutput of the sync run is rebuilt into
a RaggedBatch beforehand; each step is then timed alone, blocking on its output, and the times summed).
ratio = device-only time / engine wall time (1.0 = the host adds nothing). On CPU the "device" is the host's own
cores, so async scheduling competes with the step for them; it is built for accelerators, where the host is
free while the step runs.
"""
import json
import time

import jax
import numpy as np
from absl import flags

from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.experiment import cli
from pdjax.models.checkpoint import load_model
from pdjax.runtime.batch import Buckets
from pdjax.runtime.runner import ModelRunner
from pdjax.scheduler import Request, make_scheduler
from pdjax.serving.engine import ColocatedEngine

_CKPT = flags.DEFINE_string("checkpoint", "tiny-byte", "Checkpoint dir or registry spec name.")
_REQUESTS = flags.DEFINE_integer("requests", 32, "Requests (offline, all at t=0).")
_PROMPT = flags.DEFINE_integer("prompt_len", 96, "Prompt tokens.")
_OUTPUT = flags.DEFINE_integer("output_len", 48, "Output tokens.")
_BUDGET = flags.DEFINE_integer("token_budget", 128, "Sarathi token budget.")
_REPEAT = flags.DEFINE_integer("repeat", 2, "Alternating repeats of each mode; the minimum is reported.")


def _requests(vocab):
    rng = np.random.default_rng(0)
    return [Request(f"r{i}", list(map(int, rng.integers(0, vocab, _PROMPT.value))),
                    SamplingParams(max_tokens=_OUTPUT.value), 0.0) for i in range(_REQUESTS.value)]


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    try:
        spec, params = load_model(_CKPT.value)
    except (ValueError, OSError) as e:   # missing or corrupt checkpoint, unknown spec name
        raise cli.UserError(cli.one_line(e)) from None
    max_len = 512
    tokens = tuple(sorted({t for t in (16, 32, 64) if t < _BUDGET.value} | {_BUDGET.value}))   # none above the budget
    buckets = Buckets(tokens=tokens, seqs=(_REQUESTS.value,), pages=(max_len // 16,))
    runner = ModelRunner(spec, params, num_pages=_REQUESTS.value * max_len // 16, page_size=16, buckets=buckets,
                         max_model_len=max_len)
    compile_s = runner.warmup()
    cfg = SchedulerConfig(policy="sarathi", token_budget=_BUDGET.value, max_num_seqs=_REQUESTS.value,
                          max_model_len=max_len, page_size=16, num_pages=runner.num_pages)
    results = {"sync": [], "async": []}
    outputs = {}
    tokens = {}
    for _ in range(_REPEAT.value):
        for mode in ("sync", "async"):
            recorded = []
            sched = make_scheduler(cfg)
            schedule = sched.schedule
            sched.schedule = lambda now, s=schedule, out=recorded: out.append(s(now)) or out[-1]
            engine = ColocatedEngine(runner, sched, async_scheduling=(mode == "async"))
            start = time.perf_counter()
            res = engine.run(_requests(spec.vocab_size))
            results[mode].append(time.perf_counter() - start)
            outputs[mode] = recorded
            tokens[mode] = res.output_tokens
    # Device-only ceiling: the sync run's batches, prebuilt, dispatched back to back.
    batches = [runner.build_batch(o) for o in outputs["sync"] if not o.is_empty]
    device_s = []
    for _ in range(_REPEAT.value):
        total = 0.0
        for b in batches:
            b = jax.device_put(b)
            jax.block_until_ready(b)
            start = time.perf_counter()
            ids, runner.kv_cache = runner._step(runner.params, runner.kv_cache, b, runner._no_prev_ids)
            jax.block_until_ready(ids)
            total += time.perf_counter() - start
        device_s.append(total)
    device = min(device_s)
    out = {"checkpoint": _CKPT.value, "requests": _REQUESTS.value, "prompt_len": _PROMPT.value,
           "output_len": _OUTPUT.value, "token_budget": _BUDGET.value, "steps": len(batches),
           "compile_s": round(compile_s, 2), "tokens_identical": tokens["sync"] == tokens["async"],
           "ceiling_device_only_s": device}
    for mode in ("sync", "async"):
        wall = min(results[mode])
        out[mode] = {"wall_s": wall, "us_per_step": 1e6 * wall / len(batches),
                     "host_overhead_us_per_step": 1e6 * (wall - device) / len(batches),
                     "ratio_to_ceiling": device / wall,
                     "output_tok_s": _REQUESTS.value * _OUTPUT.value / wall}
    out["async_saves_s"] = out["sync"]["wall_s"] - out["async"]["wall_s"]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    cli.run(main)
