"""Tensor-parallel sharding on 8 fake CPU devices: sharded steps give the unsharded logits."""
import jax
import numpy as np
import pytest

from pdjax.config.model_specs import get_model_spec
from pdjax.models.llama import init_params
from pdjax.runtime.batch import Buckets
from pdjax.runtime.mesh import check_tensor_parallel, make_mesh
from pdjax.runtime.runner import ModelRunner
from test_model import sched

needs_8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake CPU) devices")


def run_mixed(spec, params, mesh):
    runner = ModelRunner(spec, params, num_pages=16, page_size=16, attention_impl="reference", mesh=mesh,
                         buckets=Buckets(tokens=(32,), seqs=(2,), pages=(4,)))
    rng = np.random.RandomState(0)
    a, b = list(rng.randint(0, spec.vocab_size, 30)), list(rng.randint(0, spec.vocab_size, 9))
    first = runner.execute_logits(sched([(a[:20], 0, [3, 5], True), (b, 0, [7], True)]))
    second = runner.execute_logits(sched([(a[20:], 20, [3, 5], True), (b[-1:], 8, [7], True)]))
    ids = runner.execute(sched([(a[-1:], 29, [3, 5], True)]))
    return runner, np.concatenate([first, second]), ids


@needs_8
@pytest.mark.parametrize("name,tp", [("tiny-llama", 2), ("tiny-mha", 4)])
def test_tensor_parallel_step_matches_unsharded(name, tp):
    spec = get_model_spec(name)
    params = init_params(spec, 1)
    _, want, want_ids = run_mixed(spec, params, None)
    runner, got, ids = run_mixed(spec, params, make_mesh(jax.devices()[:tp], dp=1, pp=1, tp=tp))
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)
    np.testing.assert_array_equal(ids, want_ids)
    k0 = runner.kv_cache.k[0]
    assert len(k0.sharding.device_set) == tp
    assert k0.addressable_shards[0].data.shape[0] == spec.num_kv_heads // tp  # heads split on 'tensor'
    assert runner.params.layers[0].w_gate.addressable_shards[0].data.shape[1] == spec.intermediate_size // tp


def test_make_mesh_axes_and_errors():
    mesh = make_mesh(jax.devices()[:1], dp=1, pp=1, tp=1)
    assert mesh.axis_names == ("data", "stage", "tensor")
    with pytest.raises(ValueError, match=r"needs 4 devices, only 1 given"):
        make_mesh(jax.devices()[:1], tp=4)
    with pytest.raises(ValueError, match=r"tp=0"):
        make_mesh(tp=0)


def test_tp_that_does_not_divide_heads_fails():
    with pytest.raises(ValueError, match=r"num_kv_heads=2 does not divide by tensor parallelism tp=4"):
        check_tensor_parallel(get_model_spec("tiny-llama"), 4)
