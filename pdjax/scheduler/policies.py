"""Batching policies: small classes over `Scheduler`, picked by `SchedulerConfig.policy` in `make_scheduler`.

| policy        | one iteration                                                                           |
|---------------|-----------------------------------------------------------------------------------------|
| vllm_v0       | if requests wait (and none is swapped): a prefill-only batch of whole prompts, in queue |
|               | order up to the first that does not fit; only if none fits, a decode batch of all       |
|               | running requests (+ swap-ins)                                                           |
| orca          | all decodes (+ swap-ins), then whole new prompts that fit the rest of the budget        |
| decode_first  | once no request runs: prefill-only iterations of whole prompts forming a batch; then    |
|               | decodes of that batch only (+ swap-ins) until it drains                                 |
| sarathi       | all decodes, then running prefill chunks, then swap-ins, then new requests' chunks,     |
|               | cut to the budget (stall-free); optional tile alignment / dynamic chunk caps            |
| chunked_only  | Sarathi-Serve's chunked-prefills-only ablation (its `simple_chunking` scheduler): turns |
|               | alternate strictly: a prefill turn (running prefill chunks + prefill swap-ins; only if  |
|               | none ran, new requests' chunks) then a decode turn (every decode + decode swap-ins);    |
|               | a turn with no work passes to the other in the same step; never both in one batch       |
| chunked_prefill_first | a prefill batch (running chunks, then swap-ins, then new chunks) whenever any   |
|               | prefill work can run, else a decode batch (the old `chunked_only`; decodes wait for     |
|               | whole prompts)                                                                          |
| vllm_v1       | vLLM V1's scheduler at its defaults: running requests in admission order, each with     |
|               | what it needs (1 decode token or its next chunk), then swap-ins, then waiting ones; one |
|               | budget; admission needs the whole sequence's pages; vLLM's victim rule (see the class)  |
| prefill_only  | sarathi without decodes; a request finishes with 'handoff' once its first token is      |
|               | sampled, keeping its pages until `release`                                              |
| decode_only   | sarathi over handed-off requests, admitted once their KV has arrived and pages fit      |

Disaggregation protocol (prefill instance P with a prefill_only scheduler, decode instance D with decode_only):
1. P: `add_request(req)`; P schedules its prefill chunks; the last chunk has do_sample=True; `update` appends
   the first token (first_token_time set) and returns req finished with finish_reason 'handoff' (or 'stop' /
   'length' if the first token already ends it: then nothing is handed off and its pages are freed).
2. P's pages stay allocated: `P.held_page_table(req_id)` names the pages holding its KV (the first
   `num_computed_tokens == num_prompt_tokens` tokens). The engine starts the KV transfer.
3. D: `add_handoff(req, now)` with that same Request (or a copy carrying prompt, output, timestamps): D resets
   status to WAITING_FOR_KV and finish_reason/finish_time to None; returns False (req finished as 'rejected'
   with reject_reason) if D cannot take it.
4. When the transfer has landed in D's staging area: `D.mark_kv_arrived(req_id)`; then P: `release(req_id)`
   frees P's pages (or P.abort(req_id, now) if the transfer failed).
5. D admits arrived requests in arrival-mark order when it has a sequence slot, budget and pages for the
   whole context plus the watermark (backpressure: otherwise they wait). On admission D allocates the pages
   and lists the request in `SchedulerOutput.kv_handoff_req_ids`: before that step the runner writes the
   received KV into the first `num_computed_tokens` positions of its `page_tables` entry. The same step
   decodes the first token (the token fed is the first output token).
D may preempt handed-off requests like any other; a recompute preemption re-prefills prompt + outputs on D.

Batches in flight (pipeline parallelism, pdjax.scheduler.batch_queue): every policy above builds its batch from
the requests that are not in an in-flight batch (the shared passes of base.py skip them) and never preempts one.
"""
from __future__ import annotations

from typing import Type

from pdjax.config.registry import POLICIES, PolicyInfo, add_policy
from pdjax.config.scheduler import SchedulerConfig
from pdjax.scheduler.block_manager import request_page_keys
from pdjax.scheduler.base import FINISHED, RUNNING, WAITING_FOR_KV, Scheduler
from pdjax.scheduler.output import SchedulerOutput
from pdjax.scheduler.request import Request


