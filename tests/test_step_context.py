"""Step context (issue 12): the shape-switch and idle-wake terms of the step time, the StepContext the simulator
derives from its own schedule, and the blocked kernel's decode pass costed by the longest context."""
from __future__ import annotations

import pytest

from pdjax.config.buckets import Buckets
from pdjax.config.model_specs import get_model_spec
from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.scheduler import Request, SchedulerOutput, make_scheduler
from pdjax.sim import cost_model as cm
from pdjax.sim.calibration import STEP_CONTEXT_PARAMS, fit_step_context
from pdjax.sim.cost_model import BatchComposition, CostParams, iteration_time
from pdjax.sim.hardware import get_hardware_spec
from pdjax.sim.profile import Profile, load_profile, save_profile
from pdjax.sim.simulator import SimInstance, StepContext, simulate
from pdjax.sim.step_cost import EnginePadding, make_step_time, padded_composition
from pdjax.sim.step_time import StepTimeBase

SPEC, HW = get_model_spec("tiny-byte"), get_hardware_spec("a100-80gb-sxm")
BUCKETS = Buckets(tokens=(16, 64, 256), seqs=(8, 32), pages=(64,))
BLOCKED = EnginePadding(BUCKETS, 16, dense_attention=False, attention="blocked")


def output(seqs):
    """A SchedulerOutput of (new tokens, context before them, is_prefill) per sequence."""
    out = SchedulerOutput(step=0)
    for i, (n, c, p) in enumerate(seqs):
        out.req_ids.append(f"r{i}")
        out.num_new_tokens.append(n)
        out.num_computed_tokens.append(c)
        out.is_prefill.append(p)
        out.token_ids.append([0] * n)
        out.page_tables.append([])
        out.do_sample.append(True)
    return out


def decodes(*contexts):
    return output([(1, c, False) for c in contexts])


# ------------------------------------------------------------------------------------------------ defaults
def test_step_context_terms_are_zero_by_default():
    p = CostParams()
    for name in STEP_CONTEXT_PARAMS:
        assert getattr(p, name) == 0.0
    assert cm.context_time(p, True, 10.0) == 0.0
    # The step time with a context equals the one without, bit for bit, at the default parameters.
    step = make_step_time(SPEC, HW, params=CostParams(), padding=BLOCKED)
    a, b = decodes(100, 200), output([(200, 0, True)])
    assert step(a, StepContext(b, 0.05)) == step(a) == step(a, None)
    assert CostParams.from_dict(CostParams().to_dict()) == CostParams()


def test_context_time_form():
    p = CostParams(shape_switch_s=5e-4, idle_wake_s=1e-3, idle_wake_tau_s=0.02, idle_wake_fixed_s=2e-4)
    assert cm.context_time(p, False, 0.0) == 0.0
    assert cm.context_time(p, True, 0.0) == 5e-4
    assert cm.context_time(p, False, 0.01) == pytest.approx(2e-4 + 0.5e-3)
    assert cm.context_time(p, False, 0.5) == pytest.approx(1.2e-3)           # saturated
    assert cm.context_time(p, True, 0.5) == pytest.approx(1.7e-3)            # the two add up
    assert cm.context_time(p.replace(idle_wake_tau_s=0.0), False, 1e-6) == pytest.approx(1.2e-3)


def test_step_time_adds_switch_only_on_a_new_padded_shape():
    p = CostParams(shape_switch_s=1e-3)
    step = make_step_time(SPEC, HW, params=p, padding=BLOCKED)
    a, a2, prefill = decodes(100, 200), decodes(300, 20), output([(200, 0, True)])
    assert step(a, StepContext(a2, 0.0)) == step(a)               # same (16, 8, 64) bucket: no switch
    assert step(a, StepContext(prefill, 0.0)) == pytest.approx(step(a) + 1e-3)
    assert step(a, StepContext(None, 0.0)) == step(a)             # first step: nothing to switch from
    # No padding (GPU profiles fitted without buckets): no executables to switch.
    plain = make_step_time(SPEC, HW, params=p)
    assert plain(a, StepContext(prefill, 0.0)) == plain(a)


