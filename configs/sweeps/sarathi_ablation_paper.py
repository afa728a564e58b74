"""Sarathi-Serve ablation at paper scale, in simulation: Yi-34B on 2x A100-80GB (TP2), 128 requests, Poisson
arrivals at 1 req/s, chat lengths (openchat_sharegpt4 trace) or long-prompt summarization (arxiv) lengths.
Schemes: `orca` (hybrid batching only: decodes + whole prompts), `chunked_only` (chunked prefills only: a batch is
all prefill or all decode) and `sarathi` (both: stall-free batching), the chunking ones at token budgets 512 and
1024. Writes summary.csv (P50 TTFT, P99 TBT, ... per scheme).

    python -m experiments.sweep --config=configs/sweeps/sarathi_ablation_paper.py:chat --workdir=/tmp/abl_chat \
        --parallel=2
    python -m experiments.sweep --config=configs/sweeps/sarathi_ablation_paper.py:arxiv --workdir=/tmp/abl_arxiv \
        --parallel=2

The grid's one axis sets (policy, token_budget) together, because `orca` never chunks and so cannot take a
512/1024 budget (its budget must hold a whole prompt): 5 points, not a 3x2 product.
"""

import ml_collections

from pdjax.config.files import config_file


def _paper_base(arg):
    return config_file(__file__, "../sim/paper_base.py", arg)


SCHEMES = (("orca", None), ("chunked_only", 512), ("chunked_only", 1024), ("sarathi", 512), ("sarathi", 1024))


def get_config(arg="chat"):
    if arg not in ("chat", "arxiv"):
        raise ValueError(f"sarathi_ablation_paper: ARG={arg!r}, expected 'chat' or 'arxiv'")
    base = _paper_base("yi34b")
    base.workload.preset = arg
    base.workload.rate = 1.0
    # orca: a budget that holds a whole max-length prompt next to every running decode (no budget limit, as in
    # Orca and Sarathi-Serve's hybrid-batching-only baseline).
    unlimited = base.scheduler.max_model_len + base.scheduler.max_num_seqs
    schemes = [(policy, budget or unlimited) for policy, budget in SCHEMES]
    c = ml_collections.ConfigDict()
    c.name = f"sarathi_ablation_paper_{arg}"
    c.base = base
    c.grid = {"scheme": (("scheduler.policy", "scheduler.token_budget"), schemes)}
    return c
