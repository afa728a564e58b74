"""Fit a machine profile (pdjax/sim/profiles/<hardware>.json) from operator measurements and print the fit errors
per regime as JSON (pdjax.sim.calibration.fit_operator_profile says what is fitted on what).

python -m experiments.fit_profile --hardware=h100 [--profiling_dir=../shared/data/profiling] [--out=PATH]
python -m experiments.fit_profile --hardware=a100          (writes pdjax/sim/profiles/a100.json)
python -m experiments.fit_profile --hardware=h100 --evaluate_only   (errors of the shipped profiles, no writes)
python -m experiments.fit_profile --stack_steps=STEPS.csv --hardware=a100-80gb-sxm --model=opt-13b --tp=2 \
    --out=my_stack.json [--stack_floor_s=0.002 --stack_per_context_token_s=1e-7]
    (a serving stack fitted from a few measured steps, pdjax.sim.stack.fit_step_stack; use it as
    --config.deployment.<group>.stack=my_stack.json on the simulator)

Output JSON: {"hardware", "profile", "median_rel_error": {"before", "after"}, "full": {"before", "after"}} with,
per table, per TP, per regime, {"median_rel_error", "p90_rel_error", "num_measurements"}; "before" is the profile
shipped before this fit (a100: the previous a100.json; h100: the A100 profile on H100 peaks).
"""
from __future__ import annotations

import json
import pathlib

from absl import flags

from pdjax.experiment import cli
from pdjax.config.model_specs import get_model_spec
from pdjax.sim.calibration import fit_operator_profile, operator_fit_summary
from pdjax.sim.hardware import get_hardware_spec
from pdjax.sim.stack import fit_step_stack, read_step_csv, save_stack

FLAGS = flags.FLAGS
flags.DEFINE_string("hardware", "h100", "Profile to fit: 'a100' or 'h100'.")
flags.DEFINE_string("profiling_dir", str(pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "profiling"),
                    "Directory with a100/, h100/ and network/ CSVs (see its SOURCES.md).")
flags.DEFINE_string("out", "", "Profile JSON to write (default pdjax/sim/profiles/<hardware>.json).")
flags.DEFINE_bool("evaluate_only", False, "Only print the errors of the shipped profile (and the 'before' one).")
flags.DEFINE_string("stack_steps", "", "Fit a serving stack instead: a CSV of measured steps (phase, lengths, "
                    "seconds).")
flags.DEFINE_string("stack_name", "fitted", "With --stack_steps: the stack's name.")
flags.DEFINE_string("model", "", "With --stack_steps: the model the steps ran (a registry name).")
flags.DEFINE_integer("tp", 1, "With --stack_steps: the TP degree the steps ran at.")
flags.DEFINE_float("stack_floor_s", 0.0, "With --stack_steps: the engine's per-step floor, kept outside the fit.")
flags.DEFINE_float("stack_per_context_token_s", 0.0, "With --stack_steps: per context token overhead (s).")
flags.DEFINE_integer("large_batch_threshold", 95, "With --stack_steps: decode batches of at least this many "
                     "requests get their own fit (DistServe's 95).")


def fit_stack_main() -> dict:
    if not FLAGS.out or not FLAGS.model:
        raise ValueError("--stack_steps needs --out=STACK.json and --model=NAME")
    stack = fit_step_stack(read_step_csv(FLAGS.stack_steps), name=FLAGS.stack_name,
                           hardware=get_hardware_spec(FLAGS.hardware).name, model=get_model_spec(FLAGS.model).name,
                           tp=FLAGS.tp, large_batch_threshold=FLAGS.large_batch_threshold,
                           step_floor_s=FLAGS.stack_floor_s, per_context_token_s=FLAGS.stack_per_context_token_s,
                           source=f"fitted from {FLAGS.stack_steps}")
    save_stack(stack, FLAGS.out)
    (fit,) = stack.fits.values()
    return {"stack": stack.describe(), "out": FLAGS.out, "prefill_ms": fit.prefill, "decode_small_ms": fit.decode_small,
            "decode_large_ms": fit.decode_large}


def main(argv):
    del argv
    if FLAGS.stack_steps:
        try:
            print(json.dumps(fit_stack_main(), indent=1))
        except ValueError as e:
            raise cli.UserError(str(e)) from None
        return
    try:
        report = fit_operator_profile(FLAGS.hardware, FLAGS.profiling_dir, FLAGS.out, FLAGS.evaluate_only)
    except ValueError as e:
        raise cli.UserError(str(e)) from None
    print(json.dumps(operator_fit_summary(report), indent=1))


if __name__ == "__main__":
    cli.run(main)
