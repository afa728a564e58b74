"""Fit the A100 machine profile and write pdjax/sim/profiles/a100.json: an alias of
`python -m experiments.fit_profile --hardware=a100` (see experiments/fit_profile.py for what is fitted on what).

python -m experiments.fit_a100 [--profiling_dir=../shared/data/profiling] [--out=pdjax/sim/profiles/a100.json]

Prints JSON: median relative errors per table / TP / regime, before and after, and the full error tables.
"""
from __future__ import annotations

import json
import pathlib

from absl import app, flags

FLAGS = flags.FLAGS
_REPO = pathlib.Path(__file__).resolve().parents[1]
flags.DEFINE_string("profiling_dir", str(_REPO.parent / "shared" / "data" / "profiling"),
                    "Directory with a100/*.csv and network/*.csv (see its SOURCES.md).")
flags.DEFINE_string("out", str(_REPO / "pdjax" / "sim" / "profiles" / "a100.json"), "Profile JSON to write.")


def run(profiling_dir: str, out: str) -> dict:
    from experiments.fit_profile import run as fit  # noqa: PLC0415
    return fit("a100", profiling_dir, out)


def main(argv):
    del argv
    from experiments.fit_profile import medians  # noqa: PLC0415
    report = run(FLAGS.profiling_dir, FLAGS.out)
    print(json.dumps({"hardware": report["hardware"], "profile": report["profile"],
                      "median_rel_error": medians(report)}, indent=1))


if __name__ == "__main__":
    app.run(main)
