"""Token-length distributions (prompt or output lengths), sampled with a numpy Generator.

A `LengthDist` is a frozen description; `sample_lengths(dist, n, rng)` draws [n] int64 lengths >= 1.
Kinds:
- fixed: always `value`.
- uniform: integers uniform on [low, high] inclusive.
- lognormal: round(exp(N(log(median), sigma))), clipped to [low, high] (high 0 = no upper clip).
- zipf: P(L = k) ∝ k^-alpha on [low, high] (a bounded Zipf; `high` is required).
- quantiles: inverse-CDF table ((q, length), ...) with q from 0 to 1, linearly interpolated; this is how the
  named presets carry a real trace's distribution without the file.
- empirical: resample with replacement from `samples` (lengths taken from a trace, see traces.py).
`sample_length_pairs` draws (prompt, output) lengths together: two empirical distributions of one trace's
columns (equal sample counts, row i of each the same request) are drawn jointly, one row index per request, so
the trace's prompt/output correlation is kept (as DistServe and Splitwise sample); anything else draws each
column on its own generator, exactly as `sample_lengths`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Tuple, Union

import numpy as np

LENGTH_KINDS = ("fixed", "uniform", "lognormal", "zipf", "quantiles", "empirical")


@dataclasses.dataclass(frozen=True)
class LengthDist:
    kind: str
    value: int = 0
    low: int = 1
    high: int = 0
    median: float = 0.0
    sigma: float = 0.0
    alpha: float = 0.0
    quantiles: Tuple[Tuple[float, float], ...] = ()
    samples: Tuple[int, ...] = ()

    def __post_init__(self):
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"length distribution kind={self.kind!r}, expected one of {LENGTH_KINDS}")
        if self.low < 1:
            raise ValueError(f"{self.kind}: low={self.low!r}, expected >= 1")
        if self.high and self.high < self.low:
            raise ValueError(f"{self.kind}: high={self.high!r} < low={self.low!r}")
        if self.kind == "fixed" and self.value < 1:
            raise ValueError(f"fixed: value={self.value!r}, expected >= 1")
        if self.kind == "uniform" and self.high < 1:
            raise ValueError(f"uniform: high={self.high!r}, expected >= low={self.low}")
        if self.kind == "lognormal" and not (self.median >= 1 and self.sigma >= 0):
            raise ValueError(f"lognormal: median={self.median!r}, sigma={self.sigma!r}, "
                             "expected median >= 1, sigma >= 0")
        if self.kind == "zipf" and not (self.alpha > 0 and self.high >= self.low):
            raise ValueError(f"zipf: alpha={self.alpha!r}, high={self.high!r}, expected alpha > 0 and high >= low")
        if self.kind == "quantiles":
            qs = [q for q, _ in self.quantiles]
            vals = [v for _, v in self.quantiles]
            if len(qs) < 2 or qs[0] != 0.0 or qs[-1] != 1.0 or any(b <= a for a, b in zip(qs, qs[1:])):
                raise ValueError(f"quantiles: q values {qs!r}, expected strictly increasing from 0.0 to 1.0")
            if any(b < a for a, b in zip(vals, vals[1:])) or vals[0] < 1:
                raise ValueError(f"quantiles: lengths {vals!r}, expected non-decreasing and >= 1")
        if self.kind == "empirical" and (not self.samples or min(self.samples) < 1):
            raise ValueError("empirical: samples must be a non-empty sequence of lengths >= 1")

    @property
    def max_length(self) -> int:
        """Largest length this distribution can produce (before any workload scaling or caps)."""
        if self.kind == "fixed":
            return self.value
        if self.kind == "quantiles":
            return int(round(self.quantiles[-1][1]))
        if self.kind == "empirical":
            return max(self.samples)
        if self.kind == "lognormal" and not self.high:
            return 2**62
        return self.high


def parse_length_dist(text: str) -> dict:
    """The dict form of a command-line length distribution 'kind' or 'kind:key=value,key=value', e.g.
    'fixed:value=20', 'uniform:low=8,high=64', 'lognormal:median=300,sigma=1.0,high=4096'."""
    kind, _, rest = text.strip().partition(":")
    out: dict = {"kind": kind.strip()}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"length distribution {text!r}: {item!r} is not key=value "
                             "(expected e.g. 'uniform:low=8,high=64')")
        number = float(value)
        out[key.strip()] = int(number) if number.is_integer() and "." not in value else number
    return out


def length_dist(spec: Union[LengthDist, Mapping[str, Any], str]) -> LengthDist:
    """A LengthDist from itself, a dict such as {'kind': 'lognormal', 'median': 300, 'sigma': 1.0}, or its
    command-line string 'lognormal:median=300,sigma=1.0' (`parse_length_dist`)."""
    if isinstance(spec, LengthDist):
        return spec
    if isinstance(spec, str):
        spec = parse_length_dist(spec)
    if not isinstance(spec, Mapping):
        raise TypeError(f"length distribution {spec!r}: expected a LengthDist or a mapping with a 'kind' key")
    fields = {f.name for f in dataclasses.fields(LengthDist)}
    unknown = sorted(set(spec) - fields)
    if unknown:
        raise ValueError(f"length distribution: unknown keys {unknown}, expected some of {sorted(fields)}")
    kwargs = dict(spec)
    if "quantiles" in kwargs:
        kwargs["quantiles"] = tuple((float(q), float(v)) for q, v in kwargs["quantiles"])
    if "samples" in kwargs:
        kwargs["samples"] = tuple(int(v) for v in kwargs["samples"])
    return LengthDist(**kwargs)


def is_pairable(prompt: LengthDist, output: LengthDist) -> bool:
    """Both empirical with equal sample counts: row i of each can be one (prompt, output) pair."""
    return prompt.kind == output.kind == "empirical" and len(prompt.samples) == len(output.samples)


def sample_length_pairs(prompt: LengthDist, output: LengthDist, n: int, prompt_rng: np.random.Generator,
                        output_rng: np.random.Generator, joint: bool) -> Tuple[np.ndarray, np.ndarray]:
    """([n] prompt lengths, [n] output lengths). joint (module docstring; needs `is_pairable`): one row index per
    request, drawn from prompt_rng, picks both (the prompts are the ones an independent draw gives); otherwise
    prompt lengths from prompt_rng and output lengths from output_rng."""
    if not joint:
        return sample_lengths(prompt, n, prompt_rng), sample_lengths(output, n, output_rng)
    if not is_pairable(prompt, output):
        raise ValueError(f"joint length sampling needs two empirical distributions with equal sample counts (one "
                         f"trace's columns); got {prompt.kind!r} ({len(prompt.samples)} samples) and {output.kind!r} "
                         f"({len(output.samples)} samples)")
    rows = prompt_rng.integers(0, len(prompt.samples), size=n)
    return _clip(prompt, np.asarray(prompt.samples, dtype=np.float64)[rows]), \
        _clip(output, np.asarray(output.samples, dtype=np.float64)[rows])


def _clip(dist: LengthDist, out: np.ndarray) -> np.ndarray:
    out = np.maximum(np.rint(out), dist.low)
    if dist.high:
        out = np.minimum(out, dist.high)
    return out.astype(np.int64)


def sample_lengths(dist: LengthDist, n: int, rng: np.random.Generator) -> np.ndarray:
    """[n] int64 lengths >= 1 drawn from `dist`."""
    if dist.kind == "fixed":
        out = np.full(n, dist.value, dtype=np.float64)
    elif dist.kind == "uniform":
        out = rng.integers(dist.low, dist.high, size=n, endpoint=True).astype(np.float64)
    elif dist.kind == "lognormal":
        out = np.exp(rng.normal(np.log(dist.median), dist.sigma, size=n))
    elif dist.kind == "zipf":
        support = np.arange(dist.low, dist.high + 1, dtype=np.float64)
        weights = support ** -dist.alpha
        out = rng.choice(support, size=n, p=weights / weights.sum())
    elif dist.kind == "quantiles":
        qs = np.array([q for q, _ in dist.quantiles])
        vals = np.array([v for _, v in dist.quantiles])
        out = np.interp(rng.random(n), qs, vals)
    else:
        out = np.asarray(dist.samples, dtype=np.float64)[rng.integers(0, len(dist.samples), size=n)]
    return _clip(dist, out)
