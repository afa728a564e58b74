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
their schedule() in such a state is the decode pass over the running list, then, for a class with
`_run_prefills` (sarathi), its prefill pass); nothing swapped, handed off or in flight; no prefix caching (it
would register pages in update()); no request's stop tokens include the placeholder; the decodes fit the policy's
decode budget. Waiting requests are allowed only where they certainly stay waiting: running is full
(`_admission_blocked`; decode_first: a sealed batch), or, with a prefill pass, in steps whose chunks leave no
budget (a step that leaves some is not taken). A run ends (its last step included) at the first step in which a
request finishes or a prefill completes its prompt (it then samples and becomes a decoder: the next run takes
it as one), and before a step whose page growth the free pages at the start of the run cannot cover (that step
would preempt).

Per step, with D decoders whose contexts sum to `total` (it grows by D per step): the decode pass allocates a page
to each decoder whose computed tokens reach its table's end (decoders in running order), then the prefill pass
gives each prefill (running order) `Scheduler._chunk_size` of what the decodes left of the budget and allocates
the pages its chunk needs. `apply` replays those allocations in that order.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from pdjax.scheduler.request import RequestStatus

PLACEHOLDER = 0   # pdjax.scheduler.base.PLACEHOLDER_TOKEN (the simulator's sampled id)
RUNNING = RequestStatus.RUNNING


