"""Batches in flight (pipeline parallelism): the BatchQueue, the scheduler's in-flight rule, the per-stage cost, and
greedy tokens of a real tiny model through ColocatedEngine on a 2-stage PipelineRunner with 2 batches in flight
equal to the single-device run (sarathi, vllm_v0; recompute and swap preemption; prefix caching)."""
import random

import pytest

from pdjax.config.model_specs import get_model_spec
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.scheduler import BatchQueue, Request, RequestStatus, SchedulerOutput, make_scheduler
from pdjax.scheduler.batch_queue import mean_in_flight
from pdjax.scheduler.fake_runner import fake_sample
from pdjax.sim.cost_model import BatchComposition, CostParams, iteration_time, stage_link, stage_times
from pdjax.sim.hardware import get_hardware_spec
from pdjax.sim.simulator import SimInstance, simulate
from pdjax.sim.step_cost import PipelineStepTime, make_step_time


def _out(step, ids):
    out = SchedulerOutput(step=step)
    out.req_ids.extend(ids)
    return out


# ------------------------------------------------------------------------------------------------ the queue
def test_batch_queue_push_pop_in_order():
    q = BatchQueue(2)
    assert not q and not q.full and len(q) == 0
    q.push(_out(1, ["a", "b"]), "h1")
    q.push(_out(2, ["c"]), "h2")
    assert q.full and q.in_flight_ids == {"a", "b", "c"} and q.is_in_flight("c")
    with pytest.raises(RuntimeError, match="2 batches already in flight"):
        q.push(_out(3, ["d"]))
    out, payload = q.pop()
    assert out.step == 1 and payload == "h1" and q.in_flight_ids == {"c"}
    with pytest.raises(RuntimeError, match=r"requests \['c'\] that are already in an in-flight batch"):
        q.push(_out(3, ["c"]))
    with pytest.raises(ValueError, match="schedules nothing"):
        q.push(_out(3, []))
    assert q.pop()[0].step == 2
    with pytest.raises(IndexError):
        q.pop()
    with pytest.raises(ValueError, match="max_in_flight=0"):
        BatchQueue(0)


def test_mean_in_flight():
    assert mean_in_flight([]) == (0.0, 0.0)
    assert mean_in_flight([(0, 2), (1, 3), (5, 6)]) == ((2 + 2 + 1) / 4, 4.0)


# ------------------------------------------------------------------------------------------------ scheduler rule
def _cfg(**kw):
    base = dict(policy="sarathi", token_budget=64, max_num_seqs=8, max_model_len=64, page_size=4, num_pages=64,
                watermark=0.0)
    base.update(kw)
    return SchedulerConfig(**base)


@pytest.mark.parametrize("policy", ["sarathi", "vllm_v0", "orca", "vllm_v1", "chunked_only", "decode_first"])
def test_in_flight_requests_are_not_scheduled_again(policy):
    s = make_scheduler(_cfg(policy=policy))
    for i in range(3):
        s.add_request(Request(f"r{i}", [1] * 5, SamplingParams(max_tokens=8), 0.0))
    a = s.schedule(0.0)
    assert sorted(a.req_ids) == ["r0", "r1", "r2"] and s.has_in_flight
    b = s.schedule(0.0)                        # every request is in flight: nothing to run
    assert b.is_empty
    s.add_request(Request("late", [2] * 5, SamplingParams(max_tokens=8), 0.0))
    c = s.schedule(0.0)                        # a second batch from the requests not in flight
    # (decode_first: the empty step sealed its batch of three, late waits for it to drain)
    assert c.req_ids == ([] if policy == "decode_first" else ["late"])
    s.update(a, fake_sample(a), 1.0)
    d = s.schedule(1.0)                        # r* are back; late is still in flight
    assert "late" not in d.req_ids and sorted(d.req_ids) == ["r0", "r1", "r2"]
    with pytest.raises(ValueError, match="update\\(\\) of step 1 after step 1 was applied"):
        s.update(a, fake_sample(a), 1.0)
    if c.req_ids:
        s.update(c, fake_sample(c), 2.0)
        with pytest.raises(ValueError, match="in the order schedule\\(\\) returned them"):
            s.update(c, fake_sample(c), 2.0)
    s.update(d, fake_sample(d), 2.0)
    assert not s.has_in_flight
    s.check_invariants()


