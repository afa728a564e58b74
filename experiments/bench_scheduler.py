"""Scheduler overhead benchmark (pdjax.experiment.scheduler_bench): drive one policy with a fake runner until all
requests finish; JSON to stdout.

    python -m experiments.bench_scheduler --policy=sarathi --requests=256 --prompt_len=512 --output_len=128 \
        --token_budget=2048 --max_num_seqs=64 [--page_size=16] [--num_pages=N] [--prefix_caching] [--repeat=5]
"""
from __future__ import annotations

import json

from absl import flags

from pdjax.config.scheduler import POLICIES
from pdjax.experiment import cli
from pdjax.experiment.scheduler_bench import run

FLAGS = flags.FLAGS
flags.DEFINE_enum("policy", "sarathi", list(POLICIES), "Scheduler policy.")
flags.DEFINE_integer("requests", 256, "Requests, all arriving at t=0.", lower_bound=1)
flags.DEFINE_integer("prompt_len", 512, "Prompt tokens per request.", lower_bound=1)
flags.DEFINE_integer("output_len", 128, "Output tokens per request.", lower_bound=1)
flags.DEFINE_integer("token_budget", 2048, "Scheduler token budget.", lower_bound=1)
flags.DEFINE_integer("max_num_seqs", 64, "Scheduler max sequences per step.", lower_bound=1)
flags.DEFINE_integer("page_size", 16, "KV page size.", lower_bound=1)
flags.DEFINE_integer("num_pages", 0, "KV pages (0: enough for max_num_seqs full requests).", lower_bound=0)
flags.DEFINE_bool("prefix_caching", False, "Enable prefix caching.")
flags.DEFINE_integer("repeat", 5, "Runs; the fastest is reported.", lower_bound=1)


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    print(json.dumps(run(FLAGS.policy, FLAGS.requests, FLAGS.prompt_len, FLAGS.output_len, FLAGS.token_budget,
                         FLAGS.max_num_seqs, FLAGS.page_size, FLAGS.num_pages, FLAGS.prefix_caching,
                         FLAGS.repeat)))


if __name__ == "__main__":
    cli.run(main)
