"""Frozen config dataclasses, validated once at start-up. No JAX import."""
from pdjax.config.model_specs import MODEL_SPECS, ModelSpec, RopeScaling, get_model_spec
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig

__all__ = ["MODEL_SPECS", "ModelSpec", "RopeScaling", "get_model_spec", "SamplingParams", "SchedulerConfig"]
