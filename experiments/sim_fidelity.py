"""Simulator fidelity on this machine (pdjax.experiment.fidelity: calibrate on the CPU engine, run one online
workload for real and in simulation, compare the latency metrics); three seeds by default, and the median.

    python -m experiments.sim_fidelity                                   # configs/sim/fidelity_cpu.py, seeds 0,1,2
    python -m experiments.sim_fidelity --seeds=0                         # one seed
    python -m experiments.sim_fidelity --profile=pdjax/sim/profiles/host-cpu.json   # skip calibration

Prints, per seed and as the median over seeds, the P50/P99 TTFT and P50/P99 TBT errors, the target line
"median P99 TBT error <= 10%" with PASS/FAIL, then the JSON summary.
"""
from __future__ import annotations

import json
import os
import sys

from absl import flags

from pdjax.config.serving import serve_config_from_dict
from pdjax.experiment import cli
from pdjax.experiment.fidelity import format_table, run_seeds
from pdjax.experiment.run import to_plain_dict

FLAGS = flags.FLAGS
cli.define_config_file("config", "configs/sim/fidelity_cpu.py", "Serve config of the workload.")
flags.DEFINE_string("workdir", "/tmp/pdjax_sim_fidelity", "Outputs: seed<N>/{real,sim,profile.json}.")
flags.DEFINE_string("profile", "", "Use this sim profile instead of calibrating now.")
flags.DEFINE_list("seeds", ["0", "1", "2"], "Workload seeds (config.seed); one run per seed, then the median.")
flags.DEFINE_integer("repeats", 5, "Calibration: timed runs per grid point.")
flags.DEFINE_bool("quick", False, "Calibration: the smaller grid.")


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731
    config = to_plain_dict(FLAGS.config)
    try:
        serve_config_from_dict({**config, "backend": "real"})
    except ValueError as e:
        raise cli.UserError(cli.one_line(e)) from None
    if FLAGS.profile and not os.path.isfile(FLAGS.profile):
        raise cli.UserError(f"--profile={FLAGS.profile!r} is not a file")
    try:
        seeds = [int(s) for s in FLAGS.seeds]
    except ValueError:
        raise cli.UserError(f"--seeds={','.join(FLAGS.seeds)!r}: expected comma-separated integers") from None
    if not seeds:
        raise cli.UserError("--seeds is empty; expected e.g. --seeds=0,1,2")
    result = run_seeds(config, FLAGS.workdir, seeds, profile=FLAGS.profile, repeats=FLAGS.repeats,
                       quick=FLAGS.quick, log=log)
    print(format_table(result))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    cli.run(main)
