"""Policies against the systems they reproduce, rule by rule, on hand-built queues.

- `chunked_only` is Sarathi-Serve's chunked-prefills-only ablation (its artifact's `simple_chunking`
  scheduler): prefill and decode turns alternate strictly; `chunked_prefill_first` keeps the old meaning.
- `vllm_v1` is vLLM V1's scheduler at vLLM's defaults (vllm/v1/core/sched/scheduler.py `Scheduler.schedule`,
  vllm/v1/core/kv_cache_manager.py `KVCacheManager.allocate_slots`, vllm/config/scheduler.py):
  (a) admission needs pages for the whole current sequence (`scheduler_reserve_full_isl`), (b) the long-prefill
  cap applies only when the step starts with more than one request, (c) vLLM's victim rule, which may take a
  request already scheduled in the step back out of the batch, (d) watermark 0 by default.
Each vllm_v1 case is one where pdjax's former behaviour differs.
"""
from pdjax.config import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.scheduler import Request, make_scheduler
from pdjax.scheduler.fake_runner import drive, fake_sample


def _req(rid, n_prompt, max_tokens, t=0.0, token=1, priority=0):
    return Request(rid, [token] * n_prompt, SamplingParams(max_tokens=max_tokens), t, priority=priority)


def _kinds(outs):
    """'P' (prefill-only batch), 'D' (decode-only) or 'M' (mixed) per non-empty step."""
    kinds = []
    for o in outs:
        if o.is_empty:
            continue
        kinds.append("M" if o.num_prefill_tokens and o.num_decode_tokens else "P" if o.num_prefill_tokens else "D")
    return kinds


# ---------------------------------------------------------------- chunked_only: Sarathi-Serve's simple_chunking
def _two_decoders_and_a_long_prompt(policy):
    cfg = SchedulerConfig(policy=policy, token_budget=16, max_num_seqs=4, max_model_len=128, page_size=4,
                          num_pages=64)
    reqs = [(0.0, _req("d0", 4, 12, token=1)), (0.0, _req("d1", 4, 12, token=2)),
            (0.0, _req("long", 40, 3, token=3))]
    return drive(make_scheduler(cfg), reqs)


def test_chunked_only_alternates_prefill_and_decode_turns():
    outs = _two_decoders_and_a_long_prompt("chunked_only")
    # turn 1 admits d0, d1 and long's first chunk (4 + 4 + 8 = 16); then decode and prefill turns alternate
    # while long's prompt is chunked through (16, 16 more), then only decodes are left
    assert [(o.req_ids, o.num_new_tokens) for o in outs[:6]] == [
        (["d0", "d1", "long"], [4, 4, 8]), (["d0", "d1"], [1, 1]), (["long"], [16]), (["d0", "d1"], [1, 1]),
        (["long"], [16]), (["d0", "d1", "long"], [1, 1, 1])]
    assert _kinds(outs)[:6] == ["P", "D", "P", "D", "P", "D"]
    assert set(_kinds(outs)[6:]) == {"D"}


def test_chunked_only_decode_waits_at_most_one_prefill_turn():
    for policy, max_wait in (("chunked_only", 1), ("chunked_prefill_first", 2)):
        outs = _two_decoders_and_a_long_prompt(policy)
        # the most batches in a row without d0 between two of its tokens (all of them prefill batches)
        d0_steps = [i for i, o in enumerate(outs) if "d0" in o.req_ids]
        longest = max(b - a - 1 for a, b in zip(d0_steps, d0_steps[1:]))
        assert longest == max_wait, policy
    # the old meaning, kept as chunked_prefill_first: prefill batches as long as any prefill can run
    assert _kinds(_two_decoders_and_a_long_prompt("chunked_prefill_first"))[:4] == ["P", "P", "P", "D"]


def test_chunked_only_turn_without_work_passes_to_the_other():
    # a lone long prompt: the decode turns have nothing to run, so chunks run back to back (no idle step)
    cfg = SchedulerConfig(policy="chunked_only", token_budget=16, max_num_seqs=4, max_model_len=64, page_size=4,
                          num_pages=64)
    outs = drive(make_scheduler(cfg), [(0.0, _req("p", 40, 2))])
    assert [(o.num_prefill_tokens, o.num_decode_tokens) for o in outs] == [(16, 0), (16, 0), (8, 0), (0, 1)]


