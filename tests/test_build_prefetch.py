"""Notebook 03's build cell (prefetch in the learner's engine from 02) and its check
(labkit.buildalong.prefetch_check): the filled cell passes every property on real ranks, and each planted mistake
fails the property it breaks with the sentence that names the moment; the student release stubs the cell, shows
none of its answer lines, and runs 03 on the stubs and on the learner's own pieces. The tests that start ranks or
write a release are marked slow by hand (tests/conftest.py lists whole modules)."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
import verdict_checker
from release_helpers import answer_lines_shown, executed_text, learners_copy, type_in_the_filled_cells

import labkit
from labkit.buildalong.cells import PREFETCH_NOTEBOOK, notebook_namespace, prefetch_namespace
from labkit.buildalong.prefetch_check import check_prefetch
from labkit.buildalong.stubs import NotWritten, write_this_piece
from labkit.course import course_path
from labkit.engines import scratch
from labkit.engines.base import RunConfig
from labkit.model import build_model
from labkit.neighbours import busy_neighbours

slow = pytest.mark.slow
FILLED = prefetch_namespace()  # 02's filled pieces, then 03's filled build cell over them
START, FINISH = FILLED["start_gather"], FILLED["finish_gather"]


def _build_cell() -> nbformat.NotebookNode:
    cells = nbformat.read(course_path(PREFETCH_NOTEBOOK), as_version=4).cells
    (cell,) = [c for c in cells if "build" in c.metadata.get("tags", [])]
    return cell


def _check(before_forward=None, before_backward=None, world_size=2, model="tiny"):
    return check_prefetch(
        before_forward or FILLED["before_forward"],
        before_backward or FILLED["before_backward"],
        world_size,
        model,
        quiet=True,
    )


# ------------------------------------------------------------------------------------------------ the cell


def test_the_build_cell_has_slides_an_id_and_a_stub_that_defines_its_names_and_says_write_this_piece():
    cell = _build_cell()
    assert cell.id == "prefetch-build" and cell.metadata["slideshow"] == {"slide_type": "-"}
    filled, stub = {}, {**notebook_namespace(), "write_this_piece": write_this_piece}
    exec(compile(cell.source, "filled", "exec"), {**stub}, filled)
    exec(compile(cell.metadata["labkit"]["stub"], "stub", "exec"), stub)
    names = [name for name in filled if callable(filled[name])]
    assert names == ["start_gather", "finish_gather", "before_forward", "before_backward"]
    for name in names:
        with pytest.raises(NotWritten, match=f"^write this piece: {name} \\("):
            stub[name](None)


def test_a_stub_says_write_this_piece_without_starting_ranks():
    stub = {**FILLED, "write_this_piece": write_this_piece}
    exec(compile(_build_cell().metadata["labkit"]["stub"], "stub", "exec"), stub)
    result = _check(stub["before_forward"], stub["before_backward"])
    assert not result.ok and result.sentence == (
        "write this piece: before_forward (finish this unit's gather, start unit.next's), then run this check again"
    )


# ------------------------------------------------------------------------------------------------ on real ranks


def _order_of_units() -> list[tuple[str, str | None, str | None]]:
    import torch.distributed as dist

    from labkit.buildalong import attach
    from labkit.engines import on_rank

    units = attach(on_rank.rank_model("tiny"), _pieces())
    assert dist.get_world_size() == 1
    return [(u.name, u.next and u.next.name, u.backward_next and u.backward_next.name) for u in units]


def _pieces():
    from labkit.buildalong.scaffold import Pieces

    return Pieces(**{name: FILLED.get(name) for name in Pieces.__dataclass_fields__})


@slow
def test_the_scaffold_names_the_next_unit_of_each_pass():
    order = labkit.launch(_order_of_units, 1)[0]
    assert order == [
        ("root", "blocks.0", "blocks.3"),
        ("blocks.0", "blocks.1", None),  # the root is still gathered when blocks.0's backward ends
        ("blocks.1", "blocks.2", "blocks.0"),
        ("blocks.2", "blocks.3", "blocks.1"),
        ("blocks.3", None, "blocks.2"),
    ]


@slow
@pytest.mark.parametrize(("world_size", "model"), [(2, "tiny"), (3, "tiny_uneven")])
def test_the_filled_cell_passes_every_property(world_size, model):
    result = _check(world_size=world_size, model=model)
    assert result.ok, result.sentence
    assert result.figures["loss_rel"] <= 1e-4
    assert result.figures["wire_bytes"] == result.figures["formula_bytes"]
    assert "each unit's gather but the first of each pass" in result.sentence
    assert {e["rank"] for e in result.figures["timeline"]} == set(range(world_size))


def _synchronous(unit):
    """The next unit's gather issued and waited for at once: the right bytes and losses, nothing in flight."""
    FINISH(unit)
    if unit.next is not None:
        START(unit.next)
        for work, *_ in unit.next.pending.values():
            work.wait()