class VllmV0Scheduler(Scheduler):
    """Prefill-prioritizing (vLLM V0 default): whole prompts in prefill-only batches whenever one fits."""
    name = "vllm_v0"

    def _schedule(self, out: SchedulerOutput, now: float) -> None:
        if self.waiting and not self.swapped:
            self._admit_waiting(out, self._budget, now)
            if out.req_ids:
                return
        left = self._decode_pass(out, now, self._budget, None)
        self._resume_swapped(out, left, now)


class OrcaScheduler(Scheduler):
    """Iteration-level hybrid batches: every decode plus whole new prompts (never split)."""
    name = "orca"

    def _schedule(self, out: SchedulerOutput, now: float) -> None:
        left = self._decode_pass(out, now, self._budget, None)
        left -= self._resume_swapped(out, left, now)
        self._admit_waiting(out, left, now)


class DecodeFirstScheduler(Scheduler):
    """Request-level batching (FasterTransformer-style): form a batch, decode it until it drains, repeat.

    Once no request runs, the scheduler forms a new batch: prefill-only iterations of whole prompts while
    waiting requests fit (max_num_seqs, budget, pages). The first iteration that can admit nothing seals the
    batch; from then on only its decodes run (plus swap-ins of its own preempted members), and nothing is
    admitted until every member finished (recompute-preempted members rejoin the next batch).
    """
    name = "decode_first"

    def __init__(self, config: SchedulerConfig):
        super().__init__(config)
        self._forming = True

    def _schedule(self, out: SchedulerOutput, now: float) -> None:
        if not self.running and not self.swapped:
            self._forming = True
        if self._forming:
            self._admit_waiting(out, self._budget, now)
            if out.req_ids:
                return
            self._forming = False
        left = self._decode_pass(out, now, self._budget, None)
        self._resume_swapped(out, left, now)

    def _admission_blocked(self) -> bool:
        return not self._forming or super()._admission_blocked()   # a sealed batch admits nothing

    def _after_decode_run(self) -> None:
        self._forming = False    # running requests and nothing to admit: the batch is sealed