@pytest.mark.parametrize("policy", ["sarathi", "vllm_v1"])
def test_an_in_flight_victim_is_never_preempted_the_requester_waits(policy):
    """old and young alternate batches (2 in flight); 6 pages of 4 hold both up to 12 tokens each. When old needs
    a 4th page, the victim rule names young (latest arrival / last admitted), which is in flight: nobody is
    preempted and old waits; once young's batch is applied, young is preempted and old gets its page."""
    s = make_scheduler(_cfg(policy=policy, num_pages=6, max_model_len=24))
    old = Request("old", [1] * 8, SamplingParams(max_tokens=14), 0.0)
    young = Request("young", [2] * 8, SamplingParams(max_tokens=14), 1.0)
    s.add_request(old)
    batches = [s.schedule(0.0)]
    s.add_request(young)
    batches.append(s.schedule(1.0))
    assert [b.req_ids for b in batches] == [["old"], ["young"]]
    for _ in range(8):                  # apply the oldest, schedule the next: the two alternate
        b = batches.pop(0)
        s.update(b, fake_sample(b), 2.0)
        batches.append(s.schedule(2.0))
        assert batches[-1].req_ids == b.req_ids and not batches[-1].preempted_req_ids
    assert (old.num_computed_tokens, young.num_computed_tokens) == (11, 11)
    b = batches.pop(0)
    s.update(b, fake_sample(b), 3.0)    # old: 12 computed, its 3 pages full; young in flight
    assert s.block_manager.num_free_pages == 0 and s.is_in_flight(young)
    waited = s.schedule(3.0)
    assert waited.is_empty and not waited.preempted_req_ids and young.status is RequestStatus.RUNNING
    b = batches.pop(0)
    s.update(b, fake_sample(b), 4.0)    # young applied: now it can be preempted
    out = s.schedule(4.0)
    assert out.req_ids == ["old"] and out.preempted_req_ids == ["young"]
    s.update(out, fake_sample(out), 5.0)
    s.check_invariants()


# ------------------------------------------------------------------------------------------------ stage cost
A100 = get_hardware_spec("a100-80gb-sxm")


def test_stage_times_split_the_iteration_and_pp1_matches():
    model = get_model_spec("llama-2-70b")
    params = CostParams(launch_overhead_s=2e-6)
    rng = random.Random(0)
    for _ in range(20):
        batch = BatchComposition(tuple((rng.randint(1, 600), rng.randint(0, 2000)) for _ in range(rng.randint(0, 2))),
                                 ((rng.randint(1, 64), rng.randint(0, 3000)),))
        (one,), sends = stage_times(batch, model, A100, 4, 1, params)
        assert sends == () and one == pytest.approx(iteration_time(batch, model, A100, 4, 1, params).total, rel=1e-12)
        stages, sends = stage_times(batch, model, A100, 4, 2, params)
        assert len(stages) == 2 and len(sends) == 1
        # two stages of 40 layers each ~ half the work each; stage 0 carries the host time
        assert stages[0] > stages[1] > 0.3 * one
        assert sum(stages) == pytest.approx(one, rel=0.05)


def test_stage_link_follows_the_placement():
    node4 = A100.replace(devices_per_node=4)
    assert stage_link(A100, 4, 0) == (A100.intra_node_bandwidth, A100.intra_node_latency)    # one 8-GPU node
    assert stage_link(node4, 4, 0) == (A100.inter_node_bandwidth, A100.inter_node_latency)   # two 4-GPU nodes
    pairwise = get_hardware_spec("a100-80gb-pcie")
    assert stage_link(pairwise, 1, 0)[0] == pairwise.pairwise_bandwidth     # GPU 0 -> 1: bridged pair
    assert stage_link(pairwise, 1, 1)[0] == pairwise.intra_node_bandwidth   # GPU 1 -> 2: PCIe