def _previous_unit(unit):
    """Prefetches the unit before it (already computed), not the next: the next is gathered on the spot."""
    FINISH(unit)
    if unit.prev is not None:
        START(unit.prev)


def _gathers_itself_again(unit):
    """Issues its own gather although a prefetch has it in flight: that prefetch is sent for nothing."""
    START(unit)
    FINISH(unit)
    if unit.next is not None:
        START(unit.next)


def _next_step_early(unit):
    """At the end of the backward, prefetches the root for the next step: before AdamW changes its shards."""
    FINISH(unit)
    after = unit.backward_next or unit.prev
    if after is not None:
        START(after)


@slow
def test_a_synchronous_prefetch_keeps_losses_and_bytes_and_fails_the_order():
    result = _check(before_forward=_synchronous)
    assert not result.ok and result.sentence == (
        "order: before_forward(root) waited for blocks.0's gather before root computed in step 0's forward (issued and "
        "waited for at once): nothing was in flight while root computed; leave it pending and wait for it in "
        "before_forward(blocks.0)"
    )


@slow
def test_02s_moments_gather_on_the_spot_and_fail_the_order():
    result = _check(notebook_namespace()["before_forward"])
    assert not result.ok and result.sentence.startswith(
        "order: blocks.0's gather was issued only when blocks.0 began, after root had begun computing in step 0's "
        "forward: nothing was in flight while root computed; before_forward(root) must issue it (unit.next)"
    )


@slow
@pytest.mark.parametrize(
    ("before_forward", "said"),
    [
        (
            _previous_unit,
            "blocks.0's gathers sent 671,040 B, its share 447,360 B, issued in before_forward(blocks.0), "
            "before_forward(blocks.1) and before_backward(blocks.1)",
        ),
        (
            _gathers_itself_again,
            "blocks.0's gathers sent 671,040 B, its share 447,360 B, issued in before_forward(root), "
            "before_forward(blocks.0) and before_backward(blocks.1)",
        ),
    ],
)
def test_a_gather_of_the_wrong_unit_or_an_extra_one_fails_the_bytes(before_forward, said):
    result = _check(before_forward=before_forward)
    first, *others = result.sentence.split("\n  ")
    assert not result.ok and first == (
        "bytes: in step 0 your engine sent "
        f"{result.figures['wire_bytes']['all_gather']:,} B of all-gather per rank, the formula 1,956,096 B (each unit "
        f"once for its forward, once for its backward): {said}: a prefetched gather its unit does not use, or a unit "
        "gathered again in its own moment, is sent all the same"
    )
    assert result.figures["wire_bytes"]["all_gather"] > 1_956_096
    assert not first.startswith("losses") and all(s.startswith("order: ") for s in others)


def _finish_keeping_pending(unit):
    """The filled finish_gather but for its last line: unit.pending is never emptied."""
    if not unit.pending:
        START(unit)
    for p, (work, buffer, d0) in unit.pending.items():
        work.wait()
        FILLED["load"](p, buffer[:d0])


def _forward_keeping_pending(unit):
    _finish_keeping_pending(unit)
    if unit.next is not None:
        START(unit.next)


