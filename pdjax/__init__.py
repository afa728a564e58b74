"""pdjax: a JAX research framework for LLM serving.

Layers (see DESIGN.md): config/scheduler/workload/metrics/sim import no JAX; models/kernels/runtime/serving do.
"""
__version__ = "0.1.0"
