"""Step noise (issue 12, the tail): the simulator samples each step's factor from the engine loop's measured /
predicted step times (pdjax.sim.step_cost.StepNoise), fitted from a calibration probe (pdjax.sim.calibration.
fit_step_noise over pdjax.sim.replay's steady decode steps), stored in the profile and switched by sim.step_noise."""
from __future__ import annotations

import json

import numpy as np
import pytest

from pdjax.config.buckets import Buckets
from pdjax.config.model_specs import get_model_spec
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.metrics import IterationRecord, tbts
from pdjax.scheduler import Request, make_scheduler
from pdjax.sim.calibration import MIN_NOISE_STEPS, fit_step_noise
from pdjax.sim.cost_model import CostParams
from pdjax.sim.hardware import get_hardware_spec
from pdjax.sim.profile import Profile, load_profile, save_profile
from pdjax.sim.replay import replay_steps, step_noise_ratios
from pdjax.sim.simulator import SimInstance, simulate
from pdjax.sim.step_cost import EnginePadding, StepNoise, make_step_time

SPEC, HW = get_model_spec("tiny-byte"), get_hardware_spec("a100-80gb-sxm")
BUCKETS = Buckets(tokens=(16, 64), seqs=(8,), pages=(64,))
PADDING = EnginePadding(BUCKETS, 16, dense_attention=False, attention="blocked")
SKEWED = [1.0 + 0.002 * i + (2.0 if i >= 98 else 0.0) for i in range(101)]   # flat body, a heavy top 2%


def test_noise_draws_follow_the_quantiles_and_the_seed():
    noise = StepNoise(SKEWED, seed=3)
    draws = np.array([noise() for _ in range(40000)])
    for p in (0.1, 0.5, 0.9, 0.97):
        want = np.interp(p * 100, np.arange(101), SKEWED)
        assert np.quantile(draws, p) == pytest.approx(want, rel=0.01), p
    assert np.mean(draws > 2.5) == pytest.approx(0.02, abs=0.005)      # the heavy top is drawn as often as measured
    assert draws.min() >= SKEWED[0] and draws.max() <= SKEWED[-1]
    again = StepNoise(SKEWED, seed=3)
    assert [again() for _ in range(50)] == list(draws[:50])
    other = StepNoise(SKEWED, seed=4)
    assert [other() for _ in range(50)] != list(draws[:50])


@pytest.mark.parametrize("bad, words", [([1.0], "at least 2"), ([1.0, 0.9], "non-decreasing"),
                                        ([0.0, 1.0], "> 0")])
def test_bad_noise_quantiles_are_refused(bad, words):
    with pytest.raises(ValueError, match=words):
        StepNoise(bad)


def test_fit_step_noise_is_the_empirical_distribution():
    rng = np.random.default_rng(0)
    ratios = rng.lognormal(0.05, 0.2, 5000)
    q = fit_step_noise(ratios)
    assert len(q) == 101 and q[0] == ratios.min() and q[-1] == ratios.max()
    assert q[50] == pytest.approx(np.median(ratios)) and q[99] == pytest.approx(np.quantile(ratios, 0.99))
    with pytest.raises(ValueError, match=f"expected at least {MIN_NOISE_STEPS}"):
        fit_step_noise(ratios[:MIN_NOISE_STEPS - 1])
    with pytest.raises(ValueError, match="> 0"):
        fit_step_noise(np.r_[ratios, 0.0])


def test_step_times_are_multiplied_by_one_draw_per_step():
    out = _decodes(3, 100)
    plain = make_step_time(SPEC, HW, params=CostParams(), padding=PADDING)
    scaled = make_step_time(SPEC, HW, params=CostParams(), padding=PADDING, noise=StepNoise([1.5, 1.5]))
    assert scaled(out) == pytest.approx(1.5 * plain(out))
    pipe = make_step_time(SPEC, HW, pp=2, params=CostParams(), padding=PADDING)
    pipe_scaled = make_step_time(SPEC, HW, pp=2, params=CostParams(), padding=PADDING, noise=StepNoise([2.0, 2.0]))
    (stages, sends), (stages2, sends2) = pipe.stage_times(out), pipe_scaled.stage_times(out)
    assert stages2 == pytest.approx(tuple(2.0 * s for s in stages)) and sends2 == sends


