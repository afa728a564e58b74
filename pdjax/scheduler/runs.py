"""Decode runs: a scheduler's next steps applied in bulk when they are certain (the simulator's fast path).

A *decode run* is a sequence of steps, each `schedule(now)` then `update(out, PLACEHOLDER_TOKEN ids, end)` back to
back with no request added, aborted or otherwise touched in between, in which every running request in the decode
phase ("decoder") decodes one token and every running request in the prefill phase gets the chunk the policy's
prefill pass gives it, with no preemption, nothing resumed and nothing admitted. `Scheduler.decode_run(max_steps)`
returns a DecodeRun when the scheduler's state makes that certain; the caller plans its steps one by one
(`next_step`: the chunks of the next step, or None when the run cannot take it), costs each one, and applies the
first k (`apply`) with exactly the effects the k schedule() and update() calls would have had: the same pages in
the same order, the same queues and counters, every request's tokens and timestamps. No SchedulerOutput is built.
The engine never uses this; the simulator (pdjax.sim.simulator) does, where the sampled ids are placeholders.

When a run is possible (Scheduler.decode_run): the policy is one of Scheduler.DECODE_RUN_CLASSES (exact classes:
their schedule() in such a state is the decode pass over the running list, then, for a class with `_run_prefills`
(sarathi), its prefill pass); nothing swapped, handed off or in flight; no request's stop tokens include the
placeholder; the decodes fit the policy's decode budget. With prefix caching, also no host -> device copy pending
(the next step would carry it, priced) and no landed handed-off request holding a reused prefix (decode_only's
`reuse_prefix`: its admission needs fewer pages than the run reads). Waiting requests are allowed where they
certainly stay waiting (so no admission looks the prefix cache or host tier up within a run): running is full
(`_admission_blocked`; decode_first: a sealed batch), or, with a prefill pass, in steps whose chunks leave no budget
(a later step that leaves some is not taken). The first step of a run with a prefill pass (sarathi) also makes the
admission pass with the budget its decodes and chunks leave (Scheduler._plan_admissions, as _admit_waiting: in queue
order, each with its first chunk and its pages, until one does not fit: a sequence slot, the budget, the pages above
the watermark) when no request it reaches can hit a cached prefix (without prefix caching, any; with it, numbered
keys never scheduled, `holds_no_prefix`, or one whose first page neither the cache nor the host tier holds), else the
run takes no step; the admitted are prefills from then on
(`_admit_fresh` applies the admissions, as pair runs do theirs). A run ends (its last step included) at the first
step in which a request finishes or a prefill completes its prompt (it then samples and becomes a decoder: the next
run takes it as one), and before a step whose page growth the free pages at the start of the run cannot cover (that
step would preempt).
Handed-off requests whose KV landed (decode_only's `_kv_ready`) do not stop a run: its first step admits those
decode_only's schedule() would (after the decode pass: a sequence slot, the budget, pages for the context plus the
watermark, in landing order; they decode from that step on, `admitted`), and the rest stay waiting for the whole run
(slots, budget and free pages only shrink until its last step). A run that follows the last one with nothing
touching the scheduler in between (same step counters, the running list starting with that run's decoders) reads
those decoders from that run (`continued_run`) instead of from every request, and only the requests after them
(that run's prefills, some of them decoders now) afresh (`joined_parts`). Such a chain of runs keeps the end times
of the steps it applied once, on its clock: its decoders' token lists catch up with the clock when read
(Request.settle_run; a finished decoder leaves the chain caught up), so a run touches only their computed tokens
and step numbers.

Pair runs (`PairRun`, `pair_run`, pdjax.scheduler.pair_runs, re-exported here): an instance with two batches in
flight whose running requests form two groups taking turns (each is scheduled again when its batch is collected,
the other group's batch being in flight).

Per step, with D decoders whose contexts sum to `total` (it grows by D per step): the decode pass allocates a page
to each decoder whose computed tokens reach its table's end (decoders in running order), then the prefill pass
gives each prefill (running order) `Scheduler._chunk_size` of what the decodes left of the budget and allocates
the pages its chunk needs. `apply` replays those allocations in that order.

Prefix caching (`DecodeRun._grow_pages_caching`, `_registrations`, `_register_pages`): an allocation that finds
no uncached free page evicts the least recently freed cached one (its key dropped; with a host KV tier, offloaded
to it), and each step's update() registers the full pages its batch completed (a decoder its page b in the step
that makes its computed tokens (b + 1) * page_size, one step before it grows into page b + 1; a chunk the pages
it completes; keys from `all_token_ids`, placeholders included; a key another page holds is skipped). The two
interact only through a key: a registration at step j is skipped while a cached page holds its key, i.e. unless
that page was evicted at a step <= j. `apply` makes all the allocations in order, noting the step of each
eviction, then the registrations in update order against those steps, then frees the finished requests' pages
(cached ones to the LRU end), so the block manager and host tier end exactly as step by step. The host-tier
copies of the evictions (`pending_swap_out`) would have gone into the steps' SchedulerOutputs, which the run
builds none of: they are dropped (offloads cost no step time in the simulator, pdjax.sim.kv_tier). A run
applied at once evicts into a host tier ahead of the other instances' steps within its span: with a tier shared
by several instances no run may cross another instance's event (pdjax.sim.disagg._enable_crossing_runs); a
cache-aware router reads an instance's prefix cache and free pages at each arrival, so a run that crosses an
arrival is applied up to it first where the router's reading would differ (a colocated replica's run is caught up:
`apply_range` of the steps ended, `schedule_step` of the one running across it; pdjax.sim.simulator's LazyRun).
"""
from __future__ import annotations

