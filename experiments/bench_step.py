"""Step benchmark (pdjax.experiment.step_bench): decode and prefill step times per attention implementation
beside the machine's measured ceilings, JSON to stdout.

    python -m experiments.bench_step [--spec=tiny-llama] [--repeats=5] [--impls=reference,blocked]
    (smoke run: --decode_batches=1 --decode_contexts=32 --prefill_tokens=16 --repeats=1)
"""
from __future__ import annotations

import json

from absl import flags

from pdjax.experiment import cli
from pdjax.experiment.step_bench import run

FLAGS = flags.FLAGS
flags.DEFINE_string("spec", "tiny-llama", "Registry spec (dummy weights).")
flags.DEFINE_integer("repeats", 5, "Timed calls per point (median reported).")
flags.DEFINE_integer("page_size", 16, "KV page size.")
flags.DEFINE_list("impls", ["reference", "blocked"], "Attention implementations to run side by side.")
flags.DEFINE_list("decode_batches", ["1", "8", "32", "128"], "Decode batch sizes (smoke run: 1).")
flags.DEFINE_list("decode_contexts", ["128", "1024"], "Decode context lengths, multiples of --page_size.")
flags.DEFINE_list("prefill_tokens", ["128", "512", "2048"], "Prefill chunk sizes.")


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    grid = []
    for name in ("decode_batches", "decode_contexts", "prefill_tokens"):
        try:
            grid.append([int(x) for x in getattr(FLAGS, name)])
        except ValueError:
            raise cli.UserError(f"--{name}={','.join(getattr(FLAGS, name))!r}: expected comma-separated "
                                "integers") from None
    print(json.dumps(run(FLAGS.spec, FLAGS.repeats, FLAGS.page_size, FLAGS.impls, *grid), indent=1))


if __name__ == "__main__":
    cli.run(main)
