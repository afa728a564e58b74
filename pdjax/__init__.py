"""pdjax: a JAX research framework for LLM serving.

Layers (see DESIGN.md): config/scheduler/workload/metrics/sim import no JAX; models/kernels/runtime/serving do.
"""
import time as _time

__version__ = "0.1.0"
IMPORT_TIME = _time.time()   # when pdjax was first imported: the start of a run's start-up (see serving/run.py)
