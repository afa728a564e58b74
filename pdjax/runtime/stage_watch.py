"""When each pipeline stage's output of each batch became ready: a hook of pdjax.runtime.pipeline.PipelineRunner
(`runner.stage_watch = StageWatch(runner.pp)`), for the per-stage busy time of experiments/bench_pipeline.py.

While `recording`, every dispatched batch is recorded as [dispatch time, its stage outputs, ready times]; a watcher
thread blocks on every stage's output of every batch in turn and stamps when it became ready (the outputs are
dropped then). `stage_busy` turns the records into busy seconds per stage: stage s of batch k is busy from
max(dispatch of k, stage s-1 of k ready, stage s of k-1 ready) to its own readiness.
"""
from __future__ import annotations

import threading
import time
from typing import List, Sequence

import jax


class StageWatch:
    def __init__(self, pp: int):
        self.pp = pp
        self.recording = False
        self.batches: list = []          # [dispatch time, [stage outputs] (None once ready), [ready times]]
        self._pending: list = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def on_stage_outputs(self, outs) -> None:
        """PipelineRunner's hook: every stage's (unfinished) output of a step just enqueued."""
        if self.recording:
            rec = [time.perf_counter(), list(outs), [None] * self.pp]
            self.batches.append(rec)
            with self._cv:
                self._pending.append(rec)
                self._cv.notify()

    def _watch(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stop:
                    self._cv.wait()
                if self._stop and not self._pending:
                    return
                rec = self._pending.pop(0)
            for s, arr in enumerate(rec[1]):
                jax.block_until_ready(arr)
                rec[2][s] = time.perf_counter()
            rec[1] = None

    def drain(self) -> None:
        """Wait until every recorded batch's stages are stamped."""
        while True:
            with self._cv:
                if not self._pending and all(r[1] is None for r in self.batches):
                    return
            time.sleep(0.001)

    def stop(self, timeout: float = 60.0) -> None:
        """End the watcher thread (once the recorded batches are stamped) and wait for it: a daemon thread still
        inside JAX when the interpreter exits is torn down in C++ frames, which can abort the process."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)


def stage_busy(batches: Sequence, pp: int) -> List[float]:
    """Busy seconds per stage of (dispatch time, _, ready times) records (module docstring)."""
    busy = [0.0] * pp
    prev_end = [0.0] * pp
    for t0, _, ready in batches:
        upstream = t0
        for s in range(pp):
            start = max(upstream, prev_end[s], t0)
            busy[s] += max(0.0, ready[s] - start)
            prev_end[s] = ready[s]
            upstream = ready[s]
    return busy
