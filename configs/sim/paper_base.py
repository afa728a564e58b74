"""Shared base of the Sarathi-Serve paper configs, as the OSDI'24 artifact ran them (microsoft/sarathi-serve,
osdi-experiments/): a serve config on the simulator backend, one model deployment on A100-80GB PCIe cards joined
in pairs by NVLink bridges, 4 per node (Azure NC96ads v4, hardware 'a100-80gb-pcie'), lengths replayed from the
artifact's trace, Poisson arrivals, Sarathi with a 512-token budget and up to 128 sequences.

ARG = <model>[-<trace>]  (trace default: chat)
    model  mistral7b   Mistral-7B, 1 GPU
           yi34b       Yi-34B-200K (the artifact's 01-ai/Yi-34B-200K), TP2 on one NVLink pair
                       (deployment.colocated.tp=2)
           llama70b    Llama-2-70B ('llama-2-70b-16k': its dimensions with 16384 positions, as the artifact served it
                       beyond its 4096), TP4 x PP2 over two 4-GPU nodes (deployment.colocated.tp=4, .pp=2: each stage's
                       TP group inside one node, activations cross the nodes over HDR InfiniBand; the artifact's
                       Falcon-180B testbed. pdjax's registry has no Falcon; the artifact ran Llama-2-70B TP4 x PP2
                       on one node of 8 A40s)
    trace  chat        sarathi_sharegpt_8k_filtered_llama2_tok.csv (openchat_sharegpt4: prompt median 1730, P90
                       5696; output 415 / 834), max_model_len 8192, default rate 1.0 req/s
           arxiv       vidur_arxiv_summarization_llama2_tok_filtered_v2.csv, max_model_len 16384, default rate
                       0.5 req/s. NOT the paper's arxiv file (its Table 2: prompt median 7059, total <= 16384): the
                       public filtered_v2 file has every total <= 4096 (../shared/data/traces/SOURCES.md)

workload.kind='trace' replays the trace's own lengths, rows trace_start .. +num_requests, in order (no scaling;
the caps cut nothing: every row fits max_model_len); arrivals are Poisson at workload.rate, as in the artifact
(--synthetic_request_generator_interval_provider poisson, length provider trace, scale factors 1). The traces are
read from ../shared/data/traces relative to the repository root (resolved here, so the configs work from any
working directory). max_model_len is within every model spec's positions (both backends refuse more): hence
yi-34b-200k (the registry's yi-34b, the base checkpoint, has 4096) and llama-2-70b-16k.

Used by configs/sweeps/sarathi_ablation_paper.py, configs/sim/capacity_paper.py and experiments.sim_paper.
    python -m experiments.serve --config=configs/sim/paper_base.py:yi34b-arxiv --workdir=/tmp/yi_arxiv
"""

from pdjax.config.files import config_file, replay_trace_lengths, shared_trace


MODELS = {
    "mistral7b": dict(model="mistral-7b", hardware="a100-80gb-pcie", tp=1, pp=1),
    "yi34b": dict(model="yi-34b-200k", hardware="a100-80gb-pcie", tp=2, pp=1),
    "llama70b": dict(model="llama-2-70b-16k", hardware="a100-80gb-pcie", tp=4, pp=2),
}
TRACES = {
    "chat": dict(file="sarathi_sharegpt_8k_filtered_llama2_tok.csv", max_model_len=8192, rate=1.0),
    "arxiv": dict(file="vidur_arxiv_summarization_llama2_tok_filtered_v2.csv", max_model_len=16384, rate=0.5),
}


def trace_path(trace: str) -> str:
    """Absolute path of a paper trace (../shared/data/traces relative to the repository root)."""
    return shared_trace(TRACES[trace]["file"])


def parse_arg(arg: str):
    """'<model>[-<trace>]' -> (model, trace)."""
    model, _, trace = arg.partition("-")
    trace = trace or "chat"
    if model not in MODELS or trace not in TRACES:
        raise ValueError(f"paper_base: ARG={arg!r}, expected <{'|'.join(MODELS)}>[-<{'|'.join(TRACES)}>]")
    return model, trace


def get_config(arg="yi34b"):
    model, trace = parse_arg(arg)
    m, t = MODELS[model], TRACES[trace]
    c = config_file(__file__, "../serve.py")
    c.backend = "sim"
    c.seed = 0
    c.model.checkpoint = m["model"]
    c.engine.progress = False
    c.scheduler.policy = "sarathi"
    c.scheduler.token_budget = 512
    c.scheduler.max_num_seqs = 128
    c.scheduler.max_model_len = t["max_model_len"]
    # Ignored by the simulator (sim.num_pages = 0 sizes the KV cache from A100 memory); validation wants it to hold
    # one max-length request.
    c.scheduler.num_pages = 2 * t["max_model_len"] // c.scheduler.page_size
    replay_trace_lengths(c.workload, trace_path(trace), num_requests=128)
    c.workload.arrival = "poisson"
    c.workload.rate = t["rate"]
    c.slo.ttft = 0.0
    c.slo.tbt = 0.0
    c.slo.tpot = 0.0
    c.deployment.colocated.tp = m["tp"]
    c.deployment.colocated.pp = m["pp"]
    c.sim.hardware = m["hardware"]
    c.sim.profile = ""                    # the shipped A100 profile (fitted on Vidur's A100 operator data)
    return c
