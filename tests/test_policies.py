"""Policy properties under random arrivals, lengths and knobs (hypothesis), plus the textbook behaviours."""
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdjax.config import SamplingParams
from pdjax.config.registry import POLICIES
from pdjax.config.scheduler import SchedulerConfig
from pdjax.scheduler import Request, make_scheduler
from pdjax.scheduler.fake_runner import drive, fake_token

# Every policy a fresh request can run under alone (the policy table's rows but the decode role's, which takes
# handed-off requests): the built-ins are vllm_v0, orca, decode_first, sarathi, chunked_only, chunked_prefill_first,
# vllm_v1 and prefill_only.
COLOCATED = [name for name in POLICIES if POLICIES[name].role != "decode"]
FINISH_REASONS = {"length", "stop", "handoff", "rejected"}


def make_requests(rng, n, max_prompt, max_out, prefixes=(), stop_token=None, priorities=False, spread=0.2):
    reqs = []
    for i in range(n):
        plen = rng.randint(1, max_prompt)
        if prefixes and rng.random() < 0.6:
            base = rng.choice(prefixes)
            prompt = (base + [rng.randrange(50) for _ in range(plen)])[:plen]
        else:
            prompt = [rng.randrange(50) for _ in range(plen)]
        stops = (stop_token,) if stop_token is not None else ()
        sp = SamplingParams(max_tokens=rng.randint(1, max_out), stop_token_ids=stops)
        reqs.append((rng.random() * spread, Request(f"q{i}", prompt, sp, 0.0,
                                                    priority=rng.randint(0, 2) if priorities else 0)))
    for t, r in reqs:
        r.arrival_time = t
    return reqs


