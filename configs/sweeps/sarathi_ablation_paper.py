"""Sarathi-Serve's scheduling ablation (paper Table 6) as the OSDI'24 artifact ran it
(osdi-experiments/table-6/scheduling_ablation.sh), in simulation: Yi-34B, TP2 on two A100-80GB PCIe cards joined by
NVLink (configs/sim/paper_base.py), 128 requests with lengths replayed from the trace, Poisson arrivals, up to 128
sequences per batch.
    chat   sharegpt_8k trace (openchat_sharegpt4), max_model_len 8192, 1.0 req/s
    arxiv  arxiv_summarization filtered_v2 trace, max_model_len 16384, 0.5 req/s (the public file, not the
           paper's: see paper_base.py)
Schemes: `orca` (hybrid batching only: decodes + whole prompts; the artifact ran Sarathi with a chunk size of the
whole max length, 8192 / 16384), `chunked_only` (chunked prefills only: a batch is all prefill or all decode; the
artifact's `simple_chunking`) and `sarathi` (both: stall-free batching), the chunking ones at token budget 512 (the
artifact's) and 1024 (the paper's text). Writes summary.csv (P50 TTFT, P99 TBT, ... per scheme).

    python -m experiments.sweep --config=configs/sweeps/sarathi_ablation_paper.py:chat --workdir=/tmp/abl_chat \
        --parallel=2
    python -m experiments.sim_paper --table=ablation --parallel=2      # both traces, one table

The grid's one axis sets (policy, token_budget) together, because `orca` never chunks and so cannot take a
512/1024 budget (its budget must hold a whole prompt): 5 points, not a 3x2 product.
"""

import ml_collections

from pdjax.config.files import config_file

SCHEMES = (("orca", None), ("chunked_only", 512), ("chunked_only", 1024), ("sarathi", 512), ("sarathi", 1024))
TRACES = ("chat", "arxiv")


def get_config(arg="chat"):
    if arg not in TRACES:
        raise ValueError(f"sarathi_ablation_paper: ARG={arg!r}, expected one of {TRACES}")
    base = config_file(__file__, "../sim/paper_base.py", f"yi34b-{arg}")   # rate: chat 1.0, arxiv 0.5 req/s
    base.workload.num_requests = 128
    # orca: a budget that holds a whole max-length prompt next to every running decode (no budget limit, as in
    # Orca and Sarathi-Serve's hybrid-batching-only baseline).
    unlimited = base.scheduler.max_model_len + base.scheduler.max_num_seqs
    schemes = [(policy, budget or unlimited) for policy, budget in SCHEMES]
    c = ml_collections.ConfigDict()
    c.name = f"sarathi_ablation_paper_{arg}"
    c.base = base
    c.grid = {"scheme": (("scheduler.policy", "scheduler.token_budget"), schemes)}
    return c
