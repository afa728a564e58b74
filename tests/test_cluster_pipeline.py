"""Batches in flight on every instance of the multi-instance loop (pdjax.serving.cluster.ClusterEngine), 8 fake CPU
devices, tiny-mha with dummy weights: each pp2 instance keeps up to 2 batches in flight in its own BatchQueue, in
both groups of a disaggregated deployment (with async and sync KV transfer, and with the mixed pool) and on
colocated replicas (with swap preemption); greedy tokens equal one device, iteration records of one instance
overlap in time, nothing leaks; max_in_flight=1 is the one-batch-per-round loop; the Coordinator hooks see every
schedule and every collect."""
import numpy as np
import pytest

from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig

jax = pytest.importorskip("jax")
pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake CPU) devices")

PAGE, MAX_LEN, BUDGET = 8, 64, 16
PROMPT_LENS = (5, 8, 16, 17, 33, 40)
MAX_TOKENS = (4, 1, 6, 3, 5, 7)


@pytest.fixture(scope="module")
def model(tiny_mha):
    return tiny_mha


def _buckets():
    from pdjax.runtime.batch import Buckets
    return Buckets(tokens=(BUDGET,), seqs=(8,), pages=(MAX_LEN // PAGE,))   # one compiled shape per stage


@pytest.fixture(scope="module")
def pipes(model):
    """Four pp2 x tp1 PipelineRunners on devices (0, 1), (2, 3), (4, 5), (6, 7), reused by every test (stale KV
    from earlier tests is harmless: a request reads only positions it wrote or received)."""
    from pdjax.runtime.mesh import make_mesh
    from pdjax.runtime.pipeline import PipelineRunner
    spec, params = model
    devs = jax.devices()
    return [PipelineRunner(spec, params, num_pages=48, page_size=PAGE, buckets=_buckets(),
                           attention_impl="reference", mesh=make_mesh(devs[2 * i:2 * i + 2], pp=2, tp=1),
                           max_model_len=MAX_LEN) for i in range(4)]


@pytest.fixture(scope="module")
def prompts(model):
    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(0, model[0].vocab_size, n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(model, prompts):
    from pdjax.runtime.generate import generate
    from pdjax.runtime.runner import ModelRunner
    spec, params = model
    one = ModelRunner(spec, params, num_pages=48, page_size=PAGE, buckets=_buckets(), attention_impl="reference",
                      max_model_len=MAX_LEN)
    tokens, _ = generate(one, prompts, max(MAX_TOKENS), chunk_size=BUDGET, token_budget=BUDGET)
    return {f"r{i}": [int(t) for t in tokens[i][:m]] for i, m in enumerate(MAX_TOKENS)}


def _requests(prompts, gap=0.0):
    from pdjax.scheduler import Request
    return [Request(f"r{i}", p, SamplingParams(max_tokens=m), i * gap)
            for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS))]


def _instance(name, runner, policy=None, **kw):
    from pdjax.scheduler import make_scheduler
    from pdjax.serving.cluster import Instance
    role = name.rstrip("0123456789")
    role = "colocated" if role == "replica" else role
    base = dict(policy=policy or f"{role}_only", token_budget=BUDGET, max_num_seqs=8, max_model_len=MAX_LEN,
                page_size=PAGE, num_pages=48, watermark=0.0)
    return Instance(name, role, runner, make_scheduler(SchedulerConfig(**{**base, **kw})))


def _ints(tokens):
    return {rid: [int(t) for t in toks] for rid, toks in tokens.items()}


def _overlaps(result, name):
    """Pairs of consecutive iterations of instance `name` whose (start, end) spans overlap (batches in flight)."""
    its = [it for it in result.iterations if it.instance == name]
    assert [it.step for it in its] == list(range(len(its)))
    return sum(b.start_time < a.end_time for a, b in zip(its, its[1:]))


def _no_leaks(engine):
    assert not engine._staged and not engine._in_flight
    for inst in engine.instances:
        s = inst.scheduler
        assert not s.has_unfinished() and getattr(s, "num_held", 0) == 0, inst.name
        assert s.block_manager.num_free_pages == s.config.num_pages, inst.name


def _check_records(result):
    for rec in result.requests:
        assert rec.finish_reason == "length"
        assert rec.num_output_tokens == len(rec.token_times) == MAX_TOKENS[int(rec.request_id[1:])]
        assert rec.token_times == sorted(rec.token_times)


# ------------------------------------------------------------------------------------------------ disaggregated
@pytest.mark.parametrize("async_transfer", [True, False], ids=["async", "sync"])
def test_disaggregated_pp2_to_pp2_keeps_batches_in_flight_in_both_groups(pipes, prompts, reference,
                                                                        async_transfer):
    """prefill pp2 -> decode pp2: both instances keep 2 batches in flight (the decode side admits handed-off
    requests while a batch is in flight, then its running requests alternate between two batches); tokens equal
    one device; every transfer lands."""
    from pdjax.serving.disagg import DisaggregatedEngine
    prefill = _instance("prefill0", pipes[0])
    decode = _instance("decode0", pipes[1])
    engine = DisaggregatedEngine([prefill], [decode], async_transfer=async_transfer)
    assert [engine.instance_max_in_flight(i) for i in engine.instances] == [2, 2]
    result = engine.run(_requests(prompts))
    assert _ints(result.output_tokens) == reference
    _check_records(result)
    assert _overlaps(result, "prefill0") > 0, "the prefill instance never had two batches in flight"
    # The decode side splits its running requests once a handoff is admitted while a batch is in flight: with
    # sync transfers the KV lands in the prefill's collect, before the decode's top-up (deterministic); async
    # landings are noticed at polls, so there it depends on timing (in practice most decode batches overlap).
    if not async_transfer:
        assert _overlaps(result, "decode0") > 0, "the decode instance never had two batches in flight"
    assert all(it.num_decode_tokens == 0 for it in result.iterations if it.instance == "prefill0")
    assert all(it.num_prefill_tokens == 0 for it in result.iterations if it.instance == "decode0")
    assert sorted(t.request_id for t in result.transfers) == [f"r{i}" for i, m in enumerate(MAX_TOKENS) if m > 1]
    assert all(t.landed_time >= t.start_time for t in result.transfers)
    _no_leaks(engine)


def test_a_pp2_decode_group_splits_its_decodes_over_two_batches_in_flight(pipes, prompts, reference):
    """decode pp2 with decode_batches=2 (what instance_scheduler_config gives a pp2 decode group): each decode
    batch takes at most half the running requests, so the next batch takes the rest and both stages work (vLLM
    v0's virtual engines); tokens equal one device."""
    from pdjax.serving.disagg import DisaggregatedEngine
    from pdjax.config.deployment import InstanceGroupConfig, instance_scheduler_config
    base = SchedulerConfig(policy="sarathi", token_budget=BUDGET, max_num_seqs=8, max_model_len=MAX_LEN,
                           page_size=PAGE, num_pages=48)
    assert instance_scheduler_config(base, InstanceGroupConfig(pp=2), "decode").decode_batches == 2
    assert instance_scheduler_config(base, InstanceGroupConfig(pp=2), "prefill").decode_batches == 1
    logged = []
    decode = _instance("decode0", pipes[1], decode_batches=2)
    schedule = decode.scheduler.schedule
    decode.scheduler.schedule = lambda now: logged.append((schedule(now), len(decode.scheduler.running))) or \
        logged[-1][0]
    engine = DisaggregatedEngine([_instance("prefill0", pipes[0])], [decode], async_transfer=False)
    result = engine.run(_requests(prompts))
    assert _ints(result.output_tokens) == reference
    _check_records(result)
    batches = [(out, running) for out, running in logged if not out.is_empty]
    decodes = [[rid for rid, pre in zip(out.req_ids, out.is_prefill) if not pre] for out, _ in batches]
    assert all(len(d) <= -(-running // 2) for d, (_, running) in zip(decodes, batches))
    assert sum(len(d) >= 2 for d in decodes) > 0 and _overlaps(result, "decode0") > 0
    _no_leaks(engine)


def test_max_in_flight_one_is_the_one_batch_per_round_loop(pipes, prompts, reference):
    """max_in_flight=1 on the same pp2 runners: no two batches of one instance overlap, same tokens; overlap=False
    also keeps one batch; a bad max_in_flight is refused."""
    from pdjax.serving.disagg import DisaggregatedEngine
    engine = DisaggregatedEngine([_instance("prefill0", pipes[0])], [_instance("decode0", pipes[1])],
                                 max_in_flight=1)
    result = engine.run(_requests(prompts))
    assert _ints(result.output_tokens) == reference
    assert _overlaps(result, "prefill0") == _overlaps(result, "decode0") == 0
    _no_leaks(engine)
    off = DisaggregatedEngine([_instance("prefill0", pipes[0])], [_instance("decode0", pipes[1])], overlap=False)
    assert [off.instance_max_in_flight(i) for i in off.instances] == [1, 1]
    with pytest.raises(ValueError, match="max_in_flight=0"):
        DisaggregatedEngine([_instance("prefill0", pipes[0])], [_instance("decode0", pipes[1])], max_in_flight=0)


def test_coordinator_hooks_see_every_schedule_and_collect(pipes, prompts, reference):
    """A recording Coordinator posing as process 0 of 2 (every instance's devices are on process 0 only, so its
    ids go through `agree(ids, source=0)`): one digest per schedule() call, one id agreement per iteration, every
    clock reading through now()."""
    from pdjax.serving.disagg import DisaggregatedEngine
    from pdjax.serving.distributed import Coordinator

    class Recording(Coordinator):
        num_processes = 2

        def __init__(self):
            super().__init__(record_digest=True)
            self.id_agreements = 0
            self.clock_reads = 0

        def agree(self, value, source=None):
            self.id_agreements += source is not None     # only the ids of an instance are agreed from a source
            return value

        def now(self, local_elapsed):
            self.clock_reads += 1
            return float(local_elapsed)

    coord = Recording()
    prefill, decode = _instance("prefill0", pipes[0]), _instance("decode0", pipes[1])
    schedules = []
    for inst in (prefill, decode):
        def wrap(inst=inst, orig=inst.scheduler.schedule):
            def schedule(now):
                schedules.append(inst.name)
                return orig(now)
            return schedule
        inst.scheduler.schedule = wrap()
    engine = DisaggregatedEngine([prefill], [decode], coordinator=coord)
    collected = []
    real_collect = coord.collect
    names = {id(prefill.runner): "prefill0", id(decode.runner): "decode0"}
    coord.collect = lambda runner, handle: collected.append(names[id(runner)]) or real_collect(runner, handle)
    result = engine.run(_requests(prompts))
    assert _ints(result.output_tokens) == reference
    assert len(coord.step_digests) == len(schedules) >= len(result.iterations)
    assert collected == [it.instance for it in result.iterations]
    assert coord.id_agreements == len(result.iterations)
    assert coord.clock_reads >= len(schedules) + len(result.iterations)
    assert _overlaps(result, "prefill0") > 0
    _no_leaks(engine)


def test_mixed_pool_pp2_switches_with_batches_in_flight(model, prompts, reference):
    """prefill pp2, decode pp2 and two pp2 mixed instances (all 8 devices) from the config: mixed machines take
    the prefill and the decode phase, hand off / receive KV with batches in flight, and return to the pool."""
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.serving.build import build_engine
    spec, params = model
    cfg = serve_config_from_dict({
        "model": {"checkpoint": "tiny-mha", "attention_impl": "reference"}, "workload": {"preset": "chat"},
        "engine": {"token_buckets": [BUDGET], "seq_buckets": [8], "page_buckets": [MAX_LEN // PAGE]},
        "scheduler": {"token_budget": BUDGET, "max_num_seqs": 8, "max_model_len": MAX_LEN, "page_size": PAGE,
                      "num_pages": 48, "watermark": 0.0},
        "deployment": {"kind": "disaggregated", "prefill": {"pp": 2}, "decode": {"pp": 2},
                       "mixed": {"num_instances": 2, "pp": 2},
                       "mixed_prefill_queue_tokens": 40, "mixed_decode_load": 0.2}})
    engine = build_engine(cfg, params=params, spec=spec)
    assert {i.name: engine.instance_max_in_flight(i) for i in engine.instances} == {
        "prefill0": 2, "decode0": 2, "mixed0": 2, "mixed1": 2}
    result = engine.run(_requests(prompts))
    assert _ints(result.output_tokens) == reference
    _check_records(result)
    phases = {s.phase for s in engine.pool.switches}
    assert {"prefill", "decode", None} <= phases
    assert all(i.scheduler.phase is None for i in engine.mixed)
    assert any(t.src.startswith("mixed") or t.dst.startswith("mixed") for t in result.transfers)
    assert sum(_overlaps(result, i.name) for i in engine.instances) > 0
    _no_leaks(engine)


# ------------------------------------------------------------------------------------------------ colocated
@pytest.mark.parametrize("case", ["plain", "swap", "recompute"])
def test_two_pp2_replicas_keep_batches_in_flight(pipes, prompts, reference, case):
    """Two colocated pp2 replicas behind the router: each keeps 2 batches in flight; swap and recompute
    preemption (few pages) keep working, requests in flight never chosen as victims; tokens equal one device."""
    from pdjax.serving.cluster import ClusterEngine
    kw = {"plain": {}, "swap": dict(num_pages=8, preemption_mode="swap", num_host_pages=32),
          "recompute": dict(num_pages=8)}[case]
    replicas = [_instance(f"replica{i}", pipes[2 + i], "sarathi", **kw) for i in range(2)]
    engine = ClusterEngine(replicas, router="round_robin")
    result = engine.run(_requests(prompts))
    assert _ints(result.output_tokens) == reference
    _check_records(result)
    assert _overlaps(result, "replica0") > 0 and _overlaps(result, "replica1") > 0
    if case != "plain":
        assert sum(r.num_preemptions for r in result.requests) > 0, "no preemption: the case tests nothing"
    _no_leaks(engine)


def test_pipelined_replicas_from_the_config(model, prompts, reference):
    """deployment.colocated: 2 replicas x pp2 x tp1 built from the config: batches in flight on both."""
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.serving.build import build_engine
    from pdjax.serving.cluster import ClusterEngine
    spec, params = model
    cfg = serve_config_from_dict({
        "model": {"checkpoint": "tiny-mha", "attention_impl": "reference"}, "workload": {"preset": "chat"},
        "engine": {"token_buckets": [BUDGET], "seq_buckets": [8], "page_buckets": [MAX_LEN // PAGE]},
        "scheduler": {"policy": "sarathi", "token_budget": BUDGET, "max_num_seqs": 8, "max_model_len": MAX_LEN,
                      "page_size": PAGE, "num_pages": 48},
        "deployment": {"kind": "colocated", "colocated": {"num_instances": 2, "pp": 2}}})
    engine = build_engine(cfg, params=params, spec=spec)
    assert isinstance(engine, ClusterEngine)
    assert [engine.instance_max_in_flight(i) for i in engine.instances] == [2, 2]
    result = engine.run(_requests(prompts))
    assert _ints(result.output_tokens) == reference
    assert _overlaps(result, "replica0") > 0 and _overlaps(result, "replica1") > 0
    _no_leaks(engine)
