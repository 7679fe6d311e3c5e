"""The timeline per unit: a forward and a backward span for every block on real ranks (scratch, fsdp2,
deepspeed), in the right order and between the engine's own hooks; the drawing's compute minus waits on
hand-made events; the figure itself."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch.distributed as dist
from matplotlib.figure import Figure

import labkit
from labkit import plots
from labkit.engines import on_rank, validation
from labkit.engines.base import RunConfig
from labkit.model import build_model
from labkit.probes.timeline import (
    busy_s,
    compute_segments,
    exposed_comm_s,
    merge_intervals,
    subtract_intervals,
)

N_BLOCKS = len(build_model("tiny").blocks)
ENGINES = ("scratch", "fsdp2", "deepspeed")


def ev(kind: str, name: str, start_s: float, end_s: float, rank: int = 0, step: int = 0) -> dict:
    return {"rank": rank, "kind": kind, "name": name, "start_s": start_s, "end_s": end_s, "step": step}


# ------------------------------------------------------------------------------------------ by hand


def test_subtract_intervals_removes_every_hole_and_keeps_the_rest():
    assert subtract_intervals([(0, 10)], [(2, 3), (5, 7)]) == [(0, 2), (3, 5), (7, 10)]
    assert subtract_intervals([(0, 10)], [(-1, 1), (9, 12)]) == [(1, 9)]  # holes over the edges
    assert subtract_intervals([(0, 4)], [(0, 4)]) == []
    assert subtract_intervals([(0, 4), (6, 8)], [(3, 7)]) == [(0, 3), (7, 8)]  # one hole, two intervals
    assert subtract_intervals([(0, 4)], [(2, 3), (1, 2.5)]) == [(0, 1), (3, 4)]  # overlapping holes
    assert merge_intervals([(3, 4), (0, 2), (1, 3), (5, 5)]) == [(0, 4)]


def hand_made_step() -> list[dict]:
    """One step of one rank: forward [0, 10] with blocks 0 and 1, backward [10, 22], optimizer [22, 24].

    Waits: the root's gather at the start [0, 1]; block 1's gather between the blocks [4, 5]; a wait
    inside block 1's forward [6, 7]; in backward block 0's gather [16, 17], between the blocks, and the
    last reduce-scatter [20, 21], after them.
    """
    return [
        ev("compute", "forward", 0, 10),
        ev("compute", "blocks.0.forward", 1, 4),
        ev("compute", "blocks.1.forward", 5, 8),
        ev("compute", "backward", 10, 22),
        ev("compute", "blocks.1.backward", 12, 16),
        ev("compute", "blocks.0.backward", 17, 20),
        ev("compute", "optimizer", 22, 24),
        ev("wait", "all_gather", 0, 1),
        ev("wait", "all_gather", 4, 5),
        ev("wait", "all_gather", 6, 7),
        ev("wait", "all_gather", 16, 17),
        ev("wait", "reduce_scatter", 20, 21),
        ev("comm", "all_gather", 0, 1),
        ev("comm", "reduce_scatter", 19, 21),
        ev("compute", "blocks.0.forward", 0, 1, rank=1),  # another rank's: not this rank's segments
    ]


def test_compute_segments_cut_the_waits_out_and_name_what_is_left_of_each_phase():
    pieces: dict[str, list[tuple[float, float]]] = {}
    for s in compute_segments(hand_made_step(), rank=0):
        pieces.setdefault(s["name"] if s["kind"] == "compute" else "wait", []).append(
            (s["start_s"], s["end_s"])
        )
    assert pieces == {
        "blocks.0.forward": [(1, 4)],
        "blocks.1.forward": [(5, 6), (7, 8)],  # cut where the thread was blocked
        "root.forward": [(8, 10)],  # the head and the loss, after the last block
        "blocks.1.backward": [(12, 16)],
        "blocks.0.backward": [(17, 20)],
        "root.backward": [(10, 12), (21, 22)],  # head before the blocks; embeddings after, less the wait
        "optimizer": [(22, 24)],
        "wait": [(0, 1), (4, 5), (6, 7), (16, 17), (20, 21)],
    }


def test_busy_s_is_the_compute_segments_summed_the_waits_left_out():
    # 3 + 2 forward blocks, 2 head and loss, 4 + 3 backward blocks, 3 root backward, 2 optimizer; 5 s waited
    assert busy_s(hand_made_step(), rank=0) == 19
    assert busy_s(hand_made_step(), rank=0) + exposed_comm_s(hand_made_step(), rank=0) == 24


def test_compute_segments_tile_the_step_without_overlap_and_merge_overlapping_waits():
    events = [
        *hand_made_step(),
        ev("wait", "reduce_scatter", 6.5, 7.5),
        ev("compute", "backward", 10, 22, rank=1),
    ]
    segments = compute_segments(events, rank=0)
    spans = sorted((s["start_s"], s["end_s"]) for s in segments)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
    assert sum(t - s for s, t in spans) == 24  # the three phases, every instant once
    waits = [s for s in segments if s["kind"] == "wait"]
    assert ("all_gather+reduce_scatter", 6, 7.5) in [(w["name"], w["start_s"], w["end_s"]) for w in waits]


def drawn_bars(fig: Figure, colour: str) -> list[tuple[float, float, float]]:
    """(x0, x1, y0) of every rectangle of that face colour that the figure's axes drew (ms, y units)."""
    from matplotlib.collections import PolyCollection
    from matplotlib.colors import to_rgba

    out = []
    for coll in fig.axes[0].collections:
        if not isinstance(coll, PolyCollection):
            continue  # the unit ticks and label lines
        faces = coll.get_facecolors()
        for i, path in enumerate(coll.get_paths()):
            if tuple(faces[i % len(faces)][:3]) == to_rgba(colour)[:3]:
                xs, ys = path.vertices[:, 0], path.vertices[:, 1]
                out.append((round(xs.min(), 9), round(xs.max(), 9), round(ys.min(), 9)))
    return sorted(out)


