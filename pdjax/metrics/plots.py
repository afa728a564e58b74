"""PNG plots of a run: TTFT and TBT CDFs, and a per-iteration timeline (step time over prefill/decode tokens,
like Sarathi-Serve's Figure 1, so a generation stall shows as a step-time spike over a prefill burst).

Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend switch), imported lazily so that
importing pdjax.metrics stays light. Each writer takes the final path and saves through `save_atomically`.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from pdjax.metrics.records import IterationRecord


def _figure(height: float = 3.2, width: float = 5.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415 (1 s; only when plotting)
    from matplotlib.figure import Figure  # noqa: PLC0415 (matplotlib only when plotting)
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def plot_cdf(values: Sequence[float], xlabel: str, title: str, save: Callable) -> None:
    """Empirical CDF of `values` (step plot); an empty list gives an annotated empty plot."""
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    data = sorted(values)
    if data:
        n = len(data)
        ax.step(data, [(i + 1) / n for i in range(n)], where="post")
        for q, style in ((0.5, ":"), (0.99, "--")):
            ax.axhline(q, color="gray", linestyle=style, linewidth=0.8)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of samples")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    save(fig)


def _timeline_steps(its: Sequence[IterationRecord], t0: float):
    """(edges[n+1], index[n]) of a step function over the run: one segment per iteration and one per idle gap
    between iterations (index -1), so each series draws as one artist however long the run."""
    edges, index = [], []
    last_end = None
    for i, it in enumerate(its):
        start, end = it.start_time - t0, max(it.end_time - t0, it.start_time - t0)
        if last_end is not None and start > last_end:
            edges.append(last_end)
            index.append(-1)
        elif last_end is not None and start < last_end:
            start = last_end               # overlapping records (pipelined steps): draw back to back
        edges.append(start)
        index.append(i)
        last_end = max(end, start)
    if last_end is not None:
        edges.append(last_end)
    return np.asarray(edges, float), np.asarray(index, int)


MAX_TIMELINE_SEGMENTS = 8000


def _bin_max(edges, series, num_bins: int):
    """Re-grid step functions onto `num_bins` equal time bins, keeping each bin's maximum."""
    grid = np.linspace(edges[0], edges[-1], num_bins + 1)
    which = np.clip(np.searchsorted(grid, edges[:-1], side="right") - 1, 0, num_bins - 1)
    binned = []
    for values in series:
        out = np.zeros(num_bins)
        np.maximum.at(out, which, values)
        binned.append(out)
    return grid, binned


def plot_iteration_timeline(iterations: Sequence[IterationRecord], save: Callable, max_instances: int = 4) -> None:
    """Per instance: step time (ms) on top, prefill and decode tokens stacked below, against run time (s)."""
    instances = sorted({it.instance for it in iterations})[:max_instances] or [""]
    fig = _figure(height=3.6 * len(instances), width=8.0)
    t0 = min((it.start_time for it in iterations), default=0.0)
    for row, name in enumerate(instances):
        its = sorted((it for it in iterations if it.instance == name), key=lambda it: it.start_time)
        top = fig.add_subplot(2 * len(instances), 1, 2 * row + 1)
        bottom = fig.add_subplot(2 * len(instances), 1, 2 * row + 2, sharex=top)
        top.set_ylabel("step time (ms)")
        top.set_title(f"iterations{' of ' + name if name else ''}: {len(its)} steps")
        bottom.set_ylabel("tokens / step")
        bottom.set_xlabel("time since first iteration (s)")
        if not its:
            top.text(0.5, 0.5, "no iterations", ha="center", va="center", transform=top.transAxes)
            continue
        edges, index = _timeline_steps(its, t0)
        pick = lambda values, index=index: np.where(index >= 0, np.asarray(values, float)[np.maximum(index, 0)], 0.0)  # noqa: E731
        step_ms = pick([1e3 * it.step_time for it in its])
        decode = pick([it.num_decode_tokens for it in its])
        total = decode + pick([it.num_prefill_tokens for it in its])
        if len(index) > MAX_TIMELINE_SEGMENTS:   # long runs: per time bin, the largest value (stalls stay visible)
            edges, (step_ms, decode, total) = _bin_max(edges, (step_ms, decode, total), MAX_TIMELINE_SEGMENTS // 2)
        top.stairs(step_ms, edges, fill=True, color="tab:red")
        bottom.stairs(decode, edges, fill=True, color="tab:blue", label="decode tokens")
        bottom.stairs(total, edges, baseline=decode, fill=True, color="tab:orange", label="prefill tokens")
        bottom.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    save(fig)
