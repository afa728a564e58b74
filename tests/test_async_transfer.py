"""Asynchronous KV transfer in the multi-instance loop (pdjax.serving.cluster): with a slowed transfer (its staged
arrays count as ready only `DELAY` seconds after dispatch) the prefill instance keeps stepping while a transfer is
in flight, the decode side admits a request only after its KV landed, tokens equal the colocated reference, and
no page leaks on either side. The synchronous form (async_transfer=False) gives the same tokens."""
import time

import numpy as np
import pytest

from pdjax.config.model_specs import get_model_spec
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig

PAGE_SIZE = 8
MAX_LEN = 64
BUDGET = 16
PROMPT_LENS = (5, 8, 16, 17, 33, 40)
MAX_TOKENS = (4, 1, 6, 3, 5, 2)
DELAY = 0.05


@pytest.fixture(scope="module")
def setup():
    import jax
    from pdjax.models.llama import init_params
    from pdjax.runtime.batch import Buckets
    from pdjax.runtime.generate import generate
    from pdjax.runtime.mesh import make_mesh
    from pdjax.runtime.runner import ModelRunner
    spec = get_model_spec("tiny-mha")
    params = init_params(spec, seed=0)
    devs = jax.devices()
    buckets = Buckets(tokens=(BUDGET,), seqs=(8,), pages=(MAX_LEN // PAGE_SIZE,))

    def make(ids, tp):
        return ModelRunner(spec, params, num_pages=48, page_size=PAGE_SIZE, buckets=buckets,
                           attention_impl="reference", mesh=make_mesh([devs[i] for i in ids], tp=tp),
                           max_model_len=MAX_LEN)

    runners = {"prefill": make((0, 1), 2), "decode": make((2,), 1)}
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(0, spec.vocab_size, n)] for n in PROMPT_LENS]
    tokens, _ = generate(runners["decode"], prompts, max(MAX_TOKENS), chunk_size=BUDGET, token_budget=BUDGET)
    reference = {f"r{i}": [int(t) for t in tokens[i][:m]] for i, m in enumerate(MAX_TOKENS)}
    return runners, prompts, reference


def _requests(prompts):
    from pdjax.scheduler import Request
    return [Request(f"r{i}", p, SamplingParams(max_tokens=m), 0.0)
            for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS))]


def _instance(name, runner):
    from pdjax.scheduler import make_scheduler
    from pdjax.serving.cluster import Instance
    role = name.rstrip("0123456789")
    cfg = SchedulerConfig(policy=f"{role}_only", token_budget=BUDGET, max_num_seqs=8, max_model_len=MAX_LEN,
                          page_size=PAGE_SIZE, num_pages=48, watermark=0.0)
    return Instance(name, role, runner, make_scheduler(cfg))


def slowed_transfer(delay, log):
    """transfer_kv whose result reports ready only `delay` s after dispatch (and waits that long in wait())."""
    from pdjax.serving.kv_transfer import transfer_kv

    def transfer(*args, wait=True, **kwargs):
        staged = transfer_kv(*args, wait=False, **kwargs)
        ready_at = time.perf_counter() + delay
        real_ready, real_wait = staged.is_ready, staged.wait
        staged.is_ready = lambda: time.perf_counter() >= ready_at and real_ready()
        staged.wait = lambda: (time.sleep(max(0.0, ready_at - time.perf_counter())), real_wait())
        if wait:
            staged.wait()
        log.append(wait)
        return staged
    return transfer


@pytest.mark.parametrize("async_transfer", [True, False], ids=["async", "sync"])
def test_slowed_transfer_overlaps_prefill_and_lands_before_admission(setup, async_transfer):
    from pdjax.serving.cluster import ClusterEngine
    runners, prompts, reference = setup
    prefill, decode = _instance("prefill0", runners["prefill"]), _instance("decode0", runners["decode"])
    calls = []
    engine = ClusterEngine([prefill, decode], transfer=slowed_transfer(DELAY, calls),
                           async_transfer=async_transfer)
    for inst in engine.instances:
        inst.runner.warmup()
    engine.warmup_transfers(MAX_LEN)     # nothing compiles inside a timed transfer call
    calls.clear()
    result = engine.run(_requests(prompts))
    assert {rid: [int(t) for t in toks] for rid, toks in result.output_tokens.items()} == reference
    assert calls and all(w == (not async_transfer) for w in calls)    # async: the handoff never waits

    transfers = {t.request_id: t for t in result.transfers}
    assert sorted(transfers) == [f"r{i}" for i, m in enumerate(MAX_TOKENS) if m > 1]
    for t in transfers.values():
        assert t.landed_time >= t.start_time + DELAY * 0.99
        assert t.seconds == pytest.approx(t.landed_time - t.start_time)
    # The decode side admits a request only after its KV landed: its second token comes after the landing.
    for rec in result.requests:
        if rec.request_id in transfers:
            assert rec.token_times[1] > transfers[rec.request_id].landed_time
    prefill_starts = [it.start_time for it in result.iterations if it.instance == "prefill0"]
    overlapped = [(t.request_id, s) for t in transfers.values() for s in prefill_starts
                  if t.start_time < s < t.landed_time]
    host_blocked = result.transfer_summary()["host_blocked_s"]
    if async_transfer:
        # A prefill step started while a transfer was in flight, and the loop never sat in a transfer.
        assert overlapped, "no prefill step ran while a transfer was in flight"
        assert host_blocked < DELAY * len(transfers) / 2
    else:
        assert not overlapped
        assert host_blocked >= DELAY * len(transfers) * 0.99
    # No leaks: every page free again on both sides, nothing held, staged or in flight.
    assert prefill.scheduler.num_held == 0 and not engine._staged and not engine._in_flight
    for inst in (prefill, decode):
        assert inst.scheduler.block_manager.num_free_pages == inst.scheduler.config.num_pages


def test_real_transfer_is_dispatched_without_waiting(setup):
    """The default transfer (transfer_kv, wait=False): same tokens, every transfer landed, nothing leaked."""
    from pdjax.serving.cluster import ClusterEngine
    runners, prompts, reference = setup
    prefill, decode = _instance("prefill0", runners["prefill"]), _instance("decode0", runners["decode"])
    engine = ClusterEngine([prefill, decode])
    result = engine.run(_requests(prompts))
    assert {rid: [int(t) for t in toks] for rid, toks in result.output_tokens.items()} == reference
    assert all(t.landed_time >= t.start_time and t.seconds >= 0 for t in result.transfers)
    assert len(result.transfers) == sum(m > 1 for m in MAX_TOKENS)
    assert prefill.scheduler.num_held == 0 and not engine._staged and not engine._in_flight
    for inst in (prefill, decode):
        assert inst.scheduler.block_manager.num_free_pages == inst.scheduler.config.num_pages