def test_make_step_time_pipelines():
    model = get_model_spec("llama-2-7b")
    step = make_step_time(model, A100, 1, 2)
    assert isinstance(step, PipelineStepTime) and step.pp == 2
    cfg = SchedulerConfig(policy="sarathi", token_budget=256, max_num_seqs=32, max_model_len=2048, num_pages=2000)
    rng = random.Random(1)
    reqs = [Request(f"r{i}", [1] * rng.randint(50, 800), SamplingParams(max_tokens=rng.randint(5, 60)), 0.0)
            for i in range(40)]
    inst = SimInstance("a", make_scheduler(cfg), step)
    assert inst.max_in_flight == 2
    res = simulate(reqs, [inst])
    assert all(r.finish_reason == "length" for r in res.requests)
    p = res.pipeline
    assert 0.0 < p["bubble_fraction"] < 0.6 and 1.0 < p["mean_batches_in_flight"] <= 2.0


# ------------------------------------------------------------------------------------------------ real model
jax = pytest.importorskip("jax")
needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake CPU) devices")

MAX_LEN, PAGE = 64, 16


@pytest.fixture(scope="module")
def runners():
    from pdjax.models.llama import init_params
    from pdjax.runtime.batch import Buckets
    from pdjax.runtime.mesh import make_mesh
    from pdjax.runtime.pipeline import PipelineRunner
    from pdjax.runtime.runner import ModelRunner

    spec = get_model_spec("tiny-llama")
    params = init_params(spec, 3)
    buckets = Buckets(tokens=(16, 64), seqs=(4,), pages=(MAX_LEN // PAGE,))
    kw = dict(num_pages=32, page_size=PAGE, buckets=buckets, max_model_len=MAX_LEN, attention_impl="reference")
    single = ModelRunner(spec, params, **kw)
    pipe = PipelineRunner(spec, params, mesh=make_mesh(jax.devices()[:2], pp=2, tp=1), **kw)
    return single, pipe


def _prompts(shared_prefix: bool):
    rng = random.Random(0)
    prefix = [rng.randrange(1, 500) for _ in range(32)]
    out = []
    for i, n in enumerate((5, 17, 33, 40, 9, 24)):
        p = [rng.randrange(1, 500) for _ in range(n)]
        out.append((prefix + p)[:max(n, 34)] if shared_prefix and i % 2 else p)
    return out


def _serve(runner, policy, *, max_in_flight, num_pages=32, preemption="recompute", caching=False):
    from pdjax.serving.engine import ColocatedEngine
    budget = 16 if policy == "sarathi" else 64
    cfg = SchedulerConfig(policy=policy, token_budget=budget, max_num_seqs=4, max_model_len=MAX_LEN, page_size=PAGE,
                          num_pages=num_pages, preemption_mode=preemption, watermark=0.0,
                          num_host_pages=32 if preemption == "swap" else 0, enable_prefix_caching=caching)
    prompts = _prompts(caching)
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=12), 0.0) for i, p in enumerate(prompts)]
    result = ColocatedEngine(runner, make_scheduler(cfg), max_in_flight=max_in_flight).run(reqs)
    assert all(r.finish_reason == "length" for r in result.requests)
    return result, [result.output_tokens[f"r{i}"] for i in range(len(reqs))]


@needs_8
@pytest.mark.parametrize("policy", ["sarathi", "vllm_v0"])
@pytest.mark.parametrize("case", ["plain", "recompute", "swap", "prefix_caching"])
def test_pipelined_engine_tokens_equal_single_device(runners, policy, case):
    single, pipe = runners
    kw = {"plain": {}, "recompute": dict(num_pages=8), "swap": dict(num_pages=8, preemption="swap"),
          "prefix_caching": dict(caching=True)}[case]
    _, want = _serve(single, policy, max_in_flight=1, **kw)
    result, got = _serve(pipe, policy, max_in_flight=2, **kw)
    assert got == want
    its = result.iterations
    assert any(b.start_time < a.end_time for a, b in zip(its, its[1:])), "never two batches in flight"
    if case in ("recompute", "swap"):
        assert sum(r.num_preemptions for r in result.requests) > 0
