"""Calibrate the simulator on the machine at hand: profile the real pdjax engine (ModelRunner) over a grid of batch
compositions, its step context and its engine loop, and fit a machine profile (pdjax.experiment.calibrate: the
probes of pdjax.runtime.probe, the fits of pdjax.sim.calibration; the module docstrings say what is measured and
fitted how).

    python -m experiments.calibrate --config=configs/serve.py --out=/tmp/host_cpu_profile.json
    python -m experiments.calibrate --config=configs/serve.py --config.sim.hardware=h200 --out=h200.json  # on a GPU

Prints JSON: fit errors overall and per batch kind, measurement count, the machine's measured ceilings.
"""
from __future__ import annotations

import json
import sys
import time

from absl import flags

from pdjax.config.serving import serve_config_from_dict
from pdjax.experiment import cli
from pdjax.experiment.calibrate import calibrate
from pdjax.experiment.run import to_plain_dict
from pdjax.serving.build import build_runner

FLAGS = flags.FLAGS
cli.define_config_file("config", "configs/serve.py", "Serve config (model, scheduler limits).")
flags.DEFINE_string("out", None, "Where to write the machine-profile JSON.")
flags.DEFINE_integer("repeats", 5, "Timed runs per grid point (median kept).")
flags.DEFINE_bool("quick", False, "A smaller grid (for tests).")


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    if not FLAGS.out:
        raise cli.UserError("--out=PATH.json is required")
    try:    # the config, and the checkpoint (missing, truncated)
        cfg = serve_config_from_dict(to_plain_dict(FLAGS.config))
        runner = build_runner(cfg)
    except (ValueError, OSError) as e:
        raise cli.UserError(cli.one_line(e)) from None
    t = time.perf_counter()
    runner.warmup()
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    log(f"calibrate: compiled {runner.compile_count} shapes in {time.perf_counter() - t:.1f} s")
    report = calibrate(cfg, runner, repeats=FLAGS.repeats, quick=FLAGS.quick, out_path=FLAGS.out, log=log)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    cli.run(main)
