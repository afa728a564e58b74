"""Token-budget sweep of Sarathi stall-free batching: 256..4096 tokens per iteration, on the embedded CPU default.
Small budgets: better TBT, later TTFT; large budgets: the reverse.

    python -m experiments.sweep --config=configs/sweeps/budget.py --workdir=/tmp/budget
    python -m experiments.sweep --config=configs/sweeps/budget.py:sim --workdir=/tmp/budget_sim
"""

import ml_collections

from pdjax.config.files import config_file


def _serve_config():
    return config_file(__file__, "../serve.py")


def get_config(arg="real"):
    if arg not in ("real", "sim"):
        raise ValueError(f"budget: ARG={arg!r}, expected 'real' or 'sim'")
    base = _serve_config()
    base.backend = arg
    base.engine.progress = False
    base.scheduler.policy = "sarathi"
    c = ml_collections.ConfigDict()
    c.name = f"budget_{arg}"
    c.base = base
    c.grid = {"token_budget": ("scheduler.token_budget", [256, 512, 1024, 2048, 4096])}
    return c
