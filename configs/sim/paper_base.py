"""Shared base of the paper-scale simulator configs: a serve config on the simulator backend for a registry model
on A100s (Sarathi-Serve's testbed: A100-80GB PCIe pairs joined by NVLink bridges), chat lengths, Poisson arrivals.

    get_config("yi34b")     Yi-34B, TP2 on 2x A100-80GB PCIe (pairwise NVLink), max_model_len 4096
    get_config("mistral7b") Mistral-7B, 1x A100-80GB, max_model_len 8192
Used by configs/sweeps/sarathi_ablation_paper.py, configs/sim/capacity_paper.py and experiments.sim_paper.
"""
from pdjax.config.files import config_file


def _serve_config():
    return config_file(__file__, "../serve.py")


MODELS = {
    "yi34b": dict(model="yi-34b", hardware="a100-80gb-pcie", tp=2, max_model_len=4096),
    "mistral7b": dict(model="mistral-7b", hardware="a100-80gb-pcie", tp=1, max_model_len=8192),
}


def get_config(arg="yi34b"):
    if arg not in MODELS:
        raise ValueError(f"paper_base: ARG={arg!r}, expected one of {sorted(MODELS)}")
    m = MODELS[arg]
    c = _serve_config()
    c.backend = "sim"
    c.seed = 0
    c.model.checkpoint = m["model"]
    c.engine.progress = False
    c.scheduler.policy = "sarathi"
    c.scheduler.token_budget = 512
    c.scheduler.max_num_seqs = 128
    c.scheduler.max_model_len = m["max_model_len"]
    c.scheduler.num_pages = 1024          # ignored: sim.num_pages = 0 sizes the KV cache from A100 memory
    c.workload.preset = "chat"
    c.workload.num_requests = 128
    c.workload.rate = 0.5
    c.workload.vocab_size = 32000
    c.workload.fit_to_model = False
    c.workload.max_output_len = 0
    c.slo.ttft = 0.0
    c.slo.tbt = 0.0
    c.slo.tpot = 0.0
    c.deployment.colocated.tp = m["tp"]
    c.sim.hardware = m["hardware"]
    c.sim.profile = ""                    # the shipped A100 profile (fitted on Vidur's A100 operator data)
    return c
