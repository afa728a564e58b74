"""Cost-model CLI: predicted iteration time of given batches.

python -m experiments.cost --model=yi-34b --hardware=a100-80gb-pcie --tp=2 --pp=1 \
    --batch=prefill:1021@0,decode:3@2048 [--batch=...] [--profile=a100|PATH.json] [--microbatches=1]

Each --batch is a comma list of `prefill:<tokens>@<context before the chunk>` and `decode:<count>@<context>`; a
prefill's context + tokens and a decode's context + 1 must fit the model's max_position_embeddings.
Prints JSON: the setup, and for each batch its predicted `time_s` and per-component breakdown (seconds).
"""
from __future__ import annotations

import json

from absl import flags

from pdjax.config import get_model_spec
from pdjax.experiment import cli
from pdjax.sim.cost_model import BatchComposition, CostParams, iteration_time
from pdjax.sim.hardware import get_hardware_spec
from pdjax.sim.profile import load_profile

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The flags, defined only when this is the main module (tests import `run` beside other CLIs' modules)."""
    flags.DEFINE_string("model", "llama-2-7b", "Model spec name (pdjax.config.model_specs).")
    flags.DEFINE_string("hardware", "a100-80gb-sxm", "Hardware spec name (pdjax.sim.hardware), or host-cpu.")
    flags.DEFINE_integer("tp", 1, "Tensor-parallel degree.")
    flags.DEFINE_integer("pp", 1, "Pipeline-parallel degree.")
    flags.DEFINE_integer("microbatches", 1, "Pipeline microbatches per iteration (pp > 1).")
    flags.DEFINE_multi_string("batch", [], "Batch composition, e.g. prefill:1021@0,decode:3@2048 (repeatable).")
    flags.DEFINE_string("profile", "a100",
                        "Machine profile: a shipped name (a100) or a JSON path; 'default' for priors.")


def run(model: str, hardware: str, tp: int, pp: int, batches: list[str], profile: str = "a100",
        microbatches: int = 1) -> dict:
    if not batches:
        raise ValueError("no --batch given; e.g. --batch=prefill:1021@0,decode:3@2048")
    spec = get_model_spec(model)
    hw = get_hardware_spec(hardware)
    params = CostParams() if profile == "default" else load_profile(profile).params
    parsed = [BatchComposition.parse(text) for text in batches]
    limit = spec.max_position_embeddings
    for text, batch in zip(batches, parsed):
        for tokens, context in batch.prefills:
            if tokens + context > limit:
                raise ValueError(f"batch {text!r}: prefill:{tokens}@{context} reaches context {tokens + context}, "
                                 f"expected <= max_position_embeddings={limit} of {model}")
        for count, context in batch.decodes:
            if context + 1 > limit:
                raise ValueError(f"batch {text!r}: decode:{count}@{context} reaches context {context + 1}, "
                                 f"expected <= max_position_embeddings={limit} of {model}")
    results = []
    for text, batch in zip(batches, parsed):
        cost = iteration_time(batch, spec, hw, tp, pp, params, num_microbatches=microbatches)
        results.append({"batch": text, "time_s": cost.total, "num_tokens": cost.num_tokens,
                        "breakdown": {k: getattr(cost, k) for k in ("linear", "attention", "communication",
                                                                    "overhead", "elementwise", "pipeline_bubble")},
                        "linear_bound": "compute" if cost.linear_flops_s > cost.linear_memory_s else "memory"})
    return {"model": model, "hardware": hw.name, "tp": tp, "pp": pp, "profile": profile, "batches": results}


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    try:
        out = run(FLAGS.model, FLAGS.hardware, FLAGS.tp, FLAGS.pp, FLAGS.batch, FLAGS.profile, FLAGS.microbatches)
    except ValueError as e:
        raise cli.UserError(cli.one_line(e)) from None
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    define_flags()
    cli.run(main)
