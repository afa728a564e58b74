"""Pure-Python scheduler library (no JAX): requests, block manager, batching policies."""
