"""PNG plots of a run: TTFT and TBT CDFs, and a per-iteration timeline (step time over prefill/decode tokens,
like Sarathi-Serve's Figure 1, so a generation stall shows as a step-time spike over a prefill burst).

Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend switch), imported lazily so that
importing pdjax.metrics stays light. Each writer takes the final path and saves through `save_atomically`.
"""
from __future__ import annotations

from typing import Callable, Sequence

from pdjax.metrics.records import IterationRecord


def _figure(height: float = 3.2, width: float = 5.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
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


def plot_iteration_timeline(iterations: Sequence[IterationRecord], save: Callable, max_instances: int = 4) -> None:
    """Per instance: step time (ms) on top, prefill and decode tokens stacked below, against run time (s)."""
    instances = sorted({it.instance for it in iterations})[:max_instances] or [""]
    fig = _figure(height=3.6 * len(instances), width=8.0)
    t0 = min((it.start_time for it in iterations), default=0.0)
    for row, name in enumerate(instances):
        its = sorted((it for it in iterations if it.instance == name), key=lambda it: it.start_time)
        top = fig.add_subplot(2 * len(instances), 1, 2 * row + 1)
        bottom = fig.add_subplot(2 * len(instances), 1, 2 * row + 2, sharex=top)
        x = [it.start_time - t0 for it in its]
        widths = [max(it.step_time, 1e-9) for it in its]
        top.bar(x, [1e3 * it.step_time for it in its], width=widths, align="edge", color="tab:red")
        top.set_ylabel("step time (ms)")
        top.set_title(f"iterations{' of ' + name if name else ''}: {len(its)} steps")
        prefill = [it.num_prefill_tokens for it in its]
        bottom.bar(x, [it.num_decode_tokens for it in its], width=widths, align="edge", color="tab:blue",
                   label="decode tokens")
        bottom.bar(x, prefill, width=widths, align="edge", bottom=[it.num_decode_tokens for it in its],
                   color="tab:orange", label="prefill tokens")
        bottom.set_ylabel("tokens / step")
        bottom.set_xlabel("time since first iteration (s)")
        bottom.legend(loc="upper right", fontsize="small")
        if not its:
            top.text(0.5, 0.5, "no iterations", ha="center", va="center", transform=top.transAxes)
    fig.tight_layout()
    save(fig)
