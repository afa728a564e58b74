"""Splitwise-style layouts (Patel et al., ISCA 2024) in simulation: Llama-2-70B, one instance per 8-GPU machine
(TP8 over one node's NVSwitch, so every KV transfer crosses machines over InfiniBand, as in Splitwise), a prompt
pool (deployment.prefill), a token pool (deployment.decode) and Splitwise's mixed pool on the Azure LLM inference
traces of the paper (2023, code and conversation), replayed with their own lengths and arrival times.
pdjax/scheduler/mixed.py has the reading of Splitwise's policy and its thresholds.

ARG = <machines>-<trace>[-<pool>]
    machines  aa   Splitwise-AA: prompt and token machines are DGX-A100 (8x A100-80GB SXM)
              hh   Splitwise-HH: DGX-H100 (8x H100 SXM)
              ha   Splitwise-HA: DGX-H100 prompt machines (deployment.prefill.hardware), DGX-A100 token machines
                   (sim.hardware; the mixed machine too)
    trace     code azure_llm_2023_code.csv (prompt median 1469, output median 13), at the trace's own times (the
                   first 1000 rows: ~1.9 req/s, in bursts)
              conv azure_llm_2023_conv.csv (prompt median 1020, output median 129), trace times x0.5 (the first
                   1000 rows: ~9 req/s)
    pool      borrow     (default) Splitwise's mixed pool (deployment.mixed_pool='borrow'): 2 prompt + 1 token
                         machines, 3 in all; a prompt or token machine moves into the mixed pool when the other
                         phase is overloaded, runs mixed (Sarathi) batches there under its own name, and returns to
                         its pool when idle
              dedicated  deployment.mixed_pool='dedicated' with deployment.mixed.num_instances=1: a 4th machine
                         ('mixed0') that takes one phase at a time while that pool is overloaded (issue 13's form)
              off        no mixed pool: the 2 prompt + 1 token machines alone
Layout (every count a key): 2 prompt + 1 token machine (+ the dedicated mixed machine). Prompt machines batch up to
2048 prompt tokens (Splitwise's prompt-machine batch limit), token machines up to 256 sequences as memory allows; a
machine borrowed into the mixed pool keeps its own budget and sequence limit; a dedicated mixed machine gets the
prompt machines' 2048-token budget and the token machines' 256 sequences. Mixed-pool thresholds:
deployment.mixed_prefill_queue_tokens=8192 (splitwise-sim's prompt_max_pending_batch_tokens) and
deployment.mixed_decode_load=1.0 (a token machine is overloaded when the request's KV or sequence slot would not fit).
SLOs (our choice, ~5x the unloaded figures): TTFT 2 s, TBT 0.2 s.
Every group runs the 'vllm-eager' stack (pdjax.sim.eager): the cost model under the host-bound floor of the eager
vLLM Splitwise measured (a TP 8 decode step of ~45 ms on DGX-A100 and ~30 ms on DGX-H100 at batch 1, growing ~1.2x
to batch 32), so its slowdown SLOs are judged against the engine they were set for; `--config.deployment.<group>.
stack=pdjax` for pdjax's own (XLA) engine.

    python -m experiments.serve --config=configs/sim/splitwise.py:aa-code --workdir=/tmp/splitwise_aa_code
    python -m experiments.serve --config=configs/sim/splitwise.py:aa-code-dedicated --workdir=/tmp/sw_aa_code_dedicated
    python -m experiments.serve --config=configs/sim/splitwise.py:aa-code-off --workdir=/tmp/sw_aa_code_off
(equivalently `--config.deployment.mixed_pool=dedicated --config.deployment.mixed.num_instances=1` on the default,
or `--config.deployment.mixed_pool=dedicated` alone for no mixed pool). results.json "engine" / "mixed_pool" lists
every pool move (borrow: time, machine, from pool, to pool, reason; per-machine counts and seconds in the mixed
pool; requests kept on their prompt machine) or every change of phase of the dedicated mixed machine.
"""

from pdjax.config.files import config_file, replay_trace_lengths, shared_trace


MACHINES = {"aa": ("a100-80gb-sxm", ""), "hh": ("h100-sxm", ""), "ha": ("a100-80gb-sxm", "h100-sxm")}   # token, prompt
TRACES = {"code": dict(file="azure_llm_2023_code.csv", time_scale=1.0),
          "conv": dict(file="azure_llm_2023_conv.csv", time_scale=0.5)}
POOLS = ("borrow", "dedicated", "off")
GPUS_PER_MACHINE = 8


def get_config(arg="aa-code"):
    machines, trace, pool = (arg.split("-") + ["borrow"])[:3] if arg.count("-") in (1, 2) else ("", "", "")
    if machines not in MACHINES or trace not in TRACES or pool not in POOLS:
        raise ValueError(f"splitwise: ARG={arg!r}, expected <{'|'.join(MACHINES)}>-<{'|'.join(TRACES)}>"
                         f"[-<{'|'.join(POOLS)}>]")
    t = TRACES[trace]
    c = config_file(__file__, "../serve.py")
    c.backend = "sim"
    c.seed = 0
    c.model.checkpoint = "llama-2-70b-16k"     # Llama-2-70B's dimensions, positions for the traces' 14k tokens
    c.engine.progress = False
    c.scheduler.policy = "sarathi"             # the base of the roles' prefill_only / decode_only
    c.scheduler.token_budget = 512
    c.scheduler.max_num_seqs = 256
    c.scheduler.max_model_len = 16384          # every row of both traces fits (conv's longest: 14089 tokens)
    c.scheduler.num_pages = 2048               # ignored: sim.num_pages = 0 sizes every KV cache from GPU memory
    replay_trace_lengths(c.workload, shared_trace(t["file"]), num_requests=1000)
    c.workload.arrival = "trace"               # the trace's own arrival times, scaled
    c.workload.trace_time_scale = t["time_scale"]
    c.slo.ttft = 2.0
    c.slo.tbt = 0.2
    c.slo.tpot = 0.0
    c.sim.hardware, c.deployment.prefill.hardware = MACHINES[machines]
    c.sim.profile = ""                         # the shipped profile of the hardware
    c.deployment.kind = "disaggregated"
    c.deployment.router = "least_loaded"       # join the shortest queue, as Splitwise's cluster scheduler
    num_mixed = 1 if pool == "dedicated" else 0
    for role, n in (("prefill", 2), ("decode", 1), ("mixed", num_mixed)):
        group = c.deployment[role]
        group.num_instances = n
        group.tp = GPUS_PER_MACHINE
        group.stack = "vllm-eager"             # Splitwise's engine (module docstring)
    c.deployment.prefill.token_budget = 2048
    c.deployment.decode.max_num_seqs = 256
    c.deployment.mixed.token_budget = 2048
    c.deployment.mixed_pool = "borrow" if pool == "borrow" else "dedicated"
    c.deployment.mixed_prefill_queue_tokens = 8192
    c.deployment.mixed_decode_load = 1.0
    return c
