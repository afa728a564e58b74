"""The colocated engine loop with a fake runner on a fake clock (no model): arrival handling, stamps, callbacks."""
import pytest

from pdjax.config.sampling import SamplingParams
from pdjax.config.scheduler import SchedulerConfig
from pdjax.scheduler import Request, make_scheduler
from pdjax.scheduler.fake_runner import fake_sample, linear_step_time
from pdjax.serving.engine import ColocatedEngine


class FakeClock:
    def __init__(self):
        self.t = 100.0   # the engine must work relative to its own start

    def __call__(self):
        return self.t

    def sleep(self, dt):
        assert dt >= 0
        self.t += dt


class FakeRunner:
    """Advances the fake clock by a linear step cost; samples fake tokens."""

    def __init__(self, clock):
        self.clock = clock
        self.batches = []

    def execute(self, out):
        self.batches.append(out)
        self.clock.t += linear_step_time(out)
        return fake_sample(out, vocab_size=97)

    def dispatch(self, out):
        return self.execute(out)

    def collect(self, handle):
        return handle


def _requests(n, gap, prompt_len=40, max_tokens=5):
    return [Request(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), i * gap)
            for i in range(n)]


def _engine(policy="sarathi", budget=64, on_token=None):
    clock = FakeClock()
    cfg = SchedulerConfig(policy=policy, token_budget=budget, max_num_seqs=8, max_model_len=256, page_size=16,
                          num_pages=128)
    runner = FakeRunner(clock)
    return ColocatedEngine(runner, make_scheduler(cfg), clock=clock, sleep=clock.sleep, on_token=on_token), runner


def test_online_run_honours_arrivals_and_stamps_every_token():
    tokens = []
    engine, runner = _engine(on_token=lambda rid, tok, t: tokens.append((rid, tok, t)))
    reqs = _requests(6, gap=0.5)
    result = engine.run(reqs)
    assert len(result.requests) == 6
    for rec in result.requests:
        assert rec.finish_reason == "length"
        assert rec.first_scheduled_time >= rec.arrival_time
        assert rec.num_output_tokens == 5 == len(rec.token_times)
        assert rec.token_times == sorted(rec.token_times)
    # Callback: every output token exactly once, in order, with the engine's (relative) time stamps.
    by_req = {}
    for rid, tok, t in tokens:
        by_req.setdefault(rid, []).append((tok, t))
    for rec in result.requests:
        assert [t for _, t in by_req[rec.request_id]] == rec.token_times
        assert [tok for tok, _ in by_req[rec.request_id]] == result.output_tokens[rec.request_id]
    # The engine idles between sparse arrivals: the run lasts at least until the last arrival.
    assert result.duration_s >= 2.5
    assert len(result.iterations) == len(runner.batches)
    for it, out in zip(result.iterations, runner.batches):
        assert it.num_prefill_tokens + it.num_decode_tokens == out.total_tokens <= 64


def test_offline_requests_all_arrive_at_zero_and_tokens_match_online():
    engine, _ = _engine()
    online = engine.run(_requests(4, gap=1.0))
    engine2, _ = _engine()
    offline_reqs = _requests(4, gap=1.0)
    for r in offline_reqs:
        r.arrival_time = 0.0
    offline = engine2.run(offline_reqs)
    assert all(r.arrival_time == 0.0 for r in offline.requests)
    assert offline.output_tokens == online.output_tokens
    assert offline.duration_s < online.duration_s


def test_rejected_request_does_not_stop_the_others():
    engine, _ = _engine()
    reqs = _requests(3, gap=0.1)
    reqs.append(Request("too-long", list(range(1, 300)), SamplingParams(max_tokens=4), 0.05))
    result = engine.run(reqs)
    reasons = {r.request_id: r.finish_reason for r in result.requests}
    assert reasons["too-long"] == "rejected"
    assert [reasons[f"r{i}"] for i in range(3)] == ["length"] * 3


def test_async_scheduling_requires_requests_without_stop_tokens():
    clock = FakeClock()
    cfg = SchedulerConfig(policy="sarathi", token_budget=64, max_num_seqs=8, max_model_len=256, page_size=16,
                          num_pages=128)
    engine = ColocatedEngine(FakeRunner(clock), make_scheduler(cfg), clock=clock, sleep=clock.sleep,
                             async_scheduling=True)
    reqs = [Request("s", [1, 2, 3], SamplingParams(max_tokens=4, stop_token_ids=(7,)), 0.0)]
    with pytest.raises(ValueError, match="stop tokens"):
        engine.run(reqs)


def test_arrival_wait_never_sleeps_a_negative_time():
    """Regression (CI): the clock was read twice, and a real clock can pass the arrival between the check and the
    sleep, so sleep() got a negative length and the run died. Here every read advances the clock by 0.6 s."""
    from pdjax.serving.engine import ArrivalQueue

    reads = iter([0.0, 0.6, 1.2, 1.8])
    slept, added = [], []
    queue = ArrivalQueue([Request("r0", [1, 2], SamplingParams(max_tokens=1), arrival_time=1.0)],
                         add=lambda r: added.append(r.request_id) or True)

    def sleep(dt):
        assert dt >= 0, f"negative sleep {dt}"
        slept.append(dt)

    assert queue.wait(lambda: next(reads), sleep) == 0
    assert slept == [1.0] and added == ["r0"] and queue.exhausted
