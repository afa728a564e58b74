"""Pair runs: an instance with two batches in flight whose running requests form two groups taking turns, applied in
bulk (the simulator's fast path for pipelined instances, pdjax.sim.simulator.Simulation.pair_run; the engine never
uses this). `pair_run(sched, out)` reads the scheduler with batch `out` in flight and returns a `PairRun`, or None
when its state does not allow one.

At the start, group 1 (`out`'s requests) is in flight in batch `out` and group 0 (every other running request) was
just applied. Half-step h = 0, 1, 2, ...: at h >= 1 the oldest batch (h = 1: `out`, else batch h - 2) is collected
and applied (update), then, unless the run ends there, batch h of group g = h % 2 is scheduled: its pass j =
(h - g) // 2. schedule() there is: the decode pass over the group's decoders (running order), then, for a policy
with a prefill pass (sarathi), the next chunk of each of the group's prefills in what the decodes leave of the
budget (running order; every other running request is in flight), then, when the run admits (`queue`), the waiting
requests the batch admits. A run of H half-steps ends with collect H applied and batch H - 1 in flight: `apply`
leaves the scheduler exactly as those H schedule() and H update() calls would (the same pages in the same order,
queues, counters, every request's tokens and timestamps), and `in_flight_output` is batch H - 1's SchedulerOutput
for the caller's batch queue.

Within a run, groups change only at collects: a decoder finishes at the collect of its last token (its pages freed,
in batch order, before the schedule at that half-step); a prefill whose chunk completes its prompt samples its
first token at that batch's collect and decodes in its group from the group's next pass (or finishes there); an
admitted request is a prefill of the group whose batch admitted it. A decoder's page table grows at the first pass
whose context reaches its end and every page_size passes after. The caller plans the half-steps one by one
(`collect(h)` then `schedule_next(g, free)`) and stops where the run cannot go on: a schedule that would preempt
(pages), leave a prefill without a chunk or a decoder out of the decode budget, or be empty; an arrival the run
cannot take; with requests waiting and no admission (`queue` None), the first finish (it may unblock them) or
arrival.

Admission (`queue` not None: sarathi's FIFO queue): the requests waiting at the start, then those the caller adds
as they arrive (`queue.extend` at the collect where the engine's loop adds them, validated), are admitted as
schedule() admits them: after the group's chunks, a chunk of what the batch leaves of the budget, a free sequence
slot, pages for it above the watermark; in queue order, the first that does not fit ends that batch's admissions.
`apply` admits them from `sched.waiting`, which the caller has given every arrival up to the last schedule.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from pdjax.scheduler.output import SchedulerOutput
from pdjax.scheduler.request import PLACEHOLDER_TOKEN as PLACEHOLDER, RequestStatus

RUNNING = RequestStatus.RUNNING
NEVER = 1 << 62   # a pass no run reaches


def _grown(cross: int, end: int, page_size: int) -> int:
    """Pages a decoder grows into before pass `end` (growing at passes cross, cross + page_size, ...)."""
    return 1 + (end - 1 - cross) // page_size if end > cross else 0


class PairRun:
    """The planned half-steps of one pair run (module docstring).

    members[g]: the decode phases of group g's requests, (rank, first, end, context, cross, pages, pre, req): its
    position in the running list (`rank`; the admitted after every running one), the group passes first .. end - 1
    it decodes in (end: the pass it leaves at, its last token collected with pass end - 1; NEVER), its context at
    pass `first`, the pass its table first grows at (`cross`), its pages at pass `first`, and `pre`: for group 1 at
    the start, the tokens `out`'s collect gives it (its decode token, or its prompt's last chunk: it samples its
    first token there), else 0. prefills[g] / ranks[g]: group g's requests in the prefill phase and their ranks,
    admitted ones appended."""

    __slots__ = ("sched", "members", "prefills", "ranks", "out", "chunks", "batch_counts", "batch_tokens", "queue",
                 "admitted", "finished", "ends_completing", "_ps", "_count", "_total", "_active", "_starts", "_leaves",
                 "_joins", "_passes", "_p_state", "_p_live", "_p_since", "_p_done", "_frees", "_running", "_taken",
                 "_budget", "_admits", "_stop_at_finish", "stops", "_completing")

    def __init__(self, sched, members: Tuple[list, list], prefills: Tuple[list, list], ranks: Tuple[list, list],
                 out, queue: Optional[list], admits: bool, completing: dict, budget: int):
        self.sched = sched
        self.members = members
        self.prefills = prefills
        self.ranks = ranks
        self.out = out
        self.queue = queue
        self.chunks: List[list] = []         # per planned batch: [(prefill index, tokens, pages)]
        self.batch_counts: List[int] = []    # per planned batch: its decodes
        self.batch_tokens: List[int] = []    # per planned batch: its prefill tokens
        self.admitted: List[Tuple[int, object]] = []    # (half-step, request) of each admission, in order
        self.finished: list = []             # apply: the requests the run finished, in the order update() does
        self.ends_completing = False         # the run ends at a finish that may let a waiting request in
        self._ps = ps = sched._ps
        self._budget = budget                # decodes a batch takes at most
        self._admits = admits                # no queue: a batch leaving budget would admit (the run cannot take it)
        self._stop_at_finish = queue is None and bool(sched.waiting)
        self.stops = False                   # the last collect ends the run (a finish may let a waiting one in)
        self._completing = completing        # id(request) -> (request, chunk): the prompts `out` completes
        self._running = len(sched.running)
        self._taken = 0                      # queue entries admitted so far
        self._passes = [0, 0]
        self._count, self._total = [0, 0], [0, 0]
        self._active = ([0] * ps, [0] * ps)  # per group and pass residue: decoders growing at such passes
        self._starts: Tuple[dict, dict] = ({}, {})   # per group: pass -> decoders whose growth starts there
        self._leaves: Tuple[dict, dict] = ({}, {})   # per group: pass -> [(context at first, first, cross)]
        self._joins: Tuple[dict, dict] = ({}, {})    # per group: pass -> [(context, cross)]
        self._frees: dict = {}               # half-step -> [pages freed, requests finished] by its collect
        # per group and prefill: [tokens computed by its next schedule, prompt tokens, pages held]
        pending = {id(r): n for r, n in zip(out.reqs, out.num_new_tokens)} if prefills[1] else {}
        self._p_state = tuple([[r.num_computed_tokens + pending.get(id(r), 0), len(r.all_token_ids),
                                len(r.page_table)] for r in group] for group in prefills)
        self._p_live = (list(range(len(prefills[0]))), list(range(len(prefills[1]))))   # those still prefilling
        self._p_since = ([0] * len(prefills[0]), [1] * len(prefills[1]))   # per prefill: its first half-step
        self._p_done = ([NEVER] * len(prefills[0]), [NEVER] * len(prefills[1]))   # ... and its completing one
        for g in (0, 1):
            for _, first, end, context, cross, pages, _, _ in members[g]:
                self._enter(g, first, end, context, cross, pages, True)

    def _enter(self, g: int, first: int, end: int, context: int, cross: int, pages: int, now: bool) -> None:
        """A decode phase of group g (see the class) into the plan: counted from pass `first` (now: the group's
        next pass; else a later one), leaving at `end`, its pages freed by the collect of pass end - 1."""
        if end < NEVER:
            free = self._frees.setdefault(2 * end + g, [0, 0])
            free[0] += pages + _grown(cross, end, self._ps)
            free[1] += 1
        if end <= first:
            return
        if not now:
            self._joins[g].setdefault(first, []).append((context, cross))
        else:
            self._count[g] += 1
            self._total[g] += context
            self._starts[g][cross] = self._starts[g].get(cross, 0) + 1
        if end < NEVER:
            self._leaves[g].setdefault(end, []).append((context, first, cross))

    def collect(self, h: int) -> int:
        """The collect at half-step h >= 1: the pages it frees (requests finishing)."""
        free = self._frees.get(h)
        if free is None:
            return 0
        self._running -= free[1]
        if self._stop_at_finish:
            self.stops = True
        return free[0]

    def schedule_next(self, g: int, free: int) -> Optional[Tuple[int, list, int, int]]:
        """Plan group g's next batch with `free` free pages: (pages it takes, its prefill chunks [(tokens, context
        before them)] in batch order, its decodes, their context sum), or None when the run cannot take it (too few
        pages, a prefill left without a chunk, decodes over the budget, an empty batch, budget left for a waiting
        request the run does not admit)."""
        j = self._passes[g]
        ps = self._ps
        pages = self._pass_start(g, j)
        count = self._count[g]
        if count > self._budget:
            return None
        sched = self.sched
        chunks = plan = done = ()                   # no prefill work: shared empty tuples
        left = sched._budget - count
        states = self._p_state[g]
        live = self._p_live[g]
        if live:
            chunks, plan, done = [], [], []
        for k in live:
            c, tokens, held = states[k]
            n = sched._chunk_size(c, tokens, left) if left > 0 else 0
            if n <= 0:
                return None
            need = -(-(c + n) // ps) - held
            if need < 0:
                need = 0
            pages += need
            plan.append((k, n, need))
            chunks.append((n, c))
            left -= n
            if c + n == tokens:
                done.append((k, held + need))
        admits = ()
        if self.queue is not None:
            if left > 0 and self._taken < len(self.queue):
                if not live:
                    chunks, plan, done = [], [], []
                admits, pages, left = self._admissions(g, chunks, plan, pages, free, left, done)
        elif self._admits and left > 0:
            return None
        if pages > free or not (count or chunks):
            return None
        total = self._total[g]
        self._total[g] = total + count
        self.batch_counts.append(count)
        self.batch_tokens.append(sched._budget - count - left)
        if admits:
            self._admit_planned(g, admits)
        for k, n, need in plan:
            state = states[k]
            state[0] += n
            state[2] += need
        self.chunks.append(plan)
        self._passes[g] = j + 1
        if done:
            self._complete(g, j, done)
        return pages, chunks, count, total

    def _pass_start(self, g: int, j: int) -> int:
        """Group g's decoders at pass j (`_count`, `_total`): those leaving before it out, those joining at it in;
        returns the pages their decode pass grows into."""
        if j in self._leaves[g] or j in self._joins[g]:
            self._pass_events(g, j)
        active = self._active[g]
        started = self._starts[g].pop(j, 0)
        if started:
            active[j % self._ps] += started
        return active[j % self._ps]

    def _pass_events(self, g: int, j: int) -> None:
        """Group g's decoders at pass j: those leaving before it out, those joining at it in."""
        ps = self._ps
        active, starts = self._active[g], self._starts[g]
        for context, first, cross in self._leaves[g].pop(j, ()):
            self._count[g] -= 1
            self._total[g] -= context + j - first
            if cross < j:
                active[cross % ps] -= 1
            else:
                starts[cross] -= 1
        for context, cross in self._joins[g].pop(j, ()):
            self._count[g] += 1
            self._total[g] += context
            starts[cross] = starts.get(cross, 0) + 1

    def _admit_planned(self, g: int, admits: Sequence) -> None:
        """Group g's admissions in the pass being planned (before its plan is recorded): new prefill states."""
        h = len(self.chunks)
        sched = self.sched
        states = self._p_state[g]
        for req, tokens in admits:
            states.append([0, tokens, 0])
            self.prefills[g].append(req)
            self.ranks[g].append(len(sched.running) + len(self.admitted))
            self._p_since[g].append(h)
            self._p_live[g].append(len(states) - 1)
            self._p_done[g].append(NEVER)
            self.admitted.append((h, req))
            self._running += 1
        self._taken += len(admits)

    def _complete(self, g: int, j: int, done: Sequence) -> None:
        """Group g's prompts completed in pass j (just recorded): their decode phases."""
        h = len(self.chunks) - 1
        sched = self.sched
        states = self._p_state[g]
        gone = {k for k, _ in done}
        self._p_live = tuple(live if i != g else [k for k in live if k not in gone]
                             for i, live in enumerate(self._p_live))
        for k, held in done:                 # first token at the collect of this batch (half-step h + 2)
            req = self.prefills[g][k]
            self._p_done[g][k] = h
            tokens = states[k][1]
            left = req.max_tokens - len(req.output_token_ids)
            if sched._max_len - tokens < left:
                left = sched._max_len - tokens
            first = j + 1
            end = first + left - 1 if left > 1 else first
            cross = first + held * self._ps - tokens
            self.members[g].append((self.ranks[g][k], first, end, tokens, cross, held, 0, req))
            self._enter(g, first, end, tokens, cross, held, False)

    def _admissions(self, g: int, chunks: list, plan: list, pages: int, free: int, left: int, done: list):
        """The queue's requests the batch of group g admits after its chunks (Scheduler._plan_admissions; no prefix
        cache), appended to `chunks`, `plan` and `done` (prompts completed; the batch's pages so far `pages` of
        `free`, budget `left`): ([(request, prompt tokens)], pages, left)."""
        planned = self.sched._plan_admissions(self.queue[self._taken:], self._running, free - pages, left)
        for k, (req, n, need) in enumerate(planned, len(self._p_state[g])):
            plan.append((k, n, need))
            chunks.append((n, 0))
            pages += need
            left -= n
            if n == len(req.all_token_ids):
                done.append((k, need))
        return [(req, len(req.all_token_ids)) for req, _, _ in planned], pages, left

    # ------------------------------------------------------------------------------------------- apply
    def apply(self, times: Sequence[float], half_steps: int) -> None:
        """Apply half-steps 0 .. H - 1's schedules and collects 1 .. H (H = half_steps >= 2); times[h]: the time of
        half-step h (its collect, then its schedule)."""
        H = half_steps
        if H < 2 or H > len(self.chunks):
            raise ValueError(f"PairRun.apply: {H} half-steps, expected 2 .. {len(self.chunks)} (planned)")
        sched = self.sched
        s0 = sched.step
        if self.admitted:
            self._admit(times, H)
        events: list = []
        for g in (0, 1):
            self._advance_prefills(g, times, H, s0, events)
        for g in (0, 1):
            self._advance_decoders(g, times, H, s0, events)
        self._pages_and_finishes(events, times)
        sched.step = s0 + H
        sched._last_emitted = s0 + H
        sched._applied_step = s0 + H - 1
        sched._floor = s0 + H - 2
        sched._preempted_this_step = False
        sched._run_after = None
        sched._after_decode_run()
        if self.finished:
            sched.running = [r for r in sched.running if r.status is RUNNING]

    def _admit(self, times: Sequence[float], H: int) -> None:
        """The admissions of half-steps < H (`_admit` then `_start_running` at their half-step's time), from the
        front of sched.waiting, in order."""
        sched = self.sched
        waiting = sched.waiting
        admitted = [(h, req) for h, req in self.admitted if h < H]
        k = len(admitted)
        if [id(r) for r in waiting[:k]] != [id(r) for _, r in admitted]:
            raise ValueError("PairRun.apply: the waiting queue does not start with the planned admissions")
        del waiting[:k]
        for h, req in admitted:
            sched._start_admitted(req, 0, times[h])

    def _advance_prefills(self, g: int, times: Sequence[float], H: int, s0: int, events: list) -> None:
        """Group g's prefills: a chunk in each of its schedules from its first to its completing one; the tokens of
        the collected ones (`out`'s included) computed; one whose prompt a collect completes samples its first
        token there. Their page grants into `events`."""
        pending = {id(r): n for r, n in zip(self.out.reqs, self.out.num_new_tokens)} if g else {}
        chunks = self.chunks
        for k, req in enumerate(self.prefills[g]):
            since, done = self._p_since[g][k], self._p_done[g][k]
            if since >= H:                      # admitted past the run's end
                break
            last = done if done < H else H - 1 - (H - 1 - g) % 2      # its last schedule in the run
            c = req.num_computed_tokens + pending.get(id(req), 0)
            rank = self.ranks[g][k]
            for h in range(since, last + 1, 2):
                for q, n, need in chunks[h]:
                    if q == k:
                        if h + 2 <= H:
                            c += n
                        if need:
                            events.append((h, 2, 0, rank, need, req))
                        break
            req.num_computed_tokens = c
            req.sched_step = s0 + 1 + last
            if done + 2 <= H:                    # completed: its first token at that collect
                now = times[done + 2]
                req.output_token_ids.append(PLACEHOLDER)
                req.all_token_ids.append(PLACEHOLDER)
                req.token_times.append(now)
                if req.first_token_time is None:
                    req.first_token_time = now

    def _advance_decoders(self, g: int, times: Sequence[float], H: int, s0: int, events: list) -> None:
        """Group g's decode phases: a token at each of their collected passes (and `out`'s), the schedules of their
        passes; their page growth and finishes into `events`."""
        scheduled = len(range(g, H, 2))
        collected = len(range(2 + g, H + 1, 2))
        ps = self._ps
        for rank, first, end, _, cross, _, pre, req in self.members[g]:
            if req.run_lag is not None:       # its chain of decode runs, which this run ended
                req.leave_run()
            s = end if end < scheduled else scheduled
            c = end if end < collected else collected
            k = c - first if c > first else 0
            if pre:                           # `out`'s collect: its decode token, or its prompt's first token
                req.num_computed_tokens += pre + k
                tokens = [PLACEHOLDER] * (k + 1)
                req._token_times.append(times[1])
                if req.first_token_time is None:
                    req.first_token_time = times[1]
            else:
                req.num_computed_tokens += k
                tokens = [PLACEHOLDER] * k
            if k:
                req._token_times += times[2 * first + 2 + g:2 * c + g + 1:2]
            req._output_token_ids += tokens     # (the lists themselves: their properties would be calls)
            req._all_token_ids += tokens
            if s > first:
                req.sched_step = s0 + g + 2 * s - 1
                if cross < s:
                    events += [(g + 2 * p, 1, 0, rank, 1, req) for p in range(cross, s, ps)]
            if 2 * end + g <= H:              # finished by the collect of its last token (decode, or prefill part)
                from_chunk = end == first and (not pre or id(req) in self._completing)
                events.append((2 * end + g, 0, int(from_chunk), rank, 0, req))

    def _pages_and_finishes(self, events: list, times: Sequence[float]) -> None:
        """Replay the page events in the order the schedules and updates make them: by half-step, the finishes of
        its collect (batch order: pages freed one request after the other), then its schedule's decode pass
        (running order), then its chunks and admissions."""
        events.sort()         # (half-step, phase, part, rank) is unique: the requests are never compared
        sched = self.sched
        bm = sched.block_manager
        grants = []
        for h, phase, _, _, need, req in events:
            if phase:
                grants.append((req.page_table, need))
                continue
            if grants:
                bm.allocate_each(grants)
                grants = []
            sched._free_finished(req)
            req.page_table = []
            sched._finish(req, "length", times[h])
            self.finished.append(req)
        if grants:
            bm.allocate_each(grants)

    def in_flight_output(self, half_steps: int):
        """Batch H - 1's SchedulerOutput (applied: its schedule; not: its update), after `apply`."""
        g = (half_steps - 1) % 2
        j = (half_steps - 1 - g) // 2
        out = SchedulerOutput(step=self.sched.step)
        decoders = sorted((m for m in self.members[g] if m[1] <= j < m[2]), key=_rank)
        out.num_decode_tokens = self.sched._emit_decodes(out, [m[7] for m in decoders])
        prefills = self.prefills[g]
        for k, n, _ in self.chunks[half_steps - 1]:
            req = prefills[k]
            c = req.num_computed_tokens
            out.reqs.append(req)
            out.req_ids.append(req.request_id)
            out.token_ids.append(req.all_token_ids[c:c + n])
            out.num_computed_tokens.append(c)
            out.num_new_tokens.append(n)
            out.page_tables.append(req.page_table)
            out.do_sample.append(c + n == len(req.all_token_ids))
            out.sampling.append(req.sampling)
            out.is_prefill.append(True)
            out.num_prefill_tokens += n
        return out