def test_gantt_draws_units_cut_by_red_waits_and_comm_on_lanes_of_their_own():
    fig = plots.gantt(hand_made_step(), ranks=[0])
    red = plots._COMPUTE_STYLE["wait"][0]
    light, dark = plots._COMPUTE_STYLE["forward"][0], plots._COMPUTE_STYLE["backward"][0]
    assert [b[:2] for b in drawn_bars(fig, red)] == [
        (0, 1000),
        (4000, 5000),
        (6000, 7000),
        (16000, 17000),
        (20000, 21000),
    ]
    assert [b[:2] for b in drawn_bars(fig, light)] == [(1000, 4000), (5000, 6000), (7000, 8000)]
    assert [b[:2] for b in drawn_bars(fig, dark)] == [(12000, 16000), (17000, 20000)]
    compute_y = {b[2] for b in drawn_bars(fig, red) + drawn_bars(fig, light) + drawn_bars(fig, dark)}
    gathers = drawn_bars(fig, plots._COMM_COLORS["all_gather"])
    scatters = drawn_bars(fig, plots._COMM_COLORS["reduce_scatter"])
    assert len(compute_y) == 1 and len(gathers) == len(scatters) == 1
    assert len({*compute_y, gathers[0][2], scatters[0][2]}) == 3  # three lanes
    texts = {t.get_text() for t in fig.axes[0].texts}
    assert {"F0", "F1", "B0", "B1"} <= texts
    legend = {t.get_text() for t in fig.legends[0].get_texts()}
    assert {"blocked on a collective (exposed)", "all-gather in flight", "reduce-scatter in flight"} <= legend
    assert fig.axes[0].get_xlabel() == "time (ms)"
    assert "blocked on collectives (red) for 5000.0 ms of 24000.0 ms" in fig.axes[0].get_title()
    assert plots.gantt(hand_made_step(), title="the finding").axes[0].get_title() == "the finding"


# ------------------------------------------------------------------------------------------ real ranks


