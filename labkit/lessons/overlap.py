"""Prefetch against an emulated link, measured so that a busy machine cannot turn the lesson around (03).

`interleaved_runs` trains the scratch engine in `rounds` interleaved rounds of three runs on the same ranks
(prefetch off over the link, prefetch on over it, prefetch on with no link: gloo's own waits), and keeps,
per run, each kept step's figures as a `labkit.measured.Measured`: rank 0's seconds blocked on collectives,
rank 0's computing seconds (the waits cut out), the slowest rank's step. The sentences (`prefetch_lines`,
`parts_lines`) compare two figures only beyond their spreads, and say so where this run cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from labkit.engines.base import RunConfig
from labkit.engines.loop import run_many
from labkit.engines.registry import SCRATCH
from labkit.measured import ADVICE, Measured, beyond, compare, interleaved, unresolved
from labkit.probes import comm_s, exposed_comm_s
from labkit.probes.timeline import PHASES, busy_s

OFF, ON, BARE = "prefetch off", "prefetch on", "prefetch on, no link"


@dataclass(frozen=True)
class Overlap:
    """One run's figures over every kept step of every round (seconds), and its last step's events."""

    exposed: Measured  # rank 0 blocked on collectives
    busy: Measured  # rank 0 computing, the waits cut out
    step: Measured  # the slowest rank's step
    events: list[dict]  # every rank's events of the last round's last step (to draw)

    def drawn_line(self) -> str:
        """Rank 0's drawn step: its computing and blocked seconds, which make up its own step."""
        phases = [e for e in self.events if e["rank"] == 0 and e["kind"] == "compute" and e["name"] in PHASES]
        own_s = max(e["end_s"] for e in phases) - min(e["start_s"] for e in phases)
        return (
            f"the step drawn, rank 0: {busy_s(self.events, 0) * 1e3:.1f} ms computing + "
            f"{exposed_comm_s(self.events, 0) * 1e3:.1f} ms blocked of its own {own_s * 1e3:.1f} ms step, "
            f"{comm_s(self.events, 0) * 1e3:.1f} ms of collectives in flight"
        )


def variants(cfg: RunConfig) -> dict[str, RunConfig]:
    """The three runs 03 compares, from `cfg` (its link and model): prefetch off, on, and on with no link."""
    return {
        OFF: replace(cfg, prefetch=False),
        ON: replace(cfg, prefetch=True),
        BARE: replace(cfg, prefetch=True, link_gbytes=None),
    }


def interleaved_runs(cfg: RunConfig, rounds: int = 3) -> dict[str, Overlap]:
    """Every run of `variants(cfg)`, `rounds` times interleaved in one launch; {label: Overlap}."""
    runs = variants(cfg)
    order = interleaved(list(runs), rounds)
    records = run_many([(SCRATCH, runs[label]) for label in order])
    return {
        label: _overlap([r for lab, r in zip(order, records, strict=True) if lab == label]) for label in runs
    }


def _overlap(records: Sequence[dict]) -> Overlap:
    exposed, busy, step = [], [], []
    for rec in records:
        kept = sorted({e["step"] for e in rec["timeline"]} - {0})  # step 0 warms up
        for s in kept:
            events = [e for e in rec["timeline"] if e["step"] == s]
            exposed.append(exposed_comm_s(events, 0))
            busy.append(busy_s(events, 0))
            step.append(rec["step_time_s"][s])
    last = records[-1]
    final = max(e["step"] for e in last["timeline"])
    return Overlap(
        Measured.of(exposed),
        Measured.of(busy),
        Measured.of(step),
        [e for e in last["timeline"] if e["step"] == final],
    )


def prefetch_lines(on: Overlap, off: Overlap, floor_s: float) -> list[str]:
    """What prefetch did, against the floor and against no prefetch, said only as far as the spreads allow."""
    lines = [f"measured with prefetch: {on.exposed.text()} exposed; the floor {floor_s * 1e3:.1f} ms"]
    side = beyond(on.exposed, floor_s)
    ratio = on.exposed.median / floor_s
    if side > 0:
        lines.append(
            f"Above the floor by {(on.exposed.q1 - floor_s) * 1e3:.1f} to {(on.exposed.q3 - floor_s) * 1e3:.1f} ms "
            f"({ratio:.1f}x it, at the median): the parts below."
        )
    elif side < 0:
        lines.append(
            f"Below the floor by more than its spread ({ratio:.2f}x it): the compute the unit plan counts as none "
            "(the embedding lookup and its backward) hid part of the collectives the floor counts."
        )
    else:
        lines.append(f"At the floor, within this run's spread ({ratio:.2f}x it at the median).")
    cut = compare(on.exposed, off.exposed)
    if cut < 0:
        lines.append(
            f"Prefetch cut the exposed time to {on.exposed.shown() / off.exposed.shown():.0%} of the "
            f"{off.exposed.text()} without it."
        )
    else:
        lines.append(
            unresolved(
                "what prefetch did to the exposed time", [("with", on.exposed), ("without", off.exposed)]
            )
        )
    return lines


def parts_lines(on: Overlap, off: Overlap, bare: Overlap, floor_s: float, link_s: float) -> list[str]:
    """The parts above the floor (gloo's waits alone, the difference with its spread) and whether prefetch
    slowed rank 0's compute, each said only beyond the spreads."""
    above = on.exposed.scaled(1e3)
    lines = [
        f"exposed with prefetch      : {on.exposed.text()} = {on.exposed.median / link_s:.0%} of the link's "
        f"{link_s * 1e3:.1f} ms",
        f"  the unit plan's floor    : {floor_s * 1e3:.1f} ms ({floor_s / link_s:.2f} x the link's time)",
        f"  gloo alone, no link      : {bare.exposed.text()} (prefetch on, link_gbytes=None)",
        f"  above the floor          : {above.q1 - floor_s * 1e3:+.1f} to {above.q3 - floor_s * 1e3:+.1f} ms "
        "(the interquartile range): gathers that outlast the compute beside them, the link's queue at the end "
        "of the backward, gloo's waits where they outlast the link (they overlap it: not a sum), and this "
        "machine's noise",
    ]
    slower = compare(on.busy, off.busy)
    both = f"{off.busy.text()} without prefetch, {on.busy.text()} with"
    if slower > 0:
        lines.append(
            f"rank 0 computing, waits cut out: {both}: slower with prefetch, beyond the spread: the collectives "
            "in flight beside the compute (gloo's copies on the same caches and memory) slowed it"
        )
    elif slower < 0:
        lines.append(
            f"rank 0 computing, waits cut out: {both}: faster with prefetch, beyond the spread; {ADVICE}"
        )
    else:
        lines.append(
            f"rank 0 computing, waits cut out: {both}: no difference this run can resolve (the spreads overlap)"
        )
    return lines
