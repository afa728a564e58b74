"""Logprobs overhead benchmark (pdjax.experiment.logprobs_bench): decode step times when nobody, one or every
sequence asks for logprobs, beside the step before logprobs existed and the machine's copy bandwidth, JSON to
stdout.

    python -m experiments.bench_logprobs [--spec=tiny-llama] [--vocab_size=32000] [--batches=1,8,32]
    (smoke run: --batches=1 --repeats=1 --vocab_size=0)
"""
from __future__ import annotations

import json

from absl import flags

from pdjax.experiment import cli
from pdjax.experiment.logprobs_bench import run

FLAGS = flags.FLAGS
flags.DEFINE_string("spec", "tiny-llama", "Registry spec (dummy weights).")
flags.DEFINE_integer("vocab_size", 32000, "Vocabulary size to give the spec (0: the spec's own).")
flags.DEFINE_list("batches", ["1", "8", "32"], "Decode batch sizes.")
flags.DEFINE_integer("context", 128, "Decode context length, a multiple of --page_size.")
flags.DEFINE_integer("repeats", 20, "Timed calls per mode and point (median reported).")
flags.DEFINE_integer("page_size", 16, "KV page size.")


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    try:
        batches = [int(x) for x in FLAGS.batches]
    except ValueError:
        raise cli.UserError(f"--batches={','.join(FLAGS.batches)!r}: expected comma-separated integers") from None
    if FLAGS.vocab_size < 0 or FLAGS.context % FLAGS.page_size or min(batches) < 1:
        raise cli.UserError(f"--vocab_size={FLAGS.vocab_size} (>= 0), --context={FLAGS.context} (a multiple of "
                            f"--page_size={FLAGS.page_size}) and --batches={batches} (>= 1) expected")
    print(json.dumps(run(FLAGS.spec, FLAGS.vocab_size, batches, FLAGS.context, FLAGS.repeats, FLAGS.page_size),
                     indent=1))


if __name__ == "__main__":
    cli.run(main)
