"""The real engine sizes its KV cache from device memory (scheduler.num_pages = 0) and refuses, before anything of
the run compiles, a cache that cannot fit. CPU devices report no memory size, so the device's size is given here
(as a TPU or GPU reports it: `memory_stats()['bytes_limit']`); the planning compiles run on the CPU."""
import pytest

from pdjax.config.serving import serve_config_from_dict
from pdjax.errors import UserError
from pdjax.runtime import aot
from pdjax.serving.build import build_engine, build_instances

MiB = 2 ** 20


def _cfg(num_pages, tp=1, utilization=0.9):
    return serve_config_from_dict({
        "model": {"checkpoint": "tiny-mha", "dtype": "float32"}, "workload": {"preset": "chat"},
        "engine": {"token_buckets": [32], "seq_buckets": [4], "kv_memory_utilization": utilization},
        "scheduler": {"token_budget": 32, "max_num_seqs": 4, "max_model_len": 128, "page_size": 16,
                      "num_pages": num_pages},
        "deployment": {"colocated": {"tp": tp}}})


@pytest.fixture(scope="module")
def model(tiny_mha):
    return tiny_mha


def test_num_pages_zero_on_cpu_names_the_fix(model):
    spec, params = model
    with pytest.raises(UserError, match="report none: set scheduler.num_pages"):
        build_engine(_cfg(0), params=params, spec=spec)


def test_num_pages_zero_fills_the_devices_memory(model, monkeypatch):
    """tp=2: each device holds half the KV heads, so the same memory holds about twice the pages of tp=1; the plan
    compiled (on these CPU devices) fits utilization x memory."""
    spec, params = model
    monkeypatch.setattr(aot, "device_memory_bytes", lambda devices: 64 * MiB)
    pages = {}
    for tp in (1, 2):
        (inst,) = build_instances(_cfg(0, tp=tp), params=params, spec=spec)
        pages[tp] = inst.runner.num_pages
        assert inst.scheduler.config.num_pages == pages[tp] > 8
    per_page = aot.kv_page_bytes(spec, tp=1, num_layers=spec.num_layers, page_size=16, dtype="float32")
    assert pages[1] < 0.9 * 64 * MiB / per_page            # the weights and the step's temporaries come first
    assert 1.8 < pages[2] / pages[1] < 2.2


def test_a_cache_that_cannot_fit_is_refused_in_one_line(model, monkeypatch):
    spec, params = model
    monkeypatch.setattr(aot, "device_memory_bytes", lambda devices: 8 * MiB)
    with pytest.raises(UserError) as err:
        build_engine(_cfg(10_000), params=params, spec=spec)
    text = str(err.value)
    assert "\n" not in text and "'tiny-mha' does not fit deployment.colocated" in text
    assert "num_pages=10000" in text and "0.01 GiB available" in text


def test_simulator_on_host_cpu_refuses_num_pages_zero():
    from pdjax.sim.build import build_setup
    cfg = serve_config_from_dict({"backend": "sim", "model": {"checkpoint": "tiny-mha"}, "workload": {"preset": "chat"},
                                  "scheduler": {"num_pages": 0}, "sim": {"hardware": "host-cpu"}})
    with pytest.raises(ValueError, match="scheduler.num_pages=0 sizes the KV cache from a GPU/TPU's memory"):
        build_setup(cfg)


@pytest.mark.parametrize("where", [{"sim": {"hardware": "a100-80gb-sxm", "num_pages": 1024}},
                                   {"sim": {"hardware": "a100-80gb-sxm"},
                                    "deployment": {"colocated": {"num_pages": 1024}}}])
def test_simulator_refuses_an_explicit_cache_that_cannot_fit(where):
    """issue 27 item 1: Llama-2-70B on one A100-80GB at TP 1 with an explicit num_pages simulated with attainment 1."""
    from pdjax.sim.build import build_setup
    cfg = serve_config_from_dict({"backend": "sim", "model": {"checkpoint": "llama-2-70b"},
                                  "workload": {"preset": "chat"}, **where})
    with pytest.raises(ValueError, match=r"llama-2-70b does not fit a100-80gb-sxm with tp=1, pp=1 and num_pages=1024: "
                                         r"128.5 GiB of weights"):
        build_setup(cfg)
    build_setup(serve_config_from_dict({"backend": "sim", "model": {"checkpoint": "llama-2-70b"},
                                        "workload": {"preset": "chat"}, "sim": where["sim"],
                                        "deployment": {"colocated": {"tp": 4, "num_pages": 1024}}}))
