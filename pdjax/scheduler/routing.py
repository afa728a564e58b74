"""Routing requests across the instances of one role (the engines and the simulator share it).

An instance is anything with `.scheduler` (a pdjax Scheduler) and, unless the router is given its role, `.role`
('colocated', 'prefill' or 'decode'; pdjax.scheduler.instances). Policies (`deployment.router`):
- 'round_robin': instances in turn.
- 'least_loaded': the instance with the least load, ties to the lowest index (deterministic). Load per role:
    prefill    prompt tokens still to prefill (waiting and running requests);
    decode     live requests (running plus waiting, incl. handed-off ones whose KV is on its way);
    colocated  tokens still to compute: for every request it holds (running, waiting, swapped, and routed but
               not yet admitted: an `inbox` when the instance has one, as the simulator's do), the prompt tokens
               still to prefill plus the decode steps still to run, i.e. prompt + max_tokens - 1 minus the tokens
               already computed (a recompute preemption adds its lost tokens back). This is the work queued on the
               replica, which sets when a new request's prefill completes.
  Loads are recomputed at each pick (O(requests held) per pick).
- 'prefix_affinity' (the SGLang router's cache-aware rule): when the loads (live requests: running, waiting and
  routed) are imbalanced, max - min > `balance_abs` and max > min x `balance_rel`, the least loaded instance;
  else the instance holding the longest prefix of the request (device prefix cache, then its host KV tier,
  pdjax.scheduler.kv_tier) when that prefix covers more than `cache_threshold` of the prompt, else the instance
  with the most free KV pages (SGLang: the smallest radix tree). Ties to the lowest index. The rule and its
  defaults (32, 1.0001, 0.5) are the sgl-router's (`--balance-abs-threshold`, `--balance-rel-threshold`,
  `--cache-threshold`, as its README states them; its load is the worker's pending requests, here the live ones);
  SGLang matches a prefix in an approximate tree of the text it routed, pdjax in the instance's own cache.
- 'kv_centric' (Mooncake's Conductor): for each instance, predicted TTFT = queue time + prefill time of the
  tokens it does not hold + time to load the held pages from host memory (its own tier, or the shared pool's
  pages another instance offloaded: a remote fetch); the minimum wins. Times come from `cost(new_tokens,
  cached_tokens) -> seconds` (the simulator passes its own step cost, the engine the same or a measured
  estimate; default: one second per token, a ranking by tokens) and `fetch(local_pages, remote_pages) ->
  seconds` (default 0); the queue time is cost(tokens still to prefill on the instance, 0). A cost or fetch with
  an `of(inst)` method is per instance: `of(inst)` is that instance's (the engine's measured default,
  pdjax.scheduler.step_fit.MeasuredCost, fitted from each instance's own timed steps). A decode instance
  (role 'decode') is picked by load and free KV instead: the least (live requests / max_num_seqs + pages in
  use / pages), among those with room for the request's pages if any has.
  Both read the request (`pick(request)`); without one they pick as 'least_loaded'.
Each router is a row of the router table (pdjax.config.registry.ROUTERS, which `deployment.router` is checked
against) with its pick function, `(InstanceRouter) -> instance`: `register_router(name, pick)` adds one. A row may
say when its pick reads nothing that an instance's pending steps change (`stale_ok`, RouterInfo): round_robin never
reads an instance; least_loaded reads a colocated one's tokens to compute (less what the pending steps computed);
prefix_affinity and kv_centric (prefill side) read its live requests, its queued prompt tokens and free pages
(offset by what the pending steps compute and allocate: `unapplied`) and the request's hit there, which prefix
caching may change (`cache_aware_stale_ok`). The simulator then leaves a replica's decode run unapplied while it
routes (pdjax.sim.simulator.LazyRun); without it, every replica is brought up to date first.
A router is callable as `router(request, instances)` too, the simulator's routing protocol (the request does not
change the pick).
A router serves one of the roles 'colocated', 'prefill', 'decode'. Mixed-pool instances (role 'mixed', Splitwise)
are routed to by pdjax.scheduler.mixed.MixedPool, which wraps the prefill and decode routers and uses the loads
above (prefill_load for the prefill pool's overload test).
"""
from __future__ import annotations

import itertools
from typing import Optional, Sequence, Tuple

from pdjax.config.deployment import ROLES
from pdjax.config.registry import ROUTERS, RouterInfo
from pdjax.scheduler.block_manager import holds_no_prefix, request_page_keys

__all__ = ["ROUTERS", "InstanceRouter", "register_router"]


