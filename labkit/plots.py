"""Matplotlib figures for the lab: one flat module of functions, each returning a `Figure`.

Figures are built with `matplotlib.figure.Figure` directly (no pyplot state, no `plt.show()`), so they
render the same under Agg, in a notebook, and inside a widget. Bytes are shown in GB (1e9 B).
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import matplotlib
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import LogLocator, NullLocator, StrMethodFormatter

from labkit.budget import MEMORY_TERMS
from labkit.names import ALL_GATHER, ALL_REDUCE, BROADCAST, REDUCE_SCATTER

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
    without one-layer-ahead prefetch (compute, then the comm left exposed, then offload's I/O and CPU Adam)."""
    fig, ax = _figure_and_axes(ax, (6.0, 2.6))
    compute = result["compute_time_s"]
    rows = ["step, no prefetch", "step, prefetch", "communication", "compute"]
    ax.barh(3, compute, color="#55A868", label="compute")
    left = 0.0
    for link, seconds in result["comm_time_by_link_s"].items():
        if seconds:
            ax.barh(2, seconds, left=left, color=LINK_COLORS[link], label=f"comm, {link.replace('_', '-')}")
            left += seconds
    # After the compute and the exposed comm, the step pays what offload adds: PCIe/NVMe transfers, then
    # CPU Adam on the host (both zero without offload).
    extras = [("offload_time_s", "#CCB974", "offload I/O"), ("host_optimizer_time_s", "#8172B3", "CPU Adam")]
    for y, exposed in ((1, result["exposed_comm_prefetch_s"]), (0, result["exposed_comm_no_prefetch_s"])):
        ax.barh(y, compute, color="#55A868")
        ax.barh(y, exposed, left=compute, color="#333333", label="exposed comm" if y == 1 else None)
        total = compute + exposed
        for key, colour, label in extras:
            if result.get(key):
                ax.barh(y, result[key], left=total, color=colour, label=label if y == 1 else None)
                total += result[key]
        ax.annotate(
            f"{total:.3g} s", (total, y), va="center", fontsize=8, xytext=(3, 0), textcoords="offset points"
        )
    ax.set_yticks(range(4), rows)
    ax.set_xlabel("seconds per step")
    longest = compute + result["exposed_comm_no_prefetch_s"] + sum(result.get(k, 0.0) for k, _, _ in extras)
    ax.set_xlim(0, max(longest, left) * 1.2)
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

# Per rank, from the top: a band for the unit labels that do not fit inside their bar, the compute lane
# (per-unit compute, forward light and backward dark, red where the thread is blocked on a collective),
# then one lane per collective kind.
_COMPUTE_STYLE = {  # what: (colour, label colour, legend)
    "forward": ("#9DC3E6", "#1F3B5A", "forward of block i (Fi)"),
    "backward": ("#2E75B6", "white", "backward of block i (Bi)"),
    "root": ("#A5A5A5", "#202020", "root: embeddings, head, loss"),
    "between": ("#DADADA", "#202020", "engine, between units"),
    "optimizer": ("#70AD47", "#202020", "optimizer"),
    "wait": ("#C00000", "white", "blocked on a collective (exposed)"),
}
_COMM_COLORS = {
    ALL_GATHER: "#ED7D31",
    REDUCE_SCATTER: "#7030A0",
    ALL_REDUCE: "#00A3A3",
    BROADCAST: "#BF9000",
}
_LABEL_H, _COMPUTE_H, _COMM_H, _RANK_GAP = 0.3, 0.8, 0.42, 0.25  # heights (y units)
_LABEL_PT = 7


