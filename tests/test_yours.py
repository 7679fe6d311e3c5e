"""Your engine from 02 in the later notebooks (labkit.buildalong.yours): read from 02's build cells, never
replaced by labkit's while a piece is a stub or fails its check (said before any run, naming the piece), and said
against single's losses and ZeRO-3's byte formula."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import nbformat
import planted
import pytest
import torch
import torch.distributed as dist
from planted import FILLED

from labkit.buildalong.cells import (
    NOTEBOOK,
    OFFLOAD_NOTEBOOK,
    PREFETCH_NOTEBOOK,
    pieces_from_notebook,
    prefetch_namespace,
)
from labkit.buildalong.learners_engine import failing_pieces, refusal
from labkit.buildalong.scaffold import Learner
from labkit.buildalong.verdicts import formula_wire_bytes
from labkit.buildalong.yours import NAME, TABLE, beside, your_engine
from labkit.course import COURSE_ENV, course_path
from labkit.engines.base import RunConfig

PIECES = pieces_from_notebook()
PLANTED = {  # the piece a mistake is in: (the pieces with it, the 02 check that fails, words of what it saw)
    "shard": (
        dataclasses.replace(PIECES, shard=lambda full, r, n: full.tensor_split(n)[r].clone()),
        "shard",
        "ceil(101/3) = 34",
    ),
    "gather": (
        dataclasses.replace(
            PIECES,
            gather=lambda s, d0, group=None: FILLED["gather"](
                s, s.shape[0] * dist.get_world_size(group), group
            ),
        ),
        "gather",
        "first d0 = 101",
    ),
    "after_forward": (
        dataclasses.replace(PIECES, after_forward=lambda unit: None),
        "forward",
        "free them in after_forward",
    ),
    "before_backward": (
        dataclasses.replace(PIECES, before_backward=lambda unit: None),
        "backward",
        "gather them again in before_backward",
    ),
    "after_grad": (
        dataclasses.replace(PIECES, after_grad=planted.after_grad(divide=False)),
        "reduce_scatter",
        "after_grad did not divide by n",
    ),
    "make_optimizer": (
        dataclasses.replace(PIECES, make_optimizer=lambda shards: torch.optim.AdamW(shards)),
        "adamw",
        "not the lab's betas=(0.9, 0.95), weight_decay=0.1",
    ),
}


@pytest.mark.slow  # a launch of 3 ranks (02's checks), then one of 2 ranks for 03's and 04's each
def test_the_filled_cells_give_an_engine_named_yours_with_the_pieces_its_settings_need():
    learner, waiting = your_engine(RunConfig(offload="cpu"))
    assert isinstance(learner, Learner) and learner.name == NAME and waiting == ""
    prefetching = prefetch_namespace()
    assert (
        learner.pieces.before_forward.__code__.co_filename
        == prefetching["before_forward"].__code__.co_filename
    )
    assert learner.pieces.make_optimizer.__code__.co_filename.startswith("<04 cell")
    plain, _ = your_engine(RunConfig(prefetch=False))
    assert plain.pieces.before_forward.__code__.co_filename.startswith("<02 cell")
    assert plain.pieces.make_optimizer.__code__.co_filename.startswith("<02 cell")
    said = your_engine(RunConfig(dtype="bfloat16"))[1]
    assert (
        said
        == f"Your engine does not do dtype 'bfloat16' (yours computes in float32), so {TABLE}: leave that setting out."
    )


def test_a_stub_in_02_names_the_piece_and_gives_no_engine(tmp_path: Path):
    nb = nbformat.read(course_path(NOTEBOOK), as_version=4)
    stubbed = 0
    for cell in nb.cells:
        if "build" in cell.metadata.get("tags", []) and "def after_grad" in cell.source:
            cell.source, stubbed = cell.metadata["labkit"]["stub"], stubbed + 1
    assert stubbed == 1
    nbformat.write(nb, tmp_path / "02.ipynb")
    learner, waiting = your_engine(RunConfig(prefetch=False), notebook=tmp_path / "02.ipynb")
    assert learner is None and waiting.startswith("Your 02 still has after_grad to write")


@pytest.mark.slow  # a launch of 3 ranks
def test_before_any_run_a_wrong_piece_is_named_with_the_02_check_to_run_again():
    # The correct pieces and one mistake in each piece, all checked in one launch of 3 ranks.
    said = dict(
        zip(
            ["correct", *PLANTED],
            failing_pieces([PIECES, *(p for p, _, _ in PLANTED.values())], TABLE),
            strict=True,
        )
    )
    assert said.pop("correct") == ""
    for piece, sentence in said.items():
        _, step, words = PLANTED[piece]
        assert f"`{piece}`" in sentence.split(" fail")[0] and f"02's `{step}` check" in sentence, sentence
        assert words in sentence and sentence.endswith("run that check cell again.") and "\n" not in sentence


@pytest.mark.slow  # a launch of 3 ranks
def test_a_wrong_piece_in_02_gives_no_engine(tmp_path: Path):
    nb = nbformat.read(course_path(NOTEBOOK), as_version=4)
    (cell,) = [c for c in nb.cells if "build" in c.metadata.get("tags", []) and "def after_grad" in c.source]
    cell.source = cell.source.replace("s.grad = summed / unit.n", "s.grad = summed")
    nbformat.write(nb, tmp_path / "02.ipynb")
    learner, said = your_engine(RunConfig(prefetch=False), notebook=tmp_path / "02.ipynb")
    assert learner is None and said.startswith("Your `after_grad` fails 02's `reduce_scatter` check"), said


PLANTED_LATER = {  # a mistake in 03's or 04's build cell: (the notebook, the line, what replaces it)
    "03": (PREFETCH_NOTEBOOK, "start_gather(unit.next)  # in flight while this unit computes", "pass"),
    "04": (OFFLOAD_NOTEBOOK, "s.copy_(h)", "pass"),
}


@pytest.mark.slow  # 02's checks (3 ranks), then 03's and 04's (2 ranks each), per planted course
@pytest.mark.parametrize("notebook", PLANTED_LATER)
def test_before_a_run_a_wrong_03_or_04_piece_is_named_with_its_check(notebook, tmp_path: Path, monkeypatch):
    """A prefetching run reads 03's moments and an offloaded one 04's optimizer: a mistake there is named before
    any run, with the check cell that sees it (03: no prefetch in the forward; 04: weights never copied back)."""
    course = tmp_path / "course"
    (course / "exercises").mkdir(parents=True)
    (course / "notebooks").mkdir()
    for nb in (NOTEBOOK, PREFETCH_NOTEBOOK, OFFLOAD_NOTEBOOK):
        (course / nb).write_text(course_path(nb).read_text())
    path, line, planted_line = PLANTED_LATER[notebook]
    text = (course / path).read_text()
    assert text.count(line) == 1
    (course / path).write_text(text.replace(line, planted_line))
    monkeypatch.setenv(COURSE_ENV, str(course))
    said = refusal(RunConfig(world_size=2, prefetch=notebook == "03", offload="cpu"), TABLE)
    pieces, check, saw = {
        "03": ("`before_forward` and `before_backward` fail", "03's `prefetch` check", "order: "),
        "04": ("`make_optimizer` fails", "04's `offload` check", "weights: "),
    }[notebook]
    assert said.startswith(f"Your {pieces} {check}, so {TABLE}: "), said
    assert saw in said and said.endswith(
        f"fix {'them' if notebook == '03' else 'it'} in {notebook} and run that check cell again."
    )
    assert "\n" not in said


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


def test_the_student_copys_engine_reads_the_notebooks_a_run_needs_and_names_what_it_does_not_do():
    """In the student copy the scratch engine is the learner's (labkit.buildalong.learners_engine): 02's cells,
    03's for a prefetching run, 04's for an offloaded one; a setting it does not do is named, never ignored."""
    from labkit.buildalong.cells import OFFLOAD_NOTEBOOK, PREFETCH_NOTEBOOK
    from labkit.buildalong.learners_engine import unsupported, written_notebooks
    from labkit.course import holds
    from labkit.engines.base import RunConfig

    assert written_notebooks(RunConfig(prefetch=False)) == (NOTEBOOK,)
    assert written_notebooks(RunConfig(offload="cpu")) == (NOTEBOOK, PREFETCH_NOTEBOOK, OFFLOAD_NOTEBOOK)
    assert (
        unsupported(RunConfig()) == unsupported(RunConfig(offload="cpu", options={"split_root": False})) == ""
    )
    said = {
        "dtype 'bfloat16'": RunConfig(dtype="bfloat16"),
        "reshard_after_forward=False": RunConfig(reshard_after_forward=False),
        "prefetch_depth 2": RunConfig(prefetch_depth=2),
        "offload 'nvme'": RunConfig(offload="nvme"),
        "activation_checkpointing = True": RunConfig(options={"activation_checkpointing": True}),
        "split_root = True": RunConfig(options={"split_root": True}),
    }
    for words, cfg in said.items():
        assert words in unsupported(cfg), (words, unsupported(cfg))
    assert holds("labkit.zero") and holds("labkit.zero.hooks") and not holds("labkit.zero.nothing")
