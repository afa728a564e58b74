"""Each request's own unloaded run on a reference machine: the denominators of Splitwise's slowdown SLOs (no JAX).

Splitwise (Patel et al., ISCA 2024, §6 / Table 4) expresses its latency SLOs as slowdowns against the request
running alone on a DGX-A100 (splitwise-sim's notebooks/plots.ipynb normalizes to hardware a100-80gb, TP 8, via
its performance model at batch size 1). Here the request alone is costed with the very step-time functions the
simulator runs (pdjax.sim.step_cost's cost model, or a fitted stack's, pdjax.sim.stack): its prompt's prefill
(one step of the whole prompt, or chunks of `prefill_chunk` tokens when the reference machine chunks), which
samples its first token, then one decode step per further output token at batch size 1, the context growing by
one each step. So, for prompt length p and output length n (prefill steps of c_1..c_k tokens, sum = p):
    TTFT = sum_i step(prefill c_i at offset c_1 + .. + c_{i-1})
    TBT_j = step(decode at context p + j - 1), j = 1 .. n-1;   mean TBT = sum_j TBT_j / (n - 1)  (None for n = 1)
    E2E  = TTFT + sum_j TBT_j
This is exactly what the simulator does with the request alone on that machine (no other request, no step
noise, no step context: idle-wake and shape-switch costs, which every GPU profile sets to 0, are not included),
so a request served alone on the reference has slowdown 1 (tests/test_slowdown_reference.py runs it).

Speed: a decode step's time at batch 1 depends on its context only, so the decode times are cached per context
with running sums (`UnloadedRuns._decode_prefix`): any (p, n) costs two lookups after the first; prefills are
cached per prompt length. No JAX.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from pdjax.config.model_specs import ModelSpec
from pdjax.scheduler.output import SchedulerOutput
from pdjax.sim.build import group_hardware, group_step_time
from pdjax.sim.hardware import get_hardware_spec
from pdjax.sim.profile import profile_for
from pdjax.sim.stack import get_stack
from pdjax.sim.step_time import GroupTiming

Latencies = Tuple[float, Optional[float], float]     # (TTFT, mean TBT or None, E2E), seconds


@dataclasses.dataclass(frozen=True)
class ReferenceMachine:
    """Where a request's unloaded run is costed. hardware: a pdjax.sim.hardware name; tp: tensor-parallel degree
    of the one instance (pp 1); stack: 'pdjax' (the cost model with `profile`, '' = the hardware's shipped one) or
    a fitted stack name/file (pdjax.sim.stack); prefill_chunk: 0 = the whole prompt in one step (Splitwise's
    reference), else prefill chunks of this many tokens (a chunking scheduler's token budget)."""
    hardware: str = "a100-80gb-sxm"
    tp: int = 8
    stack: str = "pdjax"
    profile: str = ""
    prefill_chunk: int = 0

    def __post_init__(self):
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"reference tp={self.tp!r}, expected a positive int")
        if not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 0:
            raise ValueError(f"reference prefill_chunk={self.prefill_chunk!r}, expected 0 (whole prompt) or a "
                             "positive int (tokens per prefill step)")

    def describe(self) -> Dict[str, object]:
        return dataclasses.asdict(self)


# Splitwise's reference: one DGX-A100 (8 x A100-80GB, TP 8), whole-prompt prefill.
SPLITWISE_REFERENCE = ReferenceMachine()


def _step(num_computed: int, num_new: int, is_prefill: bool, sample: bool) -> SchedulerOutput:
    return SchedulerOutput(step=0, req_ids=["ref"], num_computed_tokens=[num_computed], num_new_tokens=[num_new],
                           do_sample=[sample], is_prefill=[is_prefill],
                           num_prefill_tokens=num_new if is_prefill else 0,
                           num_decode_tokens=0 if is_prefill else num_new)


def prefill_chunks(prompt_len: int, chunk: int) -> List[int]:
    """The prefill steps' token counts of a `prompt_len` prompt with chunks of `chunk` tokens (0: one step)."""
    if prompt_len < 1:
        raise ValueError(f"prompt_len={prompt_len!r}, expected >= 1")
    if not chunk or chunk >= prompt_len:
        return [prompt_len]
    full, rest = divmod(prompt_len, chunk)
    return [chunk] * full + ([rest] if rest else [])


class UnloadedRuns:
    """(TTFT, mean TBT, E2E) of requests run alone with `step_time` ((SchedulerOutput) -> seconds, called without
    a step context), prefill chunks of `prefill_chunk` tokens (0: whole prompt). `describe`: what results record
    of the reference."""

    def __init__(self, step_time: Callable, prefill_chunk: int = 0, describe: Optional[Mapping] = None):
        self.step_time, self.prefill_chunk = step_time, int(prefill_chunk)
        self.description = dict(describe or {"prefill_chunk": self.prefill_chunk})
        self._prefill: Dict[int, float] = {}
        self._decode_prefix: List[float] = [0.0]   # [k] = sum of decode steps at contexts 0 .. k-1

    @classmethod
    def on(cls, model: ModelSpec, reference: ReferenceMachine = SPLITWISE_REFERENCE) -> "UnloadedRuns":
        """The unloaded runs of `model` on `reference` (its step-time function built as the simulator builds a
        group's: pdjax.sim.build.group_step_time's rule, deterministic)."""
        hw = get_hardware_spec(reference.hardware)
        stack = get_stack(reference.stack)
        stack.check(model.name, hw.name, reference.tp)
        profile = profile_for(reference.profile, reference.hardware) if reference.stack == "pdjax" else None
        params = profile.params if profile is not None else None
        step_time = stack.step_time(GroupTiming(model, hw, hw.name, reference.tp, 1, params))
        return cls(step_time, reference.prefill_chunk, {**reference.describe(), "model": model.name})

    @classmethod
    def of_setup(cls, setup, role: str = "") -> "UnloadedRuns":
        """The unloaded runs on a built deployment's own instances (pdjax.sim.build.SimSetup): `role`'s group
        (default: 'colocated', or 'prefill' for a disaggregated deployment: the request runs whole on a prefill
        machine), its step time without noise, its prefill chunked by its token budget when its policy chunks.
        What a run's own results compare against (pdjax.sim.run.sim_info)."""
        role = role or ("colocated" if setup.kind == "colocated" else "prefill")
        g = setup.groups[role]
        chunk = g.scheduler_config.token_budget if g.scheduler_config.chunking else 0
        return cls(group_step_time(setup, role, noise=False), chunk,
                   {"hardware": group_hardware(setup, role).name, "tp": g.tp, "pp": g.pp,
                    "stack": g.stack.name, "prefill_chunk": chunk,
                    "model": setup.model.name, "of": f"this run's {role} instances"})

    def ttft(self, prompt_len: int) -> float:
        t = self._prefill.get(prompt_len)
        if t is None:
            chunks, done, t = prefill_chunks(prompt_len, self.prefill_chunk), 0, 0.0
            for i, n in enumerate(chunks):
                t += self.step_time(_step(done, n, True, i == len(chunks) - 1))
                done += n
            self._prefill[prompt_len] = t
        return t

    def decode_sum(self, start: int, end: int) -> float:
        """Seconds of the batch-1 decode steps at contexts start .. end-1 (num_computed_tokens of each step)."""
        prefix = self._decode_prefix
        while len(prefix) <= end:
            k = len(prefix) - 1
            prefix.append(prefix[-1] + self.step_time(_step(k, 1, False, True)))
        return prefix[end] - prefix[start]

    def latencies(self, prompt_len: int, output_len: int) -> Latencies:
        """(TTFT, mean TBT or None for one output token, E2E) of a (prompt_len, output_len) request alone."""
        if output_len < 1:
            raise ValueError(f"output_len={output_len!r}, expected >= 1")
        ttft = self.ttft(prompt_len)
        # decode j (1 .. n-1) feeds output token j at position p + j - 1: num_computed_tokens = p + j - 1
        decode = self.decode_sum(prompt_len, prompt_len + output_len - 1)
        return ttft, (decode / (output_len - 1) if output_len > 1 else None), ttft + decode

    def for_records(self, records: Sequence) -> Dict[str, Latencies]:
        """{request_id: latencies} of the completed RequestRecords (prompt and output lengths as served)."""
        return {r.request_id: self.latencies(r.num_prompt_tokens, len(r.token_times))
                for r in records if r.completed}
