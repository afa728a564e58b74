"""Splitwise's slowdown references (pdjax.sim.reference) against the real simulator: a request served alone has
slowdown 1; a loaded run's slowdowns are >= 1; results.json carries the check beside the absolute SLOs."""
import pytest

from pdjax.config.model_specs import get_model_spec
from pdjax.config.serving import serve_config_from_dict
from pdjax.metrics.slowdown import slowdowns, splitwise_slo_check
from pdjax.sim.build import build_setup
from pdjax.sim.reference import ReferenceMachine, UnloadedRuns, prefill_chunks
from pdjax.sim.run import sim_info, simulate_config


def config(policy="vllm_v0", token_budget=4096, num_requests=1, rate=1.0, prompt=700, output=9,
           hardware="a100-80gb-sxm", tp=1, deployment=None):
    return serve_config_from_dict({
        "backend": "sim", "seed": 5, "model": {"checkpoint": "llama-2-7b"},
        "engine": {"mode": "online", "progress": False},
        "scheduler": {"policy": policy, "token_budget": token_budget, "max_num_seqs": 64, "max_model_len": 4096,
                      "page_size": 16, "num_pages": 4096},
        "workload": {"prompt_len": {"kind": "fixed", "value": prompt},
                     "output_len": {"kind": "fixed", "value": output}, "num_requests": num_requests, "rate": rate,
                     "vocab_size": 32000},
        "sim": {"hardware": hardware},
        "deployment": deployment or {"kind": "colocated", "colocated": {"tp": tp}}})


def _alone_slowdowns(cfg, reference):
    result, _ = simulate_config(cfg)
    (record,) = result.requests
    per = slowdowns(result.requests, reference.for_records(result.requests))
    return record, per


@pytest.mark.parametrize("policy,budget,prompt", [("vllm_v0", 4096, 700), ("sarathi", 256, 700),
                                                  ("sarathi", 256, 512)])
def test_a_request_served_alone_on_the_reference_has_slowdown_one(policy, budget, prompt):
    """The request alone (arriving at 0, then at 3.7 s) on a TP-2 A100 instance; the reference is that machine
    built independently (ReferenceMachine -> UnloadedRuns.on), chunked as the policy chunks."""
    model = get_model_spec("llama-2-7b")
    chunk = budget if policy == "sarathi" else 0
    reference = UnloadedRuns.on(model, ReferenceMachine("a100-80gb-sxm", tp=2, prefill_chunk=chunk))
    for rate in (1.0, 1 / 3.7):
        record, per = _alone_slowdowns(config(policy, budget, prompt=prompt, rate=rate, tp=2), reference)
        assert len(record.token_times) == 9 and record.num_prompt_tokens == prompt
        for metric in ("ttft", "tbt", "e2e"):
            assert per[metric] == [pytest.approx(1.0, rel=1e-12, abs=0)], metric
    # and the latencies themselves are those of the record
    ttft, tbt, e2e = reference.latencies(prompt, 9)
    assert record.token_times[0] - record.arrival_time == pytest.approx(ttft, rel=1e-12)
    assert e2e == pytest.approx(ttft + 8 * tbt, rel=1e-12)


def test_the_reference_costs_every_step_it_should():
    """A step function that records what it is asked: the prefill chunks, then one decode per further token at
    contexts p .. p+n-2, batch 1."""
    calls = []

    def step(out):
        calls.append((out.num_computed_tokens[0], out.num_new_tokens[0], out.is_prefill[0], out.do_sample[0]))
        return 1.0 + out.num_new_tokens[0] / 100 + out.num_computed_tokens[0] / 1000

    runs = UnloadedRuns(step, prefill_chunk=300)
    ttft, tbt, e2e = runs.latencies(700, 4)
    assert calls == [(0, 300, True, False), (300, 300, True, False), (600, 100, True, True),
                     (0, 1, False, True), (1, 1, False, True), (2, 1, False, True)] + \
        [(k, 1, False, True) for k in range(3, 703)]          # decode prefix filled up to context 702
    assert ttft == pytest.approx((1 + 3 + .0) + (1 + 3 + .3) + (1 + 1 + .6))
    decodes = [1 + 0.01 + c / 1000 for c in (700, 701, 702)]
    assert tbt == pytest.approx(sum(decodes) / 3) and e2e == pytest.approx(ttft + sum(decodes))
    assert runs.latencies(5, 1)[1] is None
    assert prefill_chunks(512, 256) == [256, 256] and prefill_chunks(10, 0) == [10]
    with pytest.raises(ValueError, match="output_len=0"):
        runs.latencies(5, 0)
    with pytest.raises(ValueError, match="prefill_chunk=-1"):
        ReferenceMachine(prefill_chunk=-1)


def test_a_loaded_run_is_slowed_and_results_report_the_check():
    cfg = config("vllm_v0", 4096, num_requests=40, rate=40.0, prompt=1500, output=30)
    result, setup = simulate_config(cfg)
    reference = UnloadedRuns.of_setup(setup)
    per = slowdowns(result.requests, reference.for_records(result.requests))
    assert len(per["e2e"]) == 40
    for metric in ("ttft", "tbt", "e2e"):
        assert min(per[metric]) >= 1.0 - 1e-9, metric
    assert max(per["ttft"]) > 2.0            # 40 requests in one second queue up
    info = sim_info(result, setup, cfg)["slowdown_slo"]
    check = splitwise_slo_check(result.requests, reference.for_records(result.requests))
    assert info["slowdowns"] == check["slowdowns"] and info["passes"] == check["passes"]
    assert info["reference"]["hardware"] == "a100-80gb-sxm" and info["reference"]["prefill_chunk"] == 0


def test_the_splitwise_reference_is_the_dgx_a100_at_tp8():
    model = get_model_spec("llama-2-70b")
    runs = UnloadedRuns.on(model)
    assert runs.description["hardware"] == "a100-80gb-sxm" and runs.description["tp"] == 8
    ttft_a100 = runs.latencies(2000, 10)[0]
    ttft_h100 = UnloadedRuns.on(model, ReferenceMachine("h100-sxm")).latencies(2000, 10)[0]
    assert ttft_h100 < ttft_a100


def test_a_fitted_stack_is_refused_off_its_fits(shared_data):  # DistServe's step fits live in the shared data
    with pytest.raises(ValueError, match="no step fit"):
        UnloadedRuns.on(get_model_spec("llama-2-70b"), ReferenceMachine(stack="distserve", tp=8))


def test_own_setup_reference_of_a_disaggregated_run_is_its_prefill_machine():
    cfg = config("sarathi", 512, deployment={"kind": "disaggregated", "prefill": {"tp": 1}, "decode": {"tp": 1}})
    setup = build_setup(cfg)
    runs = UnloadedRuns.of_setup(setup)
    assert runs.description["of"] == "this run's prefill instances" and runs.prefill_chunk == 512
