"""Run a sweep of serve configs (one workdir per point, resumable) and write summary.csv.

    python -m experiments.sweep --config=configs/sweeps/sarathi_ablation.py:chat --workdir=/tmp/ablation
"""
from absl import app, flags
from ml_collections import config_flags

from pdjax.config.serving import serve_config_from_dict
from pdjax.experiment.run import run_experiment, to_plain_dict
from pdjax.experiment.sweep import run_sweep, sweep_columns, write_sweep_plots

_CONFIG = config_flags.DEFINE_config_file("config", None, "Sweep config file (configs/sweeps/NAME.py[:ARG]).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Sweep directory: one subdirectory per point.")
_PARALLEL = flags.DEFINE_integer("parallel", 1, "Points run at once, each in its own process.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    del argv
    sweep = to_plain_dict(_CONFIG.value)
    rows = run_sweep(sweep, _WORKDIR.value, run_experiment, parallel=_PARALLEL.value,
                     validate=serve_config_from_dict)
    write_sweep_plots(rows, sweep_columns(sweep), _WORKDIR.value)
    print(f"{len(rows)} points; summary: {_WORKDIR.value}/summary.csv")


if __name__ == "__main__":
    app.run(main)
