"""Probing a ModelRunner for calibration: time the real step over a grid of batch compositions and measure the
step-context effects (shape switch, idle wake). The fits are pdjax.sim.calibration's; pdjax.experiment.calibrate
composes the two (and the engine-loop probe) into a profile.

Grid (`calibration_grid`, every point within the config's token budget, max_num_seqs and max_model_len, capped
by the runner's buckets: `engine_grid`): prefill chunks x context offsets, decode batches x contexts, and mixed
batches (decodes + one chunk). Each point is built as a SchedulerOutput (`synthetic_output`), its bucket shape
compiled first, then timed `repeats` times in rounds over the grid (median kept: the machine is shared and noisy)
through `runner.execute`, which is what one engine iteration runs.

Step context (`profile_step_context`): a few compositions of distinct padded shapes (`context_outputs`), each
timed right after itself and right after each other one (shape switch), and after sleeps of CONTEXT_GAPS_S
(idle wake), as paired differences.

`runner_padding(runner)`: how the runner pads a step and which attention implementation it runs, as the
profile's "padding" entry (pdjax.sim.step_cost.padding_from_profile reads it).
"""
from __future__ import annotations

import inspect

import statistics
import time
from typing import Sequence, Tuple

from pdjax.config.sampling import SamplingParams
from pdjax.kernels import blocked, reference_attention
from pdjax.scheduler import SchedulerOutput

CONTEXT_GAPS_S = (0.0005, 0.002, 0.005, 0.02, 0.05)   # idle gaps (sleeps) before a step, seconds


