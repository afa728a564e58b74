"""Serve one experiment (real engine or simulator) from an ml_collections config file.

    python -m experiments.serve --config=configs/serve.py --workdir=/tmp/serve
    python -m experiments.serve --config=configs/serve.py --config.scheduler.policy=vllm_v0 --workdir=...

Several processes, one program (multi-controller JAX; launch/local.py, launch/slurm.sbatch set the environment):
    python3 launch/local.py -n 2 --devices_per_process 4 -- python3 -m experiments.serve --workdir=/tmp/x
--coordinator_address / --num_processes / --process_id default to JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID; with more than one process, jax.distributed is initialized before any JAX use, the deployment's
device indices refer to the global device list, process 0 decides the time for all (identical schedules;
pdjax/serving/distributed.py) and alone writes the outputs. A process that dies or cannot reach the coordinator
ends the run within --distributed_timeout_s: the others exit 1 with an error naming the process, and no
results.json is written.
"""
import json
import os
import sys

from absl import flags

from pdjax.experiment import cli
from pdjax.experiment.run import prepare_experiment, run_prepared, to_plain_dict
from pdjax.metrics import summarize_table
from pdjax.procs import exit_now
from pdjax.serving.distributed import (DistributedError, end_after_failure, initialize, make_coordinator,
                                       settings_from_env)
from pdjax.workload import describe_length_report
from pdjax.workload.tokenizer import load_tokenizer


def sample_text_output(workdir: str):
    """(request id, decoded text) of the output with the most letters when the model has a tokenizer (pdjax.workload.
    tokenizer.load_tokenizer); None otherwise."""
    path = os.path.join(workdir, "outputs.json")
    with open(os.path.join(workdir, "config.json")) as f:
        checkpoint = json.load(f).get("model", {}).get("checkpoint", "")
    tokenizer = load_tokenizer(checkpoint) if checkpoint else None
    if not os.path.exists(path) or tokenizer is None:
        return None
    with open(path) as f:
        outputs = json.load(f)
    if not outputs:
        return None
    texts = {rid: tokenizer.decode(ids) for rid, ids in outputs.items()}
    rid = max(texts, key=lambda r: (sum(ch.isalpha() for ch in texts[r]), r))   # the most wordy one
    return rid, texts[rid]


_CONFIG = cli.define_config_file("config", "configs/serve.py", "Serve config file.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of the jax.distributed coordinator "
                                   "(default $JAX_COORDINATOR_ADDRESS).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes of a multi-controller run (default "
                                      "$JAX_NUM_PROCESSES, else 1).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index (default $JAX_PROCESS_ID, else 0).")
_DIST_TIMEOUT = flags.DEFINE_float("distributed_timeout_s", 60.0, "Seconds a process waits for the others (start-up, "
                                   "each broadcast, barriers, heartbeats) before the run fails.")
_DIGEST_DIR = flags.DEFINE_string("schedule_digest_dir", "", "If set, every process writes the digest of every "
                                  "step's SchedulerOutput to DIR/schedule_p<process_id>.json (checks that all "
                                  "processes scheduled identically).")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/pdjax_serve", "Output directory of the run (new, empty, or an "
                               "earlier run's, whose outputs are replaced).")


def distributed_settings():
    """The run's DistributedSettings from the flags (env defaults); a bad value is a UserError."""
    try:
        return settings_from_env(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _DIST_TIMEOUT.value)
    except ValueError as e:
        raise cli.UserError(cli.one_line(e)) from e


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}; settings go in --config.KEY=VALUE flags")
    settings = distributed_settings()
    try:
        initialize(settings)      # before any JAX use; no-op for one process
        coordinator = make_coordinator(settings, record_digest=bool(_DIGEST_DIR.value))
        # A bad config, path or file here, or a config the engine cannot be built from in run_prepared (before
        # warm-up), raises UserError: one line (cli.run). Any other exception is a bug and keeps its traceback.
        # Configs that differ between the processes are one too (every process names the keys).
        coordinator.check_same_config(to_plain_dict(_CONFIG.value))
        prep = prepare_experiment(_CONFIG.value, _WORKDIR.value, is_main=coordinator.is_main)
        note = describe_length_report(prep.length_report)
        if note and coordinator.is_main:
            print(note)
        summary = run_prepared(prep, coordinator)
    except DistributedError as e:
        print(f"error: {e}", file=sys.stderr)
        exit_now(1)       # not through jax's shutdown barrier, which would wait for the process that failed us
    except cli.UserError:
        raise
    except Exception as e:
        if not settings.multi:
            raise
        end_after_failure(e)     # one line naming the dead peer (or this failure), exit 1
    if _DIGEST_DIR.value:
        coordinator.write_digest(_DIGEST_DIR.value)
    if not coordinator.is_main:
        return
    print(summarize_table(summary))
    sample = sample_text_output(_WORKDIR.value)
    if sample:
        print(f"sample output (request {sample[0]}): {sample[1]!r}")
    print(f"outputs written to {_WORKDIR.value}")


if __name__ == "__main__":
    cli.run(main)