def _train_each(runs: list[tuple[str, RunConfig]]) -> list[dict]:
    out = []
    for engine, cfg in runs:
        out.append(on_rank.train_rank(engine, cfg))
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def last_steps() -> dict[str, list[list[dict]]]:
    """{engine: [rank 0's, rank 1's events of the last step]}, 2 ranks, no prefetch (the gathers are waited
    for between the units: where the hooks' order shows)."""
    cfg = RunConfig(world_size=2, steps=2)  # no prefetch for the engines that have the setting
    runs = [(e, replace(cfg, prefetch="prefetch" not in validation.engine_settings(e))) for e in ENGINES]
    per_rank = labkit.launch(_train_each, 2, runs, timeout=300)
    return {
        engine: [[e for e in r[i]["timeline"] if e["step"] == 1] for r in per_rank]
        for i, engine in enumerate(ENGINES)
    }


@pytest.mark.parametrize("engine", ENGINES)
def test_every_block_has_a_forward_and_a_backward_span_inside_its_phase_in_order(last_steps, engine):
    for rank, events in enumerate(last_steps[engine]):
        spans = {e["name"]: e for e in events if e["kind"] == "compute"}
        names = [e["name"] for e in events if e["kind"] == "compute"]
        for i in range(N_BLOCKS):
            for d in ("forward", "backward"):
                assert names.count(f"blocks.{i}.{d}") == 1, (
                    f"{engine} rank {rank}: blocks.{i}.{d} x{names.count(f'blocks.{i}.{d}')}"
                )
        fwd = [spans[f"blocks.{i}.forward"] for i in range(N_BLOCKS)]
        bwd = [spans[f"blocks.{i}.backward"] for i in reversed(range(N_BLOCKS))]  # the order they run in
        for phase, units in (("forward", fwd), ("backward", bwd)):
            p = spans[phase]
            assert p["start_s"] <= units[0]["start_s"] and units[-1]["end_s"] <= p["end_s"], (engine, phase)
            for a, b in zip(units, units[1:], strict=False):
                assert a["start_s"] <= a["end_s"] <= b["start_s"], (
                    f"{engine} rank {rank}: {a['name']} then {b['name']}"
                )
        assert spans["forward"]["end_s"] <= spans["backward"]["start_s"]


@pytest.mark.parametrize("engine", ["scratch", "fsdp2"])
def test_unit_spans_start_once_the_weights_are_there_and_end_before_the_engines_next_hooks(
    last_steps, engine
):
    """No gather is waited for inside a unit's span: the engine's pre-forward / pre-backward hook ran first.
    Block i's backward ends before the engine's hooks on its input: scratch's gather of block i-1 (fsdp2
    prefetches it, implicitly, one block ahead) and fsdp2's post-backward reduce-scatter of block i."""
    for events in last_steps[engine]:
        spans = {e["name"]: e for e in events if e["kind"] == "compute"}
        gathers = [e for e in events if e["kind"] == "wait" and e["name"] == "all_gather"]
        for name, span in spans.items():
            if name.startswith("blocks."):
                inside = [g for g in gathers if span["start_s"] < g["end_s"] and g["start_s"] < span["end_s"]]
                assert not inside, f"{engine}: {name} waited for a gather inside its span"
        for i in range(1, N_BLOCKS):
            end_s = spans[f"blocks.{i}.backward"]["end_s"]
            next_start_s = spans[f"blocks.{i - 1}.backward"]["start_s"]
            between = {
                (e["kind"], e["name"]) for e in events if end_s <= e["start_s"] and e["end_s"] <= next_start_s
            }
            expected = ("comm", "reduce_scatter") if engine == "fsdp2" else ("wait", "all_gather")
            assert expected in between, (engine, i, between)


@pytest.mark.parametrize("engine", ENGINES)
def test_real_timeline_draws_with_every_unit_labelled_or_cut(last_steps, engine):
    events = [e for rank in last_steps[engine] for e in rank]
    for rank in (0, 1):
        segments = compute_segments(events, rank)
        spans = sorted((s["start_s"], s["end_s"]) for s in segments)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:], strict=False))
        units = {s["name"] for s in segments if s["name"].startswith("blocks.")}
        assert units == {f"blocks.{i}.{d}" for i in range(N_BLOCKS) for d in ("forward", "backward")}
    assert isinstance(plots.gantt(events, title=engine), Figure)
