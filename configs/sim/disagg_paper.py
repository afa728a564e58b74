"""Colocation vs prefill/decode disaggregation at DistServe scale, in simulation: Llama-2-13B (DistServe's OPT-13B
has the same dimensions bar the architecture; the cost model needs a runnable-architecture spec) on 2x A100-80GB
SXM (one NVSwitch node, so the KV moves over NVLink), Poisson arrivals.

ARG = <layout>-<trace>:
    layout  2xtp1   colocated Sarathi (budget 512), 2 replicas TP1 behind a round-robin router
            1xtp2   colocated Sarathi (budget 512), 1 replica TP2
            1p1d    disaggregated: 1 prefill GPU (prefill_only, budget 4096: whole prompts, DistServe-style)
                    + 1 decode GPU (decode_only, budget 512, up to 128 sequences), KV over NVLink
    trace   chat    openchat_sharegpt4 lengths scaled to 4096 tokens; SLOs TTFT 0.25 s, TPOT 0.1 s
                    (DistServe's chatbot SLOs for OPT-13B)
            arxiv   long-prompt summarization (total <= 4096); SLOs TTFT 1.5 s, TPOT 0.15 s (our choice:
                    a summarization SLO scaled to a 13B model)

    python -m experiments.serve --config=configs/sim/disagg_paper.py:1p1d-chat --config.workload.rate=3 \
        --workdir=/tmp/disagg_1p1d
    python -m experiments.sim_paper --table=disagg       # the whole comparison over arrival rates
"""
from pdjax.config.files import config_file

LAYOUTS = ("2xtp1", "1xtp2", "1p1d")
TRACES = {"chat": {"ttft": 0.75, "tpot": 0.1}, "arxiv": {"ttft": 1.5, "tpot": 0.15}}
MAX_MODEL_LEN = 4096


def get_config(arg="1p1d-chat"):
    parts = arg.split("-")
    if len(parts) != 2 or parts[0] not in LAYOUTS or parts[1] not in TRACES:
        raise ValueError(f"disagg_paper: ARG={arg!r}, expected <{'|'.join(LAYOUTS)}>-<{'|'.join(TRACES)}>")
    layout, trace = parts
    c = config_file(__file__, "../serve.py")
    c.backend = "sim"
    c.seed = 0
    c.model.checkpoint = "llama-2-13b"
    c.engine.progress = False
    c.scheduler.policy = "sarathi"
    c.scheduler.token_budget = 512
    c.scheduler.max_num_seqs = 128
    c.scheduler.max_model_len = MAX_MODEL_LEN
    c.scheduler.num_pages = 1024          # ignored: sim.num_pages = 0 sizes every KV cache from A100 memory
    c.workload.preset = trace
    c.workload.num_requests = 512
    c.workload.rate = 2.0
    c.workload.vocab_size = 32000
    c.workload.fit_to_model = True        # chat's lengths (<= 8192) scaled to the 4096-token context
    c.workload.max_output_len = 0
    c.slo.ttft = TRACES[trace]["ttft"]
    c.slo.tbt = 0.0
    c.slo.tpot = TRACES[trace]["tpot"]
    c.sim.hardware = "a100-80gb-sxm"
    c.sim.profile = ""                    # the shipped A100 profile
    c.deployment.router = "round_robin"
    if layout == "2xtp1":
        c.deployment.colocated.num_instances = 2
    elif layout == "1xtp2":
        c.deployment.colocated.tp = 2
    else:
        c.deployment.kind = "disaggregated"
        c.deployment.prefill.token_budget = MAX_MODEL_LEN
    return c
