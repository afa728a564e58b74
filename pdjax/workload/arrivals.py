"""Arrival processes: request arrival times in seconds, first request at t=0.

Every process starts at 0 (the run begins when the first request arrives) and adds inter-arrival gaps:
- poisson: exponential gaps with mean 1/rate (CV 1).
- gamma: gamma gaps with mean 1/rate and coefficient of variation `cv` (shape 1/cv^2, scale cv^2/rate);
  cv > 1 is burstier than Poisson, cv < 1 smoother, cv = 1 is Poisson.
- fixed: constant gap 1/rate.
- offline: everything at t=0 (a batch job).
"""
from __future__ import annotations

import numpy as np

ARRIVAL_KINDS = ("poisson", "gamma", "fixed", "offline")


def arrival_times(kind: str, num_requests: int, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """[num_requests] float64 arrival times in seconds, non-decreasing, the first one 0."""
    if kind not in ARRIVAL_KINDS:
        raise ValueError(f"arrival={kind!r}, expected one of {ARRIVAL_KINDS}")
    if num_requests < 0:
        raise ValueError(f"num_requests={num_requests!r}, expected >= 0")
    if kind != "offline" and not rate > 0:
        raise ValueError(f"rate={rate!r} req/s, expected > 0 for arrival={kind!r}")
    if kind == "gamma" and not cv > 0:
        raise ValueError(f"cv={cv!r}, expected > 0 for arrival='gamma'")
    if num_requests == 0:
        return np.zeros(0)
    num_gaps = num_requests - 1
    if kind == "offline":
        gaps = np.zeros(num_gaps)
    elif kind == "fixed":
        gaps = np.full(num_gaps, 1.0 / rate)
    elif kind == "poisson":
        gaps = rng.exponential(1.0 / rate, size=num_gaps)
    else:
        shape = 1.0 / (cv * cv)
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=num_gaps)
    return np.concatenate([[0.0], np.cumsum(gaps)])
