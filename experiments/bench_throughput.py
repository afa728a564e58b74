"""Offline throughput benchmark (pdjax.experiment.throughput): the colocated engine on P prompts of L tokens, N
greedy output tokens each, JSON to stdout; with --backend=hf side by side with HF transformers.

    python -m experiments.bench_throughput [--checkpoint=SPEC_OR_DIR] [--num_prompts=32] [--prompt_len=128]
        [--output_len=64] [--policy=sarathi] [--token_budget=2048] [--attention_impl=auto]
        [--backend=hf --repeats=3 --hf_threads=0] [--async_scheduling]
"""
from __future__ import annotations

import json

from absl import flags

from pdjax.experiment import cli
from pdjax.experiment.throughput import BACKENDS, run, validate
from pdjax.runtime.hf_baseline import MissingExtraError, require_hf

_CKPT = flags.DEFINE_string("checkpoint", "", "Checkpoint dir or registry spec name ('' = the 4-layer bench spec).")
_P = flags.DEFINE_integer("num_prompts", 32, "P: number of prompts (requests).")
_L = flags.DEFINE_integer("prompt_len", 128, "L: tokens per prompt.")
_N = flags.DEFINE_integer("output_len", 64, "N: greedy output tokens per request.")
_POLICY = flags.DEFINE_string("policy", "sarathi", "Scheduler policy.")
_BUDGET = flags.DEFINE_integer("token_budget", 2048, "Tokens per iteration (scheduler token budget).")
_PAGE = flags.DEFINE_integer("page_size", 16, "KV page size.")
_IMPL = flags.DEFINE_string("attention_impl", "auto", "Attention implementation (pdjax.kernels.ATTENTION_IMPLS).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the dummy weights and the prompts.")
_BACKEND = flags.DEFINE_string("backend", "pdjax", "pdjax, or hf: pdjax and HF transformers (PyTorch eager) side "
                               "by side, alternating (needs the 'hf' extra).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "With --backend=hf: alternating rounds (best of each kept).")
_HF_THREADS = flags.DEFINE_integer("hf_threads", 0, "With --backend=hf: PyTorch threads (0 = all cores).")
_ASYNC = flags.DEFINE_bool("async_scheduling", False, "Serve with async scheduling (the host schedules step k+1 "
                           "while step k runs; every request runs to max_tokens, as async scheduling needs).")


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    try:
        validate(_P.value, _L.value, _N.value, _BUDGET.value, _PAGE.value)
        if _BACKEND.value not in BACKENDS:
            raise ValueError(f"--backend={_BACKEND.value!r}, expected one of {BACKENDS}")
        if _BACKEND.value == "hf":
            require_hf()
    except (ValueError, MissingExtraError) as e:
        raise cli.UserError(str(e)) from None
    print(json.dumps(run(_CKPT.value, _P.value, _L.value, _N.value, policy=_POLICY.value,
                         token_budget=_BUDGET.value, page_size=_PAGE.value, attention_impl=_IMPL.value,
                         seed=_SEED.value, backend=_BACKEND.value, repeats=_REPEATS.value,
                         hf_threads=_HF_THREADS.value, async_scheduling=_ASYNC.value), indent=1))


if __name__ == "__main__":
    cli.run(main)
