"""ModelRunner host duties: swap-out/swap-in page copies, empty iterations."""
import numpy as np
import pytest

from pdjax.config.model_specs import get_model_spec
from pdjax.models.llama import init_params
from pdjax.runtime.batch import Buckets
from pdjax.runtime.runner import ModelRunner
from pdjax.scheduler.output import SchedulerOutput
from test_model import sched

TINY = get_model_spec("tiny-llama")


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(TINY, init_params(TINY, 2), num_pages=16, page_size=8, attention_impl="reference",
                       buckets=Buckets(tokens=(32,), seqs=(2,), pages=(4,)))


def test_swap_out_then_in_elsewhere_continues_identically(runner):
    seq = list(np.random.RandomState(0).randint(0, TINY.vocab_size, 21))
    runner.execute(sched([(seq[:20], 0, [1, 2, 3], False)]))
    want = runner.execute_logits(sched([(seq[20:], 20, [1, 2, 3], True)]))

    runner.execute(sched([(seq[:20], 0, [4, 5, 6], False)]))
    out = SchedulerOutput(step=1, swap_out=[(0, 4), (1, 5), (2, 6)])
    assert runner.execute(out).shape == (0,)
    runner.execute(sched([(list(range(24)), 0, [4, 5, 6], False)]))  # clobber the device pages
    swap_in = sched([(seq[20:], 20, [9, 12, 10], True)])
    swap_in.swap_in = [(0, 9), (1, 12), (2, 10)]
    got = runner.execute_logits(swap_in)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_swap_reads_before_writes_when_a_page_is_reused(runner):
    runner.execute(sched([(list(range(8)), 0, [7], False), (list(range(100, 108)), 0, [8], False)]))
    k7 = np.asarray(runner.kv_cache.k[0][:, 7]).copy()
    runner.swap(swap_out=[(5, 8)], swap_in=[])
    k8 = runner.host_pages[5][0][0].copy()
    # Same call: page 7 goes out to slot 6 while slot 5 (old page 8) comes into page 7.
    runner.swap(swap_out=[(6, 7)], swap_in=[(5, 7)])
    np.testing.assert_array_equal(runner.host_pages[6][0][0], k7)
    np.testing.assert_array_equal(np.asarray(runner.kv_cache.k[0][:, 7]), k8)
    assert not np.array_equal(k7, k8)


def test_swap_errors(runner):
    with pytest.raises(ValueError, match=r"swap page 99 outside \[0, 16\)"):
        runner.swap(swap_out=[(0, 99)], swap_in=[])
    with pytest.raises(ValueError, match=r"host slots \[1234\]"):
        runner.swap(swap_out=[], swap_in=[(1234, 0)])


def test_dispatch_collect_equals_execute(runner):
    seqs = [([3, 1, 4, 1, 5], 0, [0], True), ([9, 2, 6], 0, [1], False)]
    handle = runner.dispatch(sched(seqs))
    got = runner.collect(handle)
    want = runner.execute(sched(seqs))
    np.testing.assert_array_equal(got, want)
    assert got[1] == -1 and 0 <= got[0] < TINY.vocab_size and got.dtype == np.int32
    assert runner.collect(runner.dispatch(SchedulerOutput(step=0))).shape == (0,)