class DecodeRun:
    """The planned steps of one decode run of `sched` (module docstring). count: decoders per step; total: their
    context sum (num_computed_tokens) in the first step. `next_step()` plans one more step; `apply(starts, ends)`
    applies the first len(starts) planned ones."""

    __slots__ = ("sched", "decoders", "prefills", "count", "total", "limit", "steps", "_free", "_first", "_active",
                 "_p_state", "_plan", "_done", "_left", "_admits", "_crossings", "_lefts")

    def __init__(self, sched, decoders: list, prefills: list, crossings: List[int], lefts: List[int], total: int,
                 limit: int, free: int, budget_left: int, admits: bool = False):
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

    def next_step(self) -> Optional[list]:
        """Plan the next step: its prefill chunks [(tokens, context before them)] in batch order ([]: decodes
        only), or None when the run cannot take another step (nothing is planned then)."""
        if self._done or self.steps >= self.limit:
            return None
        j = self.steps
        sched = self.sched
        ps = sched._ps
        if self._first is None:
            first: dict = {}
            for c in self._crossings:
                first[c] = first.get(c, 0) + 1
            self._first = first
            self._active = [0] * ps
            self._p_state = [[r.num_computed_tokens, len(r.all_token_ids), len(r.page_table)] for r in self.prefills]
        active = self._active
        started = self._first.get(j)
        if started:
            active[j % ps] += started
        pages = active[j % ps]
        chunks = []
        plan = ()
        done = False
        left = self._left
        if self.prefills:
            states = self._p_state
            plan = []
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
            if not chunks and not self.count:
                return None           # the step would schedule nothing
        if (self._admits and left > 0) or pages > self._free:
            if started:
                active[j % ps] -= started
            return None
        self._free -= pages
        for k, n, need in plan:
            state = self._p_state[k]
            state[0] += n
            state[2] += need
        self._plan.append(tuple(plan))
        self._done = done
        self.steps = j + 1
        return chunks

    @property
    def decoders_only(self) -> bool:
        """No prefill in the run, and nobody waiting could be admitted in any of its steps (nobody waits, or
        admission is blocked: running is full): a schedule() between its steps, with every running request in
        flight, returns nothing."""
        return not self.prefills and not self._admits

    def apply(self, starts: Sequence[float], ends: Sequence[float], schedules: int = 1) -> list:
        """Apply the first len(starts) planned steps, step j scheduled at starts[j] and updated at ends[j];
        returns the requests that finished (in the last step, in batch order), as update() does. schedules: the
        schedule() calls per step: 2 where the loop keeps batches in flight (after dispatching a step it schedules
        again, and gets nothing: every running request is in flight), a run of decoders only (`decoders_only`)."""
        k = len(starts)
        if k > self.steps:
            raise ValueError(f"DecodeRun.apply: {k} steps given, {self.steps} planned")
        if schedules != 1 and not self.decoders_only:
            raise ValueError("DecodeRun.apply: schedules > 1 needs a run of decoders only")
        sched = self.sched
        if not k:
            return []
        decoders, prefills = self.decoders, self.prefills
        self._grow_pages(k)
        first_step = sched.step
        step = first_step + 1 + schedules * (k - 1)     # the last step's number (schedules == 1: first_step + k)
        finished = []
        tokens = [PLACEHOLDER] * k
        for req in decoders:
            req.num_computed_tokens += k
            req.output_token_ids += tokens
            req.all_token_ids += tokens
            req.token_times += ends
            req.schedule_times += starts
            req.sched_step = step
        if k == self.limit:     # some decoder finishes in this step (the limit is the first finish)
            finished = [req for req, left in zip(decoders, self._lefts) if left == k]
        if prefills:
            self._advance_prefills(k, starts, ends, first_step, finished)
        _set_step_counters(sched, step, k, schedules)
        sched._preempted_this_step = False
        if finished:
            now = ends[-1]
            free = sched.block_manager.free
            for req in finished:      # as update(): in batch order (decodes, then chunks), after the page growth
                free(req.page_table)
                req.page_table = []
                sched._finish(req, "length", now)
            sched.running = [r for r in sched.running if r.status is RUNNING]
        sched._after_decode_run()
        return finished

    def _grow_pages(self, k: int) -> None:
        """The page growth of the first k steps, in the order the steps allocate: by step, the decode pass (running
        order) before the prefill pass."""
        sched = self.sched
        ps = sched._ps
        decoders, prefills = self.decoders, self.prefills
        crossings = self._crossings
        plan = self._plan
        if not prefills and k <= ps:     # each decoder grows at most once: by step, then running order
            grown = [i for i, j in enumerate(crossings) if j < k]
            if grown:
                grown.sort(key=crossings.__getitem__)      # stable
                sched.block_manager.allocate_one_each([decoders[i].page_table for i in grown])
            grow = None
        elif k <= ps:
            grow = [(j, 0, i, 1) for i, j in enumerate(crossings) if j < k]
        else:
            grow = [(j + m, 0, i, 1) for i, j in enumerate(crossings) for m in range(0, k - j, ps)]
        if prefills:
            grow += [(j, 1, p, need) for j in range(k) for p, _, need in plan[j] if need]
        if grow:
            grow.sort()
            sched.block_manager.allocate_each([((prefills if kind else decoders)[i].page_table, need)
                                               for _, kind, i, need in grow])

    def _advance_prefills(self, k: int, starts, ends, first_step: int, finished: list) -> None:
        """The prefill chunks of the first k steps: tokens computed, schedule times, and a sample (appended to
        `finished` when it ends the request) for a prompt done in the run."""
        plan, max_len = self._plan, self.sched._max_len
        for p, req in enumerate(self.prefills):
            last = -1
            c = req.num_computed_tokens
            times = req.schedule_times
            for j in range(k):
                for q, n, _ in plan[j]:
                    if q == p:
                        c += n
                        times.append(starts[j])
                        last = j
            if last < 0:
                continue
            req.num_computed_tokens = c
            req.sched_step = first_step + 1 + last
            if c == len(req.all_token_ids):       # its prompt is done: it samples (the run's last step)
                now = ends[last]
                req.output_token_ids.append(PLACEHOLDER)
                req.all_token_ids.append(PLACEHOLDER)
                req.token_times.append(now)
                if req.first_token_time is None:
                    req.first_token_time = now
                if len(req.output_token_ids) >= req.max_tokens or len(req.all_token_ids) >= max_len:
                    finished.append(req)



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