def gantt(
    timeline: Sequence[dict], *, ax=None, title: str | None = None, ranks: Sequence[int] | None = None
) -> Figure:
    """Per-rank timeline of one or more steps (ms): what the compute thread did, unit by unit, and the
    collectives in flight, one lane per kind.

    Compute lane: forward (light) and backward (dark) of each block, labelled Fi / Bi inside the bar, or
    above it, where the label fits; the root's own compute (grey); the optimizer; red where the thread
    was blocked on a collective, cut out of the compute (`labkit.probes.timeline.compute_segments`). Any
    engine's timeline (loop.run's "timeline"); `ranks`: those to draw; `title`: the finding (else measured).
    """
    from labkit.probes.timeline import compute_segments  # here: it imports torch, the calculators do not

    ranks = sorted({e["rank"] for e in timeline} if ranks is None else ranks)
    events = [e for e in timeline if e["rank"] in ranks]
    kinds = sorted({e["name"] for e in events if e["kind"] == "comm"}, key=_comm_order)
    rank_h = _LABEL_H + _COMPUTE_H + _COMM_H * len(kinds) + _RANK_GAP
    own_figure = ax is None
    fig, ax = _figure_and_axes(ax, (11, 1.4 + 0.85 * len(ranks) * rank_h))
    t0 = min((e["start_s"] for e in events), default=0.0)
    span_ms = max((e["end_s"] for e in events), default=t0 + 1e-3) * 1e3 - t0 * 1e3
    ax.set_xlim(0, span_ms * 1.01)
    lane = _Lane(ax, t0, ms_per_inch=span_ms * 1.01 / max(1.0, fig.get_figwidth() - 1.3))
    seen: set[str] = set()
    ticks: list[tuple[float, str]] = []
    for i, rank in enumerate(ranks):
        top = i * rank_h + _LABEL_H
        seen |= lane.compute(compute_segments(events, rank), top)
        ticks.append((top + _COMPUTE_H / 2, f"rank {rank}"))
        for j, kind in enumerate(kinds):
            y = top + _COMPUTE_H + j * _COMM_H
            lane.comm(
                [e for e in events if e["rank"] == rank and e["kind"] == "comm" and e["name"] == kind], y
            )
            ticks.append((y + _COMM_H / 2, kind.replace("_", "-")))
    ax.set_yticks([y for y, _ in ticks], [t for _, t in ticks])
    for label in ax.get_yticklabels():
        label.set_fontsize(9 if label.get_text().startswith("rank") else 7)
    ax.set_ylim(len(ranks) * rank_h - _RANK_GAP, 0)
    ax.set_xlabel("time (ms)")
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    handles = [Patch(color=c, label=text) for what, (c, _, text) in _COMPUTE_STYLE.items() if what in seen]
    handles += [Patch(color=_comm_color(k), label=f"{k.replace('_', '-')} in flight") for k in kinds]
    if own_figure:
        fig.legend(handles=handles, loc="outside lower center", ncols=4, fontsize=8, frameon=False)
    else:
        ax.legend(handles=handles, loc="upper right", ncols=2, fontsize=7)
    ax.set_title(title or _measured_title(events, ranks[0] if ranks else 0), fontsize=10)
    return fig


