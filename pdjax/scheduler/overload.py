"""The cluster pool of a disaggregated deployment with overload handling on (pdjax.config.overload): early rejection
(pdjax.scheduler.admission) and online rebalancing (pdjax.scheduler.rebalance), built the same way by the real
engine (pdjax.serving.build -> ClusterEngine(pool_factory=...)) and the simulator (pdjax.sim.build ->
simulate_disaggregated(pool_factory=...)). No JAX.

`AdmittingPool` wraps a cluster pool (MixedPool without mixed instances, or a RebalancingPool): `pick_prefill`
returns None for an arrival the admission policy rejects (the request is finished as 'rejected' here) and
`pick_decode` None for a handoff it rejects after the prefill (the caller releases the prefill side's pages);
everything else is the wrapped pool's. The engines' only change is that None.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from pdjax.config.overload import overload_features
from pdjax.scheduler.admission import Admission, admission_from_deployment, reject_request
from pdjax.scheduler.instances import make_role_scheduler
from pdjax.scheduler.mixed import make_borrowing_scheduler, make_pool
from pdjax.scheduler.rebalance import rebalancing_pool

__all__ = ["AdmittingPool", "has_overload", "overload_pool_factory", "overload_scheduler_maker", "pool_sides"]


def has_overload(dep) -> bool:
    return bool(overload_features(dep))


def pool_sides(pool):
    """(prefill instances, decode instances) serving now: a RebalancingPool's members, else the pool's groups."""
    members = getattr(pool, "members", None)
    if members is not None:
        return members("prefill"), members("decode")
    return pool.prefill, pool.decode


class AdmittingPool:
    """A cluster pool with an admission policy in front (module docstring)."""

    def __init__(self, pool, admission: Admission):
        self.pool, self.admission = pool, admission

    def __getattr__(self, name):
        if name == "pool":       # not set yet (e.g. while copying): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.pool, name)

    def bind(self, iterations: Sequence) -> None:
        """The run's iteration records (the admission's step rates learn from them)."""
        self.admission.bind(iterations)

    def pick_prefill(self, req, now: float):
        prefill, decode = pool_sides(self.pool)
        reason = self.admission.admit_arrival(req, now, prefill, decode)
        if reason is not None:
            reject_request(req, reason)
            return None
        return self.pool.pick_prefill(req, now)

    def pick_decode(self, req, now: float, src=None):
        dst = self.pool.pick_decode(req, now, src)
        if dst is src:
            return dst
        reason = self.admission.admit_handoff(req, now, dst)
        if reason is not None:
            reject_request(req, reason, now)
            return None
        return dst

    def summary(self, *args, **kwargs) -> dict:
        out = self.pool.summary(*args, **kwargs) if self.pool.active else {}
        return {**out, "admission": self.admission.summary()}

    @property
    def active(self) -> bool:
        return self.pool.active


def overload_scheduler_maker(dep) -> Callable:
    """make(role, scheduler config) for the prefill and decode instances: BorrowingSchedulers when rebalancing
    (a flip moves them between the two pools), else the roles' own."""
    return make_borrowing_scheduler if dep.rebalance else make_role_scheduler


def overload_pool_factory(dep, slo=None) -> Optional[Callable]:
    """None without overload features; else factory(prefill, decode) -> the cluster pool (module docstring).
    slo: the serve config's SLOConfig (read by rebalance_trigger='slo')."""
    if not has_overload(dep):
        return None

    def factory(prefill: Sequence, decode: Sequence):
        pool = (rebalancing_pool(dep, prefill, decode, slo) if dep.rebalance
                else make_pool("dedicated", dep.router, prefill, decode))
        admission = admission_from_deployment(dep)
        return AdmittingPool(pool, admission) if admission.active else pool
    return factory
