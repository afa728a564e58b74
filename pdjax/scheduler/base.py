"""Scheduler: the shared machinery of every batching policy (queues, admission, paging, preemption, update).

A policy subclass implements only `_schedule(out, now)`, composing the helpers below. The engine loop is:

    out = sched.schedule(now)                  # SchedulerOutput; the runner copies swap_out, then swap_in,
    sampled = runner.step(out)                 # loads kv_handoff_req_ids' KV, then runs the ragged batch
    finished = sched.update(out, sampled, now) # len(sampled) == out.num_seqs, -1 where do_sample is False

Choices (the "why" of the hot path):
- Queues are plain lists of Request: `running` in admission order, `waiting` (fcfs: arrival order, with
  recompute-preempted requests put back at the front; priority: kept sorted by (priority, arrival, id)
  with bisect), `swapped` in preemption order. Swapped requests resume before any waiting request.
- Removal from `running` is done once per step by one filter pass, only when something left it.
- Preemption happens only for a running request that needs a page the pool does not have. The victim is
  the running request not yet scheduled in this step with the lowest priority (largest `priority` value),
  then the latest arrival; it may be the requester itself. Requests already in this step's batch are never
  victims, so a SchedulerOutput never names a preempted request. After a preemption no request is
  admitted or resumed in the same step (it would likely be preempted again). (vllm_v1 overrides the victim
  rule with vLLM's: see policies.py.)
- Admission never preempts; it needs pages for its first chunk plus the watermark. With `_full_isl` (set by
  vllm_v1 when `scheduler_reserve_full_isl`) it needs pages for the whole current sequence plus the
  watermark; with `_watermark_if_running` (vllm_v1) the watermark counts only while some request runs.
- Recompute preemption frees the pages and restarts the request from `all_token_ids` (prompt + outputs),
  keeping its outputs and timestamps. Swap preemption moves its pages to host slots (copies listed in
  `swap_out`) and keeps `num_computed_tokens`; it falls back to recompute when host slots run short.
- Disaggregation hooks (used by the prefill_only / decode_only policies, see policies.py for the protocol):
  `release`, `held_page_table`, `add_handoff`, `mark_kv_arrived`.
- Batches in flight (pipeline parallelism; pdjax.scheduler.batch_queue): an engine may call schedule() again
  before it applied the previous outputs, as long as it applies every non-empty output with update(), in
  schedule order (update refuses an older output than one already applied). A request is *in flight* from the
  schedule() that emitted it to the update() that applies it: `req.sched_step > last applied step`. Every
  policy builds its batch only from requests not in flight (their tokens are not computed yet), and an
  in-flight request is never a preemption victim (its pages are being written): when the victim rule picks
  one, nobody is preempted, the request short of pages is not scheduled in this step and nothing is admitted
  (it retries once that batch is applied). Waiting rather than preempting itself keeps the victim order (a
  request that would be spared at pp 1 is spared here too), which is what keeps two requests that do not fit
  together from preempting each other forever. With one batch in flight at a time (every output applied
  before the next schedule()) nothing is ever in flight at schedule() and every rule above is unchanged.
- Decode runs (`decode_run`, pdjax.scheduler.runs): the simulator applies steps whose outcome is certain in
  bulk, with exactly the state schedule() and update() would leave; the engine never uses them.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from pdjax.config.scheduler import SchedulerConfig
from pdjax.scheduler.block_manager import BlockManager, holds_no_prefix, request_page_keys
from pdjax.scheduler.output import SchedulerOutput
from pdjax.scheduler.request import PLACEHOLDER_TOKEN, Request, RequestStatus
from pdjax.scheduler.runs import DecodeRun, continued_run, joined_parts

WAITING = RequestStatus.WAITING
RUNNING = RequestStatus.RUNNING
PREEMPTED = RequestStatus.PREEMPTED
SWAPPED = RequestStatus.SWAPPED
WAITING_FOR_KV = RequestStatus.WAITING_FOR_KV
FINISHED = RequestStatus.FINISHED
REJECTED = RequestStatus.REJECTED


@dataclasses.dataclass
class PendingTokens:
    """The placeholders `update_async` appended for one dispatched step, for `resolve_async` to overwrite.

    slots: (batch index, request, output index, all-token index) per request that got a token;
    finished: the requests that finished on a placeholder (their finish time is the step's end)."""
    slots: List[Tuple[int, Request, int, int]]
    finished: List[Request]


def _priority_key(req: Request):
    return (req.priority, req.arrival_time, req.request_id)


class Scheduler:
    """Shared interface of all policies. Subclasses set `name` and implement `_schedule`."""
    name = "base"
    handoff_after_prefill = False   # prefill_only: finish with 'handoff' once the first token is sampled
    FINISHED_PAGES_DEAD = True      # no request looks up a finished one's pages again (_free_finished)

    def __init__(self, config: SchedulerConfig):
        if not isinstance(config, SchedulerConfig):
            raise TypeError(f"config={config!r}, expected a SchedulerConfig")
        self.config = config
        self.block_manager = BlockManager(config.num_pages, config.page_size, config.enable_prefix_caching,
                                          config.num_host_pages)
        self.running: List[Request] = []
        self.waiting: List[Request] = []
        self.swapped: List[Request] = []
        self.finished: List[Request] = []
        self._live: Dict[str, Request] = {}        # every accepted, not yet finished request
        self._held: Dict[str, Request] = {}        # prefill_only: handed off, pages kept until release()
        self._held_tables: Dict[str, List[int]] = {}
        self._kv_pending: Dict[str, Request] = {}  # decode_only: handed off, KV not yet arrived
        self._kv_ready: List[Request] = []         # decode_only: KV arrived, waiting for room
        self.step = 0
        self._admit_counter = 0
        self._preempted_this_step = False
        self._removed_from_running = False
        self._applied_step = 0     # step of the last output applied by update()
        self._last_emitted = 0     # step of the last non-empty output of schedule()
        self._floor = 0            # this step: requests with sched_step > _floor are in flight (or just emitted)
        self.num_preemptions = 0
        self.num_swaps = 0
        self._run_after = None     # decode runs: (step, applied step, running, ...) after the last (runs.py)
        # hot-path constants
        self._ps = config.page_size
        self._budget = config.token_budget
        self._max_seqs = config.max_num_seqs
        self._max_len = config.max_model_len
        self._caching = config.enable_prefix_caching
        self._dead = self._caching and self.FINISHED_PAGES_DEAD
        self._chunking = config.chunking
        self._tile = config.tile_size
        self._long = config.long_prefill_token_threshold     # which prefills are "long" (partial-prefill limits)
        self._chunk_cap = config.long_prefill_token_threshold  # per-step chunk cap (vllm_v1 sets it each step)
        self._dynamic = config.dynamic_chunking
        self._watermark_pages = config.watermark_pages
        self._full_isl = False                # vllm_v1: admission needs pages for the whole current sequence
        self._watermark_if_running = False    # vllm_v1: the watermark applies only while a request runs
        self._swap = config.preemption_mode == "swap"
        self._priority = config.ordering == "priority"

    # ------------------------------------------------------------------ public API
    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.swapped) + len(self._kv_pending) + len(self._kv_ready)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_held(self) -> int:
        """prefill_only: handed-off requests whose pages await `release`."""
        return len(self._held)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self.swapped or self._kv_pending or self._kv_ready)

    @property
    def is_idle(self) -> bool:
        """Nothing waiting, running or awaiting its KV, and no pages held for a transfer (a mixed-pool instance
        changes phase or pool only then: pdjax.scheduler.mixed)."""
        return not self.has_unfinished() and not self._held

    def get_request(self, request_id: str) -> Optional[Request]:
        return self._live.get(request_id) or self._held.get(request_id)

    def add_request(self, req: Request) -> bool:
        """Queue `req`; returns False (and finishes it as 'rejected' with `reject_reason`) for a bad request."""
        reason = self._validate_request(req)
        if reason is not None:
            self._reject(req, reason)
            return False
        req.status = WAITING
        req.prefill_end = len(req.all_token_ids)
        self._live[req.request_id] = req
        self._enqueue_waiting(req, front=False)
        return True

    def abort(self, request_id: str, now: float) -> Optional[Request]:
        """Finish request `request_id` as 'aborted' wherever it is, freeing its pages; None if not live."""
        req = self._live.get(request_id)
        if req is None:
            if request_id in self._held:   # handed off already: aborting just drops the kept pages
                self.release(request_id)
            return None
        st = req.status
        if st is RUNNING:
            self._free_finished(req)
            self._removed_from_running = True
            self.running = [r for r in self.running if r is not req]
        elif st is WAITING or st is PREEMPTED:
            self.waiting.remove(req)
        elif st is SWAPPED:
            self.swapped.remove(req)
            self.block_manager.free_host(req.host_slots)
            req.host_slots = []
        elif st is WAITING_FOR_KV:
            if self._kv_pending.pop(request_id, None) is None:
                self._kv_ready.remove(req)
            if req.page_table:           # the prefix it reused here (DecodeOnlyScheduler.reuse_prefix)
                self.block_manager.free(req.page_table)
        req.page_table = []
        self._finish(req, "aborted", now)
        return req

    @property
    def has_in_flight(self) -> bool:
        """Some non-empty output of schedule() is not applied by update() yet."""
        return self._last_emitted > self._applied_step

    def is_in_flight(self, req: Request) -> bool:
        """`req` is in a scheduled, not yet applied batch (module docstring)."""
        return self._applied_step < req.sched_step and req.status is RUNNING

    def schedule(self, now: float) -> SchedulerOutput:
        """Pick this iteration's batch (see the policy's docstring) from the requests not in flight."""
        self.step += 1
        out = SchedulerOutput(step=self.step)
        self._preempted_this_step = False
        # Running requests with sched_step > _floor are skipped by every pass: those in an unapplied batch (and
        # those already emitted in this step). Nothing in flight: _floor = this step, the test never fires.
        self._floor = self._applied_step if self._last_emitted > self._applied_step else self.step
        self._schedule(out, now)
        if out.req_ids and self.block_manager.host_tier is not None:
            self.block_manager.drain_tier_copies(out)
        if self._preempted_this_step:
            self.running = [r for r in self.running if r.status is RUNNING]
        if out.req_ids:
            self._last_emitted = self.step
        return out

    def update(self, output: SchedulerOutput, sampled_token_ids: Sequence[int], now: float) -> List[Request]:
        """Advance the requests of `output` by its tokens and append the sampled ones; returns the finished."""
        reqs = output.reqs
        if len(sampled_token_ids) != len(reqs):
            raise ValueError(f"len(sampled_token_ids)={len(sampled_token_ids)}, expected one per scheduled "
                             f"request ({len(reqs)}), -1 where do_sample is False")
        if reqs:
            if output.step <= self._applied_step:
                raise ValueError(f"update() of step {output.step} after step {self._applied_step} was applied: "
                                 "outputs must be applied once each, in the order schedule() returned them")
            self._applied_step = output.step
        finished = []
        ps = self._ps
        caching = self._caching
        max_len = self._max_len
        handoff = self.handoff_after_prefill
        for req, n, sample, tok in zip(reqs, output.num_new_tokens, output.do_sample, sampled_token_ids):
            if req.status is not RUNNING:      # aborted between schedule() and update()
                continue
            c = req.num_computed_tokens + n
            req.num_computed_tokens = c
            if caching and c // ps > req.num_registered_pages:
                self._register(req)
            if not sample:
                continue
            if tok < 0:
                raise ValueError(f"request {req.request_id!r}: sampled token {tok} where do_sample is True, "
                                 f"expected a token id >= 0")
            if req.run_lag is not None:     # its chain of decode runs, which schedule() ended
                req.leave_run()
            output_ids, all_ids = req._output_token_ids, req._all_token_ids    # (the lists' properties: calls)
            output_ids.append(tok)
            all_ids.append(tok)
            req._token_times.append(now)
            if req.first_token_time is None:
                req.first_token_time = now
            if tok in req.stop_ids:
                reason = "stop"
            elif len(output_ids) >= req.max_tokens or len(all_ids) >= max_len:
                reason = "length"
            elif handoff:
                reason = "handoff"
            else:
                continue
            if reason == "handoff":
                self._held[req.request_id] = req
                self._held_tables[req.request_id] = req.page_table
            else:
                self._free_finished(req)
            req.page_table = []
            self._finish(req, reason, now)
            finished.append(req)
        if finished or self._removed_from_running:
            self.running = [r for r in self.running if r.status is RUNNING]
            self._removed_from_running = False
        return finished

    def update_async(self, output: SchedulerOutput, now: float) -> PendingTokens:
        """update() for a step whose sampled ids are still on the device (async scheduling, as vLLM's
        AsyncScheduler): each sampled request gets PLACEHOLDER_TOKEN so the next step can be scheduled at once.
        The real ids replace them in resolve_async; no policy reads a token's value before then (stop tokens
        are refused with async scheduling, since a placeholder cannot be checked against them)."""
        lens = [(len(r.output_token_ids), len(r.all_token_ids)) for r in output.reqs]
        finished = self.update(output, [PLACEHOLDER_TOKEN if s else -1 for s in output.do_sample], now)
        slots = [(i, r, n_out, n_all) for i, (r, (n_out, n_all)) in enumerate(zip(output.reqs, lens))
                 if len(r.output_token_ids) > n_out]
        return PendingTokens(slots, finished)

    @staticmethod
    def resolve_async(pending: PendingTokens, sampled_token_ids: Sequence[int], now: float) -> None:
        """Write the step's real ids (one per scheduled request, as for update()) over the placeholders of
        `pending`, stamped with the step's end time `now`."""
        for i, req, n_out, n_all in pending.slots:
            tok = int(sampled_token_ids[i])
            req.output_token_ids[n_out] = tok
            req.all_token_ids[n_all] = tok
            req.token_times[n_out] = now
            if n_out == 0:
                req.first_token_time = now
        for req in pending.finished:
            req.finish_time = now

    def check_invariants(self) -> None:
        """Block-manager accounting plus: every live request sits in exactly one queue matching its status."""
        tables = [r.page_table for r in self.running] + list(self._held_tables.values())
        self.block_manager.check_invariants(tables, [r.host_slots for r in self.swapped])
        seen = {}
        for name, q in (("running", self.running), ("waiting", self.waiting), ("swapped", self.swapped),
                        ("kv_ready", self._kv_ready), ("kv_pending", list(self._kv_pending.values()))):
            for r in q:
                assert r.request_id not in seen, f"{r.request_id} in {name} and {seen[r.request_id]}"
                seen[r.request_id] = name
        assert set(seen) == set(self._live), "live requests and queues disagree"
        for r in self.running:
            assert r.status is RUNNING, f"{r.request_id} in running with status {r.status}"
            need = -(-r.num_computed_tokens // self._ps)
            assert len(r.page_table) >= need, (f"{r.request_id}: {r.num_computed_tokens} computed tokens in "
                                               f"{len(r.page_table)} pages")
        for r in self.waiting:
            assert r.status in (WAITING, PREEMPTED) and not r.page_table and r.num_computed_tokens == 0
        for r in self.swapped:
            assert r.status is SWAPPED and not r.page_table
            assert len(r.host_slots) == -(-r.num_computed_tokens // self._ps)
        assert len(self.running) <= self._max_seqs

    # ---- decode runs (the simulator's fast path; the engine never calls these)
    # The exact policy classes whose schedule(), with nothing waiting, swapped, in flight or in the prefill phase,
    # is one decode token for every running request, in running order, and nothing else (set in policies.py; a
    # subclass is not covered, since it may schedule differently).
    DECODE_RUN_CLASSES: frozenset = frozenset()

    def decode_run(self, max_steps: int) -> Optional[DecodeRun]:
        """The decode run starting at the next step (pdjax.scheduler.runs: steps applied in bulk, the simulator's
        fast path; the engine never calls this), at most `max_steps` steps; None when the state does not allow
        one (with prefix caching, also when `_caching_run_ok` does not hold; the run evicts and registers as the
        steps would: pdjax.scheduler.runs)."""
        if type(self) not in self.DECODE_RUN_CLASSES or not self._decode_run_policy_ok():
            return None
        running = self.running
        if ((not running and not self._kv_ready) or self.swapped
                or self._last_emitted > self._applied_step or self._removed_from_running):
            return None
        if self._caching and not self._caching_run_ok():
            return None
        # Waiting requests stay waiting if running is full (for the whole run: it only shrinks in its last step);
        # with a prefill pass, also in a step whose chunks leave no budget (DecodeRun.next_step checks that).
        admit_blocked = self._admission_blocked()
        if self.waiting and not admit_blocked and not self._run_prefills:
            return None
        after = self._run_after     # the run applied last, if nothing touched this scheduler since
        n = 0 if after is None else len(after[2])
        clock, joined = None, 0     # a fresh run: a new clock, nobody on it
        if after is not None and after[0] == self.step and after[1] == self._applied_step and running[:n] == after[2]:
            parts = continued_run(after, self._ps, max_steps)
            clock, joined = after[7], n
            if len(running) > n:    # after its decoders (its prefills, some decoders now): read afresh
                parts = joined_parts(parts, self._run_parts(running[n:], max_steps))
                if parts is None:
                    return None
        else:
            parts = self._run_parts(running, max_steps)
            if parts is None:
                return None
        decoders, prefills, crossings, lefts, total, limit = parts
        if len(decoders) > self._run_decode_budget(bool(prefills or self.waiting)):
            return None
        bm = self.block_manager
        free = len(bm._free) + len(bm._free_cached)
        admitted = ()
        if self._kv_ready:      # handed-off requests whose KV landed: the first step may admit some (decode_only)
            if prefills or (self.waiting and not admit_blocked):
                return None
            admitted = self._run_kv_admissions(len(running), len(decoders), free - crossings.count(0))
            if admitted is None:
                return None
            for req, need in admitted:
                left = min(req.max_tokens - len(req.output_token_ids), self._max_len - len(req.all_token_ids))
                if left < limit:
                    limit = left
                decoders.append(req)
                crossings.append(need * self._ps - req.num_computed_tokens)
                lefts.append(left)
                total += req.num_computed_tokens
                free -= need
            if not decoders or len(decoders) > self._run_decode_budget(bool(self.waiting)):
                return None
        if limit < 1:
            return None
        return DecodeRun(self, decoders, prefills, crossings, lefts, total, limit, free,
                         self._budget - len(decoders), bool(self.waiting) and not admit_blocked, admitted,
                         bool(self._kv_ready), clock, joined)

    def _run_parts(self, running: List[Request], max_steps: int) -> Optional[tuple]:
        """decode_run's reading of the running requests: (decoders, prefills, crossings, lefts, total, limit) or
        None when one of them rules a run out (pdjax.scheduler.runs.DecodeRun's arguments)."""
        ps = self._ps
        max_len = self._max_len
        limit = max_steps
        decoders, prefills = [], []
        total = 0
        crossings = []      # per decoder: steps until it grows into a new page (0: in the run's first step)
        lefts = []          # per decoder: the step of the run (1: its first) in which it finishes
        for req in running:
            if req.status is not RUNNING or PLACEHOLDER_TOKEN in req.stop_ids:
                return None
            c = req.num_computed_tokens
            if c < req.prefill_end:
                if not self._run_prefills:
                    return None
                prefills.append(req)
                continue
            if req.first_token_time is None:
                return None
            if req.content_key_pages > req.num_registered_pages and self._keyless(req):
                return None      # a decoder registering its shared pages with keys (DecodeRun._registrations)
            # it finishes in the step that makes its outputs max_tokens or its tokens max_model_len
            left = req.max_tokens - len(req.output_token_ids)
            left2 = max_len - len(req.all_token_ids)
            if left2 < left:
                left = left2
            if left < limit:
                limit = left
            j = len(req.page_table) * ps - c
            if j < 0:
                return None
            decoders.append(req)
            crossings.append(j)
            lefts.append(left)
            total += c
        return decoders, prefills, crossings, lefts, total, limit

    def _caching_run_ok(self) -> bool:
        """With prefix caching: no host -> device copy pending (the next step's SchedulerOutput would carry it, and
        the simulator prices it: pdjax.sim.kv_tier), and no handed-off request whose KV landed holding pages
        already (a prefix reused here, DecodeOnlyScheduler.reuse_prefix: its admission needs fewer pages than the
        run's reading of it)."""
        if self.block_manager.pending_swap_in:
            return False
        for req in self._kv_ready:
            if req.page_table:
                return False
        return True

    # policy hooks of decode runs
    _run_prefills = False    # the policy's step in a run also runs its prefill pass over running prefills

    def _run_decode_budget(self, prefill_pending: bool) -> int:
        """Decodes the policy's decode pass takes at most in a run's step (with prefill work pending or not)."""
        return self._budget

    def _admission_blocked(self) -> bool:
        """No waiting request can be admitted in the run's steps, whatever the budget: running is full."""
        return len(self.running) >= self._max_seqs

    def _decode_run_policy_ok(self) -> bool:
        """The policy's own conditions for a decode run (see decode_run_limit)."""
        return True

    def _run_kv_admissions(self, running: int, decodes: int, free: int) -> Optional[list]:
        """The handed-off requests whose KV landed (`_kv_ready`) that a decode run's first step admits after its
        decode pass ([(request, pages it is given)]), with `running` requests running, `decodes` decodes in the
        step and `free` pages left by their page growth; None: no run (a policy without such admissions)."""
        return None

    def _after_decode_run(self) -> None:
        """The policy state its decode steps leave (see apply_decode_run)."""

    # ---- disaggregation hooks (meaningful for prefill_only / decode_only)
    def held_page_table(self, request_id: str) -> List[int]:
        """prefill_only: the pages holding a handed-off request's KV (the transfer's source)."""
        return self._held_tables[request_id]

    def release(self, request_id: str) -> None:
        """prefill_only: free a handed-off request's pages once its KV was transferred."""
        if request_id not in self._held:
            raise KeyError(f"release({request_id!r}): not a handed-off request held by this scheduler")
        del self._held[request_id]
        self.block_manager.free(self._held_tables.pop(request_id))

    def add_handoff(self, req: Request, now: float) -> bool:
        raise TypeError(f"add_handoff is for a 'decode_only' scheduler, this one is {self.name!r}")

    def mark_kv_arrived(self, request_id: str) -> None:
        raise TypeError(f"mark_kv_arrived is for a 'decode_only' scheduler, this one is {self.name!r}")

    # ------------------------------------------------------------------ internals
    def _validate_request(self, req: Request) -> Optional[str]:
        if not isinstance(req, Request):
            raise TypeError(f"add_request({req!r}): expected a pdjax.scheduler.Request")
        if req.status is not WAITING or req.num_computed_tokens or req.output_token_ids:
            return f"request is not fresh (status {req.status}, {req.num_computed_tokens} computed tokens)"
        if req.request_id in self._live or req.request_id in self._held:
            return f"duplicate request_id {req.request_id!r} of a live request"
        n = len(req.prompt_token_ids)
        if n == 0:
            return "empty prompt: expected at least one token"
        if n > self._max_len:
            return f"prompt of {n} tokens exceeds max_model_len={self._max_len}"
        vocab = self.config.vocab_size
        bound = req.token_bound       # a guarantee (lo, hi) of the request's maker: scan only if it allows a bad id
        if bound is None or bound[0] < 0 or (vocab and bound[1] >= vocab):
            if min(req.prompt_token_ids) < 0:
                return f"negative token id {min(req.prompt_token_ids)} in the prompt"
            if vocab and max(req.prompt_token_ids) >= vocab:
                return f"token id {max(req.prompt_token_ids)} in the prompt is outside the vocabulary [0, {vocab})"
        if req.max_tokens < 1:
            return f"max_tokens={req.max_tokens}, expected >= 1"
        return None

    def _reject(self, req: Request, reason: str) -> None:
        req.status = REJECTED
        req.finish_reason = "rejected"
        req.reject_reason = reason
        req.finish_time = req.arrival_time
        self.finished.append(req)

    def _finish(self, req: Request, reason: str, now: float) -> None:
        req.status = FINISHED
        req.finish_reason = reason
        req.finish_time = now
        self._live.pop(req.request_id, None)
        self.finished.append(req)

    def _enqueue_waiting(self, req: Request, front: bool) -> None:
        if self._priority:
            bisect.insort(self.waiting, req, key=_priority_key)
        elif front:
            self.waiting.insert(0, req)
        else:
            self.waiting.append(req)

    def _keyless(self, req: Request) -> bool:
        """Whether `req` offers its full pages to the prefix cache without keys: it has numbered keys (no other
        request can look its pages up), was never preempted (nor itself: it never will while it runs), and this
        scheduler's finished requests' pages are never looked up again (FINISHED_PAGES_DEAD). Its first
        `content_key_pages` (numbered_keys: other requests may share them) are still registered with their keys."""
        return self._dead and req.key_base is not None and not req.num_preemptions

    def _free_finished(self, req: Request) -> None:
        """Free the pages of `req`, finished for good. A numbered request (block_manager.numbered_key_bases) never
        preempted, on a scheduler whose finished requests' pages no request can look up again, offered its full
        pages to the prefix cache without keys (_keyless): they become a dead segment (free_dead)."""
        if self._keyless(req):
            registered = req.num_registered_pages
            keyed = min(req.content_key_pages, registered)
            if self.block_manager.free_dead(req.page_table, registered, keyed):
                return
            self._keep_registered(req)
        self.block_manager.free(req.page_table)

    def _keep_registered(self, req: Request) -> None:
        """Before `req` is first preempted (it will look its pages up again): register the pages _register
        offered without keys, as it would have with them."""
        if self._keyless(req):
            n = req.num_registered_pages
            self.block_manager.register(req.page_table, request_page_keys(req, self._ps, n), 0, n)

    def _register(self, req: Request) -> None:
        full = req.num_computed_tokens // self._ps
        keyed = full         # keyless: only the pages other requests may share get keys (_free_finished reads the rest)
        if self._keyless(req) and req.content_key_pages < full:
            keyed = req.content_key_pages
        if keyed > req.num_registered_pages:
            self.block_manager.register(req.page_table, request_page_keys(req, self._ps, keyed),
                                        req.num_registered_pages, keyed)
        req.num_registered_pages = full

    def _prefill_chunk(self, req: Request, budget_left: int) -> int:
        """Tokens of `req`'s remaining prefill to schedule given `budget_left` (0: none this step)."""
        return self._chunk_size(req.num_computed_tokens, len(req.all_token_ids), budget_left)

    def _chunk_size(self, c: int, tokens: int, budget_left: int) -> int:
        """Tokens of a prefill with `c` of its `tokens` computed to schedule given `budget_left` (0: none)."""
        rem = tokens - c
        n = rem if rem < budget_left else budget_left
        cap = self._chunk_cap
        if cap and n > cap:
            n = cap
        if self._dynamic:
            cfg = self.config
            cap = max(cfg.dynamic_chunk_min_tokens,
                      self._budget * cfg.dynamic_chunk_ref_context // (cfg.dynamic_chunk_ref_context + c))
            if n > cap:
                n = cap
        if n < rem:
            if not self._chunking:
                return 0
            if self._tile:
                n -= n % self._tile
        return n

    def _emit(self, out: SchedulerOutput, req: Request, n: int) -> None:
        c = req.num_computed_tokens
        end = c + n
        out.reqs.append(req)
        out.req_ids.append(req.request_id)
        out.token_ids.append(req.all_token_ids[c:end])
        out.num_computed_tokens.append(c)
        out.num_new_tokens.append(n)
        out.page_tables.append(req.page_table)
        out.do_sample.append(end == len(req.all_token_ids))
        out.sampling.append(req.sampling)
        if c < req.prefill_end:
            out.is_prefill.append(True)
            out.num_prefill_tokens += n
        else:
            out.is_prefill.append(False)
            out.num_decode_tokens += n
        req.sched_step = self.step

    def _schedule_running(self, out: SchedulerOutput, req: Request, n: int, now: float) -> bool:
        """Grow `req`'s pages for `n` more tokens (preempting if needed) and emit it; False if it was preempted."""
        need = -(-(req.num_computed_tokens + n) // self._ps) - len(req.page_table)
        if need > 0:
            bm = self.block_manager
            while bm.num_free_pages < need:
                victim = self._pick_victim()
                if victim is None:
                    # The victim is in an in-flight batch (never preempted: its pages are being written): `req`
                    # waits for that batch; nothing is admitted in this step, as after a preemption.
                    self._preempted_this_step = True
                    return False
                self._preempt(victim, out, now)
                if victim is req:
                    return False
            bm.allocate(req.page_table, need)
        self._emit(out, req, n)
        return True

    def _decode_pass(self, out: SchedulerOutput, now: float, budget: int, prefills: Optional[list]) -> int:
        """Schedule one token for each running decode, in admission order, while `budget` lasts.

        Running requests in the prefill phase are appended to `prefills` (when given). Returns the budget left.
        This is the hot loop: page growth is inlined and the decodes that need no preemption are emitted in
        bulk (`_emit_decodes`, in batch order: a run is flushed before any slow-path emission)."""
        ps = self._ps
        step = self.step
        bm = self.block_manager
        used = 0      # decode tokens of this pass, both paths
        n_fast = 0    # of which emitted in bulk (the slow path's _emit counts its own)
        run: List[Request] = []
        add = run.append
        floor = self._floor
        for req in self.running:
            if req.status is not RUNNING or req.sched_step > floor:   # gone, or in flight
                continue
            c = req.num_computed_tokens
            if c < req.prefill_end:
                if prefills is not None:
                    prefills.append(req)
                continue
            if used >= budget:
                if prefills is None:
                    break
                continue
            table = req.page_table
            if c >= len(table) * ps:
                if bm._free or bm._free_cached:
                    bm.allocate(table, 1)
                else:
                    if run:
                        n_fast += self._emit_decodes(out, run)
                        run = []
                        add = run.append
                    if self._schedule_running(out, req, 1, now):
                        used += 1
                    continue
            add(req)
            req.sched_step = step
            used += 1
        if run:
            n_fast += self._emit_decodes(out, run)
        out.num_decode_tokens += n_fast
        return budget - used

    @staticmethod
    def _emit_decodes(out: SchedulerOutput, run: List[Request]) -> int:
        """Append one decode token of every request of `run` to `out` (what `_emit(out, req, 1)` appends
        for a decode, minus the counters and the request's own stamps); returns len(run)."""
        k = len(run)
        out.reqs += run
        out.req_ids += [r.request_id for r in run]
        out.token_ids += [r.all_token_ids[r.num_computed_tokens:r.num_computed_tokens + 1] for r in run]
        out.num_computed_tokens += [r.num_computed_tokens for r in run]
        out.num_new_tokens += [1] * k
        out.page_tables += [r.page_table for r in run]
        out.do_sample += [True] * k
        out.sampling += [r.sampling for r in run]
        out.is_prefill += [False] * k
        return k

    def _pick_victim(self) -> Optional[Request]:
        """The victim by the module docstring's rule; None when it is in an in-flight batch (then nobody is
        preempted: the requester waits for that batch)."""
        step = self.step
        victim = None
        vkey = None
        for r in self.running:
            if r.status is RUNNING and r.sched_step != step:
                k = (r.priority, r.arrival_time, r.admit_seq)
                if vkey is None or k > vkey:
                    victim, vkey = r, k
        if victim is None:
            raise RuntimeError("no preemptible request: every running request is already scheduled")
        if victim.sched_step > self._floor:
            return None
        return victim

    def _preempt(self, req: Request, out: SchedulerOutput, now: float) -> None:
        bm = self.block_manager
        self._keep_registered(req)
        self._preempted_this_step = True
        self.num_preemptions += 1
        req.num_preemptions += 1
        req.preemption_times.append(now)
        out.preempted_req_ids.append(req.request_id)
        if self._swap and req.page_table and bm.num_free_host_pages >= len(req.page_table):
            slots, copies = bm.swap_out(req.page_table)
            out.swap_out.extend(copies)
            req.host_slots = slots
            req.page_table = []
            req.status = SWAPPED
            self.swapped.append(req)
            self.num_swaps += 1
            return
        bm.free(req.page_table)
        req.page_table = []
        req.num_computed_tokens = 0
        req.num_registered_pages = 0
        req.prefill_end = len(req.all_token_ids)
        req.status = PREEMPTED
        self._enqueue_waiting(req, front=True)

    def _admit(self, out: SchedulerOutput, req: Request, budget_left: int, now: float) -> int:
        """Try to start waiting `req` with a first chunk within `budget_left`; returns its tokens (0: not admitted).

        Applies the prefix cache, the chunking rules and the watermark. The caller removes it from `waiting`
        and checks max_num_seqs."""
        bm = self.block_manager
        ps = self._ps
        hits = ()
        if self._caching:
            total = len(req.all_token_ids)
            max_hit = (total - 1) // ps     # always compute >= 1 token, to sample from it
            hits = bm.match_prefix(request_page_keys(req, ps, max_hit), max_hit)
            if bm.host_tier is not None:
                return self._admit_tiered(out, req, budget_left, now, hits, max_hit)
        req.num_computed_tokens = len(hits) * ps
        n = self._prefill_chunk(req, budget_left)
        if n <= 0:
            req.num_computed_tokens = 0
            return 0
        need = -(-(req.num_computed_tokens + n) // ps) - len(hits)
        if self._full_isl:    # vLLM's full_sequence_must_fit: pages for all tokens it has now, not just the chunk
            need_check = -(-len(req.all_token_ids) // ps) - len(hits)
        else:
            need_check = need
        wm = self._watermark_pages if (self.running or not self._watermark_if_running) else 0
        if bm.num_free_pages - need_check - (bm.num_free_among(hits) if hits else 0) < wm:
            req.num_computed_tokens = 0
            return 0
        if self._caching:
            bm.num_query_pages += (len(req.all_token_ids) - 1) // ps
        if hits:
            bm.take_cached(req.page_table, hits)
        bm.allocate(req.page_table, need)
        self._start_admitted(req, len(hits), now)
        self._emit(out, req, n)
        return n

    def _admit_tiered(self, out: SchedulerOutput, req: Request, budget_left: int, now: float, hits: list,
                      max_hit: int) -> int:
        """_admit with a host KV tier (pdjax.scheduler.kv_tier): the device hits, then the run of pages the host
        tier holds after them, loaded back into fresh pages (host -> device copies before the step), both counted
        as computed. The same rules as _admit otherwise; the host slots are looked up only once the request fits."""
        bm, ps = self.block_manager, self._ps
        keys = request_page_keys(req, ps, max_hit)
        host = bm.host_tier.count_prefix(keys, len(hits), max_hit, bm.tier_owner)
        req.num_computed_tokens = (len(hits) + host) * ps
        n = self._prefill_chunk(req, budget_left)
        if n <= 0:
            req.num_computed_tokens = 0
            return 0
        need = -(-(req.num_computed_tokens + n) // ps) - len(hits)
        need_check = -(-len(req.all_token_ids) // ps) - len(hits) if self._full_isl else need
        wm = self._watermark_pages if (self.running or not self._watermark_if_running) else 0
        if bm.num_free_pages - need_check - (bm.num_free_among(hits) if hits else 0) < wm:
            req.num_computed_tokens = 0
            return 0
        bm.num_query_pages += max_hit
        if hits:
            bm.take_cached(req.page_table, hits)
        if host:
            bm.load_from_host(req.page_table, keys, bm.match_host(keys, len(hits), len(hits) + host))
        bm.allocate(req.page_table, need - host)
        self._start_admitted(req, len(hits) + host, now)
        self._emit(out, req, n)
        return n

    def _start_admitted(self, req: Request, cached_pages: int, now: float) -> None:
        """_admit's marks on a request it starts at `now`, the first `cached_pages` of its prompt found cached
        (computed already): its cached tokens and registered pages, whether its prefill is long, running."""
        req.num_cached_tokens = cached_pages * self._ps
        req.num_registered_pages = cached_pages
        req.is_long_prefill = bool(self._long) and (len(req.all_token_ids) - req.num_computed_tokens) > self._long
        self._start_running(req, now)

    def _plan_admissions(self, queue: Sequence[Request], running: int, free: int, left: int
                         ) -> Optional[List[Tuple[Request, int, int]]]:
        """What `_admit_waiting` (and `_admit`) would start from the front of `queue` after a step's decodes and
        chunks, planned without changing anything (the decode runs: pdjax.scheduler.runs, pair_runs): with
        `running` requests running (>= 1: the watermark applies), `free` pages and `left` tokens of budget left,
        [(request, first chunk, pages)] in order until one does not fit; None when one could hit a cached prefix
        (prefix caching, not `holds_no_prefix`, and its first page on the device or in the host tier: its admission
        is schedule()'s; a page evicted by the step's growth would only move to the host tier)."""
        ps, caching = self._ps, self._caching
        planned = []
        for req in queue:
            if running >= self._max_seqs or left <= 0:
                break
            if caching and not holds_no_prefix(req) and self.block_manager.holds_first_page(req):
                return None
            tokens = len(req.all_token_ids)
            n = self._chunk_size(0, tokens, left)
            if n <= 0:
                break
            need = -(-n // ps)
            if free - (-(-tokens // ps) if self._full_isl else need) < self._watermark_pages:
                break
            planned.append((req, n, need))
            free -= need
            left -= n
            running += 1
        return planned

    def _start_running(self, req: Request, now: float) -> None:
        req.status = RUNNING
        req.admit_seq = self._admit_counter
        self._admit_counter += 1
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        self.running.append(req)

    def _resume_swapped(self, out: SchedulerOutput, budget_left: int, now: float, phase: Optional[bool] = None,
                        prefill_counts: Optional[list] = None, max_decodes: Optional[int] = None) -> int:
        """Swap in swapped requests (in preemption order) while they fit; returns the tokens scheduled.

        phase: None resumes any; True only requests in the prefill phase; False only decodes (others are
        skipped, not blocking). prefill_counts: [in-prefill, long in-prefill] running counts when the
        vllm_v1 partial-prefill limits apply (updated in place). max_decodes: at most this many decode
        resumes (the starvation guard's decode cap)."""
        if not self.swapped or self._preempted_this_step:
            return 0
        bm = self.block_manager
        ps = self._ps
        cfg = self.config
        used = 0
        resumed = 0
        for req in self.swapped:
            if len(self.running) >= self._max_seqs or budget_left - used <= 0:
                break
            in_prefill = req.num_computed_tokens < req.prefill_end
            if phase is not None and in_prefill != phase:
                continue
            if not in_prefill and max_decodes is not None:
                if max_decodes <= 0:
                    continue
                max_decodes -= 1
            if in_prefill and prefill_counts is not None:
                if cfg.max_num_partial_prefills and prefill_counts[0] >= cfg.max_num_partial_prefills:
                    break
                if (cfg.max_long_partial_prefills and req.is_long_prefill
                        and prefill_counts[1] >= cfg.max_long_partial_prefills):
                    break
            n = self._prefill_chunk(req, budget_left - used) if in_prefill else 1
            if n <= 0:
                break
            need = -(-(req.num_computed_tokens + n) // ps) - len(req.host_slots)
            wm = self._watermark_pages if (self.running or not self._watermark_if_running) else 0
            if self._full_isl:   # the whole current sequence must fit (vllm_v1)
                full = max(-(-len(req.all_token_ids) // ps), len(req.host_slots) + need)
                if bm.num_free_pages - full < wm:
                    break
            elif bm.num_free_pages - len(req.host_slots) - need < wm:
                break
            out.swap_in.extend(bm.swap_in(req.host_slots, req.page_table))
            req.host_slots = []
            req.num_registered_pages = 0
            bm.allocate(req.page_table, need)
            req.status = RUNNING
            self.running.append(req)   # keeps its admit_seq: it is as old as before
            self._emit(out, req, n)
            used += n
            resumed += 1
            if in_prefill and prefill_counts is not None:
                prefill_counts[0] += 1
                prefill_counts[1] += int(req.is_long_prefill)
        if resumed:
            self.swapped = [r for r in self.swapped if r.status is SWAPPED]
        return used

    def _prefill_pass(self, out: SchedulerOutput, now: float, prefills: List[Request], budget: int) -> int:
        """Schedule the next chunk of each running prefill in `prefills` within `budget`; returns what is left."""
        floor = self._floor
        for req in prefills:
            if budget <= 0:
                break
            if req.status is not RUNNING or req.sched_step > floor:   # gone, or in flight
                continue
            n = self._prefill_chunk(req, budget)
            if n <= 0:
                continue
            if self._schedule_running(out, req, n, now):
                budget -= n
        return budget

    def _prefill_pending(self) -> bool:
        """Is there prefill work (running prefills, swapped prefills or waiting requests)?"""
        if self.waiting:
            return True
        for r in self.swapped:
            if r.num_computed_tokens < r.prefill_end:
                return True
        for r in self.running:
            if r.num_computed_tokens < r.prefill_end:
                return True
        return False

    def _admit_waiting(self, out: SchedulerOutput, budget_left: int, now: float) -> int:
        """Admit waiting requests in queue order until one does not fit; returns the tokens scheduled."""
        if not self.waiting or self._preempted_this_step:
            return 0
        used = 0
        k = 0
        waiting = self.waiting
        while k < len(waiting) and len(self.running) < self._max_seqs and budget_left - used > 0:
            n = self._admit(out, waiting[k], budget_left - used, now)
            if n == 0:
                break
            used += n
            k += 1
        if k:
            del waiting[:k]
        return used

    def _schedule(self, out: SchedulerOutput, now: float) -> None:
        raise NotImplementedError
