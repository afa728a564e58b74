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
| chunked_only  | a prefill batch (running chunks, then swap-ins, then new chunks) whenever any prefill   |
|               | work can run, else a decode batch: never both in one batch                              |
| vllm_v1       | running requests in admission order, each with what it needs (1 decode token or its     |
|               | next chunk), then swap-ins, then waiting ones; one budget; partial-prefill limits       |
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
"""
from __future__ import annotations

from typing import Dict, Type

from pdjax.config.scheduler import SchedulerConfig
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


class SarathiScheduler(Scheduler):
    """Stall-free batching: decodes first, then prefill chunks in what the decodes leave."""
    name = "sarathi"

    def _schedule(self, out: SchedulerOutput, now: float) -> int:
        budget = self._budget
        decode_budget = budget
        guard = self.config.min_prefill_tokens
        if guard and self._prefill_pending():
            decode_budget = budget - guard
        prefills = []
        left = self._decode_pass(out, now, decode_budget, prefills)
        budget -= decode_budget - left
        budget = self._prefill_pass(out, now, prefills, budget)
        budget -= self._resume_swapped(out, budget, now, max_decodes=left if guard else None)
        budget -= self._admit_waiting(out, budget, now)
        return budget


class ChunkedOnlyScheduler(Scheduler):
    """Sarathi ablation: chunked prompts, but a batch is either all prefill or all decode (prefill first)."""
    name = "chunked_only"

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
    """No phases: running requests in admission order, then waiting ones, one shared budget.

    `long_prefill_token_threshold` caps each request's chunk. `max_num_partial_prefills` /
    `max_long_partial_prefills` are enforced: at the end of every schedule() at most that many running
    requests are in the prefill phase (num_computed_tokens < prefill_end), and of them at most
    max_long_partial_prefills have `is_long_prefill` (more than the threshold of uncached prefill at
    admission). A long request that would break the long limit is skipped, letting shorter ones behind it in.
    """
    name = "vllm_v1"

    def _schedule(self, out: SchedulerOutput, now: float) -> None:
        budget = self._budget
        guard = self.config.min_prefill_tokens
        decode_cap = budget - guard if guard and self._prefill_pending() else budget
        n_dec = 0
        ps, step, bm = self._ps, self.step, self.block_manager
        a_req, a_id, a_tok = out.reqs.append, out.req_ids.append, out.token_ids.append
        a_c, a_n, a_pt = out.num_computed_tokens.append, out.num_new_tokens.append, out.page_tables.append
        a_s, a_smp, a_pre = out.do_sample.append, out.sampling.append, out.is_prefill.append
        for req in self.running:
            if budget <= 0:
                break
            if req.status is not RUNNING:
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
                    req.schedule_times.append(now)
                    out.num_decode_tokens += 1
                    budget -= 1
                    n_dec += 1
                elif self._schedule_running(out, req, 1, now):
                    budget -= 1
                    n_dec += 1
            else:
                n = self._prefill_chunk(req, budget)
                if n > 0 and self._schedule_running(out, req, n, now):
                    budget -= n
        cfg = self.config
        max_decodes = decode_cap - n_dec if guard else None
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


class DecodeOnlyScheduler(SarathiScheduler):
    """Decode instance of a disaggregated deployment (protocol in the module docstring)."""
    name = "decode_only"

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
        self._live[req.request_id] = req
        self._kv_pending[req.request_id] = req
        return True

    def mark_kv_arrived(self, request_id: str) -> None:
        req = self._kv_pending.pop(request_id, None)
        if req is None:
            raise KeyError(f"mark_kv_arrived({request_id!r}): no handed-off request is waiting for its KV")
        self._kv_ready.append(req)

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
            need = -(-(req.num_computed_tokens + 1) // ps)
            if bm.num_free_pages - need < self._watermark_pages:
                break
            bm.allocate(req.page_table, need)
            self._start_running(req, now)
            self._emit(out, req, 1, now)
            out.kv_handoff_req_ids.append(req.request_id)
            budget -= 1
            admitted += 1
        if admitted:
            del self._kv_ready[:admitted]
        return budget


POLICY_CLASSES: Dict[str, Type[Scheduler]] = {
    cls.name: cls for cls in (VllmV0Scheduler, OrcaScheduler, DecodeFirstScheduler, SarathiScheduler,
                              ChunkedOnlyScheduler, VllmV1Scheduler, PrefillOnlyScheduler, DecodeOnlyScheduler)
}


def make_scheduler(config: SchedulerConfig) -> Scheduler:
    """The scheduler of `config.policy`."""
    if not isinstance(config, SchedulerConfig):
        raise TypeError(f"make_scheduler({config!r}): expected a SchedulerConfig")
    return POLICY_CLASSES[config.policy](config)
