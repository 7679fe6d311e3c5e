"""Matplotlib figures for the lab: one flat module of functions, each returning a `Figure`.

Figures are built with `matplotlib.figure.Figure` directly (no pyplot state, no `plt.show()`), so they
render the same under Agg, in a notebook, and inside a widget. Bytes are shown in GB (1e9 B). The one
non-figure, `self_check_html`, is the notebooks' other visual: questions whose answers open on a click.
"""

from __future__ import annotations

import html
import io
from collections.abc import Mapping, Sequence

import matplotlib
from matplotlib.figure import Figure
from matplotlib.patches import Patch

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
    # Beside the axes: inside, it covers the longest bar and its total, which the x-limits leave room for.
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
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


def _show_figures_in_notebooks() -> None:
    """Let a bare `Figure` display as a PNG in IPython (pyplot's inline backend only knows its own)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None:
        shell.display_formatter.formatters["image/png"].for_type(Figure, lambda fig: figure_png(fig, dpi=100))


_show_figures_in_notebooks()


def _figure_and_axes(ax, figsize: Sequence[float]):
    if ax is not None:
        return ax.figure, ax
    fig = Figure(figsize=tuple(figsize), layout="constrained")
    return fig, fig.add_subplot()


# ---------------------------------------------------------------------------------------------- layouts

_SEGMENT_COLORS = tuple(matplotlib.colormaps["tab20"].colors)


def layout_figure(dim0_segments, flat_segments, world_size: int, title: str = "") -> Figure:
    """The same block cut two ways: FSDP2's per-parameter dim-0 shards (top) and FSDP1's flat buffer (bottom).

    Each row is one rank's shard; each colour one parameter; hatched grey is padding (elements).
    """
    fig = Figure(figsize=(10, 1.2 + 0.55 * world_size * 2), layout="constrained")
    axes = fig.subplots(2, 1)
    names = list(dict.fromkeys(s.param for s in [*dim0_segments, *flat_segments] if not s.padding))
    colour = {n: _SEGMENT_COLORS[i % len(_SEGMENT_COLORS)] for i, n in enumerate(names)}
    flat_shard = max(s.stop for s in flat_segments) // world_size
    rows = (
        (axes[0], dim0_segments, 0, "FSDP2 / labkit: every parameter split on dim 0, padded per parameter"),
        (axes[1], flat_segments, flat_shard, "FSDP1: the block flattened into one buffer, padded once"),
    )
    for ax, segments, shard_len, label in rows:
        for s in segments:
            start = s.start - s.rank * shard_len
            style = {"color": "#DDDDDD", "hatch": "///"} if s.padding else {"color": colour[s.param]}
            ax.barh(
                s.rank, s.stop - s.start, left=start, height=0.8, edgecolor="white", linewidth=0.3, **style
            )
        ax.set_yticks(range(world_size), [f"rank {r}" for r in range(world_size)])
        ax.invert_yaxis()
        ax.set_xlabel("elements in this rank's shard")
        ax.set_title(label, fontsize=10, loc="left")
    handles = [Patch(color=colour[n], label=n) for n in names]
    fig.legend(handles=handles, loc="outside right upper", fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


# ---------------------------------------------------------------------------------------------- timelines

_KIND_STYLE = {
    "compute": ("#4C72B0", 0.0, 0.45),
    "comm": ("#DD8452", 0.45, 0.25),
    "wait": ("#C44E52", 0.7, 0.2),
}


def gantt(timeline: Sequence[dict], *, ax=None, title: str | None = None, block_level: bool = True) -> Figure:
    """Per-rank Gantt chart of a run's timeline (seconds): compute (blue), collectives in flight (orange),
    the compute thread blocked on a collective (red, the exposed communication)."""
    fig, ax = _figure_and_axes(ax, (10, 3.2))
    ranks = sorted({e["rank"] for e in timeline})
    t0 = min((e["start_s"] for e in timeline), default=0.0)
    for e in timeline:
        per_block = e["name"].startswith("blocks.")
        if e["kind"] == "compute" and (
            (block_level and e["name"] == "forward") or (not block_level and per_block)
        ):
            continue  # the forward phase is drawn block by block, or as one span
        colour, offset, height = _KIND_STYLE.get(e["kind"], ("#999999", 0.9, 0.1))
        ax.broken_barh([(e["start_s"] - t0, e["end_s"] - e["start_s"])], (e["rank"] + offset - 0.45, height),
                       color=colour, edgecolor="none")  # fmt: skip
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    handles = [Patch(color=c, label=k) for k, (c, _, _) in _KIND_STYLE.items()]
    ax.legend(handles=handles, loc="upper right", fontsize=8, ncols=3)
    if title:
        ax.set_title(title)
    return fig


def traffic_bars(comms: Mapping[str, Mapping], *, expected: Mapping[str, float] | None = None,
                 ax=None, title: str | None = None) -> Figure:  # fmt: skip
    """Wire bytes per rank per step by collective, one group of bars per engine (bytes); `expected`
    draws the formula's figure for each collective as a black tick."""
    fig, ax = _figure_and_axes(ax, (8, 3.2))
    kinds = sorted({k for comm in comms.values() for k in comm})
    width = 0.8 / max(1, len(comms))
    for i, (engine, comm) in enumerate(comms.items()):
        xs = [j + i * width for j in range(len(kinds))]
        ax.bar(xs, [comm.get(k, {}).get("wire_bytes", 0) for k in kinds], width, label=engine)
    for j, kind in enumerate(kinds):
        if expected and kind in expected:
            ax.hlines(expected[kind], j - width / 2, j + 0.8 - width / 2, color="black", linewidth=2)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(kinds))], kinds)
    ax.set_ylabel("wire bytes per rank per step")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return fig