_NOTHING_UNAPPLIED = (0, None, 0)


def _remaining_tokens(req) -> int:
    return len(req.prompt_token_ids) + req.max_tokens - 1 - req.num_computed_tokens


class InstanceRouter:
    """Picks an instance of one role for a new request (colocated, prefill) or a handed-off one (decode)."""

    def __init__(self, policy: str, instances: Sequence, role: Optional[str] = None, *, cost=None, fetch=None,
                 balance_abs: int = 32, balance_rel: float = 1.0001, cache_threshold: float = 0.5):
        if policy not in ROUTERS:
            raise ValueError(f"router={policy!r}, expected one of {ROUTERS}")
        if not instances:
            raise ValueError("a router needs at least one instance")
        roles = {role} if role is not None else {getattr(inst, "role", None) for inst in instances}
        routed = tuple(r for r in ROLES if r != "mixed")
        if len(roles) != 1 or not roles <= set(routed):
            raise ValueError(f"router over instances of roles {sorted(map(str, roles))}: expected one role of "
                             f"{routed} (pass role= for instances without a .role; mixed-pool instances are "
                             "routed by pdjax.scheduler.mixed.MixedPool)")
        self.policy = policy
        self._pick = ROUTERS[policy].pick
        self._stale_ok = ROUTERS[policy].stale_ok
        self.reads_instances = self._stale_ok is not reads_nothing
        self.role = roles.pop()
        self.instances = list(instances)
        self._cycle = itertools.cycle(self.instances)
        self._load = {"prefill": self.prefill_load, "decode": self.decode_load,
                      "colocated": self.colocated_load}[self.role]
        self.request = None           # the request being routed (cache-aware routers read it)
        # id(instance) -> (prompt tokens, () -> pages, tokens) that steps of it computed (prompt tokens; all tokens)
        # and allocated but its scheduler has not applied yet (the simulator's lazily applied replicas, where stale_ok
        # let it route past them): the offsets of queued_prefill_tokens, free_pages and a colocated load
        self.unapplied: dict = {}
        self.cost = cost if cost is not None else _tokens_cost
        self.fetch = fetch if fetch is not None else _no_fetch
        self.balance_abs, self.balance_rel, self.cache_threshold = balance_abs, balance_rel, cache_threshold

    @staticmethod
    def prefill_load(inst) -> int:
        s = inst.scheduler
        return sum(len(r.all_token_ids) - r.num_computed_tokens for r in itertools.chain(s.running, s.waiting))

    @staticmethod
    def decode_load(inst) -> int:
        s = inst.scheduler
        return s.num_running + s.num_waiting

    @staticmethod
    def colocated_load(inst) -> int:
        s = inst.scheduler
        held = itertools.chain(s.running, s.waiting, getattr(s, "swapped", ()), getattr(inst, "inbox", ()))
        return sum(_remaining_tokens(r) for r in held)

    def load(self, inst) -> int:
        """inst's load for this router's role (less, colocated, the tokens its unapplied steps computed)."""
        load = self._load(inst)
        if self.unapplied and self.role == "colocated":
            load -= self.unapplied.get(id(inst), _NOTHING_UNAPPLIED)[2]
        return load

    def pick(self, request=None):
        self.request = request
        return self._pick(self)

    def __call__(self, request=None, instances=None):
        return self.pick(request)

    def stale_ok(self, inst, request, prefill_tokens: int) -> bool:
        """Whether pick(request) reads nothing of `inst` that its unapplied steps change but the `prefill_tokens`
        prompt tokens they compute and the pages they allocate (RouterInfo.stale_ok), which the caller then puts in
        `unapplied`."""
        return self._stale_ok is not None and self._stale_ok(self, inst, request, prefill_tokens)

    def free_pages(self, inst) -> int:
        """inst's free KV pages, less those its unapplied steps allocated (`unapplied`)."""
        free = inst.scheduler.block_manager.num_free_pages
        if self.unapplied:
            entry = self.unapplied.get(id(inst))
            if entry is not None:
                free -= entry[1]()
        return free


def _round_robin(router: InstanceRouter):
    return next(router._cycle)


def _least_loaded(router: InstanceRouter):
    if len(router.instances) == 1:
        return next(router._cycle)
    return min(router.instances, key=router.load)   # min keeps the first of equals: deterministic


def _tokens_cost(new_tokens: int, cached_tokens: int) -> float:
    return float(new_tokens)


def _no_fetch(local_pages: int, remote_pages: int) -> float:
    return 0.0


