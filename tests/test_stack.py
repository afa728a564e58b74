"""Step-fit serving stacks (pdjax.sim.stack): DistServe's fits reproduced exactly, other combos refused."""
import json
import os
import random

import pytest

from pdjax.sim.stack import SHARED_PROFILING_DIR, STEP_FIT_STACKS, load_stack

HF_NAMES = {"opt-13b": "facebook/opt-13b", "opt-66b": "facebook/opt-66b"}
needs_data = pytest.mark.skipif(not os.path.isdir(os.path.join(SHARED_PROFILING_DIR, "distserve")),
                                reason="../shared/data/profiling/distserve not present")


def _raw(name):
    with open(os.path.join(SHARED_PROFILING_DIR, STEP_FIT_STACKS[name][0])) as f:
        return json.load(f)


@needs_data
@pytest.mark.parametrize("name", sorted(STEP_FIT_STACKS))
def test_every_fit_in_the_file_is_reproduced_exactly(name):
    stack, raw = load_stack(name), _raw(name)
    held = {(m, int(tp)) for m, hf in HF_NAMES.items() if hf in raw for tp in raw[hf]}
    assert set(stack.fits) == held and len(held) >= 3
    rng = random.Random(0)
    for model, tp in held:
        p = raw[HF_NAMES[model]][str(tp)]
        fit = stack.fit_for(model, "a100-80gb-sxm", tp)
        for _ in range(20):
            lens = [rng.randint(1, 2048) for _ in range(rng.randint(1, 4))]
            a, b, c = p["prefill"]
            want = a + b * sum(lens) + c * sum(n * n for n in lens)
            assert fit.step_ms([(n, 0) for n in lens], []) == pytest.approx(want, rel=1e-12)
            for batch, regime in ((rng.randint(1, p["decoding_large_small_bs_threshold"] - 1), "decoding_smallbs"),
                                  (rng.randint(p["decoding_large_small_bs_threshold"], 400), "decoding_largebs")):
                ctx = [rng.randint(2, 4096) for _ in range(batch)]
                a, b, c = p[regime]
                assert fit.step_ms([], ctx) == pytest.approx(a + b * sum(ctx) + c * batch, rel=1e-12)


@needs_data
def test_the_two_engines_differ_as_the_sources_note_says():
    chunk = [(1024, 0)]
    ours = load_stack("distserve").fit_for("opt-13b", "a100-80gb-sxm", 2).step_ms(chunk, [])
    vllm = load_stack("distserve-vllm").fit_for("opt-13b", "a100-80gb-sxm", 2).step_ms(chunk, [])
    # SOURCES.md quotes 88.5 ms vs 130.0 ms (its rounding); the engines differ by 1.3-2.5x
    assert ours == pytest.approx(88.5, rel=0.02) and vllm == pytest.approx(130.0, rel=0.02)
    assert 1.3 <= vllm / ours <= 2.5


@needs_data
@pytest.mark.parametrize("model, hardware, tp, bad", [
    ("opt-13b", "a100-80gb-sxm", 8, "tp=8"), ("llama-2-7b", "a100-80gb-sxm", 1, "'llama-2-7b'"),
    ("opt-13b", "h100-sxm", 1, "'h100-sxm'")])
def test_a_combination_the_fits_do_not_hold_is_refused(model, hardware, tp, bad):
    with pytest.raises(ValueError, match="does not extrapolate") as e:
        load_stack("distserve").fit_for(model, hardware, tp)
    assert bad in str(e.value) and "opt-66b tp=8" in str(e.value)


@needs_data
def test_stage_time_adds_the_overhead_once_and_divides_by_pp():
    stack = load_stack("distserve")
    fit = stack.fit_for("opt-66b", "a100-80gb-sxm", 4)
    chunks, ctx = [(300, 200)], [700, 900]
    whole = fit.step_ms(chunks, ctx) / 1e3
    assert fit.step_ms(chunks, ctx) == pytest.approx(fit.prefill_ms(chunks) + fit.decode_ms(ctx) - fit.decode_small[0])
    overhead = stack.step_floor_s + stack.per_context_token_s * (500 + 700 + 900)
    assert stack.stage_time_s(fit, chunks, ctx, pp=2) == pytest.approx(whole / 2 + overhead)
    assert stack.stage_time_s(fit, chunks, ctx, pp=2, first_stage=False) == pytest.approx(whole / 2)
    assert stack.stage_time_s(fit, [], []) == 0.0
    assert stack.describe()["step_floor_s"] == 2e-3


def test_unknown_stack_and_bad_file_name_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match=r"stack='vlm', expected one of \('pdjax', 'distserve'"):
        load_stack("vlm")
    (tmp_path / "distserve").mkdir()
    (tmp_path / "distserve" / "profiler-a100-80g.distserve.json").write_text('{"facebook/opt-13b": {"1": {')
    with pytest.raises(ValueError, match="profiler-a100-80g.distserve.json' is not valid JSON"):
        load_stack("distserve", profiling_dir=str(tmp_path))