def _rank(member: tuple) -> int:
    return member[0]


def pair_run(sched, out, admit: bool = False) -> Optional[PairRun]:
    """The PairRun of `sched` with batch `out` in flight (module docstring), or None when its state does not allow
    one: the policy's decode runs (Scheduler.decode_run's conditions: its class, nothing swapped, landed or
    cached), exactly one batch in flight (`out`; the prompts it completes, and prefills, only for a policy with a
    prefill pass), nobody waiting who could be admitted but from a budget left over (the chunks of a long prompt
    take it all) unless the run admits. admit: the caller can feed the run its arrivals (PairRun.queue); the run
    admits, as schedule() would, when the policy has a prefill pass and a FIFO queue."""
    if (type(sched) not in sched.DECODE_RUN_CLASSES or not sched._decode_run_policy_ok() or sched.swapped
            or sched._kv_ready or sched._caching or sched._removed_from_running or sched.handoff_after_prefill
            or out.step != sched._last_emitted or out.step != sched.step):
        return None
    blocked = sched._admission_blocked()
    prefill_pass = sched._run_prefills
    if sched.waiting and not blocked and not prefill_pass:
        return None
    completing = {}                   # collecting `out` completes these prompts: id(request) -> (request, chunk)
    if out.num_prefill_tokens:
        completing = {id(r): (r, n) for r, n, p, s in zip(out.reqs, out.num_new_tokens, out.is_prefill,
                                                          out.do_sample) if p and s}
        if completing and not prefill_pass:
            return None
    parts = _pair_parts(sched, completing)
    if parts is None:
        return None
    members, prefills, ranks = parts
    if (not members[0] and not prefills[0]) or len(members[1]) + len(prefills[1]) != len(out.reqs):
        return None
    if (prefills[0] or prefills[1]) and not prefill_pass:
        return None
    queue = list(sched.waiting) if admit and prefill_pass and not sched._priority else None
    # a waiting or admitted request, a prompt not completed: prefill work (the guard's smaller decode budget)
    budget = sched._run_decode_budget(bool(queue is not None or prefills[0] or prefills[1] or sched.waiting
                                           or completing))
    return PairRun(sched, members, prefills, ranks, out, queue, bool(sched.waiting) and not blocked, completing,
                   budget)


