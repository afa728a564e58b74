"""Predicted iteration time of given batch compositions on the simulator's cost model (the command line is
experiments/cost.py; `run` returns its JSON). JAX-free.

Each batch is a comma list of `prefill:<tokens>@<context before the chunk>` and `decode:<count>@<context>`; a
prefill's context + tokens and a decode's context + 1 must fit the model's max_position_embeddings.
"""
from __future__ import annotations

from pdjax.config import get_model_spec
from pdjax.sim.cost_model import BatchComposition, CostParams, iteration_time
from pdjax.sim.hardware import get_hardware_spec
from pdjax.sim.profile import load_profile


def run(model: str, hardware: str, tp: int, pp: int, batches: list[str], profile: str = "a100",
        microbatches: int = 1) -> dict:
    """The setup and, per batch, its predicted `time_s` and per-component breakdown (seconds); ValueError for a
    bad model, hardware, profile or batch."""
    if not batches:
        raise ValueError("no --batch given; e.g. --batch=prefill:1021@0,decode:3@2048")
    spec = get_model_spec(model)
    hw = get_hardware_spec(hardware)
    params = CostParams() if profile == "default" else load_profile(profile).params
    parsed = [BatchComposition.parse(text) for text in batches]
    limit = spec.max_position_embeddings
    for text, batch in zip(batches, parsed):
        for tokens, context in batch.prefills:
            if tokens + context > limit:
                raise ValueError(f"batch {text!r}: prefill:{tokens}@{context} reaches context {tokens + context}, "
                                 f"expected <= max_position_embeddings={limit} of {model}")
        for count, context in batch.decodes:
            if context + 1 > limit:
                raise ValueError(f"batch {text!r}: decode:{count}@{context} reaches context {context + 1}, "
                                 f"expected <= max_position_embeddings={limit} of {model}")
    results = []
    for text, batch in zip(batches, parsed):
        cost = iteration_time(batch, spec, hw, tp, pp, params, num_microbatches=microbatches)
        results.append({"batch": text, "time_s": cost.total, "num_tokens": cost.num_tokens,
                        "breakdown": {k: getattr(cost, k) for k in ("linear", "attention", "communication",
                                                                    "overhead", "elementwise", "pipeline_bubble")},
                        "linear_bound": "compute" if cost.linear_flops_s > cost.linear_memory_s else "memory"})
    return {"model": model, "hardware": hw.name, "tp": tp, "pp": pp, "profile": profile, "batches": results}