# ------------------------------------------------------------------------------------------------ simulator
class RecordingStepTime(StepTimeBase):
    """A step time in whole ticks that records the StepContext it is given; + 1 tick after an idle gap (a
    StepTime: StepTimeBase gives the members it does not set)."""
    takes_context = True

    def __init__(self, tick=1 / 1024):
        self.tick, self.calls = tick, []

    def __call__(self, out, ctx=None):
        self.calls.append((out, ctx))
        return self.tick * (3 + (1 if ctx is not None and ctx.idle_s > 0 else 0))


def requests(arrivals, prompt=20, out_tokens=3):
    return [Request(f"r{i}", [1] * prompt, SamplingParams(max_tokens=out_tokens), t) for i, t in enumerate(arrivals)]


def test_simulator_passes_previous_step_and_idle_gap():
    tick = 1 / 1024
    cfg = SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=4, max_model_len=256, num_pages=64)
    step = RecordingStepTime(tick)
    # r0 at 0 runs 3 steps (prefill + 2 decodes, then finishes); r1 arrives long after: the engine sat idle.
    res = simulate(requests([0.0, 100 * tick]), [SimInstance("a", make_scheduler(cfg), step)])
    ctxs = [c for _, c in step.calls]
    assert len(ctxs) == 6 and all(isinstance(c, StepContext) for c in ctxs)
    assert ctxs[0].previous is None and ctxs[0].idle_s == 0.0              # first step at t = 0
    for i in (1, 2, 4, 5):                                                # straight on: no idle gap
        assert ctxs[i].idle_s == 0.0 and ctxs[i].previous is step.calls[i - 1][0]
    # Step 3 (r1's prefill) after the engine idled from the end of step 2 until r1 arrived.
    end2 = res.iterations[2].end_time
    assert ctxs[3].previous is step.calls[2][0]
    assert ctxs[3].idle_s == pytest.approx(100 * tick - end2) and ctxs[3].idle_s > 0
    # The idle wake is paid once: only that step is a tick longer.
    durations = [it.end_time - it.start_time for it in res.iterations]
    assert durations == pytest.approx([3 * tick] * 3 + [4 * tick] + [3 * tick] * 2)


def test_simulator_async_loop_passes_context_too():
    tick = 1 / 1024
    cfg = SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=4, max_model_len=256, num_pages=64)
    step = RecordingStepTime(tick)
    simulate(requests([0.0, 100 * tick]), [SimInstance("a", make_scheduler(cfg), step)], async_scheduling=True)
    ctxs = [c for _, c in step.calls]
    assert all(isinstance(c, StepContext) for c in ctxs)
    assert sum(c.idle_s > 0 for c in ctxs[1:]) == 1                     # one idle gap: r1's arrival
    assert all(c.previous is step.calls[i][0] for i, c in enumerate(ctxs[1:]))


def test_simulated_idle_wake_and_switch_on_a_cost_model_step_time():
    """The real step-time function on a hand-built run: with the terms on, an idle step pays idle_wake once and
    a new shape pays shape_switch; with them at 0 every time equals the context-free step time."""
    cfg = SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=8, max_model_len=1024, num_pages=256,
                          page_size=16)
    base = CostParams(iteration_overhead_s=1e-3)
    on = base.replace(idle_wake_s=2e-3, idle_wake_tau_s=1e-9, shape_switch_s=5e-4)
    runs = {}
    for name, params in (("off", base), ("on", on)):
        step = make_step_time(SPEC, HW, params=params, padding=BLOCKED)
        res = simulate(requests([0.0, 1.0], prompt=40, out_tokens=4),
                       [SimInstance("a", make_scheduler(cfg), step)])
        runs[name] = [it.end_time - it.start_time for it in res.iterations]
    off, on_ = runs["off"], runs["on"]
    assert len(off) == len(on_) == 8
    extra = [b - a for a, b in zip(off, on_)]
    # Steps: r0 prefill (first step: idle since t=0 is 0 -> no wake), 3 decodes (the first a shape switch),
    # r1 prefill after idle (switch + wake), 3 decodes (first a switch).
    assert extra == pytest.approx([0.0, 5e-4, 0.0, 0.0, 5e-4 + 2e-3, 5e-4, 0.0, 0.0], abs=1e-12)


