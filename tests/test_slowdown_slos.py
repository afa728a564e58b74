"""Splitwise's slowdown SLOs (pdjax.metrics.slowdown)."""
import numpy as np
import pytest

from pdjax.metrics import RequestRecord
from pdjax.metrics.slowdown import SPLITWISE_SLO_FACTORS, request_latencies, slowdowns, splitwise_slo_check


def _req(rid, arrival, times, reason="length"):
    return RequestRecord(rid, arrival, arrival if times else None, times[0] if times else None,
                         times[-1] if times else None, 10, len(times), 0, reason, list(times))


def test_a_request_served_alone_has_slowdown_one_and_passes():
    alone = [_req("a", 0.0, [0.2, 0.25, 0.31, 0.36]), _req("b", 5.0, [5.1])]
    reference = {r.request_id: request_latencies(r) for r in alone}
    check = splitwise_slo_check(alone, reference)
    assert all(v == pytest.approx(1.0) for per_q in check["slowdowns"].values() for v in per_q.values())
    assert check["passes"] and check["factors"] == SPLITWISE_SLO_FACTORS


def test_percentiles_of_slowdowns_against_numpy_and_each_of_the_nine_bounds():
    rng = np.random.default_rng(1)
    loaded, reference = [], {}
    for i in range(200):
        ttft, tbt, n = 0.1, 0.02, 6
        reference[f"r{i}"] = (ttft, tbt, ttft + tbt * (n - 1))
        s_ttft, s_tbt = rng.uniform(1.0, 2.5), rng.uniform(1.0, 1.3)
        first = i + ttft * s_ttft
        loaded.append(_req(f"r{i}", float(i), [first + k * tbt * s_tbt for k in range(n)]))
    per = slowdowns(loaded, reference)
    check = splitwise_slo_check(loaded, reference)
    for metric in ("ttft", "tbt", "e2e"):
        assert check["slowdowns"][metric]["p90"] == pytest.approx(float(np.percentile(per[metric], 90)))
    assert check["holds"]["ttft"]["p50"] and check["holds"]["ttft"]["p90"] and check["holds"]["ttft"]["p99"]
    assert check["holds"]["tbt"]["p50"] and check["holds"]["tbt"]["p90"]
    assert check["passes"] == all(all(v.values()) for v in check["holds"].values())
    strict = splitwise_slo_check(loaded, reference, factors={**SPLITWISE_SLO_FACTORS, "ttft": {"p50": 1.5}})
    assert not strict["holds"]["ttft"]["p50"] and not strict["passes"]


def test_unserved_requests_fail_the_tail_and_a_missing_reference_is_named():
    served = [_req(f"r{i}", 0.0, [0.1, 0.2]) for i in range(90)]
    rejected = [_req(f"x{i}", 0.0, [], reason="rejected") for i in range(10)]
    reference = {r.request_id: request_latencies(r) for r in served}
    check = splitwise_slo_check(served + rejected, reference)
    assert check["slowdowns"]["e2e"]["p99"] is None and not check["holds"]["e2e"]["p99"] and not check["passes"]
    assert check["holds"]["e2e"]["p50"]
    with pytest.raises(ValueError, match="request 'r0' has no unloaded reference run"):
        splitwise_slo_check(served, {})
