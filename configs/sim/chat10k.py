"""Simulator speed check: a 10,000-request chat workload (openchat_sharegpt4 lengths, Poisson arrivals) on one
Mistral-7B replica on an A100-80GB (shipped a100 profile), Sarathi stall-free batching with a 512-token budget.

ARG (optional) = replicas-<router>: the same on 4 replicas at 4x the rate, prefix caching on, behind <router>
(round_robin, least_loaded, prefix_affinity, kv_centric), each replica with a 64 GiB host-memory KV tier
(about its device KV cache): the speed check with cache-aware routing (issue 30).

    python -m experiments.serve --config=configs/sim/chat10k.py --workdir=/tmp/chat10k
    python -m experiments.serve --config=configs/sim/chat10k.py:replicas-kv_centric --workdir=/tmp/chat10k_kv
(results.json's "sim" block reports the simulator's speed in simulated iterations per second)
"""
from pdjax.config.files import config_file


def _serve_config():
    return config_file(__file__, "../serve.py")


REPLICAS = 4


def get_config(arg=None):
    c = _plain_config()
    if arg is None:
        return c
    kind, _, router = arg.partition("-")
    if kind != "replicas" or not router:
        raise ValueError(f"chat10k: ARG={arg!r}, expected replicas-<router>")
    c.workload.rate *= REPLICAS
    c.scheduler.enable_prefix_caching = True
    c.deployment.kind = "colocated"
    c.deployment.router = router
    c.deployment.colocated.num_instances = REPLICAS
    c.deployment.colocated.host_kv_gib = 64.0
    return c


def _plain_config():
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
