"""kv_centric's cost on the real engine: each instance's step time fitted online from its own timed steps (issue 30).
No JAX: the engine (pdjax.serving.cluster) feeds the steps it timed, the router (pdjax.scheduler.routing) reads the
predictions.

Model of one step of an instance, seconds = theta . x with the features x (`step_features`, `FEATURES`):
    step             1 (the per-step floor: launches, weight reads, host work)
    tokens           tokens fed (prefill chunks and decodes)
    attention_pairs  query-key pairs the step's attention computes: a sequence fed n tokens after c computed ones
                     has n * (c + (n + 1) / 2) (causal within the chunk); a prefill's cached context enters here
    pages_loaded     host -> device page copies before the step (`swap_in`: host KV tier hits, swap resumes)
    pages_offloaded  device -> host page copies (`swap_out`: host KV tier offloads, swap preemption)
`StepFit` is a least-squares fit of theta over every observed step with a Gaussian prior on theta (ridge towards a
prior theta0), solved from running sums (O(1) memory, O(25) work per step, a 5 x 5 solve when read after new steps).
Features are scaled by a typical step's (`typical_step`: one full token-budget chunk at a context of one budget,
copying a budget's worth of pages), and the prior weighs `prior_steps` such steps per coefficient: it decides the
first picks and any coefficient the steps never excite (an instance that never loaded a host page keeps its prior
price per page), and fades as steps come.

`MeasuredCost` keeps one fit per instance (by name) and gives the router, per instance (`of(inst)`, the routing
protocol of a per-instance cost or fetch), kv_centric's two terms in seconds:
    prefill(new, cached)  a chunked prefill of `new` tokens after `cached` ones on that instance: ceil(new / budget)
                          steps, new tokens, new * cached + new * (new + 1) / 2 pairs (the pair count is the same
                          however the prompt is cut into chunks);
    fetch(local, remote)  (local + remote) pages x the fitted seconds per loaded page (>= 0). A remote page (another
                          instance's in a shared pool) is priced as a local one: on the engine both are a copy from
                          the same host memory (pdjax.serving.kv_tier).
The engine calls `observe_step(inst, out, start, end, num_compiles)` for every collected step: its seconds are
end - max(start, the instance's previous end) (a pipelined instance's batches overlap), and a step that compiled
is skipped (its time is the compiler's). In the engine's rounds (pdjax.serving.cluster: every busy instance dispatches,
then each is collected in turn) a step's schedule-to-collect time includes waiting for the instances collected before
it: the time a step of that instance takes in that loop, which is what its queue and prefill take there too.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Sequence, Tuple, Union

__all__ = ["FEATURES", "MeasuredCost", "StepFit", "step_features", "typical_step"]

FEATURES = ("step", "tokens", "attention_pairs", "pages_loaded", "pages_offloaded")
Features = Tuple[float, float, float, float, float]


def step_features(out) -> Features:
    """FEATURES of a SchedulerOutput (module docstring)."""
    pairs = 0.0
    for n, c in zip(out.num_new_tokens, out.num_computed_tokens):
        pairs += n * (c + (n + 1) / 2)
    return 1.0, float(sum(out.num_new_tokens)), pairs, float(len(out.swap_in)), float(len(out.swap_out))


def prefill_features(new_tokens: int, cached_tokens: int, budget: int) -> Features:
    """FEATURES summed over the steps of a chunked prefill of `new_tokens` after `cached_tokens` (budget-token
    chunks)."""
    chunks = -(-new_tokens // budget)
    return float(chunks), float(new_tokens), new_tokens * (cached_tokens + (new_tokens + 1) / 2), 0.0, 0.0


def typical_step(budget: int, page_size: int) -> Features:
    """The feature scales: one `budget`-token chunk at a context of `budget` tokens, copying budget / page_size
    pages each way."""
    pages = max(1.0, budget / page_size)
    return 1.0, float(budget), budget * (budget + (budget + 1) / 2), pages, pages


def _solve(a: List[List[float]], b: List[float]) -> List[float]:
    """x with a x = b (Gaussian elimination with partial pivoting; `a` is symmetric positive definite here)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for k in range(col, n + 1):
                    m[r][k] -= f * m[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


class StepFit:
    """theta (seconds per unit of each FEATURE) fitted to observed (features, seconds) steps (module docstring).
    prior: theta0 (seconds per unit); scales: the typical step's features; prior_steps > 0: the prior's weight in
    steps (0: plain least squares, which needs steps that excite every feature)."""

    def __init__(self, prior: Sequence[float], scales: Sequence[float], prior_steps: float = 8.0):
        if len(prior) != len(FEATURES) or len(scales) != len(FEATURES):
            raise ValueError(f"StepFit: prior {list(prior)} and scales {list(scales)}, expected {len(FEATURES)} "
                             f"values each ({', '.join(FEATURES)})")
        if any(s <= 0 for s in scales) or prior_steps < 0:
            raise ValueError(f"StepFit: scales {list(scales)} and prior_steps={prior_steps}, expected scales > 0 "
                             "and prior_steps >= 0")
        self.prior, self.scales, self.prior_steps = tuple(prior), tuple(scales), float(prior_steps)
        n = len(FEATURES)
        self._zz = [[0.0] * n for _ in range(n)]     # sum of z z^T, z = features / scales
        self._zy = [0.0] * n                         # sum of z * seconds
        self._yy = 0.0                               # sum of seconds**2
        self._y = 0.0                                # sum of seconds
        self.num_steps = 0
        self._theta = self.prior

    def observe(self, features: Sequence[float], seconds: float) -> None:
        z = [x / s for x, s in zip(features, self.scales)]
        for i, zi in enumerate(z):
            if zi:
                row = self._zz[i]
                for j, zj in enumerate(z):
                    row[j] += zi * zj
                self._zy[i] += zi * seconds
        self._yy += seconds * seconds
        self._y += seconds
        self.num_steps += 1
        self._theta = None

    @property
    def theta(self) -> Tuple[float, ...]:
        """The fitted seconds per unit of each FEATURE (the prior before any step)."""
        if self._theta is None:
            lam, s = self.prior_steps, self.scales
            a = [[v + (lam if i == j else 0.0) for j, v in enumerate(row)] for i, row in enumerate(self._zz)]
            b = [zy + lam * p * sk for zy, p, sk in zip(self._zy, self.prior, s)]
            self._theta = tuple(phi / sk for phi, sk in zip(_solve(a, b), s))
        return self._theta

    def residuals(self) -> Tuple[float, float]:
        """(mean seconds, root-mean-square error of theta's predictions) over the observed steps (0, 0 before any)."""
        if not self.num_steps:
            return 0.0, 0.0
        phi = [t * sk for t, sk in zip(self.theta, self.scales)]
        fitted = sum(p * sum(row[j] * phi[j] for j in range(len(phi))) for p, row in zip(phi, self._zz))
        sse = self._yy - 2 * sum(p * zy for p, zy in zip(phi, self._zy)) + fitted
        return self._y / self.num_steps, math.sqrt(max(0.0, sse) / self.num_steps)

    def predict(self, features: Sequence[float]) -> float:
        """Seconds of a step (or of several, features summed) with these features, at least 0."""
        return max(0.0, sum(t * x for t, x in zip(self.theta, features)))


class _InstanceCost:
    """One instance's fit and token budget: its prefill and fetch seconds (module docstring)."""

    def __init__(self, fit: StepFit, budget: int):
        self.fit, self.budget, self.last_end = fit, budget, float("-inf")

    def prefill(self, new_tokens: int, cached_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        return self.fit.predict(prefill_features(new_tokens, cached_tokens, self.budget))

    def fetch(self, local_pages: int, remote_pages: int) -> float:
        return (local_pages + remote_pages) * max(0.0, self.fit.theta[3])


class _MeasuredFetch:
    """MeasuredCost's fetch term, per instance (`of`)."""

    def __init__(self, measured: "MeasuredCost"):
        self._measured = measured

    def of(self, inst) -> Callable[[int, int], float]:
        return self._measured.instance(inst).fetch


class MeasuredCost:
    """kv_centric's prefill cost (`of(inst)`) and fetch (`fetch.of(inst)`) in seconds, from each instance's own
    timed steps (module docstring). prior: theta0 of every instance, or `(inst) -> theta0`; prior_steps: its
    weight in steps. An instance's token budget and page size are read from its scheduler's config."""

    def __init__(self, prior: Union[Sequence[float], Callable[..., Sequence[float]]], prior_steps: float = 8.0):
        self._prior, self.prior_steps = prior, prior_steps
        self._instances: Dict[str, _InstanceCost] = {}
        self.fetch = _MeasuredFetch(self)

    def instance(self, inst) -> _InstanceCost:
        """inst's cost (made on first sight, starting from the prior)."""
        cost = self._instances.get(inst.name)
        if cost is None:
            cfg = inst.scheduler.config
            prior = self._prior(inst) if callable(self._prior) else self._prior
            fit = StepFit(prior, typical_step(cfg.token_budget, cfg.page_size), self.prior_steps)
            cost = self._instances[inst.name] = _InstanceCost(fit, cfg.token_budget)
        return cost

    def of(self, inst) -> Callable[[int, int], float]:
        return self.instance(inst).prefill

    def observe_step(self, inst, out, start: float, end: float, num_compiles: int = 0) -> None:
        """A step of `inst` (its SchedulerOutput `out`) scheduled at `start` and collected at `end` (seconds)."""
        cost = self.instance(inst)
        seconds = end - max(start, cost.last_end)
        cost.last_end = end
        if num_compiles or out.is_empty or seconds < 0:
            return
        cost.fit.observe(step_features(out), seconds)

    def describe(self) -> dict:
        """Per instance: steps fitted and seconds per unit of each FEATURE (recorded with a run's results)."""
        return {"model": "seconds = " + " + ".join(f"theta_{f} * {f}" for f in FEATURES),
                "prior_steps": self.prior_steps,
                "instances": {name: {"num_steps": c.fit.num_steps, "prior": dict(zip(FEATURES, c.fit.prior)),
                                     "theta": dict(zip(FEATURES, c.fit.theta)),
                                     **dict(zip(("mean_step_s", "rms_error_s"), c.fit.residuals()))}
                              for name, c in self._instances.items()}}