class Checker:
    """Per-step checks of the contract and the policy's defining property.

    It also keeps a shadow KV cache holding, per page slot, the token whose KV a real runner would have
    written there (applying the swap copies like a runner), and checks that every scheduled request's pages
    hold exactly its context: this catches wrong prefix-cache hits, pages reused while still needed, and
    swaps that lose or misplace KV. With batches in flight (drive(max_in_flight > 1)) the shadow is written in
    dispatch order, the device's order, and the checker also asserts that no request is in two in-flight
    batches and that no in-flight request is preempted.
    """

    def __init__(self, sched):
        self.s = sched
        self.in_flight = set()          # request ids of dispatched, not yet applied batches
        self.max_in_flight_seen = 0
        self.batches_in_flight = 0
        self.cfg = sched.config
        self.decoders_before = []
        self.sealed = False
        self.last_was_prefill = False   # chunked_only: the previous batch was a prefill turn
        self.max_tokens_seen = 0
        self.kv = [[None] * sched.config.page_size for _ in range(sched.config.num_pages)]
        self.host = {}

    def shadow_kv(self, out):
        ps = self.cfg.page_size
        for slot, page in out.swap_out:
            self.host[slot] = list(self.kv[page])
        for slot, page in out.swap_in:
            self.kv[page] = list(self.host.pop(slot))
        for req, c, table in zip(out.reqs, out.num_computed_tokens, out.page_tables):
            if req.request_id in out.kv_handoff_req_ids:   # the runner loads the transferred KV
                for i in range(c):
                    self.kv[table[i // ps]][i % ps] = req.all_token_ids[i]
            held = [self.kv[table[i // ps]][i % ps] for i in range(c)]
            assert held == req.all_token_ids[:c], f"{req.request_id}: pages do not hold its context"
        # write only after every context was checked: a context must have been written in an earlier step
        for req, c, n, table in zip(out.reqs, out.num_computed_tokens, out.num_new_tokens, out.page_tables):
            for i in range(c, c + n):
                self.kv[table[i // ps]][i % ps] = req.all_token_ids[i]

    def before(self, now):
        if not self.s.running and not self.s.swapped:
            self.sealed = False      # the batch drained: a new one may form
        # Decodes that must run in this step. With batches in flight, a decode short of pages whose victim is in
        # flight waits for that batch (base.py), so only decodes with room in their pages (or nothing in flight)
        # are owed a slot.
        ps = self.cfg.page_size
        self.decoders_before = [r for r in self.s.running if r.num_computed_tokens >= r.prefill_end
                                and r.request_id not in self.in_flight
                                and (not self.in_flight or r.num_computed_tokens < len(r.page_table) * ps)]
        self.prefill_pending = self.s._prefill_pending()

    def update(self, out, now):
        if not out.req_ids:
            return
        assert set(out.req_ids) <= self.in_flight
        self.in_flight -= set(out.req_ids)
        self.batches_in_flight -= 1

    def step(self, out, now):
        s, cfg = self.s, self.cfg
        ps = cfg.page_size
        assert not set(out.req_ids) & self.in_flight, "a request in two in-flight batches"
        assert not set(out.preempted_req_ids) & self.in_flight, "an in-flight request was preempted"
        if out.req_ids:
            self.in_flight |= set(out.req_ids)
            self.batches_in_flight += 1
            self.max_in_flight_seen = max(self.max_in_flight_seen, self.batches_in_flight)
        assert out.total_tokens <= cfg.token_budget
        assert out.num_seqs <= cfg.max_num_seqs
        assert len(set(out.req_ids)) == out.num_seqs, "a request scheduled twice in one batch"
        assert not set(out.req_ids) & set(out.preempted_req_ids), "a preempted request is in the batch"
        assert sum(out.num_new_tokens) == out.total_tokens
        self.max_tokens_seen = max(self.max_tokens_seen, out.total_tokens)
        for req, rid, toks, c, n, table, samp, pre in zip(out.reqs, out.req_ids, out.token_ids,
                                                          out.num_computed_tokens, out.num_new_tokens,
                                                          out.page_tables, out.do_sample, out.is_prefill):
            assert req.request_id == rid and n >= 1
            assert len(table) * ps >= c + n, f"{rid}: tokens [{c}, {c + n}) but {len(table)} pages"
            assert list(toks) == req.all_token_ids[c:c + n]
            assert samp == (c + n == len(req.all_token_ids))
            if not pre:
                assert n == 1
        s.check_invariants()
        self.shadow_kv(out)
        pol = cfg.policy
        if pol in ("chunked_only", "chunked_prefill_first", "vllm_v0", "decode_first"):
            assert not (out.num_prefill_tokens and out.num_decode_tokens), f"{pol} mixed prefill and decode"
        if pol == "chunked_only":
            # alternation: after a prefill turn, running decodes get the next batch (never two prefill turns
            # in a row while a decode waits)
            preempted = set(out.preempted_req_ids)
            if self.last_was_prefill and any(r.request_id not in preempted for r in self.decoders_before):
                assert out.num_decode_tokens > 0, "chunked_only ran two prefill turns while decodes waited"
            self.last_was_prefill = out.num_prefill_tokens > 0
        if pol in ("vllm_v0", "orca", "decode_first"):
            assert all(smp for smp, pre in zip(out.do_sample, out.is_prefill) if pre), f"{pol} split a prompt"
        if pol == "decode_first":
            new = [r for r, pre in zip(out.reqs, out.is_prefill) if pre]
            assert not new or not self.sealed, "decode_first admitted while its batch was decoding"
            if out.num_decode_tokens:
                self.sealed = True
        if pol == "sarathi" and cfg.min_prefill_tokens == 0 and len(self.decoders_before) <= cfg.token_budget:
            scheduled = set(out.req_ids) | set(out.preempted_req_ids)
            stalled = [r.request_id for r in self.decoders_before if r.request_id not in scheduled]
            assert not stalled, f"sarathi stalled decodes {stalled}"
        if pol in ("sarathi", "vllm_v1") and cfg.min_prefill_tokens:
            assert out.num_decode_tokens <= cfg.token_budget - cfg.min_prefill_tokens or not self.prefill_pending
        if pol == "vllm_v1":
            in_prefill = [r for r in s.running if r.num_computed_tokens < r.prefill_end]
            if cfg.max_num_partial_prefills:
                assert len(in_prefill) <= cfg.max_num_partial_prefills
            if cfg.max_long_partial_prefills:
                assert sum(r.is_long_prefill for r in in_prefill) <= cfg.max_long_partial_prefills


def check_final(sched, reqs, vocab=32000):
    cfg = sched.config
    assert not sched.has_unfinished()
    sched.check_invariants()
    bm = sched.block_manager
    assert bm.num_free_pages == cfg.num_pages, "pages not returned to the pool"
    assert bm.num_free_host_pages == cfg.num_host_pages
    ids = [r.request_id for r in sched.finished]
    assert sorted(ids) == sorted(r.request_id for _, r in reqs), "a request lost or finished twice"
    for _, r in reqs:
        assert r.finish_reason in FINISH_REASONS, (r.request_id, r.finish_reason)
        if r.finish_reason == "rejected":
            assert r.reject_reason
            continue
        p = r.num_prompt_tokens
        assert 1 <= r.num_output_tokens <= r.sampling.max_tokens
        assert r.output_token_ids == [fake_token(r.request_id, p + j, vocab) for j in range(r.num_output_tokens)]
        assert len(r.token_times) == r.num_output_tokens
        assert r.token_times == sorted(r.token_times) and r.first_token_time == r.token_times[0]
        assert r.arrival_time <= r.first_scheduled_time <= r.first_token_time <= r.finish_time
        assert len(r.preemption_times) == r.num_preemptions
        if r.finish_reason == "length":
            assert r.num_output_tokens == r.sampling.max_tokens or r.num_tokens >= cfg.max_model_len
        if r.finish_reason == "handoff":
            assert r.num_output_tokens == 1 and cfg.policy == "prefill_only"


@st.composite
def scenario(draw):
    policy = draw(st.sampled_from(COLOCATED))
    chunking = POLICIES[policy].chunking
    page_size = draw(st.sampled_from([1, 4, 8, 16]))
    max_model_len = draw(st.integers(8, 96))
    max_num_seqs = draw(st.integers(1, 8))
    if chunking:
        budget = draw(st.integers(max(1, max_num_seqs if POLICIES[policy].stall_free else 1), 128))
    else:
        budget = draw(st.integers(max_model_len, max_model_len + 64))
    per_req = -(-max_model_len // page_size)
    num_pages = draw(st.integers(per_req, per_req * 3))
    mode = draw(st.sampled_from(["recompute", "swap"]))
    kw = dict(policy=policy, token_budget=budget, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
              page_size=page_size, num_pages=num_pages, watermark=0.0, preemption_mode=mode,
              num_host_pages=draw(st.integers(1, per_req * 3)) if mode == "swap" else 0,
              enable_prefix_caching=draw(st.booleans()),
              ordering=draw(st.sampled_from(["fcfs", "priority"])))
    if chunking:
        kw["tile_size"] = draw(st.sampled_from([0, 0, 2, 4]))
        if kw["tile_size"] > budget:
            kw["tile_size"] = 0
        if draw(st.booleans()):
            kw.update(dynamic_chunking=True, dynamic_chunk_ref_context=draw(st.integers(4, 64)),
                      dynamic_chunk_min_tokens=max(1, kw["tile_size"]))
        if draw(st.booleans()):
            kw["long_prefill_token_threshold"] = draw(st.integers(4, 64))
    if policy == "vllm_v1":
        kw["max_num_partial_prefills"] = draw(st.integers(0, 3))
        if kw.get("long_prefill_token_threshold"):
            kw["max_long_partial_prefills"] = draw(st.integers(0, max(1, kw["max_num_partial_prefills"] or 3)))
            if kw["max_num_partial_prefills"]:
                kw["max_long_partial_prefills"] = min(kw["max_long_partial_prefills"], kw["max_num_partial_prefills"])
    if policy in ("sarathi", "vllm_v1") and draw(st.booleans()) and budget > 1:
        kw["min_prefill_tokens"] = draw(st.integers(1, budget - 1))
    cfg = SchedulerConfig(**kw)
    seed = draw(st.integers(0, 2**31))
    n = draw(st.integers(1, 16))
    spread = draw(st.sampled_from([0.0, 0.05, 0.3]))
    max_in_flight = draw(st.integers(1, 4))    # pipeline stages: batches in flight (pdjax.scheduler.batch_queue)
    return cfg, seed, n, spread, max_in_flight


def run_scenario(sc):
    cfg, seed, n, spread, max_in_flight = sc
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(cfg.max_model_len)] for _ in range(2)]
    reqs = make_requests(rng, n, cfg.max_model_len + 2, 24, prefixes=prefixes, spread=spread,
                         stop_token=rng.choice([None, 3]), priorities=cfg.ordering == "priority")
    sched = make_scheduler(cfg)
    chk = Checker(sched)
    drive(sched, reqs, before_schedule=chk.before, on_step=chk.step, on_update=chk.update, max_steps=20000,
          max_in_flight=max_in_flight)
    assert chk.max_in_flight_seen <= max_in_flight and not chk.in_flight
    check_final(sched, reqs)
    return chk


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_random_workloads_hold_every_contract(sc):
    run_scenario(sc)


@pytest.mark.slow
@settings(max_examples=4000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_random_workloads_hold_every_contract_many(sc):
    run_scenario(sc)


@pytest.mark.parametrize("policy", ["sarathi", "vllm_v1"])
def test_prefill_starvation_guard(policy):
    def first_prefill_chunk(guard):
        cfg = SchedulerConfig(policy=policy, token_budget=17, max_num_seqs=17, max_model_len=128, page_size=4,
                              num_pages=200, min_prefill_tokens=guard)
        s = make_scheduler(cfg)
        for i in range(16):
            s.add_request(Request(f"d{i}", [1, 2], SamplingParams(max_tokens=50), 0.0))
        while s.waiting or any(r.num_output_tokens == 0 for r in s.running):
            out = s.schedule(0.0)
            s.update(out, [5 if smp else -1 for smp in out.do_sample], 0.0)
        assert s.num_running == 16                  # 16 requests decoding: they alone nearly fill 17
        s.add_request(Request("p", list(range(1, 101)), SamplingParams(max_tokens=2), 0.0))
        out = s.schedule(0.0)
        sizes = dict(zip(out.req_ids, out.num_new_tokens))
        assert out.total_tokens <= 17
        return sizes.get("p", 0), out.num_decode_tokens
    assert first_prefill_chunk(0) == (1, 16)       # no guard: decodes never stall, prefill gets 1 token
    assert first_prefill_chunk(8) == (8, 9)        # guard: 8 tokens reserved for the waiting prefill


@pytest.mark.parametrize("max_in_flight", [1, 3], ids=["pp1", "3_in_flight"])
@pytest.mark.parametrize("policy", COLOCATED)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_memory_pressure_forces_preemption_and_loses_nothing(policy, mode, max_in_flight):
    chunk = POLICIES[policy].chunking
    cfg = SchedulerConfig(policy=policy, token_budget=64 if chunk else 128, max_num_seqs=8, max_model_len=128,
                          page_size=4, num_pages=40, watermark=0.0, preemption_mode=mode,
                          num_host_pages=64 if mode == "swap" else 0)
    rng = random.Random(1)
    reqs = [(0.0, Request(f"p{i}", [rng.randrange(100) for _ in range(rng.randint(20, 60))],
                          SamplingParams(max_tokens=40), 0.0)) for i in range(12)]
    sched = make_scheduler(cfg)
    chk = Checker(sched)
    outs = drive(sched, reqs, before_schedule=chk.before, on_step=chk.step, on_update=chk.update,
                 max_in_flight=max_in_flight)
    if policy != "prefill_only":   # prefill_only holds no decodes, so 40 pages always suffice for chunks
        assert sched.num_preemptions > 0
        if mode == "swap":
            assert sched.num_swaps > 0 and any(o.swap_in for o in outs) and any(o.swap_out for o in outs)
    check_final(sched, reqs)


def _decode_then_long_prompt(policy, budget):
    cfg = SchedulerConfig(policy=policy, token_budget=budget, max_num_seqs=16, max_model_len=1024,
                          page_size=16, num_pages=1024)
    short = [(0.0, Request(f"s{i}", list(range(1, 9)), SamplingParams(max_tokens=60), 0.0)) for i in range(4)]
    long = [(0.05, Request("long", list(range(1, 1001)), SamplingParams(max_tokens=4), 0.05))]
    sched = make_scheduler(cfg)
    chk = Checker(sched)
    outs = drive(sched, short + long, before_schedule=chk.before, on_step=chk.step, on_update=chk.update)
    check_final(sched, short + long)
    return outs


def test_vllm_v0_long_prompt_stalls_decodes_for_a_whole_prompt_iteration():
    outs = _decode_then_long_prompt("vllm_v0", 1024)
    long_steps = [o for o in outs if "long" in o.req_ids and o.num_prefill_tokens]
    assert len(long_steps) == 1
    o = long_steps[0]
    assert o.num_prefill_tokens == 1000 and o.num_decode_tokens == 0   # the decodes stalled for it
    before = outs[outs.index(o) - 1]
    assert before.num_decode_tokens == 4     # they were running just before


def test_sarathi_largest_iteration_stays_within_budget_and_decodes_never_stall():
    outs = _decode_then_long_prompt("sarathi", 128)
    assert max(o.total_tokens for o in outs) <= 128
    chunks = [o for o in outs if "long" in o.req_ids and o.num_prefill_tokens]
    assert len(chunks) >= 1000 // 128
    assert all(o.num_decode_tokens == 4 for o in chunks[:3])   # the 4 decodes ride along every chunk


def test_sarathi_tile_alignment_rounds_partial_chunks():
    cfg = SchedulerConfig(policy="sarathi", token_budget=200, max_num_seqs=8, max_model_len=1024, tile_size=64,
                          num_pages=512)
    sched = make_scheduler(cfg)
    sched.add_request(Request("d", [1, 2, 3], SamplingParams(max_tokens=50), 0.0))
    out = sched.schedule(0.0)
    sched.update(out, [5], 0.0)
    sched.add_request(Request("p", list(range(1, 501)), SamplingParams(max_tokens=2), 0.0))
    sizes = []
    while sched.running and "p" in [r.request_id for r in sched.running] or sched.waiting:
        out = sched.schedule(0.0)
        for rid, n, pre, s in zip(out.req_ids, out.num_new_tokens, out.is_prefill, out.do_sample):
            if rid == "p" and pre:
                sizes.append((n, s))
        sched.update(out, [7 if s else -1 for s in out.do_sample], 0.0)
    # 199 tokens left after the decode -> 192 = 3 tiles; the last chunk is the remainder
    assert [n for n, s in sizes if not s] == [192, 192]
    assert sizes[-1] == (500 - 384, True)


def test_dynamic_chunking_shrinks_chunks_as_context_grows():
    cfg = SchedulerConfig(policy="sarathi", token_budget=512, max_num_seqs=4, max_model_len=4096,
                          dynamic_chunking=True, dynamic_chunk_ref_context=512, dynamic_chunk_min_tokens=64,
                          num_pages=512)
    sched = make_scheduler(cfg)
    sched.add_request(Request("p", list(range(1, 3001)), SamplingParams(max_tokens=1), 0.0))
    sizes = []
    while sched.has_unfinished():
        out = sched.schedule(0.0)
        sizes.append((out.num_computed_tokens[0], out.num_new_tokens[0]))
        sched.update(out, [1 if s else -1 for s in out.do_sample], 0.0)
    for c, n in sizes[:-1]:
        assert n == max(64, 512 * 512 // (512 + c))
    assert [n for _, n in sizes[:-1]] == sorted((n for _, n in sizes[:-1]), reverse=True)
    assert sum(n for _, n in sizes) == 3000


def test_vllm_v1_partial_prefill_limits_let_short_requests_pass_long_ones():
    cfg = SchedulerConfig(policy="vllm_v1", token_budget=256, max_num_seqs=8, max_model_len=2048,
                          long_prefill_token_threshold=128, max_num_partial_prefills=2, max_long_partial_prefills=1,
                          num_pages=1024)
    sched = make_scheduler(cfg)
    for i in range(3):
        sched.add_request(Request(f"long{i}", list(range(1, 1001)), SamplingParams(max_tokens=2), 0.0))
    sched.add_request(Request("short", list(range(1, 41)), SamplingParams(max_tokens=2), 0.0))
    out = sched.schedule(0.0)
    # long0 takes the one long slot (capped at the threshold); long1/long2 are skipped; short gets in
    assert out.req_ids == ["long0", "short"]
    assert out.num_new_tokens == [128, 40]
    assert [r.request_id for r in sched.waiting] == ["long1", "long2"]


def test_priority_ordering_and_victim_choice():
    cfg = SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=1, max_model_len=64, num_pages=64,
                          ordering="priority")
    sched = make_scheduler(cfg)
    sched.add_request(Request("low", [1, 2], SamplingParams(max_tokens=2), 0.0, priority=5))
    sched.add_request(Request("high", [1, 2], SamplingParams(max_tokens=2), 1.0, priority=0))
    assert sched.schedule(2.0).req_ids == ["high"]
    # victim choice (the shared rule; vllm_v1 has vLLM's, see test_policy_fidelity.py): lowest priority
    # (largest value), then latest arrival, among requests not yet scheduled in this step
    cfg = SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=4, max_model_len=32, page_size=4,
                          num_pages=9, watermark=0.0)
    sched = make_scheduler(cfg)
    for rid, prio, t in (("a", 0, 0.0), ("b", 1, 0.1), ("c", 0, 0.2)):
        sched.add_request(Request(rid, [1] * 12, SamplingParams(max_tokens=20), t, priority=prio))
    out = sched.schedule(1.0)
    sched.update(out, [9] * out.num_seqs, 1.0)   # 3 requests x 3 pages = 9 pages: the pool is full
    out = sched.schedule(2.0)
    assert out.preempted_req_ids == ["b"] and sorted(out.req_ids) == ["a", "c"]


def test_same_inputs_give_the_same_outputs():
    def run():
        cfg = SchedulerConfig(policy="sarathi", token_budget=48, max_num_seqs=6, max_model_len=96, page_size=4,
                              num_pages=40, watermark=0.0, enable_prefix_caching=True, preemption_mode="swap",
                              num_host_pages=30)
        rng = random.Random(7)
        reqs = make_requests(rng, 14, 90, 30, prefixes=[[rng.randrange(50) for _ in range(96)]])
        return drive(make_scheduler(cfg), reqs)
    a, b = run(), run()
    assert len(a) == len(b) and a == b
    assert any(o.preempted_req_ids for o in a)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), n=st.integers(1, 12), d_pages_extra=st.integers(0, 30),
       mode=st.sampled_from(["recompute", "swap"]), d_seqs=st.integers(1, 6), caching=st.booleans())
def test_disaggregated_pipeline_random(seed, n, d_pages_extra, mode, d_seqs, caching):
    """prefill_only -> (KV transfer with random delay) -> decode_only, with backpressure and preemption on D."""
    rng = random.Random(seed)
    ps, max_len = 4, 64
    P = make_scheduler(SchedulerConfig(policy="prefill_only", token_budget=24, max_num_seqs=4, max_model_len=max_len,
                                       page_size=ps, num_pages=40, watermark=0.0, enable_prefix_caching=caching))
    D = make_scheduler(SchedulerConfig(policy="decode_only", token_budget=max(d_seqs, 16), max_num_seqs=d_seqs,
                                       max_model_len=max_len, page_size=ps, num_pages=16 + d_pages_extra,
                                       watermark=0.0, preemption_mode=mode,
                                       num_host_pages=20 if mode == "swap" else 0))
    reqs = make_requests(rng, n, 40, 30)
    for _, r in reqs:
        P.add_request(r)
    chk_p, chk_d = Checker(P), Checker(D)
    in_flight = []      # [steps left, request]
    for _ in range(5000):
        if not (P.has_unfinished() or D.has_unfinished() or in_flight):
            break
        chk_p.before(0.0)
        out = P.schedule(0.0)
        chk_p.step(out, 0.0)
        finished = P.update(out, [fake_token(rid, c + k) if s else -1 for rid, c, k, s in
                                  zip(out.req_ids, out.num_computed_tokens, out.num_new_tokens, out.do_sample)], 0.0)
        chk_p.update(out, 0.0)
        for r in finished:
            if r.finish_reason == "handoff":
                assert D.add_handoff(r, 0.0)
                in_flight.append([rng.randint(0, 3), r])
        for item in in_flight:
            item[0] -= 1
            if item[0] < 0:
                D.mark_kv_arrived(item[1].request_id)
                P.release(item[1].request_id)
        in_flight = [it for it in in_flight if it[0] >= 0]
        chk_d.before(0.0)
        out = D.schedule(0.0)
        chk_d.step(out, 0.0)
        D.update(out, [fake_token(rid, c + k) if s else -1 for rid, c, k, s in
                       zip(out.req_ids, out.num_computed_tokens, out.num_new_tokens, out.do_sample)], 0.0)
        chk_d.update(out, 0.0)
    assert not (P.has_unfinished() or D.has_unfinished() or in_flight), "pipeline did not drain"
    for s in (P, D):
        s.check_invariants()
        assert s.block_manager.num_free_pages == s.config.num_pages and s.num_held == 0
    for _, r in reqs:
        assert r.finish_reason in ("length", "stop"), (r.request_id, r.finish_reason)
        p = r.num_prompt_tokens
        assert r.output_token_ids == [fake_token(r.request_id, p + j) for j in range(r.num_output_tokens)]
        assert len(r.token_times) == r.num_output_tokens
