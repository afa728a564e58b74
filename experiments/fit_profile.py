"""Fit a machine profile (pdjax/sim/profiles/<hardware>.json) from operator measurements and print the fit errors
per regime as JSON (pdjax.sim.calibration.fit_operator_profile says what is fitted on what).

python -m experiments.fit_profile --hardware=h100 [--profiling_dir=../shared/data/profiling] [--out=PATH]
python -m experiments.fit_profile --hardware=a100          (what experiments.fit_a100 runs)
python -m experiments.fit_profile --hardware=h100 --evaluate_only   (errors of the shipped profiles, no writes)

Output JSON: {"hardware", "profile", "median_rel_error": {"before", "after"}, "full": {"before", "after"}} with,
per table, per TP, per regime, {"median_rel_error", "p90_rel_error", "num_measurements"}; "before" is the profile
shipped before this fit (a100: the previous a100.json; h100: the A100 profile on H100 peaks).
"""
from __future__ import annotations

import json
import pathlib

from absl import flags

from pdjax.experiment import cli
from pdjax.sim.calibration import fit_operator_profile, operator_fit_summary

FLAGS = flags.FLAGS
flags.DEFINE_string("hardware", "h100", "Profile to fit: 'a100' or 'h100'.")
flags.DEFINE_string("profiling_dir", str(pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "profiling"),
                    "Directory with a100/, h100/ and network/ CSVs (see its SOURCES.md).")
flags.DEFINE_string("out", "", "Profile JSON to write (default pdjax/sim/profiles/<hardware>.json).")
flags.DEFINE_bool("evaluate_only", False, "Only print the errors of the shipped profile (and the 'before' one).")


def main(argv):
    del argv
    try:
        report = fit_operator_profile(FLAGS.hardware, FLAGS.profiling_dir, FLAGS.out, FLAGS.evaluate_only)
    except ValueError as e:
        raise cli.UserError(str(e)) from None
    print(json.dumps(operator_fit_summary(report), indent=1))


if __name__ == "__main__":
    cli.run(main)
