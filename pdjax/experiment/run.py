"""Run one serving experiment from a config dict on the backend it names, writing the standard run outputs."""
from __future__ import annotations

from typing import Any, Mapping

from pdjax.config.serving import serve_config_from_dict


def to_plain_dict(config: Any) -> dict:
    """A ConfigDict (or mapping) as nested plain dicts and lists."""
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if isinstance(config, Mapping):
        return {k: to_plain_dict(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [to_plain_dict(v) for v in config]
    return config


def run_experiment(config: Any, workdir: str) -> dict:
    """Validate `config` (configs/serve.py layout), run it on its backend, write outputs; returns the summary."""
    config = to_plain_dict(config)
    cfg = serve_config_from_dict(config)
    if cfg.backend == "real":
        from pdjax.serving.run import run_real  # noqa: PLC0415  (imports JAX)
        return run_real(cfg, config, workdir)
    from pdjax.sim.run import run_sim  # noqa: PLC0415
    return run_sim(cfg, config, workdir)
