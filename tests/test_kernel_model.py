"""The Pallas kernel wired into the model step: with attention_impl='pallas' (interpret mode on CPU) greedy
generation over mixed prefill/decode batches gives the same tokens as the reference path, and logits agree."""
import inspect

import numpy as np
import pytest

from pdjax.config.model_specs import get_model_spec
from pdjax.kernels import pallas_gpu
from pdjax.models.llama import init_params
from pdjax.runtime.generate import generate, generation_buckets
from pdjax.runtime.runner import ModelRunner


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-mqa"])  # GQA 2 with head_dim 32; MQA (GQA 4), 64
def test_pallas_greedy_equals_reference(model):
    spec = get_model_spec(model)
    params = init_params(spec, 0)
    rng = np.random.default_rng(1)
    # lengths cross 16-token pages and 8-token chunks at different offsets, so batches mix prefill and decode
    prompts = [rng.integers(0, spec.vocab_size, n).tolist() for n in (21, 5, 13)]
    max_new, page_size, chunk = 5, 16, 8
    budget = 16
    buckets = generation_buckets(prompts, max_new, page_size, budget)
    num_pages = sum(-(-(len(p) + max_new) // page_size) for p in prompts) + 1

    def run(impl):
        runner = ModelRunner(spec, params, num_pages=num_pages, page_size=page_size, buckets=buckets,
                             attention_impl=impl, max_model_len=64)
        if impl == "pallas":  # the kernel, not the reference, must be what the step calls
            assert inspect.unwrap(runner.attention_fn).func is pallas_gpu.ragged_paged_attention
        return generate(runner, prompts, max_new, chunk_size=chunk, token_budget=budget, return_logits=True)

    ref_tokens, ref_logits = run("reference")
    pallas_tokens, pallas_logits = run("pallas")
    assert pallas_tokens == ref_tokens
    assert all(len(t) == max_new for t in pallas_tokens)
    np.testing.assert_allclose(pallas_logits, ref_logits, atol=1e-4, rtol=1e-4)
