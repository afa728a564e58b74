"""Sarathi-Serve ablation on the real CPU engine (tiny model): hybrid-only (`orca`), chunked-only
(`chunked_only`) and both (`sarathi`), on chat-like or long-prompt (arxiv-like) lengths scaled to the tiny model.

    python -m experiments.sweep --config=configs/sweeps/sarathi_ablation.py:chat --workdir=/tmp/ablation_chat
"""

import ml_collections

from pdjax.config.files import config_file


def _serve_config():
    return config_file(__file__, "../serve.py")


def get_config(arg="chat"):
    if arg not in ("chat", "arxiv"):
        raise ValueError(f"sarathi_ablation: ARG={arg!r}, expected 'chat' or 'arxiv'")
    base = _serve_config()
    base.engine.progress = False
    base.workload.preset = arg
    base.workload.num_requests = 32
    base.workload.rate = 4.0 if arg == "chat" else 1.5
    base.scheduler.token_budget = 128
    c = ml_collections.ConfigDict()
    c.name = f"sarathi_ablation_{arg}"
    c.base = base
    # Hybrid-only (orca) never chunks, so its budget is a whole max-length prompt; the chunked variants share
    # one small budget.
    budget = base.scheduler.token_budget
    c.grid = {"policy": (("scheduler.policy", "scheduler.token_budget"),
                         [("orca", base.scheduler.max_model_len), ("chunked_only", budget), ("sarathi", budget)])}
    return c
