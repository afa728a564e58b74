"""Capacity under strict and relaxed P99 TBT SLOs (Sarathi-Serve's capacity experiment), in simulation:
Mistral-7B on 1x A100-80GB (P99 TBT 0.1 s strict / 0.5 s relaxed) and Yi-34B on 2x A100-80GB TP2 (0.2 s / 1 s),
policies `sarathi` (token budget 512 strict / 2048 relaxed, as in the paper), `vllm_v0` and `orca` (budgets that
hold a whole prompt), chat lengths, 256 Poisson requests per probe; capacity = highest rate with P99 TBT within
the SLO and median scheduling delay <= 2 s. ARG = <model>-<policy>-<strict|relaxed>.

    python -m experiments.capacity --config=configs/sim/capacity_paper.py:mistral7b-sarathi-strict --slo_tbt_p99=0.1
    python -m experiments.sim_paper --table=capacity --parallel=2       # the whole table
"""
from pdjax.config.files import config_file

SLOS = {"mistral7b": {"strict": 0.1, "relaxed": 0.5}, "yi34b": {"strict": 0.2, "relaxed": 1.0}}
SARATHI_BUDGET = {"strict": 512, "relaxed": 2048}
POLICIES = ("sarathi", "vllm_v0", "orca")


def _paper_base(arg):
    return config_file(__file__, "paper_base.py", arg)


def get_config(arg="mistral7b-sarathi-strict"):
    parts = arg.split("-")
    if len(parts) != 3 or parts[0] not in SLOS or parts[1] not in POLICIES or parts[2] not in SARATHI_BUDGET:
        raise ValueError(f"capacity_paper: ARG={arg!r}, expected <{'|'.join(SLOS)}>-<{'|'.join(POLICIES)}>-"
                         f"<strict|relaxed>")
    model, policy, slo = parts
    c = _paper_base(model)
    c.workload.num_requests = 256
    c.scheduler.policy = policy
    if policy == "sarathi":
        c.scheduler.token_budget = SARATHI_BUDGET[slo]
    elif policy == "vllm_v0":
        c.scheduler.token_budget = c.scheduler.max_model_len
    else:   # orca: a whole max-length prompt next to every running decode
        c.scheduler.token_budget = c.scheduler.max_model_len + c.scheduler.max_num_seqs
    c.slo.tbt = SLOS[model][slo]
    return c