# ---------------------------------------------------------------------------------------------- collectives


def holdings_figure(before, after, chunk: int, *, titles: Sequence[str] = ("before", "after"),
                    title: str | None = None) -> Figure:  # fmt: skip
    """What each rank holds before and after one collective, drawn from the run's tensors.

    `before[r]` and `after[r]` are `(offset, values)`: rank r holds `values` at elements offset, offset+1,
    ... of the full tensor. A cell is coloured by its chunk (element // `chunk`; chunk j is rank j's shard)
    and shows its value; an outlined empty cell is an element that rank does not hold.
    """
    ranks = len(before)
    size = max(offset + len(values) for offset, values in [*before, *after])
    fig = Figure(figsize=(min(14.0, 1.5 + 0.5 * size) * 1.6, 0.6 + 0.5 * ranks), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, rows, label in zip(axes, (before, after), titles, strict=True):
        for r, (offset, values) in enumerate(rows):
            for x in range(size):
                ax.add_patch(_cell(x, r, "none", edge="#BBBBBB"))
            for i, value in enumerate(values):
                x = offset + i
                ax.add_patch(_cell(x, r, _SEGMENT_COLORS[2 * ((x // chunk) % 10) + 1]))
                ax.text(x + 0.5, r, f"{value:g}", ha="center", va="center", fontsize=8)
        ax.set_xlim(0, size)
        ax.set_ylim(ranks - 0.5, -0.5)
        ax.set_xticks([j * chunk + chunk / 2 for j in range(size // chunk)],
                      [f"chunk {j}" for j in range(size // chunk)], fontsize=8)  # fmt: skip
        ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
        ax.set_title(label, fontsize=10, loc="left")
    if title:
        fig.suptitle(title)
    return fig


def _cell(x: float, row: int, colour, edge: str = "white"):
    from matplotlib.patches import Rectangle

    return Rectangle((x, row - 0.4), 1.0, 0.8, facecolor=colour, edgecolor=edge, linewidth=0.8)


def self_check_html(items: Sequence[tuple[str, str]]) -> str:
    """(question, answer) pairs as HTML `<details>` blocks: the answer shows when its question is clicked."""
    blocks = [
        f"<details style='margin:4px 0'><summary><b>{html.escape(q)}</b></summary>"
        f"<div style='margin:4px 0 8px 16px'>{html.escape(a)}</div></details>"
        for q, a in items
    ]
    return "\n".join(blocks)
