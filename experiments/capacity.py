"""Capacity of a serve config in simulation (DESIGN.md §4): the highest arrival rate whose P99 TBT (and any other
given limit) holds with median scheduling delay <= 2 s; probes of each bisection round run in parallel processes.

    python -m experiments.capacity --config=configs/sim/capacity_paper.py:mistral7b-sarathi-strict --slo_tbt_p99=0.1
    python -m experiments.capacity --config=configs/serve.py --config.sim.hardware=a100-80gb-sxm \
        --config.model.checkpoint=llama-2-7b --slo_tbt_p99=0.2 --lo=0.1 --hi=8 --parallel=2

Prints JSON: capacity_rps, the final bracket, every probe (rate, held, P99 TBT, P50 TTFT, median scheduling
delay), and writes it to --out when given.
"""
from __future__ import annotations

import json
import sys

from absl import flags

from pdjax.experiment import cli
from pdjax.experiment.run import resolve_config, to_plain_dict
from pdjax.metrics import write_json
from pdjax.sim.build import build_setup
from pdjax.sim.capacity import search_config_capacity

_CONFIG = cli.define_config_file("config", "configs/serve.py", "Serve config (any backend; simulated).")
_TBT = flags.DEFINE_float("slo_tbt_p99", None, "P99 TBT limit in seconds.")
_TTFT = flags.DEFINE_float("slo_ttft_p99", None, "Optional P99 TTFT limit in seconds.")
_LO = flags.DEFINE_float("lo", 0.05, "Lowest rate probed (req/s).")
_HI = flags.DEFINE_float("hi", 16.0, "Highest rate probed (req/s).")
_PARALLEL = flags.DEFINE_integer("parallel", 2, "Probes per round, each in its own process.", lower_bound=1)
_REL_TOL = flags.DEFINE_float("rel_tol", 0.05, "Stop when the bracket is within this fraction of its low end.")
_ROUNDS = flags.DEFINE_integer("max_rounds", 8, "Most rounds of probes.", lower_bound=1)
_OUT = flags.DEFINE_string("out", "", "Optional JSON output path.")


def main(argv):
    if len(argv) > 1:
        raise cli.UserError(f"unexpected arguments {argv[1:]}")
    if _TBT.value is None and _TTFT.value is None:
        raise cli.UserError("no limit given: pass --slo_tbt_p99 and/or --slo_ttft_p99 (seconds)")
    if not 0 < _LO.value < _HI.value:
        raise cli.UserError(f"--lo={_LO.value} --hi={_HI.value}, expected 0 < lo < hi")
    for flag, value in (("slo_tbt_p99", _TBT.value), ("slo_ttft_p99", _TTFT.value)):
        if value is not None and not value > 0:
            raise cli.UserError(f"--{flag}={value}, expected a limit in seconds > 0")
    if not 0 < _REL_TOL.value < 1:
        raise cli.UserError(f"--rel_tol={_REL_TOL.value}, expected a fraction in (0, 1)")
    config = to_plain_dict(_CONFIG.value)
    try:     # the config, and what the simulator builds from it (hardware, profile, deployment vs. the model)
        build_setup(resolve_config(config))
    except (ValueError, OSError) as e:
        raise cli.UserError(cli.one_line(e)) from None
    report = search_config_capacity(config, tbt_p99=_TBT.value, ttft_p99=_TTFT.value,
                                    lo=_LO.value, hi=_HI.value, parallel=_PARALLEL.value, rel_tol=_REL_TOL.value,
                                    max_rounds=_ROUNDS.value)
    if _OUT.value:
        write_json(_OUT.value, report)
    print(json.dumps(report, indent=2))
    if "note" in report:
        print(f"warning: {report['note']}", file=sys.stderr)


if __name__ == "__main__":
    cli.run(main)