def live_requests(inst) -> int:
    """Requests an instance holds: running, waiting (incl. swapped and KV-pending) and routed not yet admitted."""
    s = inst.scheduler
    return s.num_running + s.num_waiting + len(getattr(inst, "inbox", ()))


def cached_prefix(inst, req) -> Tuple[int, int, int]:
    """(device pages, local host pages, remote host pages) of the longest prefix of req's prompt that `inst`
    holds: its prefix cache, then its host KV tier (remote: pages of a shared pool another instance offloaded).
    At most (prompt - 1) // page_size pages, as admission takes (one token is always computed)."""
    bm = inst.scheduler.block_manager
    if not bm.enable_prefix_caching or holds_no_prefix(req):
        return 0, 0, 0
    ps = bm.page_size
    max_hit = (len(req.all_token_ids) - 1) // ps
    keys = request_page_keys(req, ps, max_hit)
    device = len(bm.match_prefix(keys, max_hit))
    if bm.host_tier is None:
        return device, 0, 0
    owners = bm.host_tier.owners(keys, device, max_hit, bm.tier_owner)
    local = sum(1 for o in owners if o == bm.tier_owner)
    return device, local, len(owners) - local


def _prefix_affinity(router: InstanceRouter):
    req, instances = router.request, router.instances
    if req is None or len(instances) == 1:
        return _least_loaded(router)
    loads = [live_requests(i) for i in instances]
    low, high = min(loads), max(loads)
    if high - low > router.balance_abs and high > low * router.balance_rel:
        return instances[loads.index(low)]
    best, best_pages = None, 0
    for inst in instances:
        pages = sum(cached_prefix(inst, req))
        if pages > best_pages:
            best, best_pages = inst, pages
    ps = instances[0].scheduler.block_manager.page_size
    if best is not None and best_pages * ps > router.cache_threshold * len(req.all_token_ids):
        return best
    return max(instances, key=router.free_pages)   # max keeps the first


def queued_prefill_tokens(inst) -> int:
    """Prompt tokens still to prefill on an instance: its running and waiting requests' and its inbox's."""
    s = inst.scheduler
    held = itertools.chain(s.running, s.waiting, getattr(inst, "inbox", ()))
    return sum([r.prefill_end - r.num_computed_tokens for r in held if r.num_computed_tokens < r.prefill_end])


def predicted_ttft(router: InstanceRouter, inst, req) -> float:
    """kv_centric's TTFT of `req` on `inst`: queue time + prefill of the tokens it does not hold + host loads."""
    device, local, remote = cached_prefix(inst, req)
    cached = (device + local + remote) * inst.scheduler.block_manager.page_size
    queued = queued_prefill_tokens(inst)
    if router.unapplied:
        queued -= router.unapplied.get(id(inst), _NOTHING_UNAPPLIED)[0]
    cost, fetch = _own(router.cost, inst), _own(router.fetch, inst)
    queue_s = cost(queued, 0) if queued else 0.0
    return queue_s + cost(len(req.all_token_ids) - cached, cached) + fetch(local, remote)


def _own(fn, inst):
    """fn, or inst's own when fn is per instance (it has `of(inst) -> callable`: pdjax.scheduler.step_fit)."""
    of = getattr(fn, "of", None)
    return fn if of is None else of(inst)


