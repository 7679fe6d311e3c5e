"""Your engine from 02 in the later notebooks (labkit.buildalong.yours): read from 02's build cells, never
replaced by labkit's while a piece is a stub, and said against single's losses and ZeRO-3's byte formula."""

from __future__ import annotations

from pathlib import Path

import nbformat

from labkit.buildalong.cells import NOTEBOOK
from labkit.buildalong.scaffold import Learner
from labkit.buildalong.yours import NAME, beside, formula_wire_bytes, your_engine
from labkit.course import course_path


def test_the_filled_02_gives_an_engine_named_yours():
    learner, waiting = your_engine()
    assert isinstance(learner, Learner) and learner.name == NAME and waiting == ""


def test_a_stub_in_02_names_the_piece_and_gives_no_engine(tmp_path: Path):
    nb = nbformat.read(course_path(NOTEBOOK), as_version=4)
    stubbed = 0
    for cell in nb.cells:
        if "build" in cell.metadata.get("tags", []) and "def after_grad" in cell.source:
            cell.source, stubbed = cell.metadata["labkit"]["stub"], stubbed + 1
    assert stubbed == 1
    nbformat.write(nb, tmp_path / "02.ipynb")
    learner, waiting = your_engine(tmp_path / "02.ipynb")
    assert learner is None and waiting.startswith("Your 02 still has after_grad to write")


def test_the_formula_is_two_gathers_and_one_scatter_of_the_padded_parameters():
    # tiny_uneven's vocabulary (101 rows) does not divide by 3: its shards are zero-padded to 34 rows.
    three = formula_wire_bytes("tiny_uneven", 3)
    assert three["all_gather"] == 2 * three["reduce_scatter"]
    assert formula_wire_bytes("tiny", 1) == {"all_gather": 0, "reduce_scatter": 0}


def _record(losses, comm):
    return {"losses": losses, "comm": {k: {"wire_bytes": b} for k, b in comm.items()}}


def test_beside_says_right_wrong_losses_and_wrong_bytes():
    formula = formula_wire_bytes("tiny", 2)
    records = {
        "single": _record([4.0, 3.5, 3.0], {}),
        "right": _record([4.0, 3.5, 3.0000001], formula),
        "drifts": _record([4.0, 3.6, 3.1], formula),
        "gathers_once": _record([4.0, 3.5, 3.0], {**formula, "all_gather": formula["all_gather"] // 2}),
    }
    right = beside(records, "right", "tiny", 2)
    assert (
        right.startswith("Your engine trained to single's losses") and f"{formula['all_gather']:,} B" in right
    )
    assert beside(records, "drifts", "tiny", 2).startswith(
        "Your engine's losses part from single's at step 1"
    )
    once = beside(records, "gathers_once", "tiny", 2)
    assert "but its wire bytes per step are all_gather" in once and "02's forward and backward checks" in once