def test_chunked_only_prefill_turn_with_a_running_chunk_admits_nothing():
    # as the artifact: a prefill turn that schedules a running prefill's chunk returns without new requests
    cfg = SchedulerConfig(policy="chunked_only", token_budget=16, max_num_seqs=4, max_model_len=64, page_size=4,
                          num_pages=64)
    s = make_scheduler(cfg)
    s.add_request(_req("long", 20, 2))
    out = s.schedule(0.0)
    s.update(out, fake_sample(out), 0.0)
    s.add_request(_req("new", 4, 2, t=0.0, token=2))
    out = s.schedule(0.0)            # the decode turn has no decode: the prefill turn runs long's last 4 tokens
    assert out.req_ids == ["long"] and out.num_new_tokens == [4]
    assert [r.request_id for r in s.waiting] == ["new"]


# ---------------------------------------------------------------- vllm_v1 (a): whole-sequence admission
def test_vllm_v1_admits_only_when_the_whole_prompt_fits():
    cfg = SchedulerConfig(policy="vllm_v1", token_budget=16, max_num_seqs=4, max_model_len=64, page_size=4,
                          num_pages=20, watermark=0.0)
    s = make_scheduler(cfg)
    reqs = [(0.0, _req("r0", 56, 8, token=1)), (0.0, _req("r1", 40, 8, token=2))]
    outs = drive(s, reqs)
    # r0's last chunk leaves 8 tokens of budget and 6 free pages: r1's first chunk (2 pages) would fit, its
    # 40-token prompt (10 pages) does not, so r1 waits for r0 instead of being admitted and preempted
    assert [o.req_ids for o in outs[:4]] == [["r0"]] * 4
    assert s.num_preemptions == 0
    assert sum(o.num_prefill_tokens for o in outs) == 56 + 40   # no prompt token computed twice


def test_vllm_v1_readmits_a_preempted_request_only_when_prompt_and_outputs_fit():
    cfg = SchedulerConfig(policy="vllm_v1", token_budget=8, max_num_seqs=4, max_model_len=48, page_size=4,
                          num_pages=14, watermark=0.0)
    s = make_scheduler(cfg)
    a, b = _req("a", 4, 40, token=1), _req("b", 4, 40, token=2)
    readmit = []

    def on_step(out, now):
        if "b" in out.req_ids and out.is_prefill[out.req_ids.index("b")] and b.num_preemptions:
            readmit.append((len(b.all_token_ids), s.block_manager.num_free_pages + len(b.page_table)))
    outs = drive(s, [(0.0, a), (0.0, b)], on_step=on_step)
    # the pool fills once both have grown; b (the last running) is preempted with 4 + 25 tokens = 8 pages,
    # and comes back only when 8 pages are free (after a finished), not when its first chunk's 2 pages are
    assert s.num_preemptions == 1 and b.num_preemptions == 1
    n_tokens, free_at_readmission = readmit[0]
    assert n_tokens == 29 and free_at_readmission >= 8
    assert sum(o.num_prefill_tokens for o in outs) == 4 + 4 + 29


def test_vllm_v1_reserve_full_isl_off_admits_on_the_first_chunk():
    cfg = SchedulerConfig(policy="vllm_v1", token_budget=16, max_num_seqs=4, max_model_len=64, page_size=4,
                          num_pages=20, watermark=0.0, scheduler_reserve_full_isl=False)
    s = make_scheduler(cfg)
    outs = drive(s, [(0.0, _req("r0", 56, 8, token=1)), (0.0, _req("r1", 40, 8, token=2))])
    assert outs[3].req_ids == ["r0", "r1"] and s.num_preemptions > 0


# ---------------------------------------------------------------- vllm_v1 (b): long-prefill cap only with company
def test_vllm_v1_long_prefill_threshold_spares_a_lone_request():
    def first_chunks(prompts):
        cfg = SchedulerConfig(policy="vllm_v1", token_budget=64, max_num_seqs=4, max_model_len=128,
                              long_prefill_token_threshold=16, page_size=4, num_pages=128)
        s = make_scheduler(cfg)
        for i, n in enumerate(prompts):
            s.add_request(_req(f"r{i}", n, 2, token=i + 1))
        return s.schedule(0.0).num_new_tokens
    assert first_chunks([50]) == [50]            # alone: the whole budget
    assert first_chunks([50, 50]) == [16, 16]    # two requests at the step's start: capped