def _decodes(n, ctx):
    from pdjax.scheduler import SchedulerOutput
    out = SchedulerOutput(step=0)
    for i in range(n):
        out.req_ids.append(f"r{i}")
        out.num_new_tokens.append(1)
        out.num_computed_tokens.append(ctx)
        out.is_prefill.append(False)
        out.do_sample.append(True)
    return out


def _run(noise):
    cfg = SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=8, max_model_len=512, num_pages=256)
    reqs = [Request(f"r{i}", [1] * 40, SamplingParams(max_tokens=60), 0.01 * i) for i in range(12)]
    step = make_step_time(SPEC, HW, params=CostParams(), padding=PADDING, noise=noise)
    return simulate(reqs, [SimInstance("a", make_scheduler(cfg), step)])


def test_simulated_tail_comes_from_the_noise_and_runs_repeat():
    plain, noisy = _run(None), _run(StepNoise(SKEWED, seed=0))
    t_plain = np.array(tbts(plain.requests))
    t_noisy = np.array(tbts(noisy.requests))
    # The body moves by the body's factor (~1.1), the tail by the heavy top (~3x).
    assert np.median(t_noisy) / np.median(t_plain) == pytest.approx(1.1, rel=0.05)
    assert np.quantile(t_noisy, 0.99) / np.quantile(t_plain, 0.99) > 2.0
    again = _run(StepNoise(SKEWED, seed=0))
    assert [it.end_time for it in again.iterations] == [it.end_time for it in noisy.iterations]


def test_profile_carries_the_noise_and_sim_step_noise_switches_it(tmp_path):
    from pdjax.config.serving import serve_config_from_dict
    from pdjax.sim.build import build_setup, group_step_time
    path = tmp_path / "p.json"
    save_profile(path, Profile("host-cpu", CostParams(), padding=PADDING.profile_dict(),
                               extra={"step_noise": {"quantiles": [2.0, 2.0], "num_steps": 500}}))
    assert load_profile(path).step_noise == (2.0, 2.0)
    base = {"backend": "sim", "model": {"checkpoint": "tiny-byte"}, "workload": {"preset": "chat"},
            "scheduler": {"max_model_len": 1024},     # tiny-byte's positions (more is refused)
            "sim": {"hardware": "a100-80gb-sxm", "profile": str(path)}}
    on = build_setup(serve_config_from_dict(base))
    off = build_setup(serve_config_from_dict({**base, "sim": {**base["sim"], "step_noise": False}}))
    assert on.step_noise == (2.0, 2.0) and off.step_noise == ()
    out = _decodes(2, 50)
    assert group_step_time(on, "colocated")(out) == pytest.approx(2.0 * group_step_time(off, "colocated")(out))
    assert group_step_time(on, "colocated", noise=False)(out) == group_step_time(off, "colocated")(out)
    bad = json.loads(path.read_text())
    bad["step_noise"]["quantiles"] = [2.0, 1.0]
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="p.json.*non-decreasing"):
        load_profile(path)


def test_replay_classes_and_noise_ratios_take_steady_decodes_only():
    # Steps: prefill, decode, decode, (idle gap) decode, decode. Measured = next start - start when the engine
    # went straight on, its own end - start otherwise (before an idle gap, the last step).
    batches = [((16,), (0,), (True,)), ((1,), (16,), (False,)), ((1,), (17,), (False,)),
               ((1,), (18,), (False,)), ((1,), (19,), (False,))]
    starts = [0.0, 0.010, 0.012, 0.050, 0.053]
    ends = [0.0099, 0.0119, 0.0139, 0.0529, 0.0545]
    its = [IterationRecord(i, s, e) for i, (s, e) in enumerate(zip(starts, ends))]
    step_time = make_step_time(SPEC, HW, params=CostParams(iteration_overhead_s=1e-3), padding=None)
    r = replay_steps(batches, its, step_time)
    assert list(r.after_idle) == [True, False, False, True, False]
    assert list(r.has_prefill) == [True, False, False, False, False]
    assert r.measured == pytest.approx([0.010, 0.002, 0.0139 - 0.012, 0.003, 0.0015])
    ratios = step_noise_ratios(r)
    steady_decode = [1, 2, 4]
    assert ratios == pytest.approx([r.measured[i] / r.predicted[i] for i in steady_decode])
    with pytest.raises(ValueError, match="4 recorded batches for 5 iterations"):
        replay_steps(batches[:4], its, step_time)