# ------------------------------------------------------------------------------------------------ blocked decode
def test_blocked_decode_cost_follows_the_longest_context():
    p = CostParams()
    step = make_step_time(SPEC, HW, params=p, padding=BLOCKED)
    same_mean_short = decodes(250, 250, 250, 250)
    same_mean_long = decodes(10, 10, 10, 970)           # same mean context, one long one
    assert step(same_mean_long) > step(same_mean_short)
    # One long decode costs the whole padded pass as much as all of them being long.
    assert step(same_mean_long) == pytest.approx(step(decodes(970, 970, 970, 970)))
    # The real-context (Pallas) mode keeps mean-context costing.
    pallas = make_step_time(SPEC, HW, params=p, padding=EnginePadding(BUCKETS, 16, False, "pallas"))
    assert pallas(same_mean_long) == pallas(same_mean_short)
    # The work: T_pad > S_pad -> S_pad items x key blocks (128 keys) of the longest decode's context + 1.
    batch = padded_composition(same_mean_long, BLOCKED)
    assert batch.decode_pass == (8, 1024) and batch.num_tokens == 16
    # T_pad <= S_pad (token mode): every padded token an item, over the longest sequence, chunks included.
    many = output([(1, 300, False)] * 9 + [(5, 700, True)])
    batch = padded_composition(many, BLOCKED)
    assert batch.decode_pass == (16, 768) and batch.num_tokens == 16 and not batch.prefills
    # A prefill-only step in a T > S bucket: the decode pass runs with no key blocks.
    batch = padded_composition(output([(200, 0, True)]), BLOCKED)
    assert batch.decode_pass == (8, 0) and batch.prefills == ((200, 0),)


def test_decode_pass_in_the_cost_model():
    # A decode pass of (items, keys) costs what `items` decodes at context keys - 1 cost.
    a = BatchComposition((), ((3, 0),), decode_pass=(8, 512))
    b = BatchComposition((), ((8, 511),))
    ta, tb = iteration_time(a, SPEC, HW), iteration_time(b, SPEC, HW)
    assert ta.attention == pytest.approx(tb.attention)
    assert ta.num_tokens == 3
    with pytest.raises(ValueError, match="decode_pass"):
        BatchComposition((), ((1, 0),), decode_pass=(0, 5))
    with pytest.raises(ValueError, match="only the 'reference' kernel is dense"):
        EnginePadding(BUCKETS, 16, True, "blocked")


# ------------------------------------------------------------------------------------------------ fit
def test_fit_step_context_recovers_terms():
    truth = dict(fixed=3e-4, wake=8e-4, tau=0.02)
    gaps = (0.0005, 0.002, 0.005, 0.02, 0.05)
    idle = [(g, truth["fixed"] + truth["wake"] * min(1.0, g / truth["tau"])) for g in gaps]
    fit = fit_step_context([1e-4, 6e-4, 5e-4, 7e-4], idle)
    assert fit["shape_switch_s"] == pytest.approx(5.5e-4)
    assert fit["idle_wake_fixed_s"] == pytest.approx(3e-4, rel=0.1)
    assert fit["idle_wake_s"] == pytest.approx(8e-4, rel=0.1)
    assert fit["idle_wake_tau_s"] == pytest.approx(0.02, rel=0.15)
    # Negative switch deltas (noise, no effect) floor at 0; no data: zeros.
    assert fit_step_context([-1e-4, -2e-4], [])["shape_switch_s"] == 0.0
    assert fit_step_context([], []) == {k: 0.0 for k in STEP_CONTEXT_PARAMS}


def test_profile_padding_keys_round_trip(tmp_path):
    from pdjax.sim.step_cost import padding_from_profile
    path = tmp_path / "p.json"
    save_profile(path, Profile("host-cpu", CostParams(shape_switch_s=1e-4), padding=BLOCKED.profile_dict()))
    prof = load_profile(path)
    assert prof.padding == {"dense_attention": False, "attention": "blocked", "decode_keys": 128}
    assert padding_from_profile(prof.padding, BUCKETS, 16) == BLOCKED
    assert prof.params.shape_switch_s == 1e-4
    # An old profile (dense flag only) still loads, with no attention impl.
    assert padding_from_profile({"dense_attention": False}, BUCKETS, 16).attention == ""
