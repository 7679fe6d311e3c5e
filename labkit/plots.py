"""Matplotlib figures for the lab: one flat module of functions, each returning a `Figure`.

Figures are built with `matplotlib.figure.Figure` directly (no pyplot state, no `plt.show()`), so they
render the same under Agg, in a notebook, and inside a widget. Bytes are shown in GB (1e9 B).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure

from labkit.budget import MEMORY_TERMS

TERM_COLORS = {
    "weights": "#4C72B0",
    "grads": "#DD8452",
    "grads_fp32": "#E8B27A",
    "master": "#55A868",
    "adam_m": "#C44E52",
    "adam_v": "#8172B3",
    "largest_layer_buffer": "#937860",
    "transient": "#BBBBBB",
}
LINK_COLORS = {"intra_node": "#64B5CD", "inter_node": "#C44E52"}


def _labelled(results) -> list[tuple[str, dict]]:
    """Accept one plan, a list of plans or a {label: plan} mapping; label plans by strategy and ranks."""
    if isinstance(results, Mapping) and "state_bytes_per_rank" in results:
        results = [results]
    if isinstance(results, Mapping):
        return [(str(k), v) for k, v in results.items()]
    return [(f"{r['strategy']}\n{r['world_size']} ranks", r) for r in results]


def memory_bars(results, *, ax=None, transient: bool = True, title: str | None = None) -> Figure:
    """Stacked bars of GPU memory per rank, one bar per plan, one segment per state term (GB).

    `results`: a `labkit.budget.plan()` result, a list of them, or a {label: result} mapping.
    `transient=True` adds the gathered-layer buffers on top, hatched.
    """
    fig, ax = _figure_and_axes(ax, (max(4.0, 1.3 * len(_labelled(results)) + 2), 3.6))
    labelled = _labelled(results)
    terms: list[str] = []
    for _, r in labelled:
        terms += [t for t in r["memory_bytes_per_rank"] if t not in terms]
    terms.sort(key=lambda t: (list(MEMORY_TERMS) + list(TERM_COLORS)).index(t) if t in TERM_COLORS else 99)
    xs = range(len(labelled))
    bottom = [0.0] * len(labelled)
    for term in terms:
        heights = [r["memory_bytes_per_rank"].get(term, 0) / 1e9 for _, r in labelled]
        ax.bar(xs, heights, bottom=bottom, color=TERM_COLORS.get(term, "#999999"), label=term, width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    if transient:
        heights = [sum(r["transient_bytes_per_rank"].values()) / 1e9 for _, r in labelled]
        if any(heights):
            ax.bar(
                xs,
                heights,
                bottom=bottom,
                color="white",
                edgecolor="#777777",
                hatch="//",
                label="transient",
                width=0.6,
            )
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for x, total in zip(xs, bottom, strict=True):
        ax.annotate(
            f"{total:.4g} GB",
            (x, total),
            ha="center",
            va="bottom",
            fontsize=8,
            xytext=(0, 2),
            textcoords="offset points",
        )
    ax.set_xticks(list(xs), [label for label, _ in labelled])
    ax.set_ylabel("GPU memory per rank (GB)")
    ax.set_ylim(0, max(bottom + [1e-9]) * 1.18)
    ax.legend(fontsize=8, loc="upper right", frameon=False)
    ax.set_title(title or "Training state per rank")
    return fig


def time_bars(result: dict, *, ax=None, title: str | None = None) -> Figure:
    """One step as horizontal bars (s): compute, the communication it needs (by link), and the step with and
    without one-layer-ahead prefetch (compute followed by the comm left exposed)."""
    fig, ax = _figure_and_axes(ax, (6.0, 2.6))
    compute = result["compute_time_s"]
    rows = ["step, no prefetch", "step, prefetch", "communication", "compute"]
    ax.barh(3, compute, color="#55A868", label="compute")
    left = 0.0
    for link, seconds in result["comm_time_by_link_s"].items():
        if seconds:
            ax.barh(2, seconds, left=left, color=LINK_COLORS[link], label=f"comm, {link.replace('_', '-')}")
            left += seconds
    for y, exposed in ((1, result["exposed_comm_prefetch_s"]), (0, result["exposed_comm_no_prefetch_s"])):
        ax.barh(y, compute, color="#55A868")
        ax.barh(y, exposed, left=compute, color="#333333", label="exposed comm" if y == 1 else None)
        if result.get("offload_time_s"):
            ax.barh(
                y,
                result["offload_time_s"],
                left=compute + exposed,
                color="#CCB974",
                label="offload" if y == 1 else None,
            )
        total = compute + exposed + result.get("offload_time_s", 0.0)
        ax.annotate(
            f"{total:.3g} s", (total, y), va="center", fontsize=8, xytext=(3, 0), textcoords="offset points"
        )
    ax.set_yticks(range(4), rows)
    ax.set_xlabel("seconds per step")
    ax.set_xlim(
        0, max(compute + result["exposed_comm_no_prefetch_s"] + result.get("offload_time_s", 0.0), left) * 1.2
    )
    ax.legend(fontsize=8, loc="lower right", frameon=False)
    ax.set_title(title or "Time per step")
    return fig


def budget_figure(result: dict) -> Figure:
    """Memory terms (left) and the step's time bars (right) for one `plan()` result, side by side."""
    fig = Figure(figsize=(10.5, 3.8), layout="constrained")
    mem_ax, time_ax = fig.subplots(1, 2, width_ratios=[1, 1.8])
    memory_bars(result, ax=mem_ax)
    time_bars(result, ax=time_ax)
    return fig


def figure_png(fig: Figure, dpi: int = 90) -> bytes:
    """The figure as PNG bytes (for `ipywidgets.Image` and static HTML)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _figure_and_axes(ax, figsize: Sequence[float]):
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=tuple(figsize), layout="constrained")
    return fig, fig.add_subplot()