def _pair_parts(sched, completing: dict) -> Optional[tuple]:
    """pair_run's reading of the running requests: per group (0: applied, 1: in flight) its decode phases
    (PairRun.members), its prefills and their ranks; None when one rules a run out. completing: id(request) ->
    (request, chunk) of the group 1 prompts that `out` completes (decoders from its collect on)."""
    applied = sched._applied_step
    ps, max_len = sched._ps, sched._max_len
    members, prefills, ranks = ([], []), ([], []), ([], [])
    for rank, req in enumerate(sched.running):
        if req.status is not RUNNING or PLACEHOLDER in req.stop_ids:
            return None
        g = 1 if req.sched_step > applied else 0     # 1: in flight in `out`
        c = req.num_computed_tokens
        pre = g
        if c < req.prefill_end:
            if not g or id(req) not in completing:
                prefills[g].append(req)
                ranks[g].append(rank)
                continue
            pre = completing[id(req)][1]  # its prompt, computed by `out`'s collect, which samples its first token
        elif req.first_token_time is None:
            return None
        c += pre                          # group 1: after `out` is applied
        pages = len(req.page_table)
        cross = pages * ps - c
        if cross < 0:
            return None
        left = req.max_tokens - len(req.output_token_ids)
        if max_len - len(req.all_token_ids) < left:
            left = max_len - len(req.all_token_ids)
        if left < 1:                      # a prompt of max_model_len tokens: its first token finishes it
            left = 1
        # leaves at pass `left` (group 0: its left-th token is at pass left - 1) or left - 1 (group 1: `out` first)
        members[g].append((rank, 0, left - g, c, cross, pages, pre, req))
    return members, prefills, ranks
