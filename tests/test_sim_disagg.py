"""Simulated disaggregation (pdjax/sim/disagg.py): the prefill_only/decode_only protocol, KV transfer timing,
backpressure on both sides, determinism, link choice from placement, config errors, run_sim outputs. No JAX."""
from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys

import pytest

from pdjax.config.deployment import InstanceGroupConfig, instance_scheduler_config
from pdjax.config.model_specs import get_model_spec
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.config.serving import serve_config_from_dict
from pdjax.scheduler import Request, make_scheduler
from pdjax.sim.cost_model import CostParams, kv_bytes, p2p_time
from pdjax.sim.build import build_setup, build_transfer_time
from pdjax.sim.disagg import DisaggSimInstance, kv_link, make_transfer_time, simulate_disaggregated
from pdjax.sim.hardware import get_hardware_spec

TICK = 1.0 / 1024   # dyadic times: exact float sums


def step_time(out) -> float:
    ctx_pages = sum((c + n) // 64 for c, n in zip(out.num_computed_tokens, out.num_new_tokens))
    return TICK * (3 + out.total_tokens // 8 + ctx_pages)


def tokens_transfer(ticks_per_page: int = 2, fixed: int = 1):
    """A toy transfer time: fixed + per 16 tokens, in ticks (scales with prompt length)."""
    def transfer_time(src, dst, num_tokens):
        return TICK * (fixed + ticks_per_page * -(-num_tokens // 16))
    return transfer_time


def make_requests(n, seed, *, max_prompt=300, max_out=30, rate_ticks=6, min_out=1):
    rng = random.Random(seed)
    reqs, t = [], 0
    for i in range(n):
        t += rng.randint(0, 2 * rate_ticks)
        prompt = [rng.randrange(100) for _ in range(rng.randint(1, max_prompt))]
        reqs.append(Request(f"r{i:03d}", prompt, SamplingParams(max_tokens=rng.randint(min_out, max_out)), t * TICK))
    return reqs


BASE = SchedulerConfig(policy="sarathi", token_budget=128, max_num_seqs=16, max_model_len=512, page_size=16,
                       num_pages=256)


DEFAULT_GROUP = InstanceGroupConfig()


def instances(num_prefill=1, num_decode=1, *, prefill=DEFAULT_GROUP, decode=DEFAULT_GROUP, base=BASE):
    out = []
    for role, n, group in (("prefill", num_prefill, prefill), ("decode", num_decode, decode)):
        cfg = instance_scheduler_config(base, group, role)
        out.append([DisaggSimInstance(f"{role}{i}", role, make_scheduler(cfg), step_time) for i in range(n)])
    return out


class Recorder:
    """on_schedule hook: every output per instance, with invariants checked on every scheduler each time."""

    def __init__(self, all_instances):
        self.all = all_instances
        self.log = []   # (instance name, role, time, out)

    def __call__(self, inst, out, now):
        for i in self.all:
            i.scheduler.check_invariants()
        self.log.append((inst.name, inst.role, now, out))


def run(reqs, num_prefill=1, num_decode=1, transfer=None, **kw):
    groups = {k: kw.pop(k) for k in ("prefill", "decode", "base") if k in kw}
    p, d = instances(num_prefill, num_decode, **groups)
    rec = Recorder(p + d)
    result = simulate_disaggregated(reqs, p, d, transfer or tokens_transfer(), on_schedule=rec, **kw)
    return result, p, d, rec


# --------------------------------------------------------------------------------------------------- protocol
@pytest.mark.parametrize("num_prefill,num_decode,router", [(1, 1, "round_robin"), (2, 3, "round_robin"),
                                                           (2, 2, "least_loaded")])
def test_protocol_prefill_handoff_transfer_decode(num_prefill, num_decode, router):
    reqs = make_requests(40, seed=num_prefill * 7 + num_decode)
    result, p, d, rec = run(reqs, num_prefill, num_decode, router=router)
    by_id = {r.request_id: r for r in reqs}
    transfers = {}
    for t in result.transfers:
        assert t.request_id not in transfers, f"{t.request_id} handed off twice"
        transfers[t.request_id] = t
    # Handed off exactly once unless the first token already ends it (max_tokens == 1).
    assert set(transfers) == {r.request_id for r in reqs if r.max_tokens > 1}
    prefill_tokens, decode_tokens, admitted_at = {}, {}, {}
    for name, role, now, out in rec.log:
        for rid, n, pre in zip(out.req_ids, out.num_new_tokens, out.is_prefill):
            if role == "prefill":
                assert pre, f"{rid}: a decode token on prefill instance {name}"
                prefill_tokens[rid] = prefill_tokens.get(rid, 0) + n
            else:
                assert not pre, f"{rid}: prefill work on decode instance {name} (no preemption expected)"
                decode_tokens[rid] = decode_tokens.get(rid, 0) + n
        if role == "decode":
            for rid in out.kv_handoff_req_ids:
                assert rid not in admitted_at
                admitted_at[rid] = (name, now)
    for rec_ in result.requests:
        req = by_id[rec_.request_id]
        assert rec_.finish_reason == "length" and rec_.num_output_tokens == req.max_tokens
        assert prefill_tokens[req.request_id] == req.num_prompt_tokens       # whole prompt, prefill side only
        assert decode_tokens.get(req.request_id, 0) == req.max_tokens - 1
        if req.max_tokens == 1:
            continue
        t = transfers[req.request_id]
        assert t.num_tokens == req.num_prompt_tokens
        # TTFT is stamped on the prefill instance: the handoff (transfer ready) is the first token's time, at
        # the end of an iteration of the source prefill instance.
        assert t.ready_time == rec_.token_times[0] == rec_.first_token_time
        assert any(it.instance == t.src and it.end_time == t.ready_time for it in result.iterations)
        # Admission on the decode instance the KV went to, no earlier than the KV's arrival; later tokens after it.
        name, when = admitted_at[req.request_id]
        assert name == t.dst and when >= t.end_time >= t.start_time >= t.ready_time
        assert rec_.token_times[1] - rec_.token_times[0] >= t.seconds > 0
    for inst in p + d:   # nothing leaked on either side
        s = inst.scheduler
        s.check_invariants()
        assert not s.has_unfinished() and s.num_held == 0
        assert s.block_manager.num_free_pages == s.config.num_pages
    names = {it.instance for it in result.iterations}
    assert names == {f"prefill{i}" for i in range(num_prefill)} | {f"decode{i}" for i in range(num_decode)}
    for name in names:   # per-instance step indices, as the real engine numbers them
        steps = [it.step for it in result.iterations if it.instance == name]
        assert steps == list(range(len(steps)))


def test_transfers_on_one_link_are_serialized_unless_disabled():
    reqs = [Request(f"r{i}", [1] * 256, SamplingParams(max_tokens=4), 0.0) for i in range(6)]
    slow = tokens_transfer(ticks_per_page=50)
    fresh = [Request(r.request_id, r.prompt_token_ids, r.sampling, 0.0) for r in reqs]
    serial, *_ = run(fresh, transfer=slow)
    ts = sorted(serial.transfers, key=lambda t: t.start_time)
    assert all(b.start_time >= a.end_time for a, b in zip(ts, ts[1:]))
    assert max(t.queue_s for t in ts) > 0
    parallel, *_ = run(reqs, transfer=slow, serialize_transfers=False)
    assert all(t.queue_s == 0 for t in parallel.transfers)
    assert parallel.transfer_summary()["num_transfers"] == serial.transfer_summary()["num_transfers"] == 6
    # The real engine's keys (pdjax.serving.disagg.DisaggregatedResult.transfer_summary), in the same units.
    summary = serial.transfer_summary()
    assert set(summary) == {"num_transfers", "kv_bytes", "moved_bytes", "seconds", "bandwidth_bytes_per_s"}
    assert summary["seconds"] == pytest.approx(sum(t.seconds for t in serial.transfers))


# --------------------------------------------------------------------------------------------------- timing
def test_transfer_time_scales_with_prompt_and_bandwidth():
    model = get_model_spec("llama-2-13b")
    params = CostParams()
    fast = make_transfer_time(model, 300e9, 2e-6, 1, params)
    slow = make_transfer_time(model, 25e9, 5e-6, 1, params)
    for n in (1, 100, 1000, 4000):
        assert fast(n) == pytest.approx(p2p_time(kv_bytes(model, n), 300e9, 2e-6, params))
        assert slow(n) > fast(n)
    # linear in tokens: equal steps in tokens give equal steps in time, at 1 / (bandwidth * efficiency) per byte
    per_byte = (fast(2000) - fast(1000)) / (kv_bytes(model, 1000))
    assert per_byte == pytest.approx(1 / (300e9 * params.comm_bandwidth_efficiency), rel=1e-9)
    assert make_transfer_time(model, 300e9, 2e-6, 2, params)(1000) < fast(1000)   # two streams in parallel


@pytest.mark.parametrize("prompt", [16, 17, 200, 500])
def test_slower_link_widens_the_first_to_second_token_gap(prompt):
    model = get_model_spec("llama-2-13b")

    def gap_and_transfer(bandwidth):
        fn = make_transfer_time(model, bandwidth, 5e-6)
        req = Request("a", [3] * prompt, SamplingParams(max_tokens=3), 0.0)
        result, *_ = run([req], transfer=lambda s, d, n: fn(n))
        (rec,) = result.requests
        return rec.token_times[1] - rec.token_times[0], fn(prompt)

    gap_fast, t_fast = gap_and_transfer(100e9)
    gap_slow, t_slow = gap_and_transfer(1e9)
    assert gap_slow > gap_fast and gap_fast >= t_fast and gap_slow >= t_slow
    # alone in the system, the gap is transfer + one decode step: the difference is the transfer difference
    assert gap_slow - gap_fast == pytest.approx(t_slow - t_fast, rel=1e-9)


def test_kv_link_from_placement():
    sxm = get_hardware_spec("a100-80gb-sxm")          # 8 per node, NVSwitch
    assert kv_link(sxm, (0,), (1,)) == (sxm.intra_node_bandwidth, sxm.intra_node_latency, 1)
    assert kv_link(sxm, (0,), (8,)) == (sxm.inter_node_bandwidth, sxm.inter_node_latency, 1)
    assert kv_link(sxm, (0, 1), (2,))[2] == 1 and kv_link(sxm, (0, 1), (2, 3))[2] == 2
    assert kv_link(sxm, (6, 7), (8, 9))[0] == sxm.inter_node_bandwidth
    pcie = get_hardware_spec("a100-80gb-pcie")        # NVLink pairs, PCIe between pairs
    assert kv_link(pcie, (0,), (1,))[0] == pcie.pairwise_bandwidth
    assert kv_link(pcie, (1,), (2,))[0] == pcie.intra_node_bandwidth < pcie.pairwise_bandwidth
    with pytest.raises(ValueError, match="at least one device"):
        kv_link(sxm, (), (1,))


# --------------------------------------------------------------------------------------------------- backpressure
def test_decode_backpressure_few_pages_still_finishes():
    reqs = make_requests(30, seed=5, max_prompt=200, max_out=40, min_out=2, rate_ticks=1)
    small = InstanceGroupConfig(num_pages=20)         # 320 tokens: one or two requests at a time
    base = dataclasses.replace(BASE, max_model_len=256)
    result, p, d, rec = run(reqs, decode=small, base=base)
    assert all(r.finish_reason == "length" for r in result.requests)
    _, _, _, roomy = run(make_requests(30, seed=5, max_prompt=200, max_out=40, min_out=2, rate_ticks=1))

    def peak(recorder):
        return max(len(out.req_ids) for _, role, _, out in recorder.log if role == "decode")
    assert peak(rec) < peak(roomy)
    # Some requests waited with their KV arrived: admitted more than 4 decode steps after it landed.
    admitted = {rid: now for _, role, now, out in rec.log if role == "decode" for rid in out.kv_handoff_req_ids}
    waits = [admitted[t.request_id] - t.end_time for t in result.transfers]
    assert max(waits) > 4 * step_time_bound()
    for inst in p + d:
        assert inst.scheduler.block_manager.num_free_pages == inst.scheduler.config.num_pages


def step_time_bound() -> float:
    """An upper bound on one decode step of the toy cost with <= 16 sequences of <= 512 tokens."""
    return TICK * (3 + 16 // 8 + 16 * 512 // 64)


def test_prefill_pages_stay_held_until_the_transfer_lands():
    # The prefill side holds one request's pages at a time: the next prefill starts only after the release.
    base = dataclasses.replace(BASE, watermark=0.0, max_model_len=80)
    reqs = [Request(f"r{i}", [1] * 64, SamplingParams(max_tokens=2), 0.0) for i in range(3)]
    result, p, d, rec = run(reqs, prefill=InstanceGroupConfig(num_pages=5), base=base,
                            transfer=tokens_transfer(ticks_per_page=100))
    first_sched = {}
    for _, role, now, out in rec.log:
        if role == "prefill":
            for rid in out.req_ids:
                first_sched.setdefault(rid, now)
    ends = {t.request_id: t.end_time for t in result.transfers}
    order = sorted(first_sched, key=first_sched.get)
    for a, b in zip(order, order[1:]):
        assert first_sched[b] >= ends[a]
    assert all(r.finish_reason == "length" for r in result.requests)


# --------------------------------------------------------------------------------------------------- determinism
def test_deterministic():
    def once():
        result, *_ = run(make_requests(40, seed=11), 2, 2, router="least_loaded")
        return ([dataclasses.astuple(r) for r in result.requests], [dataclasses.astuple(i) for i in result.iterations],
                [dataclasses.astuple(t) for t in result.transfers])
    assert once() == once()


# --------------------------------------------------------------------------------------------------- errors
def gpu_config(**deployment):
    return {
        "backend": "sim", "seed": 3, "model": {"checkpoint": "llama-2-13b"},
        "engine": {"mode": "online", "progress": False},
        "scheduler": {"policy": "sarathi", "token_budget": 512, "max_num_seqs": 64, "max_model_len": 4096,
                      "page_size": 16, "num_pages": 1024},
        "workload": {"preset": "chat", "num_requests": 30, "rate": 2.0, "vocab_size": 32000,
                     "fit_to_model": True},
        "slo": {"ttft": 2.0, "tpot": 0.1},
        "sim": {"hardware": "a100-80gb-sxm"},
        "deployment": {"kind": "disaggregated", **deployment},
    }


@pytest.mark.parametrize("change,match", [
    (lambda c: c["scheduler"].update(policy="vllm_v1"), "scheduler.policy='vllm_v1'"),
    (lambda c: c["sim"].update(num_replicas=2), "sim.num_replicas is not a key any more: set "
                                                 "deployment.colocated.num_instances"),
    (lambda c: c["sim"].update(tp=2), "sim.tp is not a key any more: set deployment.colocated.tp"),
    (lambda c: c["deployment"].update(decode={"dp": 2}), "deployment.decode.dp is not a key any more: replicas "
                                                          "are deployment.decode.num_instances"),
    (lambda c: c["deployment"].update(prefill={"pp": 41}), "deployment.prefill.pp=41 exceeds num_layers=40"),
    (lambda c: c["engine"].update(async_scheduling=True), "async_scheduling"),
    (lambda c: c["deployment"].update(decode={"tp": 3}), "deployment.decode.tp=3"),
])
def test_config_errors_are_clear(change, match):
    config = gpu_config()
    change(config)
    with pytest.raises(ValueError, match=match):
        build_setup(serve_config_from_dict(config))


def test_instance_and_argument_errors():
    p, d = instances()
    with pytest.raises(ValueError, match="needs a 'decode_only' scheduler"):
        DisaggSimInstance("decode9", "decode", make_scheduler(BASE), step_time)
    with pytest.raises(ValueError, match="role='split'"):
        DisaggSimInstance("x", "split", p[0].scheduler, step_time)
    with pytest.raises(ValueError, match="at least one decode"):
        simulate_disaggregated([], p, [], tokens_transfer())
    with pytest.raises(ValueError, match="given as prefill"):
        simulate_disaggregated([], d, d, tokens_transfer())
    with pytest.raises(ValueError, match="router='random'"):
        simulate_disaggregated([], p, d, tokens_transfer(), router="random")
    other = instance_scheduler_config(dataclasses.replace(BASE, page_size=32), InstanceGroupConfig(), "decode")
    with pytest.raises(ValueError, match="same page_size"):
        simulate_disaggregated([], p, [DisaggSimInstance("decode0", "decode", make_scheduler(other), step_time)],
                               tokens_transfer())
    with pytest.raises(ValueError, match="bandwidth=0"):
        make_transfer_time(get_model_spec("llama-2-7b"), 0, 1e-6)


def test_decode_pool_too_small_for_a_max_length_request_fails_at_build():
    with pytest.raises(ValueError, match="num_pages=8"):
        instances(decode=InstanceGroupConfig(num_pages=8))


# --------------------------------------------------------------------------------------------------- configs
def test_pages_and_links_from_the_config():
    from pdjax.sim.cost_model import kv_cache_capacity_tokens
    cfg = serve_config_from_dict(gpu_config(prefill={"tp": 2, "token_budget": 2048},
                                            decode={"num_instances": 2, "num_pages": 777}))
    setup = build_setup(cfg)
    model, hw = get_model_spec("llama-2-13b"), get_hardware_spec("a100-80gb-sxm")
    g = setup.groups["prefill"]
    cap = kv_cache_capacity_tokens(model, hw, 2, 1, 0.9, max_num_batched_tokens=2048, max_num_seqs=64)
    assert g.kv_capacity_tokens == cap and g.scheduler_config.num_pages == cap // 16
    assert g.scheduler_config.policy == "prefill_only" and g.devices == ((0, 1),)
    assert setup.groups["decode"].scheduler_config.num_pages == 777
    assert setup.groups["decode"].devices == ((2,), (3,))
    # Placement picks the link: decode on another node -> the inter-node network, slower than NVSwitch.
    near = build_transfer_time(setup)
    far_cfg = serve_config_from_dict(gpu_config(prefill={"devices": [0]}, decode={"devices": [8]}))
    far = build_transfer_time(build_setup(far_cfg))
    p, d = instances()
    p[0].name, d[0].name = "prefill0", "decode0"
    assert far(p[0], d[0], 1000) > near(p[0], d[0], 1000) > 0


def test_run_sim_writes_outputs_with_transfer_stats(tmp_path):
    from pdjax.sim.run import run_sim
    config = gpu_config(prefill={"token_budget": 2048})
    summary = run_sim(serve_config_from_dict(config), config, str(tmp_path), plots=False)
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["num_completed"] == summary["num_completed"] == 30
    kv = on_disk["engine"]["kv_transfer"]      # where and as the real engine writes it
    assert set(kv) == {"num_transfers", "kv_bytes", "moved_bytes", "seconds", "bandwidth_bytes_per_s"}
    assert 0 < kv["num_transfers"] <= 30 and kv["kv_bytes"] == kv["moved_bytes"] > 0
    assert kv["bandwidth_bytes_per_s"] == pytest.approx(kv["moved_bytes"] / kv["seconds"])
    stats = on_disk["sim"]["kv_transfer_stats"]
    assert stats["transfer_s"]["p99"] >= stats["transfer_s"]["mean"] > 0
    assert on_disk["engine"]["deployment"] == "disaggregated"
    iters = (tmp_path / "iterations.csv").read_text()
    assert "prefill0" in iters and "decode0" in iters
    instances = on_disk["engine"]["instances"]
    assert {n: i["role"] for n, i in instances.items()} == {"prefill0": "prefill", "decode0": "decode"}
    assert instances["prefill0"]["token_budget"] == 2048 and instances["decode0"]["devices"] == [1]


def test_disagg_paper_config_validates_and_imports_no_jax():
    from pdjax.config.files import config_file
    from pdjax.experiment.run import to_plain_dict
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1]
    for arg in ("2xtp1-chat", "1xtp2-chat", "1p1d-chat", "1p1d-arxiv"):
        cfg = serve_config_from_dict(to_plain_dict(config_file(str(root / "README.md"),
                                                               "configs/sim/disagg_paper.py", arg)))
        assert cfg.backend == "sim"
    out = subprocess.run([sys.executable, "-c", "import sys, pdjax.sim.disagg; print('jax' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_empty_workload_and_capacity_probe():
    p, d = instances()
    result = simulate_disaggregated([], p, d, tokens_transfer())
    assert result.requests == [] and result.iterations == [] and result.transfer_summary()["num_transfers"] == 0
    from pdjax.sim.capacity import simulate_summary   # capacity search runs disaggregated configs too
    low, high = (simulate_summary(gpu_config(), rate) for rate in (0.5, 50.0))
    assert low["sim"]["deployment"] == "disaggregated" and low["num_completed"] == high["num_completed"] == 30
    assert high["ttft"]["p99"] > low["ttft"]["p99"]


# --------------------------------------------------------------------------------------------------- pipeline stages
def _mixed_pool_run(make_instance):
    """2 prefill, 2 decode and 1 mixed instance of the toy step time, least-loaded, a mixed pool that switches."""
    from pdjax.scheduler.mixed import MixedScheduler
    groups = []
    for role, n in (("prefill", 2), ("decode", 2)):
        cfg = instance_scheduler_config(BASE, InstanceGroupConfig(), role)
        groups.append([make_instance(f"{role}{i}", role, make_scheduler(cfg)) for i in range(n)])
    mixed = [make_instance("mixed0", "mixed", MixedScheduler(instance_scheduler_config(BASE, InstanceGroupConfig(),
                                                                                      "decode")))]
    return simulate_disaggregated(make_requests(80, seed=11, rate_ticks=2), groups[0], groups[1], tokens_transfer(),
                                  router="least_loaded", mixed=mixed, mixed_prefill_queue_tokens=300,
                                  mixed_decode_load=0.3)


# The simulator's fields of the one TransferRecord (pdjax.scheduler.instances), first and in this order: the record
# the pinned hash below was taken on had these only (moved_bytes, num_pages, host_s came with the engine's).
SIM_TRANSFER_FIELDS = ("request_id", "src", "dst", "num_tokens", "kv_bytes", "ready_time", "start_time", "end_time")


def test_pp1_numbers_are_unchanged_by_the_stage_pipeline():
    """The one-stage loop gives exactly the numbers of the code before StagePipeline (pinned on a fixed seed:
    every request, iteration and transfer record, mixed-pool switches included)."""
    import hashlib
    result = _mixed_pool_run(lambda name, role, sched: DisaggSimInstance(name, role, sched, step_time))
    snap = repr(([dataclasses.astuple(r) for r in result.requests], [dataclasses.astuple(i) for i in result.iterations],
                 [dataclasses.astuple(t)[:len(SIM_TRANSFER_FIELDS)] for t in result.transfers]))
    assert (result.duration_s, len(result.iterations), len(result.transfers)) == (1.3662109375, 230, 76)
    assert result.mixed_pool["switch_counts"]["mixed0"]["prefill"] == 1
    assert tuple(f.name for f in dataclasses.fields(result.transfers[0]))[:len(SIM_TRANSFER_FIELDS)] == \
        SIM_TRANSFER_FIELDS
    assert hashlib.sha256(snap.encode()).hexdigest() == \
        "62da1148eae19f8f57cf141fef3dcf713b2ff8e6ea09982980c47a6b99b1f8ae"
    p = result.pipeline
    assert all(v["pp"] == 1 and v["max_in_flight"] == 1 and v["mean_batches_in_flight"] == 1.0
               for v in p["instances"].values())
    assert abs(p["bubble_fraction"]) < 1e-12


def test_stage_pipeline_schedule_and_accounting():
    from pdjax.sim.pipeline import StagePipeline, pipeline_summary

    class Out:   # the BatchQueue needs req_ids, step, is_empty
        def __init__(self, rid):
            self.req_ids, self.step, self.is_empty = [rid], 0, False

    pipe = StagePipeline(2)
    assert pipe.device_free == 0.0 and not pipe
    assert pipe.dispatch(Out("a"), 0.0, (1.0, 2.0), (0.5,)) == 3.5        # stage0 [0, 1], send, stage1 [1.5, 3.5]
    assert pipe.dispatch(Out("b"), 0.0, (1.0, 1.0), (0.5,)) == 4.5        # stage0 [1, 2], stage1 waits: [3.5, 4.5]
    assert pipe.full and pipe.device_free == 2.0 and pipe.peek()[1:] == (0.0, 3.5)
    with pytest.raises(RuntimeError, match="already in flight"):
        pipe.dispatch(Out("c"), 0.0, (1.0, 1.0), (0.5,))
    assert pipe.collect(3.5)[0].req_ids == ["a"]
    assert pipe.dispatch(Out("c"), 3.5, (1.0, 1.0), (0.5,)) == 6.0        # stage0 [3.5, 4.5], stage1 [5, 6]
    pipe.collect(4.5)
    pipe.collect(6.0)
    with pytest.raises(ValueError, match="3 stage times on a 2-stage"):
        pipe.run_stages((1.0, 1.0, 1.0), (0.0, 0.0), 7.0)
    stats = pipe.stats()
    assert stats["stage_busy_s"] == [3.0, 4.0] and stats["active_s"] == 6.0
    assert stats["bubble_fraction"] == pytest.approx(1 - 7.0 / 12.0)
    assert stats["mean_batches_in_flight"] == pytest.approx((3.5 + 4.5 + 2.5) / 6.0)
    one = StagePipeline()   # one stage: dispatch at t on a free stage ends at exactly t + seconds
    assert one.dispatch(Out("x"), 0.1, (0.2,)) == 0.1 + 0.2
    summary = pipeline_summary([("p", pipe), ("one", one)])
    assert summary["instances"]["p"] == stats and summary["stage_busy_s"] == 7.0 + 0.2


def test_colocated_simulator_dispatches_through_stage_pipeline():
    """SimInstance has no stage bookkeeping of its own: run_stages dispatches onto its StagePipeline, whose times
    are the stage recurrence (reference below), float for float, and whose queue/accounting the loop uses."""
    from pdjax.sim.pipeline import StagePipeline
    from pdjax.sim.simulator import SimInstance

    class Out:   # the BatchQueue needs req_ids, step, is_empty
        def __init__(self, rid):
            self.req_ids, self.step, self.is_empty = [rid], 0, False

    rng = random.Random(4)
    batches = [((rng.random() * 1e-2, rng.random() * 3e-2, rng.random() * 1e-2), (rng.random() * 1e-4,) * 2)
               for _ in range(200)]
    it = iter(batches)
    sim = SimInstance("a", make_scheduler(BASE), stage_times=lambda out: next(it), max_in_flight=3)
    assert isinstance(sim.pipeline, StagePipeline) and sim.max_in_flight == 3
    free, busy = [0.0] * 3, [0.0] * 3          # the reference: the stage recurrence, written out
    t = 0.0
    for k, (stages, sends) in enumerate(batches):
        t += rng.random() * 1e-2
        if sim.pipeline.full:
            sim.pipeline.collect(max(t, sim.pipeline.peek()[2]))
        ready = t
        for s, seconds in enumerate(stages):
            if s:
                ready = ready + sends[s - 1]
            ready = (ready if ready > free[s] else free[s]) + seconds
            free[s] = ready
            busy[s] += seconds
        assert sim.run_stages(Out(str(k)), t) == ready
    assert sim.pipeline.stage_free == free and sim.pipeline.stage_busy == busy
    assert sim.pipeline.device_free == free[0] and len(sim.pipeline) == 3


def _two_stage(out):
    """The toy step time split over two stages (dyadic: exact sums) with a one-tick activation send."""
    whole = step_time(out)
    return (whole / 2, whole / 2), (TICK,)


def test_pp2_groups_keep_batches_in_flight_with_the_stage_model():
    """Prefill and decode instances of two stages (stage_times, max_in_flight=2): the protocol holds, each
    instance's batches are applied in dispatch order, a request is never in two overlapping batches, the prefill
    instances overlap batches, and SimResult.pipeline reports pp=2 and a bubble fraction."""
    reqs = make_requests(60, seed=3, rate_ticks=2)
    p, d = ([DisaggSimInstance(f"{role}{i}", role, make_scheduler(instance_scheduler_config(
        BASE, InstanceGroupConfig(), role)), stage_times=_two_stage, max_in_flight=2) for i in range(2)]
        for role in ("prefill", "decode"))
    rec = Recorder(p + d)
    result = simulate_disaggregated(reqs, p, d, tokens_transfer(), on_schedule=rec)
    assert all(r.finish_reason == "length" for r in result.requests)
    assert sorted(t.request_id for t in result.transfers) == sorted(r.request_id for r in reqs if r.max_tokens > 1)
    for inst in p + d:
        s = inst.scheduler
        assert not s.has_unfinished() and s.num_held == 0 and s.block_manager.num_free_pages == s.config.num_pages
        its = [it for it in result.iterations if it.instance == inst.name]
        outs = [(now, out) for name, _, now, out in rec.log if name == inst.name]
        assert len(its) == len(outs) and [it.step for it in its] == list(range(len(its)))
        for it, (now, out) in zip(its, outs):                 # applied in dispatch order
            assert it.start_time == now and it.num_seqs == len(out.req_ids)
        for (a, (_, oa)), (b, (_, ob)) in zip(zip(its, outs), zip(its[1:], outs[1:])):
            if b.start_time < a.end_time:
                assert not set(oa.req_ids) & set(ob.req_ids)
    for name in ("prefill0", "prefill1"):
        its = [it for it in result.iterations if it.instance == name]
        assert any(b.start_time < a.end_time for a, b in zip(its, its[1:])), f"{name}: no batches in flight"
    pipe = result.pipeline
    assert {n: v["pp"] for n, v in pipe["instances"].items()} == {n: 2 for n in ("prefill0", "prefill1",
                                                                              "decode0", "decode1")}
    for name in ("prefill0", "prefill1"):
        stats = pipe["instances"][name]
        assert 1.0 < stats["mean_batches_in_flight"] <= 2.0, name
        assert 0.0 < stats["bubble_fraction"] < 1.0, name
    assert 0.0 < pipe["bubble_fraction"] < 1.0


def test_pp2_groups_from_the_config():
    """deployment prefill pp2 / decode pp2 (cost model): PipelineStepTime instances keep 2 batches in flight,
    iteration records of the prefill instance overlap, the pipeline summary has a bubble fraction."""
    from pdjax.sim.build import build_instances, build_requests, disaggregated_kwargs
    cfg = serve_config_from_dict(gpu_config(prefill={"pp": 2}, decode={"pp": 2}))
    setup = build_setup(cfg)
    inst = build_instances(setup)
    assert [i.max_in_flight for i in inst["prefill"] + inst["decode"]] == [2, 2]
    result = simulate_disaggregated(build_requests(cfg), inst["prefill"], inst["decode"], build_transfer_time(setup),
                                    **disaggregated_kwargs(setup, inst))
    assert all(r.finish_reason == "length" for r in result.requests) and len(result.requests) == 30
    its = [it for it in result.iterations if it.instance == "prefill0"]
    assert any(b.start_time < a.end_time for a, b in zip(its, its[1:]))
    stats = result.pipeline["instances"]
    assert stats["prefill0"]["pp"] == stats["decode0"]["pp"] == 2
    assert stats["prefill0"]["mean_batches_in_flight"] > 1.0
    assert 0.0 < result.pipeline["bubble_fraction"] < 1.0


def test_kv_link_pairs_pipeline_stages():
    """Equal PP: stage s sends its layers' KV to stage s (min(tp) streams per stage), as the placement search
    models it; unequal PP: devices in order."""
    sxm = get_hardware_spec("a100-80gb-sxm").replace(devices_per_node=4)
    # prefill tp2 x pp2 on node 0, decode tp1 x pp2 on devices 4 (node 1) and 2 (node 0)
    bw, _, streams = kv_link(sxm, (0, 1, 2, 3), (4, 2), 2, 2)
    assert streams == 2 and bw == sxm.inter_node_bandwidth          # pairs (0, 4), (2, 2)
    bw, _, streams = kv_link(sxm, (0, 1, 2, 3), (5, 6), 2, 2)
    assert streams == 2 and bw == sxm.inter_node_bandwidth
    bw, _, streams = kv_link(sxm, (0, 1, 2, 3), (1, 3), 2, 2)
    assert streams == 2 and bw == sxm.intra_node_bandwidth          # pairs (0, 1), (2, 3)
    assert kv_link(sxm, (0, 1, 2, 3), (4, 5), 1, 2)[2] == 2          # unequal pp: (0, 4), (1, 5)
    with pytest.raises(ValueError, match="3 devices in 2 pipeline stages"):
        kv_link(sxm, (0, 1, 2), (4, 5), 2, 2)


def test_groups_on_different_hardware_step_and_transfer_on_their_own():
    """Splitwise-HA: H100 prefill, A100 decode. Each group's steps cost on its own hardware (the test fails if
    both use one), and the KV crosses the inter-node network between the two machine types."""
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.sim.build import build_instances, build_setup, build_transfer_time, group_step_time
    from pdjax.sim.cost_model import kv_bytes
    from pdjax.sim.hardware import get_hardware_spec
    from pdjax.sim.step_cost import make_step_time
    cfg = serve_config_from_dict({
        "backend": "sim", "model": {"checkpoint": "llama-2-13b"}, "engine": {"progress": False},
        "scheduler": {"policy": "sarathi", "token_budget": 512, "max_num_seqs": 64, "max_model_len": 4096,
                      "num_pages": 1024},
        "workload": {"preset": "chat", "num_requests": 8, "vocab_size": 32000, "fit_to_model": True},
        "sim": {"hardware": "a100-80gb-sxm"},
        "deployment": {"kind": "disaggregated", "prefill": {"hardware": "h100-sxm"}}})
    setup = build_setup(cfg)
    h100, a100 = get_hardware_spec("h100-sxm"), get_hardware_spec("a100-80gb-sxm")
    assert setup.groups["prefill"].hardware.name == "h100-sxm" and setup.groups["decode"].hardware is None
    sched = make_scheduler(SchedulerConfig(policy="sarathi", token_budget=512, max_num_seqs=8, max_model_len=4096,
                                           page_size=16, num_pages=512))
    sched.add_request(Request("r0", list(range(1, 401)), SamplingParams(max_tokens=4), 0.0))
    out = sched.schedule(0.0)
    prefill_t, decode_t = group_step_time(setup, "prefill", noise=False), group_step_time(setup, "decode", noise=False)
    on_h100 = make_step_time(setup.model, h100, 1, 1, setup.groups["prefill"].params)(out)
    on_a100 = make_step_time(setup.model, a100, 1, 1, setup.params)(out)
    assert prefill_t(out) == pytest.approx(on_h100) and decode_t(out) == pytest.approx(on_a100)
    assert on_h100 < 0.8 * on_a100
    instances = build_instances(setup)
    transfer = build_transfer_time(setup)(instances["prefill"][0], instances["decode"][0], 1000)
    nvlink = make_transfer_time(setup.model, a100.intra_node_bandwidth, a100.intra_node_latency, 1, setup.params)
    network = make_transfer_time(setup.model, min(a100.inter_node_bandwidth, h100.inter_node_bandwidth),
                                 max(a100.inter_node_latency, h100.inter_node_latency), 1,
                                 setup.groups["prefill"].params)
    assert transfer == pytest.approx(network(1000)) and transfer > 2 * nvlink(1000)
    assert kv_bytes(setup.model, 1000) / transfer < a100.inter_node_bandwidth


def test_a_colocated_group_stays_on_one_hardware_and_the_real_engine_refuses_others():
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.errors import UserError
    from pdjax.serving.build import build_engine
    from pdjax.sim.build import build_setup
    base = {"backend": "sim", "model": {"checkpoint": "llama-2-13b"}, "engine": {"progress": False},
            "scheduler": {"max_model_len": 4096}, "workload": {"preset": "chat", "num_requests": 4},
            "sim": {"hardware": "a100-80gb-sxm"}}
    with pytest.raises(ValueError, match="deployment.colocated.hardware='h100-sxm': a colocated deployment runs "
                                         "on one hardware"):
        build_setup(serve_config_from_dict({**base, "deployment": {"colocated": {"hardware": "h100-sxm"}}}))
    with pytest.raises(ValueError, match=r"deployment.prefill.hardware: unknown hardware 'b300'"):
        build_setup(serve_config_from_dict({**base, "deployment": {"kind": "disaggregated",
                                                                   "prefill": {"hardware": "b300"}}}))
    real = serve_config_from_dict({"backend": "real", "model": {"checkpoint": "tiny-llama"},
                                   "workload": {"preset": "chat", "num_requests": 4},
                                   "deployment": {"colocated": {"hardware": "h100"}}})
    with pytest.raises(UserError, match=r"deployment.colocated.hardware='h100': the real engine runs on the devices "
                                        r"it has \('cpu'\)"):
        build_engine(real)