def _backward_keeping_pending(unit):
    _finish_keeping_pending(unit)
    if unit.backward_next is not None:
        START(unit.backward_next)


@slow
def test_a_gather_loaded_twice_sends_too_few_bytes_and_trains_on_stale_weights():
    result = _check(_forward_keeping_pending, _backward_keeping_pending)
    losses, sent, *_ = result.sentence.split("\n  ")
    assert not result.ok and losses.startswith("losses: with your prefetch the loss at step 1 is ")
    assert sent.startswith("bytes: in step 0 your engine sent ") and sent.endswith(
        "root's gathers sent 83,328 B, its share 166,656 B, issued in before_forward(root): a unit loaded a gather it "
        "had loaded before (empty unit.pending once its weights are loaded), whose weights may be an earlier step's"
    )


@slow
def test_a_gather_left_pending_into_the_next_step_fails_the_losses_and_names_before_backward():
    result = _check(before_backward=_next_step_early)
    losses = result.sentence.split("\n  ")[0]
    assert not result.ok and losses.startswith("losses: with your prefetch the loss at step 1 is ")
    assert "and with 02's moments it is single's: the forward of step 0 was right" in losses
    assert "before_backward must load the unit's own gather" in losses


# ------------------------------------------------------------------------------------------------ the release


@slow
def test_the_release_stubs_the_cell_and_shows_none_of_its_answer_lines(student_release: Path):
    answer, shown = answer_lines_shown(student_release, PREFETCH_NOTEBOOK, _build_cell())
    assert len(answer) >= 10, answer
    assert shown == []


@slow
def test_the_student_03_runs_on_its_stubs_and_checks_the_learners_own_engine(
    student_release: Path, tmp_path: Path, monkeypatch
):
    from labkit.buildalong.cells import NOTEBOOK

    release = learners_copy(student_release, tmp_path)
    stubbed = executed_text(release, release / PREFETCH_NOTEBOOK, monkeypatch)
    assert "✗ prefetch: write this piece: before_forward (" in stubbed
    assert "Not yet: your engine's timeline is drawn once the check above passes." in stubbed
    # the student copy's scratch engine is theirs: measured once their 02 and 03 are written, FSDP2 sets the link
    assert "yours, prefetch on: not measured yet. Your 02 still has shard, gather, before_forward" in stubbed
    assert "Until then FSDP2's step sets the link." in stubbed
    assert "prefetch on: step " not in stubbed
    for notebook in (NOTEBOOK, PREFETCH_NOTEBOOK):  # their 02, then their 03
        type_in_the_filled_cells(release, notebook)
    with busy_neighbours():  # two nice-19 spinners: a shared node, as the instructor's 03 runs in the suite
        written = executed_text(release, release / PREFETCH_NOTEBOOK, monkeypatch)
    # every timing verdict holds against its printed figures, the floor now their engine's (one root)
    assert sorted(verdict_checker.check(written)) == ["busy", "drawn", "drawn", "floor", "prefetch"], written
    assert "✓ prefetch: losses equal to single's over 3 steps" in written, written
    assert "Not yet" not in written and "not measured yet" not in written
    assert "yours, prefetch off: step " in written and "yours, prefetch on: step " in written  # their engine
    assert "FSDP2's step sets the link" not in written
    # their figures are those of labkit's engine on the same plan (one root, split_root=False), to the byte
    net, one_root = build_model("tiny"), RunConfig(model="tiny", world_size=2, options={"split_root": False})
    assert f"{sum(scratch.predicted_wire_bytes(net, one_root, 2).values()):,} wire bytes ->" in written
    for unit in scratch.unit_costs(net, one_root, 2):
        row = rf"^{re.escape(unit.name)} +{unit.gather_wire_bytes:,} +\S+ +{unit.reduce_wire_bytes:,} "
        assert re.search(row, written, re.M), (row, written)
    floor = scratch.exposed_floor(net, one_root, 2)["exposed"]
    assert "nothing to hide behind: " + "; ".join(f"{unit} {what}" for unit, what in floor) in written