def _kv_centric(router: InstanceRouter):
    req, instances = router.request, router.instances
    if req is None or len(instances) == 1:
        return _least_loaded(router)
    if router.role == "decode":
        need = -(-(len(req.all_token_ids) + 1) // instances[0].scheduler.block_manager.page_size)
        fits = [i for i in instances if i.scheduler.block_manager.num_free_pages >= need] or instances

        def score(inst):
            s = inst.scheduler
            bm = s.block_manager
            return (s.num_running + s.num_waiting) / s.config.max_num_seqs + 1 - bm.num_free_pages / bm.num_pages
        return min(fits, key=score)
    return min(instances, key=lambda inst: predicted_ttft(router, inst, req))


def no_hit_change(inst, req, prefill_tokens: int) -> bool:
    """Whether `req`'s hit on `inst` (cached_prefix) is the same before and after steps of `inst` that compute
    `prefill_tokens` prompt tokens and decode. Without prefix caching, yes. With it, only when the hit is 0 before and
    after them: req's first page is in neither the prefix cache nor the host tier (the steps' evictions could drop
    it) and no request the steps run can register it: each running request (and, with prompt tokens computed, each
    waiting one: the steps may admit it) has registered a first page already, or its first page is full and holds
    other tokens (a later page's key chains on its parent's hash, a first page's on 0, and a key's hash is 0 only
    by a 2**-64 chance). A request with numbered keys (block_manager.numbered_key_bases) that was never scheduled:
    yes, its hit is 0 anywhere until it runs."""
    bm = inst.scheduler.block_manager
    if not bm.enable_prefix_caching or holds_no_prefix(req):
        return True
    ps = bm.page_size
    if len(req.all_token_ids) <= ps:
        return True
    if bm.holds_first_page(req):
        return False
    s = inst.scheduler
    first = request_page_keys(req, ps, 1)[0]
    for r in itertools.chain(s.running, s.waiting) if prefill_tokens else s.running:
        if not r.num_registered_pages and (len(r.all_token_ids) < ps or request_page_keys(r, ps, 1)[0] == first):
            return False
    return True


def cache_aware_stale_ok(router: InstanceRouter, inst, req, prefill_tokens: int) -> bool:
    """RouterInfo.stale_ok of prefix_affinity and kv_centric on the prefill side (colocated, prefill): what they
    read of an instance is its live requests (steps that finish none leave them), its queued prefill tokens and
    free pages (less what the steps compute and allocate: `unapplied`), and req's hit there (no_hit_change). The
    decode side reads free pages against the request's need, and its load, which the steps change."""
    if router.role == "decode" or req is None or len(router.instances) == 1:
        return False
    return no_hit_change(inst, req, prefill_tokens)


def reads_nothing(router: InstanceRouter, inst, req, prefill_tokens: int) -> bool:
    """RouterInfo.stale_ok of a router that reads no instance (round_robin)."""
    return True


def register_router(name: str, pick, *, stale_ok=None, replace: bool = False) -> None:
    """Add router `name` (a valid deployment.router from now on): `pick(router) -> instance`, given the
    InstanceRouter (its `instances`, `role` and `load(inst)`), and optionally its `stale_ok` (RouterInfo). A
    built-in row takes its functions alone."""
    if name in ROUTERS and ROUTERS[name].pick is None:
        ROUTERS[name].pick, ROUTERS[name].stale_ok = pick, stale_ok
    else:
        ROUTERS.add(name, RouterInfo(name, pick, stale_ok), replace=replace)


register_router("round_robin", _round_robin, stale_ok=reads_nothing)
register_router("least_loaded", _least_loaded,     # a colocated load less the unapplied steps' tokens
                stale_ok=lambda router, inst, req, prefill_tokens: router.role == "colocated")
register_router("prefix_affinity", _prefix_affinity, stale_ok=cache_aware_stale_ok)
register_router("kv_centric", _kv_centric, stale_ok=cache_aware_stale_ok)
ROUTERS.check_complete("pick", {"round_robin": _round_robin, "least_loaded": _least_loaded,
                                "prefix_affinity": _prefix_affinity, "kv_centric": _kv_centric},
                       "pdjax.scheduler.routing's pick functions")


class RoundRobinRouter:
    """Test-only: instances in turn (as InstanceRouter's 'round_robin', over whatever instances it is called
    with), counting the requests routed to each (`num_routed`, by instance name)."""

    def __init__(self):
        self._count = 0
        self.num_routed = {}

    def __call__(self, request, instances: Sequence):
        inst = instances[self._count % len(instances)]
        self._count += 1
        self.num_routed[inst.name] = self.num_routed.get(inst.name, 0) + 1
        return inst


class LeastOutstandingTokensRouter(RoundRobinRouter):
    """Test-only: the instance with the fewest outstanding tokens (ties to the lowest index), where an
    instance's outstanding tokens are the tokens its routed requests will feed (prompt + max_tokens - 1 each)
    minus the tokens its steps ran. The simulator tells it every completed step (`observe_step`); the
    bookkeeping lives here, not in the simulator's loop."""

    def __init__(self):
        super().__init__()
        self.outstanding = {}

    def __call__(self, request, instances: Sequence):
        outstanding = self.outstanding
        best = instances[0]
        for inst in instances[1:]:
            if outstanding.get(inst.name, 0) < outstanding.get(best.name, 0):
                best = inst
        outstanding[best.name] = outstanding.get(best.name, 0) + request.num_prompt_tokens + request.max_tokens - 1
        self.num_routed[best.name] = self.num_routed.get(best.name, 0) + 1
        return best

    def observe_step(self, inst, out) -> None:
        self.outstanding[inst.name] = self.outstanding.get(inst.name, 0) - out.num_prefill_tokens \
            - out.num_decode_tokens
