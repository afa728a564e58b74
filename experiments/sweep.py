"""Run a sweep of serve configs (one workdir per point, resumable) and write summary.csv.

    python -m experiments.sweep --config=configs/sweeps/sarathi_ablation.py:chat --workdir=/tmp/ablation

Every point is checked as serve checks its config at start-up before the first point runs, and the workdir must
be new, empty or a sweep's own (its points, summary.csv, comparison.png): a bad point, config file or workdir is
one `error:` line (exit 2) before anything runs. A rerun skips the finished points. If a finished point's stored
config.json differs from the config it gets now (e.g. another --config.base.* override), the sweep stops before
running anything and names the point and the differing keys; --rerun_changed reruns such points instead. A failing
point does not stop the sweep: its traceback goes to POINT/error.txt, summary.csv marks it failed, and the sweep
exits 1 at the end naming the failed points (a rerun retries them). SIGTERM and Ctrl-C stop the worker processes
of a --parallel sweep.

On a cluster, with Ray (pip install -e ".[cluster]"):

    python -m experiments.sweep --config=... --workdir=/shared/disk/ablation --executor=ray [--ray_address=HOST:PORT]

Each point is a Ray task asking for what its config needs: a simulator point 1 CPU; a real-engine point the devices
of its deployment (1 for colocated, prefill + decode groups for disaggregated) as GPUs, TPU chips (the "TPU"
resource) or CPUs, by --platform (auto: $JAX_PLATFORMS, else what the cluster has). Without --ray_address a local
Ray cluster is started (--parallel CPUs when given, else every core) and stopped at the end; a --ray_address
nothing answers at is an error at once. A point whose worker dies is resubmitted up to --max_retries times, then
recorded as failed; the rest is as above. On several machines --workdir must be a disk they all share.
"""
import os
import signal
import sys

from absl import flags
from ml_collections import config_flags

from pdjax.experiment import cli
from pdjax.experiment.run import run_experiment, to_plain_dict
from pdjax.experiment.sweep import (EXECUTORS, PLATFORMS, SweepConfigChanged, SweepFailed, check_point, run_sweep,
                                    sweep_columns, write_sweep_plots)

_CONFIG = config_flags.DEFINE_config_file("config", None, "Sweep config file (configs/sweeps/NAME.py[:ARG]).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Sweep directory: one subdirectory per point.")
_PARALLEL = flags.DEFINE_integer("parallel", 1, "Points run at once, each in its own process.", lower_bound=1)
_RERUN_CHANGED = flags.DEFINE_bool(
    "rerun_changed", False, "Rerun finished points whose stored config.json differs from their config now "
    "(default: refuse, naming the point and the differing keys).")
_EXECUTOR = flags.DEFINE_enum(
    "executor", "local", EXECUTORS, "local: in this process, or --parallel processes; ray: one Ray task per point.")
_RAY_ADDRESS = flags.DEFINE_string(
    "ray_address", "", "--executor=ray: the Ray cluster to join (HOST:PORT, or 'auto'); empty: start a local one.")
_MAX_RETRIES = flags.DEFINE_integer(
    "max_retries", 2, "--executor=ray: resubmissions of a point whose worker died before it is recorded as failed.",
    lower_bound=0)
_PLATFORM = flags.DEFINE_enum(
    "platform", "auto", PLATFORMS, "--executor=ray: what real-engine points ask Ray for (gpu: GPUs, tpu: TPU "
    "chips, cpu: CPUs); auto: $JAX_PLATFORMS, else what the cluster has.")
flags.mark_flags_as_required(["config", "workdir"])


def _exit_on_sigterm(signum, frame):
    del frame
    raise SystemExit(128 + signum)   # unwinds run_sweep, which terminates its worker processes


def load_sweep_config() -> dict:
    """The --config sweep as plain dicts; a file that cannot be read is a UserError naming it (ml_collections
    defers that error to the first access of the config)."""
    try:
        return to_plain_dict(_CONFIG.value)
    except OSError as e:
        path = config_flags.get_config_filename(flags.FLAGS["config"])
        if not os.path.isfile(path):
            what = "is a directory" if os.path.isdir(path) else "does not exist"
            raise cli.UserError(f"--config={flags.FLAGS['config'].serialize().split('=', 1)[-1]}: {path!r} {what} "
                                f"(relative to {os.getcwd()}); expected a sweep config file, e.g. "
                                "configs/sweeps/budget.py") from None
        raise cli.UserError(f"--config: {cli.one_line(e.__cause__ or e)}") from None


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}; settings go in --config.base.KEY=VALUE flags")
    ray = _EXECUTOR.value == "ray"
    if not ray:
        for name in ("ray_address", "max_retries", "platform"):
            if flags.FLAGS[name].present:
                raise cli.UserError(f"--{name} is for --executor=ray")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sweep = load_sweep_config()
    workdir = _WORKDIR.value
    try:
        rows = run_sweep(sweep, workdir, run_experiment, parallel=_PARALLEL.value, validate=check_point,
                         rerun_changed=_RERUN_CHANGED.value, executor=_EXECUTOR.value,
                         ray_address=_RAY_ADDRESS.value or None, max_retries=_MAX_RETRIES.value,
                         platform=_PLATFORM.value,
                         ray_num_cpus=_PARALLEL.value if ray and flags.FLAGS["parallel"].present else None)
    except SweepConfigChanged as e:
        raise cli.UserError(str(e)) from None
    except (ValueError, KeyError) as e:     # a bad grid or point config, found before any point runs
        raise cli.UserError(cli.one_line(e)) from None
    except SweepFailed as e:
        write_sweep_plots(e.rows, sweep_columns(sweep), workdir)
        print(f"{len(e.rows)} points; summary: {workdir}/summary.csv")
        sys.exit(str(e))
    write_sweep_plots(rows, sweep_columns(sweep), workdir)
    print(f"{len(rows)} points; summary: {workdir}/summary.csv")


if __name__ == "__main__":
    cli.run(main)
