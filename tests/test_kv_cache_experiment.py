"""Smoke test of the KV-cache-centric experiments (pdjax.experiment.kv_cache, experiments/kv_cache.py) at their
smallest size: each part runs and its rows say what they should."""
import pytest

from pdjax.experiment import kv_cache


@pytest.fixture
def mooncake(shared_data):
    if not (shared_data / "traces" / kv_cache.TRACES["conversation"]).is_file():
        pytest.skip("Mooncake trace not present")


def test_hit_ratio_rows(mooncake):
    rows = kv_cache.hit_ratio(["conversation"], num_requests=16, rate=2.0, host_multiples=[0, 8],
                              routers=("round_robin",), num_pages=1100)
    assert [(r["pool"], r["host_multiple"]) for r in rows] == [("local", 0), ("local", 8), ("shared", 8)]
    assert all(0 <= r["hit_ratio"] <= 1 and r["queried_tokens"] > 0 for r in rows)
    assert rows[0]["host_hit_tokens"] == 0
    assert rows[1]["hit_ratio"] >= rows[0]["hit_ratio"]


def test_router_rows(mooncake):
    rows = kv_cache.routers(["conversation"], num_requests=30, rate=1.0, rates=[1.0], kinds=["disaggregated"],
                            routers_=["kv_centric"])
    (row,) = rows
    assert row["router"] == "kv_centric" and row["ttft"]["p50"] > 0 and row["tbt"]["p99"] > 0
    assert row["max_slo_rate"] in (None, 1.0)



def test_replication_rows(mooncake):
    rows = kv_cache.replication(["conversation"], num_requests=16, rate=2.0, host_multiple=8,
                                replicate_afters=[0, 1], routers_=("round_robin",), num_pages=1100)
    assert [(r["router"], r["replicate_after"]) for r in rows] == [("round_robin", 0), ("round_robin", 1)]
    assert rows[0]["replicas"] == rows[0]["copy_hits"] == 0
    assert all(0 <= r["hit_ratio"] <= 1 and r["ttft"]["p50"] > 0 for r in rows)


def test_speed_rows(monkeypatch):
    floor = {"key_s": 1.0, "register_s": 2.0, "free_and_evict_s": 3.0, "unregister_s": 4.0,
             "host_offload_and_evict_s": 100.0}
    monkeypatch.setattr(kv_cache, "bookkeeping_floor", lambda: floor)
    cases = (("round_robin", False, False), ("kv_centric", False, False), ("kv_centric", True, True))
    rows = kv_cache.speed(num_requests=300, replicas=2, cases=cases)    # enough to evict cached pages
    assert [(r["router"], r["prefix_caching"], r["host_kv_blocks"] > 0) for r in rows] == \
        [("round_robin", False, False), ("kv_centric", False, False), ("kv_centric", True, True)]
    assert all(r["num_iterations"] > 0 and r["iterations_per_s"] > 0 and r["iterations_per_cpu_s"] > 0 for r in rows)
    cached = rows[2]
    assert cached["device_evictions"] > 0 and cached["host_offloads"] > 0
    # chat10k: most prompts share no first page (numbered keys): their pages move as dead segments
    assert 0 < cached["dead_evictions"] <= cached["device_evictions"]
    assert 0 < cached["dead_offloads"] <= cached["host_offloads"]
    assert cached["floor_s"] == round((cached["device_evictions"] - cached["dead_evictions"]) * 10.0
                                      + (cached["host_offloads"] - cached["dead_offloads"]) * 100.0, 2)
    assert cached["floor_iterations_per_cpu_s"] == round(cached["num_iterations"]
                                                         / (rows[1]["cpu_s"] + cached["floor_s"]))


def test_bookkeeping_floor_prices_every_step():
    floor = kv_cache.bookkeeping_floor(pages=2000, repeat=1)
    assert set(floor) == {"key_s", "register_s", "free_and_evict_s", "unregister_s", "host_offload_and_evict_s"}
    assert all(0 < v < 1e-3 for v in floor.values()), floor
