"""The simulator follows model.dtype (issue 27, item 2): weight and KV bytes, KV pages, the fit check and the
matmul rate of the cost model; 'auto' (the default) keeps the checkpoint's own dtype, so the paper configs' 16-bit
runs and the stored fixtures are unchanged."""
import importlib.util
import pathlib

import pytest

from pdjax.config.model_specs import get_model_spec, resolve_dtype, spec_at_dtype
from pdjax.experiment.run import resolve_config
from pdjax.scheduler.output import SchedulerOutput
from pdjax.sim.build import build_setup, group_step_time
from pdjax.sim.cost_model import BatchComposition, iteration_time, param_count
from pdjax.sim.hardware import get_hardware_spec

REPO = pathlib.Path(__file__).resolve().parents[1]


def _serve_config():
    spec = importlib.util.spec_from_file_location("serve_cfg", REPO / "configs" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def _setup(dtype, checkpoint="llama-2-7b", **sim):
    c = _serve_config()
    c.backend = "sim"
    c.model.checkpoint = checkpoint
    c.model.dtype = dtype
    c.sim.hardware = "a100-80gb-sxm"
    c.scheduler.num_pages = 0
    for key, value in sim.items():
        c.sim[key] = value
    return build_setup(resolve_config(c))


def _decode(context):
    return SchedulerOutput(step=0, req_ids=["a"], num_computed_tokens=[context], num_new_tokens=[1], do_sample=[True],
                           is_prefill=[False], num_prefill_tokens=0, num_decode_tokens=1)


def _prefill(tokens):
    return SchedulerOutput(step=0, req_ids=["a"], num_computed_tokens=[0], num_new_tokens=[tokens], do_sample=[True],
                           is_prefill=[True], num_prefill_tokens=tokens, num_decode_tokens=0)


def test_float32_costs_twice_the_bytes_of_bfloat16():
    """Llama-2-7B on an A100-80GB: at float32 the weights take twice the memory, so the KV cache gets fewer pages,
    each page twice the bytes; a decode step (weight-streaming bound) and a prefill step (TF32 at half bf16's peak)
    take about twice as long. (Old main: identical pages and step times at every dtype.)"""
    bf16, fp32 = _setup("bfloat16"), _setup("float32")
    assert bf16.model.dtype == "bfloat16" and fp32.model.dtype == "float32"
    hw = get_hardware_spec("a100-80gb-sxm")
    spec = get_model_spec("llama-2-7b")
    pages = {s.model.dtype: s.groups["colocated"].scheduler_config.num_pages for s in (bf16, fp32)}
    # independent count: (0.9 HBM - weights - activations) / KV bytes per page, activations being small
    for dtype, nbytes in (("bfloat16", 2), ("float32", 4)):
        free = 0.9 * hw.hbm_capacity - param_count(spec) * nbytes
        expected = free / (16 * spec.kv_bytes_per_token(nbytes))
        assert 0.9 * expected < pages[dtype] <= expected
    assert pages["float32"] < 0.5 * pages["bfloat16"]
    steps = {}
    for s in (bf16, fp32):
        step = group_step_time(s, "colocated", noise=False)
        steps[s.model.dtype] = (step(_decode(1000)), step(_prefill(2048)))
    for i in (0, 1):
        assert 1.6 < steps["float32"][i] / steps["bfloat16"][i] < 2.2


def test_auto_is_the_checkpoints_dtype_and_float16_equals_bfloat16():
    """'auto' costs the spec's own dtype (bf16 for Llama-2, fp16 for OPT, fp32 for tiny specs); fp16 and bf16 have
    the same bytes and the same tensor-core peak, so they cost the same."""
    auto, bf16, fp16 = _setup("auto"), _setup("bfloat16"), _setup("float16")
    assert auto.model == get_model_spec("llama-2-7b")
    pages = [s.groups["colocated"].scheduler_config.num_pages for s in (auto, bf16, fp16)]
    assert pages[0] == pages[1] == pages[2]
    times = [group_step_time(s, "colocated", noise=False)(_decode(500)) for s in (auto, bf16, fp16)]
    assert times[0] == times[1] == times[2]
    assert spec_at_dtype(get_model_spec("opt-13b"), "auto").dtype == "float16"
    assert spec_at_dtype(get_model_spec("tiny-llama"), "auto").dtype == "float32"
    assert resolve_dtype("auto", "bfloat16", cpu=True) == "float32"
    assert resolve_dtype("float16", "bfloat16", cpu=True) == "float16"


def test_float32_that_cannot_fit_is_refused():
    """The fit check follows the dtype: Llama-2-13B with 4000 pages of KV fits one A100-80GB in bf16 (26 GB of
    weights + 52 GB of KV) but not in fp32 (52 + 105 GB)."""
    _setup("bfloat16", checkpoint="llama-2-13b", num_pages=4000)
    with pytest.raises(ValueError, match="does not fit"):
        _setup("float32", checkpoint="llama-2-13b", num_pages=4000)


def test_tf32_rate_for_float32_matmuls():
    """A compute-bound prefill GEMM at float32 runs at the TF32 tensor-core peak (A100: 156 of bf16's 312 TFLOPS)."""
    hw = get_hardware_spec("a100-80gb-sxm")
    assert hw.peak_flops("float32") == 156e12 and hw.peak_flops("bfloat16") == 312e12
    assert get_hardware_spec("h100-sxm").peak_flops("float32") == 494.5e12
    spec = get_model_spec("llama-2-7b")
    batch = BatchComposition(((4096, 0),), ())
    b16 = iteration_time(batch, spec, hw).linear_flops_s
    f32 = iteration_time(batch, spec_at_dtype(spec, "float32"), hw).linear_flops_s
    assert f32 == pytest.approx(2 * b16, rel=1e-9)


def test_a_step_fit_stack_refuses_another_dtype(shared_data):
    """DistServe's fits were measured at OPT's fp16: model.dtype=float32 on that stack is refused, naming it."""
    c = _serve_config()
    c.backend = "sim"
    c.model.checkpoint = "opt-13b"
    c.model.dtype = "float32"
    c.sim.hardware = "a100-80gb-sxm"
    c.scheduler.num_pages = 0
    c.scheduler.max_model_len = 2048
    c.deployment.colocated.stack = "distserve"
    with pytest.raises(ValueError, match="deployment.colocated.stack='distserve' was measured at opt-13b's own dtype"):
        build_setup(resolve_config(c))


def test_bad_dtype_is_named_at_start_up():
    c = _serve_config()
    c.model.dtype = "float8"
    with pytest.raises(ValueError, match=r"model.dtype='float8', expected one of \('auto'"):
        resolve_config(c)