class SarathiScheduler(Scheduler):
    """Stall-free batching: decodes first, then prefill chunks in what the decodes leave."""
    name = "sarathi"

    def _schedule(self, out: SchedulerOutput, now: float) -> int:
        budget = self._budget
        decode_budget = budget
        guard = self.config.min_prefill_tokens
        if guard and self._prefill_pending():
            decode_budget = budget - guard
        split = self.config.decode_batches
        if split > 1:    # at most a 1/split share of the running requests' decodes per batch in flight
            decode_budget = min(decode_budget, -(-len(self.running) // split))
        prefills = []
        left = self._decode_pass(out, now, decode_budget, prefills)
        budget -= decode_budget - left
        budget = self._prefill_pass(out, now, prefills, budget)
        budget -= self._resume_swapped(out, budget, now, max_decodes=left if guard else None)
        budget -= self._admit_waiting(out, budget, now)
        return budget

    _run_prefills = True

    def _decode_run_policy_ok(self) -> bool:
        return self.config.decode_batches <= 1

    def _run_decode_budget(self, prefill_pending: bool) -> int:
        guard = self.config.min_prefill_tokens
        return self._budget - guard if guard and prefill_pending else self._budget


class ChunkedOnlyScheduler(Scheduler):
    """Sarathi-Serve's chunked-prefills-only ablation: the `simple_chunking` scheduler of its artifact
    (sarathi/core/scheduler/simple_chunking_scheduler.py), which strictly alternates two kinds of turn.

    - Prefill turn: the next chunk of every running prefill (admission order) and of swapped requests in the
      prefill phase, cut to the token budget. Only if none of them ran: new requests' chunks, in queue order
      until one does not fit (as the artifact, which returns as soon as a running prefill was scheduled).
    - Decode turn: one token for every running decode (up to the budget), then decode swap-ins.
    After a batch of one kind the turn passes to the other. A turn with no work passes to the other in the same
    step (the artifact does so for an empty prefill turn; after an empty decode turn it returns an empty batch,
    which here would only idle the engine for one iteration, so the prefill turn runs at once instead). A batch
    never mixes prefill and decode, and a decode waits for at most one prefill turn (one chunk-sized batch).
    Admission, paging and the victim rule are pdjax's shared ones (as for `sarathi`), so the ablation differs
    from `sarathi` only in batching: the artifact instead allocates a whole prompt's blocks at admission.
    """
    name = "chunked_only"

    def __init__(self, config: SchedulerConfig):
        super().__init__(config)
        self._prefill_turn = True

    def _schedule(self, out: SchedulerOutput, now: float) -> None:
        first_prefill = self._prefill_turn
        for prefill in ((True, False) if first_prefill else (False, True)):
            ran = self._run_prefill_turn(out, now) if prefill else self._run_decode_turn(out, now)
            if ran:
                self._prefill_turn = not prefill
                return
        self._prefill_turn = True

    def _after_decode_run(self) -> None:
        self._prefill_turn = True   # a decode turn ran (after an empty prefill turn, if it was that one's turn)

    def _run_prefill_turn(self, out: SchedulerOutput, now: float) -> bool:
        prefills = [r for r in self.running if r.num_computed_tokens < r.prefill_end]
        budget = self._budget
        if prefills:
            budget = self._prefill_pass(out, now, prefills, budget)
        budget -= self._resume_swapped(out, budget, now, phase=True)
        if out.req_ids:
            return True
        self._admit_waiting(out, budget, now)
        return bool(out.req_ids)

    def _run_decode_turn(self, out: SchedulerOutput, now: float) -> bool:
        left = self._decode_pass(out, now, self._budget, None)
        self._resume_swapped(out, left, now, phase=False)
        return bool(out.req_ids)


class ChunkedPrefillFirstScheduler(Scheduler):
    """Chunked prompts, prefill-prioritizing: a prefill batch whenever any prefill work can run, else a decode
    batch, never both in one batch (what `chunked_only` meant before it became Sarathi-Serve's alternating
    ablation). Decodes wait while prompts are being chunked through: vLLM V0's prefill-first rule with chunking."""
    name = "chunked_prefill_first"

    def _schedule(self, out: SchedulerOutput, now: float) -> None:
        prefills = [r for r in self.running if r.num_computed_tokens < r.prefill_end]
        if prefills or self.waiting or any(r.num_computed_tokens < r.prefill_end for r in self.swapped):
            budget = self._prefill_pass(out, now, prefills, self._budget)
            budget -= self._resume_swapped(out, budget, now, phase=True)
            self._admit_waiting(out, budget, now)
            if out.req_ids:
                return
        left = self._decode_pass(out, now, self._budget, None)
        self._resume_swapped(out, left, now, phase=False)


class VllmV1Scheduler(Scheduler):
    """vLLM V1's scheduler (vllm/v1/core/sched/scheduler.py, `Scheduler.schedule`) at vLLM's defaults.

    No phases: running requests in admission order, each with what it needs (1 decode token or its next
    chunk), then swapped requests (pdjax's swap mode; vLLM V1 only recomputes), then waiting ones, one shared
    budget. The rules that follow vLLM:
    - Admission of a waiting or recompute-preempted request (and resuming a swapped one) needs pages for its
      whole current sequence (prompt, plus outputs so far after a recompute; prefix-cache hits count as held)
      plus the watermark, not just its first chunk's (`scheduler_reserve_full_isl`, vLLM's default True; vLLM's
      `KVCacheManager.allocate_slots(full_sequence_must_fit=...)`). Only the chunk's pages are allocated.
    - The watermark (default 0.0, as vLLM) counts only while some request runs (`has_scheduled_reqs`).
    - `long_prefill_token_threshold` caps a chunk only in a step that starts with more than one request
      (running + waiting + swapped): a lone request takes the whole budget.
    - A running request short of pages preempts, until its pages fit: under 'priority' ordering the running
      request with the largest (priority, arrival_time) (first in running order on a tie), even one already
      in this step's batch (taken back out: its tokens return to the budget and its pages to the pool); under
      'fcfs' the last request of the running list (the latest (re)admitted). If the request preempts itself,
      no further running request is scheduled in this step; after any preemption nothing is admitted.
      Batches in flight (base.py): when that victim is in an in-flight batch, nobody is preempted; the request
      is not scheduled, the running pass stops and nothing is admitted in this step (it retries once that batch
      is applied).
    pdjax extensions, off by default: `min_prefill_tokens` (a decode cap while prefill work waits), and
    `max_num_partial_prefills` / `max_long_partial_prefills`: at the end of every schedule() at most that many
    running requests are in the prefill phase (num_computed_tokens < prefill_end), and of them at most
    max_long_partial_prefills have `is_long_prefill` (more than the threshold of uncached prefill at
    admission). A long request that would break the long limit is skipped, letting shorter ones behind it in.
    """
    name = "vllm_v1"

    def __init__(self, config: SchedulerConfig):
        super().__init__(config)
        self._full_isl = config.scheduler_reserve_full_isl
        self._watermark_if_running = True

    def _schedule(self, out: SchedulerOutput, now: float) -> None:
        budget = self._budget
        # vLLM: the long-prefill cap exists to keep one prefill from starving others; alone, it is not applied
        self._chunk_cap = self._long if len(self.running) + len(self.waiting) + len(self.swapped) > 1 else 0
        guard = self.config.min_prefill_tokens
        decode_cap = budget - guard if guard and self._prefill_pending() else budget
        n_dec = 0
        ps, step, bm = self._ps, self.step, self.block_manager
        a_req, a_id, a_tok = out.reqs.append, out.req_ids.append, out.token_ids.append
        a_c, a_n, a_pt = out.num_computed_tokens.append, out.num_new_tokens.append, out.page_tables.append
        a_s, a_smp, a_pre = out.do_sample.append, out.sampling.append, out.is_prefill.append
        floor = self._floor
        for req in self.running:
            if budget <= 0:
                break
            if req.status is not RUNNING or req.sched_step > floor:   # gone, or in an in-flight batch
                continue
            c = req.num_computed_tokens
            if c >= req.prefill_end:
                if n_dec >= decode_cap:
                    continue
                table = req.page_table
                # Same inlined emission as Scheduler._decode_pass, kept inline because it is the per-decode hot
                # loop (experiments/bench_scheduler); vllm_v1 cannot reuse _decode_pass, which defers prefills.
                if c < len(table) * ps or bm._free or bm._free_cached:   # fast path: no preemption
                    if c >= len(table) * ps:
                        bm.allocate(table, 1)
                    a_req(req)
                    a_id(req.request_id)
                    a_tok(req.all_token_ids[c:c + 1])
                    a_c(c)
                    a_n(1)
                    a_pt(table)
                    a_s(True)
                    a_smp(req.sampling)
                    a_pre(False)
                    req.sched_step = step
                    out.num_decode_tokens += 1
                    budget -= 1
                    n_dec += 1
                    continue
                n = 1
            else:
                n = self._prefill_chunk(req, budget)
                if n <= 0:
                    continue
            ok, refund, refund_dec = self._grow_or_preempt(out, req, n, now)
            budget += refund
            n_dec -= refund_dec
            if not ok:
                break          # vLLM: the request could not be scheduled, stop the running pass
            budget -= n
            if c >= req.prefill_end:
                n_dec += 1
        self._resume_and_admit(out, budget, now, decode_cap - n_dec if guard else None)

    def _resume_and_admit(self, out: SchedulerOutput, budget: int, now: float, max_decodes) -> None:
        """After the running pass: swapped requests back, then new ones, under the partial-prefill limits when
        they are set (max_decodes: what the min_prefill_tokens guard leaves the decodes, None without it)."""
        cfg = self.config
        if not (cfg.max_num_partial_prefills or cfg.max_long_partial_prefills):
            budget -= self._resume_swapped(out, budget, now, max_decodes=max_decodes)
            self._admit_waiting(out, budget, now)
            return
        if self._preempted_this_step or not (self.swapped or self.waiting):
            return
        counts = [0, 0]
        for r in self.running:
            if r.status is RUNNING and r.num_computed_tokens < r.prefill_end:
                counts[0] += 1
                counts[1] += int(r.is_long_prefill)
        budget -= self._resume_swapped(out, budget, now, prefill_counts=counts, max_decodes=max_decodes)
        self._admit_limited(out, budget, now, counts)

    def _run_decode_budget(self, prefill_pending: bool) -> int:
        guard = self.config.min_prefill_tokens
        return self._budget - guard if guard and prefill_pending else self._budget

    def _after_decode_run(self) -> None:   # as its steps set it
        self._chunk_cap = self._long if len(self.running) + len(self.waiting) + len(self.swapped) > 1 else 0

    def _grow_or_preempt(self, out: SchedulerOutput, req: Request, n: int, now: float):
        """Pages for `n` more tokens of running `req`, preempting by vLLM's rule while the pool is short; emits
        `req` if it was not itself preempted. Returns (scheduled, tokens and decodes taken back out of the batch
        from preempted requests already in it)."""
        ps = self._ps
        bm = self.block_manager
        need = -(-(req.num_computed_tokens + n) // ps) - len(req.page_table)
        refund = refund_dec = 0
        while need > 0 and bm.num_free_pages < need:
            victim = self._pick_victim_v1()
            if self._floor < victim.sched_step < self.step:
                # In an in-flight batch: never a victim (its pages are being written). `req` waits for that batch
                # instead of preempting anyone, and nothing is admitted in this step (as after a preemption).
                self._preempted_this_step = True
                return False, refund, refund_dec
            if victim.sched_step == self.step:
                k, was_prefill = self._unemit(out, victim)
                refund += k
                refund_dec += not was_prefill
            self._preempt(victim, out, now)
            if victim is req:
                return False, refund, refund_dec
        if need > 0:
            bm.allocate(req.page_table, need)
        self._emit(out, req, n)
        return True, refund, refund_dec

    def _pick_victim_v1(self) -> Request:
        """vLLM's victim: 'priority': max (priority, arrival_time) over all running requests, the first in running
        order on a tie (Python's max); 'fcfs': the last of the running list (`self.running.pop()`). The victim
        may be in an in-flight batch (batches in flight, see base.py): the caller then waits instead."""
        if self._priority:
            victim = vkey = None
            for r in self.running:
                if r.status is RUNNING:
                    k = (r.priority, r.arrival_time)
                    if vkey is None or k > vkey:
                        victim, vkey = r, k
            return victim
        for r in reversed(self.running):
            if r.status is RUNNING:
                return r
        raise RuntimeError("no running request to preempt")

    def _unemit(self, out: SchedulerOutput, req: Request):
        """Take `req` back out of this step's batch: returns (its tokens, whether they were prefill). Pages
        allocated for those tokens beyond its computed ones go back to the pool."""
        i = next(k for k, r in enumerate(out.reqs) if r is req)
        n = out.num_new_tokens[i]
        pre = out.is_prefill[i]
        for lst in (out.reqs, out.req_ids, out.token_ids, out.num_computed_tokens, out.num_new_tokens,
                    out.page_tables, out.do_sample, out.sampling, out.is_prefill):
            del lst[i]
        if pre:
            out.num_prefill_tokens -= n
        else:
            out.num_decode_tokens -= n
        req.sched_step = -1
        keep = -(-req.num_computed_tokens // self._ps)
        if len(req.page_table) > keep:   # a swap keeps only the pages of computed tokens
            self.block_manager.free(req.page_table[keep:])
            del req.page_table[keep:]
        return n, pre

    def _admit_limited(self, out: SchedulerOutput, budget: int, now: float, counts: list) -> None:
        if not self.waiting or self._preempted_this_step:
            return
        cfg = self.config
        max_p, max_l = cfg.max_num_partial_prefills, cfg.max_long_partial_prefills
        admitted = 0
        for req in self.waiting:
            if len(self.running) >= self._max_seqs or budget <= 0:
                break
            if max_p and counts[0] >= max_p:
                break
            if max_l and counts[1] >= max_l and len(req.all_token_ids) > self._long:
                continue   # long and the long slots are full: let shorter requests pass
            n = self._admit(out, req, budget, now)
            if n == 0:
                break
            budget -= n
            admitted += 1
            counts[0] += 1
            counts[1] += int(req.is_long_prefill)
        if admitted:
            self.waiting = [r for r in self.waiting if r.status is not RUNNING]


class PrefillOnlyScheduler(SarathiScheduler):
    """Prefill instance of a disaggregated deployment (protocol in the module docstring)."""
    name = "prefill_only"
    handoff_after_prefill = True
    FINISHED_PAGES_DEAD = False     # a handed-off request's pages: the decode side may look them up (partial transfer)


class DecodeOnlyScheduler(SarathiScheduler):
    """Decode instance of a disaggregated deployment (protocol in the module docstring)."""
    name = "decode_only"
    reuse_prefix = False     # deployment.partial_transfer: take the KV prefix this instance holds (add_handoff)
    FINISHED_PAGES_DEAD = False     # its requests' pages come from a transfer or the prefix cache (reuse_prefix)

    def add_request(self, req: Request) -> bool:
        raise TypeError("a 'decode_only' scheduler takes requests through add_handoff(req, now) after their "
                        "prefill, not add_request")

    def add_handoff(self, req: Request, now: float) -> bool:
        """Take a request whose prefill ran elsewhere; False (req rejected with a reason) if it cannot run here."""
        if not isinstance(req, Request):
            raise TypeError(f"add_handoff({req!r}): expected a pdjax.scheduler.Request")
        reason = None
        total = len(req.all_token_ids)
        if req.request_id in self._live:
            reason = f"duplicate request_id {req.request_id!r} of a live request"
        elif req.status is not FINISHED or req.finish_reason != "handoff":
            reason = f"not a handed-off request (status {req.status}, finish_reason {req.finish_reason!r})"
        elif not req.output_token_ids or req.num_computed_tokens != total - 1:
            reason = (f"expected KV for all but the last token: {req.num_computed_tokens} computed of {total} "
                      f"tokens with {len(req.output_token_ids)} outputs")
        elif total > self._max_len:
            reason = f"{total} tokens exceed max_model_len={self._max_len}"
        if reason is not None:
            req.finish_time = None
            self._reject(req, reason)
            return False
        req.status = WAITING_FOR_KV
        req.finish_reason = None
        req.finish_time = None
        req.page_table = []
        req.host_slots = []
        req.num_registered_pages = 0
        req.prefill_end = req.num_computed_tokens   # the next token fed is a decode
        req.num_kv_local_pages = 0
        if self.reuse_prefix and self._caching:
            self._reuse_local_prefix(req)
        self._live[req.request_id] = req
        self._kv_pending[req.request_id] = req
        return True

    def _reuse_local_prefix(self, req: Request) -> None:
        """Transfer only what is missing: the leading full pages of req's KV this instance holds already (its
        prefix cache, then its host KV tier, loaded back) are taken into its page table now (pinned until it
        runs); the transfer moves the rest (`num_kv_local_pages`). Taken only when the pages fit above the
        watermark, else the whole KV moves as without reuse."""
        bm, ps = self.block_manager, self._ps
        full = req.num_computed_tokens // ps
        keys = request_page_keys(req, ps, full)
        hits = bm.match_prefix(keys, full)
        host = bm.host_tier.count_prefix(keys, len(hits), full, bm.tier_owner) if bm.host_tier is not None else 0
        if not hits and not host:
            return
        if bm.num_free_pages - bm.num_free_among(hits) - host < self._watermark_pages + 1:
            return
        bm.take_cached(req.page_table, hits)
        if host:
            bm.load_from_host(req.page_table, keys, bm.match_host(keys, len(hits), len(hits) + host))
        req.num_kv_local_pages = req.num_registered_pages = len(req.page_table)

    def mark_kv_arrived(self, request_id: str) -> None:
        req = self._kv_pending.pop(request_id, None)
        if req is None:
            raise KeyError(f"mark_kv_arrived({request_id!r}): no handed-off request is waiting for its KV")
        self._kv_ready.append(req)

    def _run_kv_admissions(self, running: int, decodes: int, free: int) -> list:
        """_schedule's admissions from `_kv_ready` in a decode run's first step (no preemption, nothing waiting
        to admit, no prefill): the budget left by the decodes, a sequence slot, pages for the context plus the
        watermark, in arrival-mark order up to the first that does not fit. Those left stay unadmitted for the
        whole run: slots, budget and free pages only shrink until its last step."""
        budget = self._budget - decodes
        ps = self._ps
        admitted = []
        for req in self._kv_ready:
            if running >= self._max_seqs or budget <= 0:
                break
            need = -(-(req.num_computed_tokens + 1) // ps)
            if free - need < self._watermark_pages:
                break
            free -= need
            running += 1
            budget -= 1
            admitted.append((req, need))
        return admitted

    def _schedule(self, out: SchedulerOutput, now: float) -> int:
        budget = super()._schedule(out, now)
        if not self._kv_ready or self._preempted_this_step:
            return budget
        bm = self.block_manager
        ps = self._ps
        admitted = 0
        for req in self._kv_ready:
            if len(self.running) >= self._max_seqs or budget <= 0:
                break
            need = -(-(req.num_computed_tokens + 1) // ps) - len(req.page_table)   # minus a reused prefix
            if bm.num_free_pages - need < self._watermark_pages:
                break
            bm.allocate(req.page_table, need)
            self._start_running(req, now)
            self._emit(out, req, 1)
            out.kv_handoff_req_ids.append(req.request_id)
            budget -= 1
            admitted += 1
        if admitted:
            del self._kv_ready[:admitted]
        return budget


# ----------------------------------------------------------------------------------------------- the registry
def register_policy(cls: Type[Scheduler], *, replace: bool = False, **traits) -> Type[Scheduler]:
    """Add a batching policy: its Scheduler class (named by `cls.name`) and its row of traits in the one policy
    table (pdjax.config.registry.POLICIES: chunking, stall_free, decode_run, colocated, baseline, role_base, role,
    decode_batches, min_prefill_tokens). Config validation, make_scheduler, the decode runs and the placement /
    provision / regime searches all read that table, so this call is all a new policy needs besides its class.
    A built-in row (declared in pdjax.config.registry) takes its class with no traits given."""
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise TypeError(f"register_policy({cls!r}): expected a Scheduler subclass")
    name = cls.name
    if name in POLICIES and POLICIES[name].cls is None and not traits:
        info = POLICIES[name]                     # a built-in row declared in pdjax.config.registry
    else:
        info = add_policy(PolicyInfo(name, **traits), replace=replace)
    info.cls = cls
    Scheduler.DECODE_RUN_CLASSES = frozenset(POLICIES[n].cls for n in POLICIES.names(decode_run=True)
                                             if POLICIES[n].cls is not None)
    return cls


def unregister_policy(name: str) -> None:
    """Drop a policy registered with register_policy (tests clean up their toy policies with it)."""
    POLICIES.remove(name)
    Scheduler.DECODE_RUN_CLASSES = frozenset(POLICIES[n].cls for n in POLICIES.names(decode_run=True))


# The built-in rows are declared in pdjax.config.registry (config validation reads them without this module); each
# takes the class of this module with its name, and the check below fails at import when a row has no class here
# or a class here has no row.
_DEFINED = {c.name: c for c in list(globals().values())
            if isinstance(c, type) and issubclass(c, Scheduler) and c is not Scheduler and c.__module__ == __name__}
for _cls in _DEFINED.values():
    if _cls.name in POLICIES:
        register_policy(_cls)
POLICIES.check_complete("cls", _DEFINED, "the Scheduler classes of pdjax.scheduler.policies")
for _info in POLICIES.values():     # the traits that the classes themselves show
    assert not _info.role or issubclass(_info.cls, SarathiScheduler), _info.name     # derived from the role base
    assert _info.decode_batches == issubclass(_info.cls, SarathiScheduler), _info.name


def policy_class(name: str) -> Type[Scheduler]:
    """The Scheduler class of policy `name`."""
    if name not in POLICIES:
        raise ValueError(f"policy={name!r}, expected one of {POLICIES}")
    return POLICIES[name].cls


def make_scheduler(config: SchedulerConfig) -> Scheduler:
    """The scheduler of `config.policy`."""
    if not isinstance(config, SchedulerConfig):
        raise TypeError(f"make_scheduler({config!r}): expected a SchedulerConfig")
    return POLICIES[config.policy].cls(config)
