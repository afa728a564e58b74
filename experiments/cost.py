"""Cost-model CLI (pdjax.experiment.cost): predicted iteration time of given batches.

python -m experiments.cost --model=yi-34b --hardware=a100-80gb-pcie --tp=2 --pp=1 \
    --batch=prefill:1021@0,decode:3@2048 [--batch=...] [--profile=a100|PATH.json] [--microbatches=1]

Each --batch is a comma list of `prefill:<tokens>@<context before the chunk>` and `decode:<count>@<context>`; a
prefill's context + tokens and a decode's context + 1 must fit the model's max_position_embeddings.
Prints JSON: the setup, and for each batch its predicted `time_s` and per-component breakdown (seconds).
"""
from __future__ import annotations

import json

from absl import flags

from pdjax.experiment import cli
from pdjax.experiment.cost import run

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "llama-2-7b", "Model spec name (pdjax.config.model_specs).")
flags.DEFINE_string("hardware", "a100-80gb-sxm", "Hardware spec name (pdjax.sim.hardware), or host-cpu.")
flags.DEFINE_integer("tp", 1, "Tensor-parallel degree.")
flags.DEFINE_integer("pp", 1, "Pipeline-parallel degree.")
flags.DEFINE_integer("microbatches", 1, "Pipeline microbatches per iteration (pp > 1).")
flags.DEFINE_multi_string("batch", [], "Batch composition, e.g. prefill:1021@0,decode:3@2048 (repeatable).")
flags.DEFINE_string("profile", "a100", "Machine profile: a shipped name (a100) or a JSON path; 'default' for priors.")


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    try:
        out = run(FLAGS.model, FLAGS.hardware, FLAGS.tp, FLAGS.pp, FLAGS.batch, FLAGS.profile, FLAGS.microbatches)
    except ValueError as e:
        raise cli.UserError(cli.one_line(e)) from None
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    cli.run(main)
