"""Simulator speed check: a 10,000-request chat workload (openchat_sharegpt4 lengths, Poisson arrivals) on one
Mistral-7B replica on an A100-80GB (shipped a100 profile), Sarathi stall-free batching with a 512-token budget.

    python -m experiments.serve --config=configs/sim/chat10k.py --workdir=/tmp/chat10k
(results.json's "sim" block reports the simulator's speed in simulated iterations per second)
"""
from pdjax.config.files import config_file


def _serve_config():
    return config_file(__file__, "../serve.py")


def get_config():
    c = _serve_config()
    c.backend = "sim"
    c.model.checkpoint = "mistral-7b"
    c.engine.progress = False
    c.scheduler.policy = "sarathi"
    c.scheduler.token_budget = 512
    c.scheduler.max_num_seqs = 128
    c.scheduler.max_model_len = 8192
    c.workload.preset = "chat"
    c.workload.num_requests = 10000
    c.workload.rate = 1.5
    c.workload.vocab_size = 32000
    c.workload.fit_to_model = False
    c.workload.max_output_len = 0
    c.slo.ttft = 0.0
    c.slo.tbt = 0.0
    c.slo.tpot = 0.0
    c.sim.hardware = "a100-80gb-sxm"
    return c
