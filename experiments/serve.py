"""Serve one experiment (real engine or simulator) from an ml_collections config file.

    python -m experiments.serve --config=configs/serve.py --workdir=/tmp/serve
    python -m experiments.serve --config=configs/serve.py --config.scheduler.policy=vllm_v0 --workdir=...
"""
from absl import app, flags
from ml_collections import config_flags

from pdjax.experiment.run import run_experiment
from pdjax.metrics import summarize_table

_CONFIG = config_flags.DEFINE_config_file("config", "configs/serve.py", "Serve config file.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/pdjax_serve", "Output directory of the run.")


def main(argv):
    del argv
    summary = run_experiment(_CONFIG.value, _WORKDIR.value)
    print(summarize_table(summary))
    print(f"outputs written to {_WORKDIR.value}")


if __name__ == "__main__":
    app.run(main)