def synthetic_output(prefills: Sequence[Tuple[int, int]], decodes: Sequence[Tuple[int, int]], *, page_size: int,
                     num_pages: int, vocab_size: int) -> SchedulerOutput:
    """A SchedulerOutput running `prefills` ((chunk tokens, context before it)) and `decodes` ((count, context))
    with in-range page tables (pages are reused across sequences: only the timing matters)."""
    out = SchedulerOutput(step=0)
    next_page = 0
    seqs = [(n, c, True) for n, c in prefills] + [(1, c, False) for count, c in decodes for _ in range(count)]
    for i, (new, start, is_prefill) in enumerate(seqs):
        pages = -(-(start + new) // page_size)
        table = [(next_page + j) % num_pages for j in range(pages)]
        next_page = (next_page + pages) % num_pages
        out.req_ids.append(f"cal{i}")
        out.token_ids.append([(7 * i + j) % vocab_size for j in range(new)])
        out.num_computed_tokens.append(start)
        out.num_new_tokens.append(new)
        out.page_tables.append(table)
        out.do_sample.append(True)
        out.sampling.append(SamplingParams(temperature=0.0, max_tokens=1))
        out.is_prefill.append(is_prefill)
        if is_prefill:
            out.num_prefill_tokens += new
        else:
            out.num_decode_tokens += new
    return out


def calibration_grid(token_budget: int, max_num_seqs: int, max_model_len: int, quick: bool = False):
    """[(kind, prefills, decodes)] within the limits: prefill chunks x contexts, decode batches x contexts, mixed."""
    def pow2_upto(lo, hi):
        out, n = [], lo
        while n <= hi:
            out.append(n)
            n *= 2
        return out
    chunks = sorted(set(pow2_upto(16, token_budget) + [token_budget, max(1, 3 * token_budget // 4)]))
    contexts = sorted({0, max_model_len // 8, max_model_len // 4, max_model_len // 2, 3 * max_model_len // 4})
    counts = sorted(set(pow2_upto(1, max_num_seqs) + [max(1, 3 * max_num_seqs // 4)]))
    dec_contexts = sorted({16, max_model_len // 8, max_model_len // 4, max_model_len // 2, max_model_len - 8})
    if quick:
        chunks, contexts = chunks[::2], contexts[::2]
        counts, dec_contexts = counts[::2], dec_contexts[::2]
    grid = []
    for chunk in chunks:
        for ctx in contexts:
            if chunk + ctx <= max_model_len:
                grid.append(("prefill", ((chunk, ctx),), ()))
    for count in counts:
        for ctx in dec_contexts:
            if ctx + 1 <= max_model_len:
                grid.append(("decode", (), ((count, ctx),)))
    for count in counts[1::2]:
        for ctx in dec_contexts[1::2]:
            for chunk in chunks[::2]:
                if count + chunk <= token_budget and count + 1 <= max_num_seqs and chunk + ctx <= max_model_len:
                    grid.append(("mixed", ((chunk, ctx // 2),), ((count, ctx),)))
    return grid


def engine_grid(cfg, runner, quick: bool = False):
    """The calibration grid of `runner` within the ServeConfig `cfg`'s limits and the runner's buckets."""
    sc, b = cfg.scheduler, runner.buckets
    return calibration_grid(min(sc.token_budget, b.max_tokens), min(sc.max_num_seqs, b.max_seqs),
                            min(sc.max_model_len, b.max_pages * runner.page_size), quick)


def profile_engine(runner, grid, *, page_size: int, repeats: int, log=None):
    """[(kind, SchedulerOutput, median seconds)] for every grid point (compiles each bucket shape first).

    The repeats run in rounds over the whole grid (not back to back per point), so a burst of load from other
    processes on a shared machine lands on one sample of many points instead of every sample of a few."""
    outputs = [(kind, synthetic_output(prefills, decodes, page_size=page_size, num_pages=runner.num_pages,
                                       vocab_size=runner.spec.vocab_size)) for kind, prefills, decodes in grid]
    for _, out in outputs:
        runner.execute(out)              # compile this shape (no-op when warm) and settle caches
    times = [[] for _ in outputs]
    for r in range(repeats):
        for i, (_, out) in enumerate(outputs):
            start = time.perf_counter()
            runner.execute(out)
            times[i].append(time.perf_counter() - start)
        if log is not None:
            log(f"calibrate: round {r + 1}/{repeats} over {len(outputs)} batch compositions done")
    return [(kind, out, statistics.median(ts)) for (kind, out), ts in zip(outputs, times)]


def padded_shape(runner, out: SchedulerOutput) -> Tuple[int, int, int]:
    """(T, S, P): the bucket `runner` pads `out` to."""
    return runner.build_batch(out).shape_key


def context_outputs(cfg, runner):
    """A few batch compositions of distinct padded shapes for `profile_step_context`, within the config's
    limits and the runner's buckets: a small and a full decode batch, a short and a full-budget prefill chunk,
    a mixed batch."""
    sc, b = cfg.scheduler, runner.buckets
    budget, seqs = min(sc.token_budget, b.max_tokens), min(sc.max_num_seqs, b.max_seqs)
    max_len = min(sc.max_model_len, b.max_pages * runner.page_size)
    ctx = max(1, min(max_len // 4, max_len - 2))
    few = max(1, seqs // 4)
    points = [((), ((few, ctx),)), ((), ((seqs, ctx),)),
              (((max(2, budget // 4), min(max_len // 8, max_len - budget // 4)),), ()), (((budget, 0),), ())]
    if budget // 2 + few <= budget and few + 1 <= seqs:
        points.append((((budget // 2, 0),), ((few, ctx),)))
    outs, shapes = [], set()
    for prefills, decodes in points:
        if any(c + n > max_len for n, c in prefills) or any(c + 1 > max_len for _, c in decodes):
            continue
        out = synthetic_output(prefills, decodes, page_size=runner.page_size, num_pages=runner.num_pages,
                               vocab_size=runner.spec.vocab_size)
        shape = padded_shape(runner, out)
        if shape not in shapes:
            shapes.add(shape)
            outs.append(out)
    return outs


def profile_step_context(runner, outputs, *, rounds: int = 11, gaps=CONTEXT_GAPS_S, log=None, sleep=time.sleep):
    """Direct measurements of the step-context terms (pdjax.sim.cost_model.context_time) on `runner`.

    For each composition B of `outputs` (distinct padded shapes), every round: B twice, then B timed (steady);
    for every other composition A: A, then B timed (shape switch: minus that round's steady B); for every gap g:
    B twice, B timed, sleep g, B timed (idle wake: the second minus the first). Medians over rounds of the paired
    differences, so load changing across the rounds cancels. Returns {"switch": [{"prev", "next", "delta_s"}],
    "idle": [{"next", "gap_s", "delta_s"}], "steady": [{"shape", "seconds"}], "rounds"} (shapes as (T, S, P));
    pdjax.sim.calibration.fit_step_context_terms fits them."""
    shapes = [padded_shape(runner, out) for out in outputs]
    for out in outputs:
        runner.execute(out)                       # compiled and warm

    def timed(out):
        start = time.perf_counter()
        runner.execute(out)
        return time.perf_counter() - start

    n = len(outputs)
    steady = [[] for _ in range(n)]
    switch = {(a, b): [] for b in range(n) for a in range(n) if a != b}
    idle = {(b, g): [] for b in range(n) for g in gaps}
    for r in range(rounds):
        for b, out in enumerate(outputs):
            runner.execute(out)
            runner.execute(out)
            base = timed(out)
            steady[b].append(base)
            for a in range(n):
                if a != b:
                    runner.execute(outputs[a])
                    switch[(a, b)].append(timed(out) - base)
                    runner.execute(out)
            for g in gaps:
                runner.execute(out)
                before = timed(out)
                sleep(g)
                idle[(b, g)].append(timed(out) - before)
        if log is not None:
            log(f"calibrate: step-context round {r + 1}/{rounds} done")
    med = statistics.median
    return {"switch": [{"prev": list(shapes[a]), "next": list(shapes[b]), "delta_s": med(v)}
                       for (a, b), v in switch.items()],
            "idle": [{"next": list(shapes[b]), "gap_s": g, "delta_s": med(v)} for (b, g), v in idle.items()],
            "steady": [{"shape": list(shapes[b]), "seconds": med(v)} for b, v in enumerate(steady)],
            "rounds": rounds}


def attention_impl(runner) -> str:
    """The attention implementation `runner` runs: 'reference' (jnp oracle), 'blocked' (XLA, the CPU default) or
    'pallas' (GPU/TPU kernels, or any other implementation that loops over each sequence's own pages)."""
    fn = inspect.unwrap(runner.attention_fn)   # the kernel under the mesh's sharding
    if fn is reference_attention:
        return "reference"
    if getattr(fn, "__module__", "") == blocked.__name__:
        return "blocked"
    return "pallas"


def runner_padding(runner) -> dict:
    """How `runner` pads steps, as a profile's "padding" entry: dense attention only for the jnp reference kernel
    (it attends every padded token over the whole page-table bucket); the Pallas kernels cost by the real
    context of each sequence, the blocked XLA kernel's decode pass by the longest context in it, in blocks of
    `decode_keys` keys. The buckets and page size are the runner's own (`runner.buckets`, `runner.page_size`)."""
    impl = attention_impl(runner)
    return {"dense_attention": impl == "reference", "attention": impl,
            "decode_keys": getattr(blocked, "DECODE_KEYS", 128)}
