"""Run a sweep of serve configs (one workdir per point, resumable) and write summary.csv.

    python -m experiments.sweep --config=configs/sweeps/sarathi_ablation.py:chat --workdir=/tmp/ablation

A rerun skips the finished points. If a finished point's stored config.json differs from the config it gets now
(e.g. another --config.base.* override), the sweep stops before running anything and names the point and the
differing keys; --rerun_changed reruns such points instead. A failing point does not stop the sweep: its
traceback goes to POINT/error.txt, summary.csv marks it failed, and the sweep exits 1 at the end naming the failed
points (a rerun retries them). SIGTERM and Ctrl-C stop the worker processes of a --parallel sweep.
"""
import signal
import sys

from absl import app, flags
from ml_collections import config_flags

from pdjax.config.serving import serve_config_from_dict
from pdjax.experiment.run import run_experiment, to_plain_dict
from pdjax.experiment.sweep import (SweepConfigChanged, SweepFailed, run_sweep, sweep_columns,
                                    write_sweep_plots)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Sweep config file (configs/sweeps/NAME.py[:ARG]).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Sweep directory: one subdirectory per point.")
_PARALLEL = flags.DEFINE_integer("parallel", 1, "Points run at once, each in its own process.", lower_bound=1)
_RERUN_CHANGED = flags.DEFINE_bool(
    "rerun_changed", False, "Rerun finished points whose stored config.json differs from their config now "
    "(default: refuse, naming the point and the differing keys).")
flags.mark_flags_as_required(["config", "workdir"])


def _exit_on_sigterm(signum, frame):
    del frame
    raise SystemExit(128 + signum)   # unwinds run_sweep, which terminates its worker processes


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sweep = to_plain_dict(_CONFIG.value)
    try:
        rows = run_sweep(sweep, _WORKDIR.value, run_experiment, parallel=_PARALLEL.value,
                         validate=serve_config_from_dict, rerun_changed=_RERUN_CHANGED.value)
    except SweepConfigChanged as e:
        sys.exit(f"sweep: {e}")
    except (ValueError, KeyError) as e:     # a bad grid or point config, found before any point runs
        sys.exit(f"sweep: {e.args[0] if isinstance(e, KeyError) and e.args else e}")
    except SweepFailed as e:
        write_sweep_plots(e.rows, sweep_columns(sweep), _WORKDIR.value)
        print(f"{len(e.rows)} points; summary: {_WORKDIR.value}/summary.csv")
        sys.exit(str(e))
    write_sweep_plots(rows, sweep_columns(sweep), _WORKDIR.value)
    print(f"{len(rows)} points; summary: {_WORKDIR.value}/summary.csv")


if __name__ == "__main__":
    app.run(main)
