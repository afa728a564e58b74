"""Simulator fidelity on the CPU engine (issue 6 "Fidelity here"): the tiny-byte Llama (dummy weights: the same
compute as the trained checkpoint), 40 chat-like requests arriving Poisson at 4 req/s, Sarathi with a 256-token
budget. experiments.sim_fidelity calibrates on this engine, serves it for real and in simulation, and compares.

    python -m experiments.sim_fidelity --config=configs/sim/fidelity_cpu.py --workdir=/tmp/fidelity
"""
from pdjax.config.files import config_file


def _serve_config():
    return config_file(__file__, "../serve.py")


def get_config(arg="full"):
    if arg not in ("full", "small"):
        raise ValueError(f"fidelity_cpu: ARG={arg!r}, expected 'full' or 'small'")
    c = _serve_config()
    c.model.checkpoint = "tiny-byte"
    c.engine.progress = False
    c.workload.num_requests = 40
    c.sim.hardware = "host-cpu"
    if arg == "small":
        # Few bucket shapes (fast to compile) and a short run: the non-slow test's variant.
        c.scheduler.token_budget = 64
        c.scheduler.max_num_seqs = 8
        c.scheduler.max_model_len = 256
        c.scheduler.num_pages = 256
        c.engine.token_buckets = (16, 64)
        c.engine.seq_buckets = (8,)
        c.engine.page_buckets = (16,)
        c.workload.max_output_len = 24
        c.workload.num_requests = 16
        c.workload.rate = 6.0
    return c
