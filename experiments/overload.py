"""Overload handling in simulation (issue 30 item 6; logic in pdjax.experiment.overload): Mooncake's early rejection
vs none vs the current-load rule at overload, and online XpYd rebalancing vs fixed XpYd vs Splitwise's borrowing pool
on a trace whose prompt:output mix shifts. Llama-2-70B, one TP8 DGX-A100 machine per instance.

python -m experiments.overload --out=/tmp/overload
python -m experiments.overload --experiments=early_rejection --trace=code --num_requests=3000 --time_scale=0.05 \
    --prefill=8 --decode_seqs=16 --out=/tmp/overload_code

Prints one JSON object (both experiments' rows) on stdout; with --out, writes overload.json and
early_rejection_decode_batch.png there (atomically).
"""
from __future__ import annotations

import json
import os
import sys

from absl import flags

from pdjax.experiment import cli
from pdjax.experiment import overload as ov
from pdjax.metrics.report import write_json

EXPERIMENTS = ("early_rejection", "shifting_mix")
FLAGS = flags.FLAGS
flags.DEFINE_list("experiments", list(EXPERIMENTS), f"Which of {list(EXPERIMENTS)}.")
flags.DEFINE_integer("num_requests", 5000, "early_rejection: trace rows.", lower_bound=2)
flags.DEFINE_float("time_scale", 0.25, "early_rejection: trace arrival times x this (0.25: 4x its load).")
flags.DEFINE_enum("trace", "conv", ["conv", "code", "mooncake"], "early_rejection: Azure 2023 conversation or code, "
                  "or Mooncake's conversation trace.")
flags.DEFINE_integer("decode_seqs", 256, "early_rejection: the token machine's max_num_seqs.", lower_bound=1)
flags.DEFINE_integer("prefill", 3, "early_rejection: prefill machines.", lower_bound=1)
flags.DEFINE_integer("decode", 1, "early_rejection: decode machines.", lower_bound=1)
flags.DEFINE_float("threshold", 0.9, "early_rejection: deployment.admission_threshold (decode load).")
flags.DEFINE_integer("phase_rows", 600, "shifting_mix: rows of each phase.", lower_bound=2)
flags.DEFINE_float("sharegpt_rate", 2.5, "shifting_mix: Poisson rate (req/s) of the ShareGPT (decode-heavy) phase.")
flags.DEFINE_float("code_scale", 1.5, "shifting_mix: arrival-time scale of the Azure code (prefill-heavy) phase.")
flags.DEFINE_integer("max_num_seqs", 32, "shifting_mix: sequences per instance (every group).", lower_bound=1)
flags.DEFINE_float("window_s", 5.0, "shifting_mix: deployment.rebalance_window_s.")
flags.DEFINE_float("flip_s", 1.0, "shifting_mix: deployment.rebalance_flip_s.")
flags.DEFINE_string("out", "", "Directory for overload.json and the plot ('' = stdout only).")


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    bad = sorted(set(FLAGS.experiments) - set(EXPERIMENTS))
    if bad:
        raise cli.UserError(f"--experiments={','.join(FLAGS.experiments)}: {bad} not in {list(EXPERIMENTS)}")
    log = lambda line: print(line, file=sys.stderr, flush=True)   # noqa: E731
    out = {}
    try:
        if "early_rejection" in FLAGS.experiments:
            out["early_rejection"] = ov.early_rejection(FLAGS.num_requests, FLAGS.time_scale, FLAGS.threshold,
                                                        FLAGS.prefill, FLAGS.decode, trace=FLAGS.trace,
                                                        decode_seqs=FLAGS.decode_seqs, log=log)
        if "shifting_mix" in FLAGS.experiments:
            phases = (("sharegpt", FLAGS.phase_rows, FLAGS.sharegpt_rate), ("code", FLAGS.phase_rows, FLAGS.code_scale))
            out["shifting_mix"] = ov.shifting_mix(phases, max_num_seqs=FLAGS.max_num_seqs, window_s=FLAGS.window_s,
                                                  flip_s=FLAGS.flip_s, log=log)
    except (ValueError, OSError) as e:
        raise cli.UserError(cli.one_line(e)) from None
    series = out.get("early_rejection", {}).pop("series", None)
    if FLAGS.out:
        os.makedirs(FLAGS.out, exist_ok=True)
        write_json(os.path.join(FLAGS.out, "overload.json"), out)
        if series:
            log(f"wrote {ov.plot_decode_series(series, os.path.join(FLAGS.out, 'early_rejection_decode_batch.png'))}")
    print(json.dumps(out))


if __name__ == "__main__":
    cli.run(main)
