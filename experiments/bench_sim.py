"""Simulator speed and memory (pdjax.experiment.sim_bench): simulated iterations per wall second and peak memory of
the colocated loop (configs/sim/chat10k.py: 10,000 requests), the disaggregated loop and the pipelined loop, each
case in its own process; JSON to stdout.

    python -m experiments.bench_sim [--cases=chat10k,disagg,pipeline] [--num_requests=N] [--repeat=1]
    python -m experiments.bench_sim --instructions [--cases=replicas] [--num_requests=2000]   # callgrind: Ir
    python -m experiments.bench_sim --instructions --cases=replicas,replicas_rr --num_requests=2000   # routing's cost
    python -m experiments.bench_sim --pythons=$VENV/bin/python,$(which python)   # interpreters side by side
"""
from __future__ import annotations

import json

from absl import flags

from pdjax.experiment import cli
from pdjax.experiment.sim_bench import CASES, DEFAULT_CASES, run

FLAGS = flags.FLAGS
flags.DEFINE_list("cases", list(DEFAULT_CASES), f"Comma-separated cases of {sorted(CASES)}.")
flags.DEFINE_integer("num_requests", 0, "Requests per case (0: its own).")
flags.DEFINE_integer("repeat", 1, "Runs per case (best wall time).")
flags.DEFINE_bool("instructions", False, "Count each case's simulation instructions under valgrind's callgrind "
                  "instead of timing it (deterministic; about 50x slower, one run per case).")
flags.DEFINE_list("pythons", [], "Interpreters to run the cases under, in turn, case by case (each importing this "
                  "checkout's pdjax, e.g. a venv's python after `pip install -e .`); default: this one alone.")
flags.register_validator("cases", lambda names: bool(names) and all(n in CASES for n in names),
                         f"expected a comma-separated list of {sorted(CASES)}")
flags.register_validator("num_requests", lambda n: n >= 0, "expected an integer >= 0")
flags.register_validator("repeat", lambda n: n >= 1, "expected an integer >= 1")


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    print(json.dumps(run(FLAGS.cases, FLAGS.num_requests, FLAGS.repeat, FLAGS.instructions, FLAGS.pythons), indent=2))


if __name__ == "__main__":
    cli.run(main)