def test_vllm_v1_long_prefill_threshold_counts_waiting_requests_at_the_step_start():
    cfg = SchedulerConfig(policy="vllm_v1", token_budget=64, max_num_seqs=1, max_model_len=256,
                          long_prefill_token_threshold=16, page_size=4, num_pages=128)
    s = make_scheduler(cfg)
    s.add_request(_req("r0", 200, 2))
    out = s.schedule(0.0)
    s.update(out, fake_sample(out), 0.0)
    assert out.num_new_tokens == [64]
    s.add_request(_req("r1", 10, 2, token=2))   # cannot run (max_num_seqs=1) but is waiting: r0 is capped
    out = s.schedule(0.0)
    assert out.req_ids == ["r0"] and out.num_new_tokens == [16]


# ---------------------------------------------------------------- vllm_v1 (c): vLLM's victim rule
def _victim_case(ordering):
    """r0 (priority 2), r1 (1), r2 (0) run in that order with the pool full; at step 6 r0's decode fits its
    pages, r1's needs one more, r2 is prefilling."""
    cfg = SchedulerConfig(policy="vllm_v1", token_budget=4, max_num_seqs=3, max_model_len=16, page_size=4,
                          num_pages=6, watermark=0.0, ordering=ordering)
    s = make_scheduler(cfg)
    r0, r1, r2 = _req("r0", 6, 7, 0.0, 1, priority=2), _req("r1", 1, 7, 1.0, 2, priority=1), \
        _req("r2", 12, 6, 2.0, 3, priority=0)
    for step in range(5):
        if step in (0, 1, 2):
            s.add_request((r0, r1, r2)[step])
        out = s.schedule(float(step))
        s.update(out, fake_sample(out), float(step))
    assert [r.request_id for r in s.running] == ["r0", "r1", "r2"] and s.block_manager.num_free_pages == 0
    return s, s.schedule(5.0), (r0, r1, r2)


def test_vllm_v1_priority_victim_may_already_be_scheduled_and_returns_its_budget():
    s, out, (r0, r1, r2) = _victim_case("priority")
    # r0 was scheduled first (its decode fitted), then r1 ran short: vLLM preempts max(priority, arrival) over
    # all running requests, r0, takes it back out of the batch, and its token goes back to the budget, which
    # r2's chunk uses (3 = 4 - r1's 1, not 2)
    assert out.preempted_req_ids == ["r0"]
    assert out.req_ids == ["r1", "r2"] and out.num_new_tokens == [1, 3]
    assert out.total_tokens == out.num_decode_tokens + out.num_prefill_tokens == 4
    assert r0.sched_step == -1 and r0.num_computed_tokens == 0 and not r0.page_table
    s.check_invariants()


def test_vllm_v1_fcfs_victim_is_the_last_running_request():
    s, out, (r0, r1, r2) = _victim_case("fcfs")
    # fcfs: `self.running.pop()`, whatever the priority values: r2, not r1 itself
    assert out.preempted_req_ids == ["r2"]
    assert out.req_ids == ["r0", "r1"] and out.num_new_tokens == [1, 1]
    s.check_invariants()


# ---------------------------------------------------------------- vllm_v1 (d): watermark 0 by default
def test_vllm_v1_default_watermark_is_zero_and_others_keep_theirs():
    assert SchedulerConfig(policy="vllm_v1").watermark_pages == 0
    assert SchedulerConfig(policy="sarathi").watermark_pages == int(0.01 * 4096)
    assert SchedulerConfig(policy="vllm_v1", watermark=0.05).watermark_pages == int(0.05 * 4096)


def test_vllm_v1_admits_into_the_last_free_pages_by_default():
    # 130 pages; r0 holds 120 of them; r1 needs exactly the 10 left. vLLM's default watermark (0) admits it;
    # the former 1% watermark (1 page) kept it waiting.
    cfg = SchedulerConfig(policy="vllm_v1", token_budget=512, max_num_seqs=4, max_model_len=512, page_size=4,
                          num_pages=130)
    s = make_scheduler(cfg)
    s.add_request(_req("r0", 479, 20))
    out = s.schedule(0.0)
    s.update(out, fake_sample(out), 0.0)
    s.add_request(_req("r1", 40, 2, token=2))
    out = s.schedule(0.0)
    assert out.req_ids == ["r0", "r1"] and out.num_new_tokens == [1, 40]
    assert s.block_manager.num_free_pages == 0
