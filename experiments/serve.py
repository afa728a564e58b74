"""Serve one experiment (real engine or simulator) from an ml_collections config file.

    python -m experiments.serve --config=configs/serve.py --workdir=/tmp/serve
    python -m experiments.serve --config=configs/serve.py --config.scheduler.policy=vllm_v0 --workdir=...
"""
import json
import os

from absl import flags

from pdjax.experiment import cli
from pdjax.experiment.run import prepare_experiment, run_prepared
from pdjax.metrics import summarize_table
from pdjax.models import byte_tokenizer
from pdjax.workload import describe_length_report


def sample_text_output(workdir: str):
    """(request id, decoded text) of the output with the most letters when the model is byte-level; None otherwise."""
    path = os.path.join(workdir, "outputs.json")
    with open(os.path.join(workdir, "config.json")) as f:
        checkpoint = json.load(f).get("model", {}).get("checkpoint", "")
    if not os.path.exists(path) or "byte" not in checkpoint:
        return None
    with open(path) as f:
        outputs = json.load(f)
    if not outputs:
        return None
    texts = {rid: byte_tokenizer.decode(ids) for rid, ids in outputs.items()}
    rid = max(texts, key=lambda r: (sum(ch.isalpha() for ch in texts[r]), r))   # the most wordy one
    return rid, texts[rid]


_CONFIG = cli.define_config_file("config", "configs/serve.py", "Serve config file.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/pdjax_serve", "Output directory of the run (new, empty, or an "
                               "earlier run's, whose outputs are replaced).")


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}; settings go in --config.KEY=VALUE flags")
    try:
        prep = prepare_experiment(_CONFIG.value, _WORKDIR.value)
    except (ValueError, OSError) as e:
        raise cli.UserError(cli.one_line(e)) from e
    note = describe_length_report(prep.length_report)
    if note:
        print(note)
    summary = run_prepared(prep)
    print(summarize_table(summary))
    sample = sample_text_output(_WORKDIR.value)
    if sample:
        print(f"sample output (request {sample[0]}): {sample[1]!r}")
    print(f"outputs written to {_WORKDIR.value}")


if __name__ == "__main__":
    cli.run(main)