class _Lane:
    """Draws one rank's lanes on `ax`: times in seconds, drawn in ms from `t0`."""

    def __init__(self, ax, t0_s: float, ms_per_inch: float):
        self.ax, self.t0_s, self.ms_per_inch = ax, t0_s, ms_per_inch

    def bar(self, e: dict) -> tuple[float, float]:
        return (e["start_s"] - self.t0_s) * 1e3, (e["end_s"] - e["start_s"]) * 1e3

    def compute(self, segments: Sequence[dict], top: float) -> set[str]:
        """The compute lane from `compute_segments`, its unit labels; returns the styles drawn."""
        by_style: dict[str, list[dict]] = {}
        for seg in segments:
            by_style.setdefault(_segment_style(seg) if seg["kind"] == "compute" else "wait", []).append(seg)
        for what, segs in by_style.items():
            self.ax.broken_barh(
                [self.bar(s) for s in segs],
                (top, _COMPUTE_H),
                color=_COMPUTE_STYLE[what][0],
                edgecolor="none",
            )
        self._units([s for what in ("forward", "backward") for s in by_style.get(what, [])], top)
        return set(by_style)

    def _units(self, unit_segments: Sequence[dict], top: float) -> None:
        """A white tick where each unit starts, and its label (Fi / Bi): inside its widest piece where it
        fits, else above the lane over a thin line spanning the unit, where there is room."""
        pieces: dict[tuple, list[dict]] = {}
        for seg in unit_segments:
            pieces.setdefault((seg["name"], seg["step"]), []).append(seg)
        above_until_ms = float("-inf")
        for segs in sorted(pieces.values(), key=lambda p: p[0]["start_s"]):
            what = _segment_style(segs[0])
            label = ("F" if what == "forward" else "B") + segs[0]["name"].split(".")[1]
            start_ms, _ = self.bar(segs[0])
            end_ms = sum(self.bar(segs[-1]))
            self.ax.vlines(start_ms, top, top + _COMPUTE_H, color="white", linewidth=0.8)
            left_ms, width_ms = self.bar(max(segs, key=_width))
            text_ms = (len(label) * 0.62 * _LABEL_PT / 72 + 0.03) * self.ms_per_inch
            if width_ms >= text_ms:
                self.ax.text(
                    left_ms + width_ms / 2,
                    top + _COMPUTE_H / 2,
                    label,
                    ha="center",
                    va="center",
                    fontsize=_LABEL_PT,
                    color=_COMPUTE_STYLE[what][1],
                )
                continue
            middle_ms = (start_ms + end_ms) / 2
            if middle_ms - text_ms / 2 > above_until_ms:
                self.ax.hlines(top - 0.05, start_ms, end_ms, color="#404040", linewidth=0.6)
                self.ax.text(
                    middle_ms,
                    top - 0.07,
                    label,
                    ha="center",
                    va="bottom",
                    fontsize=_LABEL_PT - 1,
                    color="#404040",
                )
                above_until_ms = middle_ms + text_ms / 2

    def comm(self, events: Sequence[dict], y: float) -> None:
        """One collective kind's lane: each call from issue to completion (overlapping calls darken)."""
        if events:
            self.ax.broken_barh(
                [self.bar(e) for e in events],
                (y + 0.06, _COMM_H - 0.12),
                color=_comm_color(events[0]["name"]),
                edgecolor="white",
                linewidth=0.4,
                alpha=0.85,
            )


def _comm_order(kind: str) -> tuple:
    return (list(_COMM_COLORS).index(kind) if kind in _COMM_COLORS else len(_COMM_COLORS), kind)


def _comm_color(kind: str) -> str:
    return _COMM_COLORS.get(kind, "#7F7F7F")


def _segment_style(seg: dict) -> str:
    """The `_COMPUTE_STYLE` key of a compute segment ("blocks.3.backward" -> "backward", "root.forward" -> "root")."""
    name = seg["name"]
    if name.startswith("blocks."):
        return name.rsplit(".", 1)[1]
    return "optimizer" if name == "optimizer" else name.split(".", 1)[0]


def _width(seg: dict) -> float:
    return seg["end_s"] - seg["start_s"]


def _measured_title(timeline: Sequence[dict], rank: int) -> str:
    """The finding when the caller gives none: how long `rank` was blocked, of the time shown."""
    from labkit.probes.timeline import exposed_comm_s

    mine = [e for e in timeline if e["rank"] == rank]
    if not mine:
        return "Timeline per rank"
    shown_s = max(e["end_s"] for e in mine) - min(e["start_s"] for e in mine)
    return (
        f"Rank {rank} was blocked on collectives (red) for {exposed_comm_s(mine) * 1e3:.1f} ms "
        f"of {shown_s * 1e3:.1f} ms"
    )


def traffic_bars(
    comms: Mapping[str, Mapping],
    *,
    expected: Mapping[str, float] | None = None,
    ax=None,
    title: str | None = None,
) -> Figure:
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


