"""Default serving experiment: the byte-level tiny Llama (committed checkpoint) on CPU, a small chat-like
online workload, Sarathi stall-free batching.

    python -m experiments.serve --config=configs/serve.py --workdir=/tmp/serve
    python -m experiments.serve --config=configs/serve.py --config.scheduler.policy=vllm_v0 --workdir=...

Every field of the config dataclasses is a key here (blocks are built from them by `config_block`; the
dataclasses' docstrings say what each key means), so anything can be set from the command line, e.g.
    --config.workload.kind=trace --config.workload.trace_path=../shared/data/traces/vidur_splitwise_conv.csv
    --config.scheduler.preemption_mode=swap --config.workload.prompt_len=uniform:low=8,high=64
The run has one max_model_len, scheduler.max_model_len; the workload's caps follow it.
"""
import ml_collections

from pdjax.config.files import config_block
from pdjax.config.scheduler import SchedulerConfig
from pdjax.config.serving import EngineConfig, ModelConfig, ServerConfig, SLOConfig, deployment_block, sim_block
from pdjax.workload import WorkloadConfig


def get_config():
    c = ml_collections.ConfigDict()
    c.backend = "real"          # real | sim
    c.seed = 0
    c.model = config_block(
        ModelConfig, checkpoint="checkpoints/tiny-byte",   # a directory, or a registry spec name (dummy weights)
        attention_impl="auto", dtype="auto", eos_token_id=-1)   # auto: the checkpoint's dtype (float32 on CPU)
    c.engine = config_block(EngineConfig, mode="online")
    c.scheduler = config_block(
        SchedulerConfig, policy="sarathi", token_budget=256, max_num_seqs=32, max_model_len=1024, page_size=16,
        num_pages=1024)
    c.workload = config_block(
        WorkloadConfig, exclude=("max_model_len",), kind="synthetic", preset="chat", arrival="poisson", rate=4.0,
        num_requests=48, vocab_size=256,
        prompt_source="text",       # byte windows of real text (the model is byte-level); text_path "" = pydoc
        fit_to_model=True,          # the preset's long requests fill max_model_len (synthetic sources only)
        max_output_len=64)
    # tbt_quantile (the metrics' per-request TBT statistic) stays out of the block: 1.0, the max gap
    c.slo = config_block(SLOConfig, exclude=("tbt_quantile",), ttft=1.0, tbt=0.2, tpot=0.1)
    # One deployment block for both backends (--config.backend=sim simulates exactly it).
    # colocated: deployment.colocated.num_instances replicas, each (pp, tp) on pp*tp devices, behind
    #   deployment.router, e.g. --config.deployment.colocated.num_instances=2 --config.deployment.colocated.tp=2
    # disaggregated: prefill and decode instances on disjoint device groups, KV moved once per request, e.g.
    #   --config.deployment.kind=disaggregated --config.deployment.prefill.tp=2 --config.deployment.decode.tp=1
    # (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8). The other kind's groups are unused.
    # num_pages / token_budget / max_num_seqs 0 = the scheduler block's value; devices=() places groups
    # automatically (colocated from device 0; prefill first, then decode).
    c.deployment = deployment_block()
    # Simulator only (hardware, cost profile, KV memory): what the real engine has no use for.
    c.sim = sim_block(hardware="host-cpu", num_pages=0)
    # HTTP API server only (python -m experiments.api_server): queue bound (429 beyond it), SIGTERM drain time.
    c.server = config_block(ServerConfig)
    return c
