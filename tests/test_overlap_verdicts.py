"""03's prefetch verdicts (labkit.lessons.overlap) on figures made here: a sentence orders two timings only when
their interquartile ranges part, says which way, and otherwise says in one sentence that this run cannot tell.
No launch: the fast lane's test of what 03 prints beside a neighbour."""

from __future__ import annotations

from labkit.lessons.overlap import Overlap, parts_lines, prefetch_lines
from labkit.measured import ADVICE, Measured


def _run(exposed_ms, busy_ms=(100, 101, 102, 103, 104)) -> Overlap:
    return Overlap(
        Measured.of(v / 1e3 for v in exposed_ms),
        Measured.of(v / 1e3 for v in busy_ms),
        Measured.of([1.0]),
        [],
    )


FLOOR_S, LINK_S = 0.010, 0.040


def test_prefetch_is_said_to_cut_only_when_the_spreads_part():
    on, off = _run([11, 12, 12, 13, 14]), _run([40, 41, 42, 43, 44])
    lines = prefetch_lines(on, off, FLOOR_S)
    assert lines[0] == f"measured with prefetch: {on.exposed.text()} exposed; the floor 10.0 ms"
    assert lines[1].startswith("Above the floor by 2.0 to 3.0 ms (1.2x it, at the median): the parts below.")
    assert lines[2] == f"Prefetch cut the exposed time to 29% of the {off.exposed.text()} without it."


def test_the_cut_is_the_ratio_of_the_figures_printed_beside_it():
    """13.649 / 51.4 is 26.55 %, but the sentence prints 13.6 and 51.4 ms: their ratio, 26 %, is what it says."""
    on, off = _run([13.0, 13.5, 13.649, 13.7, 14.0]), _run([50.0, 51.0, 51.4, 52.0, 53.0])
    said = prefetch_lines(on, off, FLOOR_S)
    assert said[0].startswith("measured with prefetch: 13.6 ms (IQR ")
    assert said[2] == f"Prefetch cut the exposed time to 26% of the {off.exposed.text()} without it."


def test_overlapping_spreads_give_one_sentence_and_no_verdict():
    on, off = _run([20, 30, 40, 50, 60]), _run([35, 40, 45, 50, 55])
    said = prefetch_lines(on, off, FLOOR_S)[2]
    assert said.startswith("This machine was too busy to resolve what prefetch did to the exposed time")
    assert said.endswith(f"{ADVICE}.") and "cut" not in said and said.count(". ") == 0
    assert on.exposed.text() in said and off.exposed.text() in said


def test_the_floor_is_above_below_or_within_the_spread():
    off = _run([40, 41, 42, 43, 44])
    below = prefetch_lines(_run([5, 6, 6, 7, 8]), off, FLOOR_S)[1]
    at = prefetch_lines(_run([8, 9, 10, 11, 12]), off, FLOOR_S)[1]
    assert below.startswith("Below the floor by more than its spread (0.60x it)")
    assert at == "At the floor, within this run's spread (1.00x it at the median)."


def test_a_single_repeat_orders_nothing():
    one = _run([12])
    lines = prefetch_lines(one, _run([42]), FLOOR_S)
    assert lines[0].endswith("(one run: no spread) exposed; the floor 10.0 ms")
    assert lines[1].startswith("At the floor, within this run's spread") and lines[2].startswith(
        "This machine was too busy to resolve"
    )


def test_prefetch_slowing_the_compute_is_said_only_beyond_the_spread():
    bare = _run([9, 10, 10, 11, 12])
    slower = parts_lines(
        _run([12] * 5, busy_ms=[120, 121, 122, 123, 124]), _run([42] * 5), bare, FLOOR_S, LINK_S
    )
    same = parts_lines(
        _run([12] * 5, busy_ms=[99, 101, 102, 103, 106]), _run([42] * 5), bare, FLOOR_S, LINK_S
    )
    faster = parts_lines(_run([12] * 5, busy_ms=[80, 81, 82, 83, 84]), _run([42] * 5), bare, FLOOR_S, LINK_S)
    assert slower[0].startswith(
        "exposed with prefetch      : 12.0 ms (IQR 12.0 to 12.0 over 5) = 30% of the link's 40.0 ms"
    )
    assert slower[1] == "  the unit plan's floor    : 10.0 ms (0.25 x the link's time)"
    assert slower[-1].endswith(
        "slower with prefetch, beyond the spread: the collectives in flight beside the compute (gloo's copies on the same caches and memory) slowed it"
    )
    assert same[-1].endswith("no difference this run can resolve (the spreads overlap)")
    assert "faster with prefetch, beyond the spread" in faster[-1] and faster[-1].endswith(ADVICE)
