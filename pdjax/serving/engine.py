"""Colocated serving engine: one model runner and one scheduler on one device group.

Each iteration: admit the requests that have arrived, `schedule(now)`, run the jitted step, `update` the
requests with the sampled ids, stamp every output token with the time its id reached the host. The engine never
decides who runs (that is the scheduler's job) and never builds device arrays (that is the runner's job).

Modes: online (requests join at their arrival time on the wall clock; the engine sleeps when nothing is
runnable) and offline (everything arrives at t=0). Overlap: the runner dispatches the step asynchronously
(`dispatch`), and the engine does the host work that does not depend on this step's tokens (admitting new
arrivals, progress) before it blocks on the result (`collect`); the time this hides is measured per iteration
(`host_overlap_s`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, List, Optional, Sequence

from pdjax.config.sampling import SamplingParams
from pdjax.metrics import IterationRecord, RequestRecord, request_record
from pdjax.scheduler import Request

TokenCallback = Callable[[str, int, float], None]   # (request_id, token_id, time_s)


@dataclasses.dataclass
class EngineResult:
    requests: List[RequestRecord]
    iterations: List[IterationRecord]
    output_tokens: dict                 # request_id -> list of generated token ids
    duration_s: float
    host_overlap_s: float               # host work done while a step was in flight


def to_scheduler_request(wr, *, eos_token_id: int = -1, offline: bool = False, temperature: float = 0.0,
                         seed: int = 0) -> Request:
    """A workload request as a scheduler Request (greedy unless a temperature is given)."""
    sampling = SamplingParams(temperature=temperature, seed=seed, max_tokens=int(wr.max_tokens),
                              stop_token_ids=(eos_token_id,) if eos_token_id >= 0 else ())
    return Request(str(wr.request_id), list(wr.prompt_token_ids), sampling,
                   0.0 if offline else float(wr.arrival_time))


class ColocatedEngine:
    """Drives `scheduler` and `runner` (pdjax.runtime.ModelRunner or anything with dispatch/collect)."""

    def __init__(self, runner, scheduler, *, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep, on_token: Optional[TokenCallback] = None,
                 overlap: bool = True):
        self.runner = runner
        self.overlap = overlap
        self.scheduler = scheduler
        self.clock = clock
        self.sleep = sleep
        self.on_token = on_token

    def _sleep_until(self, t: float, now: Callable[[], float]) -> None:
        wait = t - now()
        if wait > 0:
            self.sleep(wait)

    def run(self, requests: Sequence[Request], *, progress: Optional[Callable[[int], None]] = None) -> EngineResult:
        """Serve `requests` (scheduler Requests with arrival times relative to the start) until all finish."""
        pending = sorted(requests, key=lambda r: (r.arrival_time, r.request_id))
        all_reqs = list(pending)
        next_arrival = 0
        iterations: List[IterationRecord] = []
        sched = self.scheduler
        t0 = self.clock()
        now = lambda: self.clock() - t0  # noqa: E731
        overlap_total = 0.0
        num_done = 0

        def admit(t: float) -> int:
            nonlocal next_arrival
            n = 0
            while next_arrival < len(pending) and pending[next_arrival].arrival_time <= t:
                sched.add_request(pending[next_arrival])
                next_arrival += 1
                n += 1
            return n

        admit(now())
        while True:
            if not sched.has_unfinished():
                if next_arrival >= len(pending):
                    break
                self._sleep_until(pending[next_arrival].arrival_time, now)
                # max(): a clock that rounds may read a hair before the arrival it slept for.
                admit(max(now(), pending[next_arrival].arrival_time))
                continue
            start = now()
            out = sched.schedule(start)
            if out.is_empty:
                # Nothing runnable now (e.g. every request waits for memory that only arrivals can change).
                if next_arrival >= len(pending):
                    raise RuntimeError(
                        f"scheduler returned an empty batch with {sched.num_waiting} waiting and "
                        f"{sched.num_running} running requests and no arrivals left: it cannot make progress")
                self._sleep_until(pending[next_arrival].arrival_time, now)
                admit(max(now(), pending[next_arrival].arrival_time))
                continue
            if self.overlap:
                handle = self.runner.dispatch(out)
                host_start = now()
                admit(host_start)                     # overlapped with the device step
                overlap_total += now() - host_start
                sampled = self.runner.collect(handle)
            else:
                sampled = self.runner.execute(out)
            end = now()
            finished = sched.update(out, sampled, end)
            iterations.append(IterationRecord(
                step=len(iterations), start_time=start, end_time=end,
                num_prefill_tokens=out.num_prefill_tokens, num_decode_tokens=out.num_decode_tokens,
                num_seqs=out.num_seqs))
            if self.on_token is not None:
                for rid, tok in zip(out.req_ids, sampled):
                    if tok >= 0:
                        self.on_token(rid, int(tok), end)
            if finished:
                num_done += len(finished)
                if progress is not None:
                    progress(len(finished))
        duration = now()
        return EngineResult(
            requests=[request_record(r) for r in all_reqs], iterations=iterations,
            output_tokens={r.request_id: list(r.output_token_ids) for r in all_reqs},
            duration_s=duration, host_overlap_s=overlap_total)
