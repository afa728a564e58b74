"""Default serving experiment: the byte-level tiny Llama (committed checkpoint) on CPU, a small chat-like
online workload, Sarathi stall-free batching.

    python -m experiments.serve --config=configs/serve.py --workdir=/tmp/serve
    python -m experiments.serve --config=configs/serve.py --config.scheduler.policy=vllm_v0 --workdir=...
"""
import ml_collections


def get_config():
    c = ml_collections.ConfigDict()
    c.backend = "real"          # real | sim
    c.seed = 0

    c.model = ml_collections.ConfigDict()
    c.model.checkpoint = "checkpoints/tiny-byte"   # a directory, or a registry spec name for dummy weights
    c.model.attention_impl = "auto"                # auto | reference | pallas
    c.model.dtype = "float32"
    c.model.eos_token_id = -1                      # -1: outputs run to their sampled length

    c.engine = ml_collections.ConfigDict()
    c.engine.mode = "online"                       # online | offline
    c.engine.token_buckets = ()
    c.engine.seq_buckets = ()
    c.engine.page_buckets = ()
    c.engine.warmup = True
    c.engine.progress = True
    c.engine.async_scheduling = False          # True: schedule step k+1 while step k runs

    c.scheduler = ml_collections.ConfigDict()
    c.scheduler.policy = "sarathi"
    c.scheduler.token_budget = 256
    c.scheduler.max_num_seqs = 32
    c.scheduler.max_model_len = 1024
    c.scheduler.page_size = 16
    c.scheduler.num_pages = 1024
    c.scheduler.enable_prefix_caching = False

    c.workload = ml_collections.ConfigDict()
    c.workload.kind = "synthetic"
    c.workload.preset = "chat"
    c.workload.arrival = "poisson"
    c.workload.rate = 4.0
    c.workload.num_requests = 48
    c.workload.vocab_size = 256
    c.workload.prompt_source = "text"             # byte windows of real text (the model is byte-level)
    c.workload.text_path = ""                     # "": the stdlib pydoc topics text
    c.workload.max_model_len = 1024
    c.workload.fit_to_model = True
    c.workload.max_output_len = 64

    c.slo = ml_collections.ConfigDict()
    c.slo.ttft = 1.0
    c.slo.tbt = 0.2
    c.slo.tpot = 0.1

    # colocated: one instance on one device (the blocks below are unused). disaggregated: prefill and decode
    # instances on disjoint device groups, KV moved once per request (pdjax/serving/disagg.py), e.g.
    #   --config.deployment.kind=disaggregated --config.deployment.prefill.tp=2 --config.deployment.decode.tp=1
    # (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8). 0 = the scheduler block's value;
    # devices=() places groups automatically (prefill first).
    c.deployment = ml_collections.ConfigDict()
    c.deployment.kind = "colocated"                # colocated | disaggregated
    c.deployment.router = "round_robin"            # round_robin | least_loaded
    for role in ("prefill", "decode"):
        g = ml_collections.ConfigDict()
        g.num_instances = 1
        g.dp = 1
        g.pp = 1
        g.tp = 1
        g.num_pages = 0
        g.token_budget = 0
        g.max_num_seqs = 0
        g.devices = ()
        c.deployment[role] = g

    c.sim = ml_collections.ConfigDict()
    c.sim.hardware = "host-cpu"
    c.sim.tp = 1
    c.sim.pp = 1
    c.sim.profile = ""
    c.sim.num_replicas = 1
    c.sim.router = "round_robin"                  # round_robin | least_outstanding_tokens
    c.sim.model = ""                               # cost-model spec name; empty: from model.checkpoint
    c.sim.num_pages = 0                            # 0: KV capacity from memory (GPU/TPU), scheduler.num_pages (CPU)
    c.sim.gpu_memory_utilization = 0.9
    c.sim.num_microbatches = 1
    return c