def holdings_figure(
    before, after, chunk: int, *, titles: Sequence[str] = ("before", "after"), title: str | None = None
) -> Figure:
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
        ax.set_xticks(
            [j * chunk + chunk / 2 for j in range(size // chunk)],
            [f"chunk {j}" for j in range(size // chunk)],
            fontsize=8,
        )
        ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
        ax.set_title(label, fontsize=10, loc="left")
    if title:
        fig.suptitle(title)
    return fig


def _cell(x: float, row: int, colour, edge: str = "white"):
    from matplotlib.patches import Rectangle

    return Rectangle((x, row - 0.4), 1.0, 0.8, facecolor=colour, edgecolor=edge, linewidth=0.8)


# ---------------------------------------------------------------------------------------------- meshes

_MESH_COLORS = ("#A6CEE3", "#FDBF6F", "#B2DF8A", "#CAB2D6", "#FB9A99", "#FFFF99", "#1F78B4", "#E31A1C")


def mesh_groups(mesh_ranks: Sequence[Sequence[int]], dim: int) -> list[list[int]]:
    """The process groups of a 2-D mesh's dimension `dim`: the ranks that differ only in that coordinate.

    Dim 1 is each row of `mesh_ranks` (a `DeviceMesh.mesh.tolist()`), dim 0 each column: what
    `mesh.get_group(dim)` holds on each of those ranks.
    """
    rows = [list(row) for row in mesh_ranks]
    return rows if dim == 1 else [list(column) for column in zip(*rows, strict=True)]


def mesh_figure(
    mesh_ranks: Sequence[Sequence[int]],
    dim_names: Sequence[str],
    *,
    colour_by: str | None = None,
    roles: Mapping[str, str] | None = None,
    ax=None,
    title: str | None = None,
) -> Figure:
    """A 2-D device mesh as its grid of ranks (row i, column j holds `mesh_ranks[i][j]`), its groups labelled.

    Each rank is filled with the colour of its group along `colour_by` (default: the last dimension); the
    other dimension's groups are dashed outlines. Rows are labelled at their right, columns under them;
    `roles[name]`, what a group of that dimension does ("all-gather + reduce-scatter"), goes in the legend.
    """
    from matplotlib.patches import FancyBboxPatch

    rows, cols = len(mesh_ranks), len(mesh_ranks[0])
    names = tuple(dim_names)
    filled = names.index(colour_by) if colour_by is not None else 1
    dashed = 1 - filled
    roles = roles or {}
    fig, ax = _figure_and_axes(ax, (2.6 + 1.6 * cols, 1.8 + 1.2 * rows))
    where = {rank: (i, j) for i, row in enumerate(mesh_ranks) for j, rank in enumerate(row)}
    for k, group in enumerate(mesh_groups(mesh_ranks, filled)):
        for rank in group:
            i, j = where[rank]
            ax.add_patch(
                FancyBboxPatch(
                    (j - 0.4, i - 0.4),
                    0.8,
                    0.8,
                    boxstyle="round,pad=0.02",
                    facecolor=_MESH_COLORS[k % len(_MESH_COLORS)],
                    edgecolor="#333333",
                )
            )
            ax.text(j, i, f"rank {rank}", ha="center", va="center", fontsize=10, weight="bold")
    for k in range(cols if dashed == 0 else rows):
        x0, y0, w, h = (
            (k - 0.47, -0.47, 0.94, rows - 0.06) if dashed == 0 else (-0.47, k - 0.47, cols - 0.06, 0.94)
        )
        ax.add_patch(
            FancyBboxPatch(
                (x0, y0),
                w,
                h,
                boxstyle="round,pad=0.03",
                facecolor="none",
                edgecolor="#555555",
                linestyle="--",
                linewidth=1.2,
            )
        )
    for k, group in enumerate(mesh_groups(mesh_ranks, 1)):  # dim 1: the rows, labelled at their right
        ax.text(cols - 0.42, k, f"{names[1]} group\n{group}", ha="left", va="center", fontsize=9)
    for k, group in enumerate(mesh_groups(mesh_ranks, 0)):  # dim 0: the columns, labelled under them
        ax.text(k, rows - 0.4, f"{names[0]} group\n{group}", ha="center", va="top", fontsize=9)
    key = [
        Patch(facecolor=_MESH_COLORS[0], edgecolor="#333333", label=f"fill: a {names[filled]} group"),
        Patch(
            facecolor="none", edgecolor="#555555", linestyle="--", label=f"dashed: a {names[dashed]} group"
        ),
    ]
    for handle, dim in zip(key, (filled, dashed), strict=True):
        if names[dim] in roles:
            handle.set_label(f"{handle.get_label()}: {roles[names[dim]]}")
    ax.legend(handles=key, loc="upper left", bbox_to_anchor=(0.0, 0.02), fontsize=8.5, frameon=False)
    ax.set_xlim(-0.6, cols + 0.9)
    ax.set_ylim(rows + 0.05, -0.6)
    ax.set_xticks(range(cols), [f"{names[1]} {j}" for j in range(cols)])
    ax.set_yticks(range(rows), [f"{names[0]} {i}" for i in range(rows)])
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_aspect("equal")
    ax.set_title(title or f"mesh {names} = {[list(r) for r in mesh_ranks]}", fontsize=10, loc="left", pad=8)
    return fig


def roofline(rows: Sequence[dict], measured: dict, closed_form: dict | None, *, ax=None) -> Figure:
    """A sweep of `labkit.lessons.roofline` (ms against tokens per rank, log x): each step's compute and exposed
    comm over the emulated link (medians, IQRs as bars), the link's time for the step's bytes, the fitted floor,
    fall and crossover (`measured`), the closed form's band (`closed_form`, T*(1-f) to T*; None: not reached)."""
    fig, ax = _figure_and_axes(ax, (6.4, 3.4))
    tokens = [r["tokens_per_rank"] for r in rows]
    for key, style, colour, label in (
        ("compute", "o-", "#55A868", "compute (no link)"),
        ("exposed", "o-", "#C44E52", "exposed comm, prefetch on"),
    ):
        figures = [r[key].scaled(1e3) for r in rows]
        medians = [m.median for m in figures]
        bars = [[m.median - m.q1 for m in figures], [m.q3 - m.median for m in figures]]
        ax.errorbar(tokens, medians, yerr=bars, fmt=style, color=colour, capsize=2, label=label)
    ax.plot(
        tokens,
        [r["link_s"] * 1e3 for r in rows],
        "--",
        color="#4C72B0",
        label="link time of the step's bytes",
    )
    fit_x = sorted({*tokens, measured["tokens_per_rank"]})
    fit_y = [
        (measured["floor_s"] + measured["slope_s_per_token"] * max(0.0, measured["tokens_per_rank"] - t))
        * 1e3
        for t in fit_x
    ]
    ax.plot(fit_x, fit_y, ":", color="#333333", label="fit: floor + slope x max(0, T_x - T)")
    ax.axvline(measured["tokens_per_rank"], color="#C44E52", alpha=0.5, label="measured crossover T_x")
    if closed_form is not None:
        lo, hi = closed_form["low_tokens_per_rank"], closed_form["tokens_per_rank"]
        ax.axvspan(lo, hi, color="#4C72B0", alpha=0.15, label="closed form, T*(1-f) to T*")
    _tokens_axis(ax)
    ax.set_xlabel("tokens per rank per step")
    ax.set_ylabel("ms per step")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.set_title("When prefetch hides the link")
    return fig


def _tokens_axis(ax) -> None:
    """Log x in plain token counts at powers of two, as many as fit (log minor labels, 3x10^2..., overlap)."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(LogLocator(base=2))
    ax.xaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    ax.xaxis.set_minor_locator(NullLocator())
