"""Paper-scale tables in simulation (issue 6 item 7), each runnable in minutes on a 2-core CPU.

    python -m experiments.sim_paper --table=ablation --workdir=/tmp/paper --parallel=2   # Sarathi ablation
    python -m experiments.sim_paper --table=chunking         # chunked-prefill overhead, Yi-34B TP2 A100
    python -m experiments.sim_paper --table=capacity --parallel=2   # capacity, strict/relaxed P99 TBT (~25 min)
    python -m experiments.sim_paper --table=capacity --capacity_traces=chat --parallel=2   # the chat half only
    python -m experiments.sim_paper --table=mixing           # decode-only vs + whole prefill vs + chunk
    python -m experiments.sim_paper --table=tile             # tile quantization: 256 vs 257 tokens
    python -m experiments.sim_paper --table=disagg           # colocated vs prefill/decode disaggregation
    python -m experiments.sim_paper --table=all --workdir=/tmp/paper --parallel=2
    python -m experiments.sim_paper --table=disagg --num_requests=20    # smoke run: 20 requests per simulation

Prints JSON (one object per table) and a Markdown rendering of each table on stderr; the tables are
pdjax.experiment.paper_tables (its docstring says what each one is).
"""
from __future__ import annotations

import json
import sys

from absl import flags

from pdjax.experiment import cli
from pdjax.experiment.paper_tables import (render, table_ablation, table_capacity, table_chunking, table_disagg,
                                           table_mixing, table_tile)

_TABLE = flags.DEFINE_enum("table", "all", ["all", "ablation", "chunking", "capacity", "mixing", "tile", "disagg"],
                           "Which table.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/pdjax_sim_paper", "Sweep/capacity outputs.")
_PARALLEL = flags.DEFINE_integer("parallel", 2, "Processes for sweep points / capacity probes.", lower_bound=1)
_CAPACITY_TRACES = flags.DEFINE_list("capacity_traces", ["chat", "arxiv"], "Traces of the capacity table.")
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 0, "Requests per simulation of the ablation, capacity and "
                                     "disagg tables (0: each config's own; a small value is a smoke run).",
                                     lower_bound=0)


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    names = (["ablation", "chunking", "capacity", "mixing", "tile", "disagg"] if _TABLE.value == "all"
             else [_TABLE.value])
    result = {}
    for name in names:
        if name == "ablation":
            result[name] = table_ablation(_WORKDIR.value, _PARALLEL.value, _NUM_REQUESTS.value)
        elif name == "capacity":
            result[name] = table_capacity(_WORKDIR.value, _PARALLEL.value, tuple(_CAPACITY_TRACES.value),
                                          _NUM_REQUESTS.value)
        elif name == "disagg":
            result[name] = table_disagg(_NUM_REQUESTS.value)
        else:
            result[name] = {"chunking": table_chunking, "mixing": table_mixing, "tile": table_tile}[name]()
        print(render(name, result[name]) + "\n", file=sys.stderr)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    cli.run(main)