from bisect import bisect_left
from typing import List, Optional, Sequence, Tuple

from pdjax.scheduler.block_manager import request_page_keys
from pdjax.scheduler.request import PLACEHOLDER_TOKEN as PLACEHOLDER, RequestStatus

RUNNING = RequestStatus.RUNNING


class DecodeRun:
    """The planned steps of one decode run of `sched` (module docstring). count: decoders per step; total: their
    context sum (num_computed_tokens) in the first step. `next_step()` plans one more step; `apply(starts, ends)`
    applies the first len(starts) planned ones."""

    __slots__ = ("sched", "decoders", "prefills", "count", "total", "limit", "steps", "_free", "_first", "_active",
                 "_p_state", "_plan", "_done", "_left", "_admits", "_crossings", "_lefts", "admitted", "_kv_waits",
                 "_base_step", "_growth", "_groups", "_fresh", "_clock", "_joined")

    def __init__(self, sched, decoders: list, prefills: list, crossings: List[int], lefts: List[int], total: int,
                 limit: int, free: int, budget_left: int, admits: bool = False,
                 admitted: Sequence[Tuple[object, int]] = (), kv_waits: bool = False, clock: Optional[list] = None,
                 joined: int = 0):
        self.sched = sched
        self.decoders = decoders          # running order
        self.prefills = prefills          # running order
        self.count = len(decoders)
        self.total = total                # the decoders' num_computed_tokens, summed
        self.limit = limit                # steps at most (the first decoder to finish, the caller's max_steps)
        self.steps = 0                    # steps planned so far
        self._free = free                 # free pages not yet claimed by planned steps
        self._crossings = crossings       # decoder i grows a page at steps crossings[i], + page_size, ...
        self._lefts = lefts               # per decoder: the step (1-based) in which it finishes
        self._first = None                # next_step: how many decoders start growing at step j
        self._active = None               # next_step: [j % page_size] how many grow at step j once started
        self._p_state = None              # next_step: per prefill [computed, tokens, pages held]
        self._plan: List[Tuple[Tuple[int, int, int], ...]] = []    # per step: (prefill index, tokens, pages)
        self._done = False                # the last planned step completes a prefill: the run ends there
        self._left = budget_left          # tokens each step leaves the prefill pass
        self._admits = admits             # requests wait and would be admitted from any budget a step leaves
        # (request, pages) of handed-off requests whose KV landed, admitted in the first step after its decode pass
        # (decode_only; the last len(admitted) decoders); kv_waits: such requests wait (admitted or not)
        self.admitted = admitted
        self._kv_waits = kv_waits
        self._base_step = sched.step      # planned step j (0-based) is the scheduler's step _base_step + 1 + j
        self._growth = None               # _growth_range: (planned steps, [step], [grant]) of every planned step
        self._groups = None               # _growth_groups: per step residue, the tables growing (False: none)
        self._fresh: Sequence[Tuple[object, int, int]] = ()   # (request, tokens, pages): admitted in step 0
        # The chain of runs this one continues: its clock (every step end time it applied), shared by its decoders'
        # Request.run_lag; the first `joined` decoders are on it already (a fresh run: a new clock, nobody on it)
        self._clock = [] if clock is None else clock
        self._joined = joined

    def plan_decode_steps(self) -> int:
        """For a run without prefills: plan every step it can take at once (no chunks to plan) and return how
        many (next_step would give [] that many times, then None)."""
        if self.prefills:
            raise ValueError("DecodeRun.plan_decode_steps: the run has prefills; plan it with next_step")
        if self.steps:
            raise ValueError("DecodeRun.plan_decode_steps: steps were planned already")
        if self._admits and self._left > 0:
            return 0
        limit = self.limit
        ps = self.sched._ps
        crossings = self._crossings
        if _pages_grown(crossings, limit, ps) > self._free:
            lo, hi = 0, limit      # the most steps whose page growth the free pages cover
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if _pages_grown(crossings, mid, ps) <= self._free:
                    lo = mid
                else:
                    hi = mid - 1
            limit = lo
        self.steps = limit       # (no chunks: apply reads no plan)
        self._done = True
        return limit

    @property
    def admits_first(self) -> bool:
        """Nothing planned yet, and requests wait that the first step admits from the budget its decodes and
        chunks leave (sarathi's admission pass, Scheduler._plan_admissions): the run is planned by next_step."""
        return self._admits and self._left > 0 and not self.steps

    def next_step(self) -> Optional[list]:
        """Plan the next step: its prefill chunks [(tokens, context before them)] in batch order ([]: decodes
        only), or None when the run cannot take another step (nothing is planned then)."""
        if self._done or self.steps >= self.limit:
            return None
        j = self.steps
        sched = self.sched
        ps = sched._ps
        if self._first is None:
            self._start_planning()
        active = self._active
        started = self._first.get(j)
        if started:
            active[j % ps] += started
        pages = active[j % ps]
        chunks = []
        plan = []
        done = False
        left = self._left
        if self.prefills:
            states = self._p_state
            for k in range(len(states)):
                if left <= 0:
                    break
                c, tokens, held = states[k]
                n = sched._chunk_size(c, tokens, left)
                if n <= 0:
                    continue
                need = -(-(c + n) // ps) - held
                if need < 0:
                    need = 0
                pages += need
                plan.append((k, n, need))
                chunks.append((n, c))
                left -= n
                if c + n == tokens:
                    done = True
        fresh = None
        if self._admits and left > 0:      # the admission pass takes waiting requests: planned in the first step only
            fresh = None if j else sched._plan_admissions(sched.waiting, len(sched.running),
                                                          sched.block_manager.num_free_pages - pages, left)
            if fresh is None:
                return self._refuse(j, started)
            pages += sum([need for _, _, need in fresh])
            chunks += [(n, 0) for _, n, _ in fresh]
        if (not chunks and not self.count) or pages > self._free:    # nothing scheduled / it would preempt
            return self._refuse(j, started)
        if fresh is not None and self._take_admissions(fresh, plan):
            done = True
        self._free -= pages
        for k, n, need in plan:
            state = self._p_state[k]
            state[0] += n
            state[2] += need
        self._plan.append(tuple(plan))
        self._done = done
        self.steps = j + 1
        return chunks

    def _start_planning(self) -> None:
        """next_step's state, made at its first call: per step how many decoders start growing, per page-size
        residue how many grow, per prefill [computed, tokens, pages held]."""
        first: dict = {}
        for c in self._crossings:
            first[c] = first.get(c, 0) + 1
        self._first = first
        self._active = [0] * self.sched._ps
        self._p_state = [[r.num_computed_tokens, len(r.all_token_ids), len(r.page_table)] for r in self.prefills]

    def _take_admissions(self, fresh: List[Tuple[object, int, int]], plan: list) -> bool:
        """The first step admits `fresh` (Scheduler._plan_admissions): prefills of the run from then on, their
        chunks appended to the step's `plan`; returns whether one completes its prompt in it (the run's last step)."""
        base = len(self.prefills)
        self.prefills = self.prefills + [req for req, _, _ in fresh]
        for i, (req, n, need) in enumerate(fresh):
            plan.append((base + i, n, need))
            self._p_state.append([0, len(req.all_token_ids), 0])
        self._fresh = fresh
        self._admits = len(fresh) < len(self.sched.waiting)     # the rest wait: later steps must leave no budget
        return any(n == len(req.all_token_ids) for req, n, _ in fresh)

    def _refuse(self, j: int, started: Optional[int]) -> None:
        """next_step's None: step j's decoders that start growing in it are not counted."""
        if started:
            self._active[j % self.sched._ps] -= started
        return None

    @property
    def decoders_only(self) -> bool:
        """No prefill in the run, and nobody waiting could be admitted in any of its steps (nobody waits, or
        admission is blocked: running is full): a schedule() between its steps, with every running request in
        flight, returns nothing."""
        return not self.prefills and not self._admits and not self._kv_waits

    def apply(self, starts: Sequence[float], ends: Sequence[float], schedules: int = 1) -> list:
        """Apply the first len(starts) planned steps, step j scheduled at starts[j] and updated at ends[j];
        returns the requests that finished (in the last step, in batch order), as update() does. schedules: the
        schedule() calls per step: 2 where the loop keeps batches in flight (after dispatching a step it schedules
        again, and gets nothing: every running request is in flight), a run of decoders only (`decoders_only`)."""
        return self.apply_range(0, starts, ends, schedules)

    def apply_range(self, a: int, starts: Sequence[float], ends: Sequence[float], schedules: int = 1,
                    scheduled: bool = False) -> list:
        """apply() of planned steps a .. a + len(starts) - 1 (0-based), the steps before a applied already
        (apply_range), and step a's schedule() side too when `scheduled` (schedule_step: its pages; its schedule
        times are set here). schedules != 1: from the run's first step only."""
        k = len(starts)
        b = a + k
        if b > self.steps:
            raise ValueError(f"DecodeRun.apply: steps {a} to {b - 1} given, {self.steps} planned")
        if schedules != 1 and (a or not self.decoders_only):
            raise ValueError("DecodeRun.apply: schedules > 1 needs a run of decoders only, applied from its start")
        if not k:
            return []
        decoders, prefills = self.decoders, self.prefills
        if self.admitted and not a:
            self._admit_kv(starts[0])
        if self._fresh:
            self._admit_fresh(starts[0])
        evicted = self._grow_pages(a + 1 if scheduled else a, b)
        step = self._base_step + 1 + schedules * (b - 1)     # the last step's number
        finished = []
        keyed = self._append_tokens(k, ends, step)
        if self.sched._caching:   # the pages the updates register, before any is freed
            self._register_pages(self._registrations(a, b, keyed), evicted)
        if b == self.limit:     # some decoder finishes in this step (the limit is the first finish)
            finished = [req for req, left in zip(decoders, self._lefts) if left == b]
        if prefills:
            self._advance_prefills(a, b, ends, finished)
        self._end_apply(b, step, schedules, finished, ends[-1])
        return finished

    def _append_tokens(self, k: int, ends: Sequence[float], step: int) -> Optional[List[int]]:
        """Every decoder's tokens of k steps ending at `ends`, the last one numbered `step`: their end times go on
        the chain's clock once, which the decoders' token lists read when next read (Request.settle_run); and, where
        finished requests' pages are dead (Scheduler._dead), a keyless decoder's registered pages (Scheduler._keyless:
        all it registers is their count). Returns the indices of the decoders that register pages with keys
        (_registrations), None for every decoder (no dead pages). One pass per decoder: the run's hottest loop."""
        clock, decoders = self._clock, self.decoders
        if self._joined < len(decoders):       # decoders new to the chain hold its clock so far
            held = len(clock)
            for req in decoders[self._joined:]:
                if req.run_lag is not None:
                    req.leave_run()
                req.run_lag = (clock, held)
            self._joined = len(decoders)
        clock += ends
        dead, ps = self.sched._dead, self.sched._ps
        if not dead:
            for req in decoders:
                req.num_computed_tokens += k
                req.sched_step = step
            return None
        keyed = []
        for req in decoders:
            c = req.num_computed_tokens = req.num_computed_tokens + k
            req.sched_step = step
            # Scheduler._keyless inlined (a call per decoder here would cost more than the rest)
            if req.key_base is None or req.num_preemptions:
                keyed.append(req)
            elif c // ps > req.num_registered_pages:
                req.num_registered_pages = c // ps
        return [i for i, req in enumerate(decoders) if req in keyed] if keyed else []

    def schedule_step(self, j: int, now: float) -> None:
        """The schedule() side of planned step j, scheduled at `now`, the steps before it applied (apply_range):
        its admissions, pages and the step counters (the state while its batch is in flight); apply_range(j, ...,
        scheduled=True) applies the rest. A run of one stage, one batch in flight, no handed-off request admitted."""
        if not 0 <= j < self.steps or self.admitted:
            raise ValueError(f"DecodeRun.schedule_step({j}) of {self.steps} planned steps (admitting: "
                             f"{bool(self.admitted)}): expected a planned step and nobody admitted")
        if self._fresh:
            self._admit_fresh(now)
        self._grow_pages(j, j + 1)
        sched = self.sched
        sched.step = sched._last_emitted = sched._floor = self._base_step + 1 + j
        sched._preempted_this_step = False

    def _end_apply(self, k: int, step: int, schedules: int, finished: list, now: float) -> None:
        """apply's end, its k steps' tokens applied (the last one numbered `step`): the step counters, the reading
        a continued run starts from, the finished requests' pages and states (at `now`), the policy's state."""
        sched = self.sched
        decoders = self.decoders
        _set_step_counters(sched, step, k, schedules)
        sched._preempted_this_step = False
        # The next run starts from this one's decoders k steps on (those that go on running; the requests after
        # them, its prefills, are read afresh), unless the scheduler is touched in between
        if finished:
            crossings, lefts = self._crossings, self._lefts
            keep = [i for i, left in enumerate(lefts) if left != k]
            gone = sum(req.num_computed_tokens - k for req, left in zip(decoders, lefts) if left == k)
            sched._run_after = (sched.step, sched._applied_step, [decoders[i] for i in keep],
                                [crossings[i] for i in keep], [lefts[i] for i in keep], self.total - gone, k,
                                self._clock)
        else:
            sched._run_after = (sched.step, sched._applied_step, decoders, self._crossings, self._lefts, self.total,
                                k, self._clock)
        if finished:
            free = sched._free_finished
            for req in finished:      # as update(): in batch order (decodes, then chunks), after the page growth
                if req.run_lag is not None:     # off the chain, which goes on without it
                    req.leave_run()
                free(req)
                req.page_table = []
                sched._finish(req, "length", now)
            sched.running = [r for r in sched.running if r.status is RUNNING]
        sched._after_decode_run()

    def _admit_kv(self, now: float) -> None:
        """The first step's admissions of handed-off requests (`admitted`): running, as _start_running at `now`;
        their pages are given by _grow_pages."""
        sched = self.sched
        for req, _ in self.admitted:
            sched._start_running(req, now)
        del sched._kv_ready[:len(self.admitted)]

    def _admit_fresh(self, now: float) -> None:
        """The first step's admissions of waiting requests (Scheduler._plan_admissions) at `now`, as
        Scheduler._admit makes them (no prefix hit: counted as queried); their pages are given by _grow_pages,
        their chunks advanced by _advance_prefills."""
        sched = self.sched
        fresh, self._fresh = self._fresh, ()
        del sched.waiting[:len(fresh)]
        for req, _, _ in fresh:
            if sched._caching:
                sched.block_manager.num_query_pages += (len(req.all_token_ids) - 1) // sched._ps
            sched._start_admitted(req, 0, now)

    def _grow_pages(self, a: int, b: int) -> Optional[dict]:
        """The page growth of planned steps a .. b - 1, in the order the steps allocate: by step, the decode pass
        (running order) before the prefill pass, and in the first step the pages of the admitted handed-off
        requests last. With prefix caching (`_grow_pages_caching`): {the key of each page evicted: the step whose
        schedule() evicts it} for `_register_pages`; else None."""
        sched = self.sched
        if sched._caching:
            return self._grow_pages_caching(a, b)
        if a >= b:
            return None
        tables = self._decoder_growth(a, b)
        if tables is not None:
            if tables:
                sched.block_manager.allocate_one_each(tables)
            return None
        if a or self.admitted:    # a later range (apply_range / schedule_step), or landed KV admitted in step 0
            _, grants = self._growth_range(a, b)
            if grants:
                sched.block_manager.allocate_each(grants)
            return None
        # A run applied from its start (the common case): its grants built for these steps alone
        ps = sched._ps
        decoders, prefills = self.decoders, self.prefills
        crossings = self._crossings
        if b <= ps:
            grow = [(j, 0, i, 1) for i, j in enumerate(crossings) if j < b]
        else:
            grow = [(j + m, 0, i, 1) for i, j in enumerate(crossings) for m in range(0, b - j, ps)]
        if prefills:
            plan = self._plan
            grow += [(j, 1, p, need) for j in range(b) for p, _, need in plan[j] if need]
        if grow:
            grow.sort()
            sched.block_manager.allocate_each([((prefills if kind else decoders)[i].page_table, need)
                                               for _, kind, i, need in grow])
        return None

    def _decoder_growth(self, a: int, b: int) -> Optional[list]:
        """A decoders-only run's page growth in steps a .. b - 1 from `_growth_groups`: the page table of each
        page grant, in allocation order (a table per page); None when the groups do not apply."""
        if self.prefills or self.admitted:
            return None
        groups = self._growth_groups()
        if groups is None:
            return None
        ps = len(groups)
        tables = []
        for j in range(a, b):
            tables += groups[j % ps]
        return tables

    def pages_granted(self, a: int, b: int) -> int:
        """Pages planned steps a .. b - 1 allocate (_grow_pages)."""
        if a >= b:
            return 0
        if not self.prefills and not self.admitted:
            groups = self._growth_groups()
            if groups is not None:
                ps = len(groups)
                return sum([len(groups[j % ps]) for j in range(a, b)])
        return sum([need for _, need in self._growth_range(a, b)[1]])

    def _growth_groups(self) -> Optional[List[list]]:
        """A decoders-only run's page growth by step: [r] the page tables of the decoders that grow at every step j
        with j % page_size == r, in running order (each grows first within page_size steps); None when one grows
        first later (its pages reach further: _growth_range's general order)."""
        if self._groups is None:
            ps = self.sched._ps
            crossings = self._crossings
            if crossings and max(crossings) >= ps:
                self._groups = False
            else:
                groups = [[] for _ in range(ps)]
                for req, j in zip(self.decoders, crossings):
                    groups[j].append(req.page_table)
                self._groups = groups
        return self._groups or None

    def _growth_range(self, a: int, b: int) -> Tuple[list, list]:
        """([step], [(page table, pages)]) of every page grant of planned steps a .. b - 1 in allocation order
        (_grow_pages: by step, then decoders, the handed-off requests admitted in step 0, prefill chunks), sliced
        from the list of all planned steps' grants, made once per plan."""
        if self._growth is None or self._growth[0] != self.steps:
            ps, n = self.sched._ps, self.steps
            if n <= ps:      # (each decoder grows once at most)
                grow = [(j, 0, i, 1) for i, j in enumerate(self._crossings) if j < n]
            else:
                grow = [(j + m, 0, i, 1) for i, j in enumerate(self._crossings) for m in range(0, n - j, ps)]
            grow += [(0, 1, i, need) for i, (_, need) in enumerate(self.admitted)]
            if self.prefills:
                grow += [(j, 2, p, need) for j in range(n) for p, _, need in self._plan[j] if need]
            grow.sort()           # (step, pass, index) is unique: tables never compared
            owners = (self.decoders, [req for req, _ in self.admitted], self.prefills)
            self._growth = (n, [g[0] for g in grow], [(owners[kind][i].page_table, need) for _, kind, i, need in grow])
        _, steps, grants = self._growth
        lo, hi = bisect_left(steps, a), bisect_left(steps, b)
        return steps[lo:hi], grants[lo:hi]

    def _grow_pages_caching(self, a: int, b: int) -> dict:
        """_grow_pages with prefix caching: the same allocations in the same order; an allocation that finds no
        uncached free page evicts the least recently freed cached one (BlockManager.allocate: its key dropped,
        offloaded to a host tier). Returns {key of each evicted page: the step (0: the run's first) whose
        schedule() evicts it}."""
        if a >= b:
            return {}
        bm = self.sched.block_manager
        tables = self._decoder_growth(a, b)
        if tables is not None:
            if len(tables) <= len(bm._free):      # no eviction
                bm.allocate_one_each(tables)
                return {}
            evicted = bm.allocate_one_each_evicting(tables, swaps=False)
            if not evicted:
                return {}
            groups = self._groups
            steps = [j for j in range(a, b) for _ in groups[j % len(groups)]]
            return {key: steps[g] for g, key in evicted}
        steps, grants = self._growth_range(a, b)
        if sum(need for _, need in grants) <= len(bm._free):     # no eviction: uncached pages only
            bm.allocate_each(grants)
            return {}
        return {key: steps[g] for g, key in bm.allocate_each_evicting(grants, swaps=False)}

    def _registrations(self, a: int, b: int, keyed: Optional[List[int]] = None) -> Tuple[list, list]:
        """The prefix-cache registrations the update() calls of planned steps a .. b - 1 make (Scheduler._register:
        a request whose computed tokens fill pages past its registered ones offers them), read after the decoders'
        tokens of those steps are applied (apply_range), before the prefills' chunks: ([(step (0: the run's first),
        pass (0: decoders, 1: prefill chunks), index, full pages after it)] in update order (by step, then batch
        order), [(request, full pages after step b - 1)] of the prefills the scheduler registers without keys
        (Scheduler._keyless: only their count changes, set after the events; their first content_key_pages, shared
        with other requests, are events even so). keyed: the indices of the decoders registered with keys (the
        others are keyless: apply_range set their counts with their tokens); None: every decoder. A decoder with c
        computed tokens fills page b in the step that makes them (b + 1) * page_size (one step before it grows into
        page b + 1); a chunk, the pages it completes."""
        ps = self.sched._ps
        keyless = self.sched._keyless
        events, counts = [], []
        add = events.append
        decoders, k = self.decoders, b - a
        for i in range(len(decoders)) if keyed is None else keyed:
            req = decoders[i]
            c = req.num_computed_tokens - k     # before the steps
            m = (c + 1) // ps           # its full pages after step a
            if m > req.num_registered_pages:
                add((a, 0, i, m))
            j = a + (m + 1) * ps - c - 1     # the step that fills its next page (most decoders: none in a .. b - 1)
            while j < b:
                m += 1
                add((j, 0, i, m))
                j += ps
        if self.prefills:
            plan = self._plan
            prefills = self.prefills
            computed = [r.num_computed_tokens for r in prefills]
            registered = [r.num_registered_pages for r in prefills]
            # -1: keyed; else keyless, its first content_key_pages (shared with other requests) still keyed
            shared = [r.content_key_pages if keyless(r) else -1 for r in prefills]
            for j in range(a, b):
                for p, n, _ in plan[j]:
                    c = computed[p] = computed[p] + n
                    if c // ps > registered[p]:
                        if shared[p] < 0:
                            add((j, 1, p, c // ps))
                        elif registered[p] < shared[p]:
                            add((j, 1, p, min(c // ps, shared[p])))
                        registered[p] = c // ps
            counts += [(prefills[p], registered[p]) for p in range(len(prefills))
                       if registered[p] > prefills[p].num_registered_pages and shared[p] >= 0]
        events.sort()
        return events, counts

    def _register_pages(self, registrations: Tuple[list, list], evicted: dict) -> None:
        """Apply `_registrations` (after the decoders' tokens are appended: a page's key reads its tokens) as
        update() would have, each in its step: a key is skipped while another page holds it, which a cached page
        evicted by a later step (`evicted`) still did then. The host-tier copies the evictions recorded went into
        the steps' SchedulerOutputs (BlockManager.drain_tier_copies), which the run builds none of: dropped."""
        sched = self.sched
        ps, bm = sched._ps, sched.block_manager
        k2p, page_key = bm._key_to_page, bm.page_key
        owners = (self.decoders, self.prefills)
        events, counts = registrations
        if events and self._register_all(events, evicted):
            events = ()
        for j, kind, i, full in events:
            req = owners[kind][i]
            keys = request_page_keys(req, ps, full)
            table = req.page_table
            if not evicted:
                bm.register(table, keys, req.num_registered_pages, full)
            else:
                for b in range(req.num_registered_pages, full):
                    p = table[b]
                    if page_key[p] is None:
                        key = keys[b]
                        if key not in k2p and evicted.get(key, -1) <= j:
                            k2p[key] = p
                            page_key[p] = key
            req.num_registered_pages = full
        for req, full in counts:      # after the events: a keyless request's shared pages are keyed ones
            req.num_registered_pages = full
        if bm.pending_swap_out:
            bm.pending_swap_out = []

    def _register_all(self, events: list, evicted: dict) -> bool:
        """_register_pages in one pass when every registration of `events` takes place (the common case): no page
        it offers holds a key, and no key repeats, is held or was evicted in the run (so none is skipped, whatever
        the order). Registers them and returns True; else False, having changed nothing but extended page keys."""
        ps, bm = self.sched._ps, self.sched.block_manager
        owners = (self.decoders, self.prefills)
        last = {(kind, i): full for _, kind, i, full in events}      # by step: each request's last is its most
        keys, pages = [], []
        for (kind, i), full in last.items():
            req = owners[kind][i]
            r = req.num_registered_pages
            keys += request_page_keys(req, ps, full)[r:full]
            pages += req.page_table[r:full]
        page_key, k2p = bm.page_key, bm._key_to_page
        new = dict(zip(keys, pages))
        if (len(new) != len(keys) or any(map(page_key.__getitem__, pages)) or len(set(pages)) != len(pages)
                or not k2p.keys().isdisjoint(new) or (evicted and not evicted.keys().isdisjoint(new))):
            return False
        k2p.update(new)
        for p, key in zip(pages, keys):
            page_key[p] = key
        for (kind, i), full in last.items():
            owners[kind][i].num_registered_pages = full
        return True

    def _advance_prefills(self, a: int, b: int, ends, finished: list) -> None:
        """The prefill chunks of planned steps a .. b - 1 (ends[j - a] step j's end): tokens computed, and a sample
        (appended to `finished` when it ends the request) for a prompt done in the run."""
        plan, max_len = self._plan, self.sched._max_len
        for p, req in enumerate(self.prefills):
            last = -1
            c = req.num_computed_tokens
            for j in range(a, b):
                for q, n, _ in plan[j]:
                    if q == p:
                        c += n
                        last = j
            if last < 0:
                continue
            req.num_computed_tokens = c
            req.sched_step = self._base_step + 1 + last
            if c == len(req.all_token_ids):       # its prompt is done: it samples (the run's last step)
                now = ends[last - a]
                req.output_token_ids.append(PLACEHOLDER)
                req.all_token_ids.append(PLACEHOLDER)
                req.token_times.append(now)
                if req.first_token_time is None:
                    req.first_token_time = now
                if len(req.output_token_ids) >= req.max_tokens or len(req.all_token_ids) >= max_len:
                    finished.append(req)


def continued_run(after: tuple, page_size: int, max_steps: int) -> tuple:
    """Scheduler.decode_run's reading of the running requests that are the decoders of the run applied last when
    nothing touched the scheduler since (`after`: (step, applied step, decoders, crossings, lefts, total, k, clock) as
    DecodeRun.apply leaves it, k the steps it applied): the same (decoders, [], crossings, lefts, total, limit) as
    reading them afresh. A decoder that first grew at step j grows next at (j - k) mod page_size steps on (j - k if
    it had not grown yet); each has k fewer steps left; their contexts grew by k each."""
    _, _, decoders, crossings, lefts, total, k, _ = after
    crossings = [j - k if j >= k else (j - k) % page_size for j in crossings]
    lefts = [left - k for left in lefts]
    limit = min(lefts) if lefts else max_steps
    return list(decoders), [], crossings, lefts, total + k * len(decoders), min(limit, max_steps)


def _set_step_counters(sched, step: int, k: int, schedules: int) -> None:
    """The scheduler's step counters after a run of k steps whose last one is step `step`, `schedules` schedule()
    calls per step (DecodeRun.apply): with one, all at that step; with more, the empty schedule() calls after the
    last step advanced `step` and set the floor to the step applied before it."""
    if schedules == 1:
        sched.step = sched._applied_step = sched._last_emitted = sched._floor = step
        return
    sched._floor = step - schedules if k > 1 else sched._applied_step
    sched.step = step + schedules - 1
    sched._applied_step = sched._last_emitted = step


def _pages_grown(crossings: Sequence[int], steps: int, page_size: int) -> int:
    """Pages the decoders grow into within `steps` steps: one that grows first at step crossings[i] (0: the run's
    first) grows every page_size steps from then on."""
    n = 0
    for j in crossings:
        if j < steps:
            n += 1 + (steps - 1 - j) // page_size
    return n


def joined_parts(head: tuple, tail: Optional[tuple]) -> Optional[tuple]:
    """The reading (decoders, prefills, crossings, lefts, total, limit) of running requests head + tail from the
    readings of each (None where one rules a run out): the reading is request by request, in running order."""
    if tail is None:
        return None
    return (head[0] + tail[0], head[1] + tail[1], head[2] + tail[2], head[3] + tail[3], head[4] + tail[4],
            min(head[5], tail[5]))


from pdjax.scheduler.pair_runs import PairRun, pair_run  # noqa: E402, F401 (re-exported: callers and tests name runs.PairRun)
