"""The pristine exercises in `exercises/`: their ids and the role of each cell.

A cell's role comes from its tags in the pristine exercise: `answer` (the student fills it), `parameters`
(papermill's), `setup` (imports and fixed definitions the answers rely on), `check` (the in-notebook
check() call); every other code cell is a locked demonstration. Cells are matched to a submission's by
cell id, which Jupyter keeps when a cell is edited.
"""

from __future__ import annotations

from pathlib import Path

import nbformat

from labkit.course import course_path

ANSWER, PARAMETERS, SETUP, CHECK, LOCKED = "answer", "parameters", "setup", "check", "locked"
# Cells the grader runs, in order, in the fresh answers process: the fixed set-up, then the answers.
GRADED_ROLES = (PARAMETERS, SETUP, ANSWER)
NOTEBOOK_VERSION = 4


def exercise_dir() -> Path:
    """Where the pristine exercises live: $LABKIT_EXERCISES, else the course's `exercises/` (labkit.course)."""
    return course_path("exercises")


def exercise_id(nb) -> str | None:
    """`metadata.labkit.exercise` of a notebook, or None."""
    meta = nb.get("metadata", {}).get("labkit", {})
    value = meta.get("exercise") if isinstance(meta, dict) else None
    return value if isinstance(value, str) else None


def index(directory: Path | None = None) -> dict[str, Path]:
    """{exercise id: pristine notebook path} for every notebook in the exercise folder."""
    found = {}
    for path in sorted((directory or exercise_dir()).glob("*.ipynb")):
        ex_id = exercise_id(nbformat.read(path, as_version=NOTEBOOK_VERSION))
        if ex_id:
            found[ex_id] = path
    return found


def exercise_title(exercise_id: str, directory: Path | None = None) -> str | None:
    """`metadata.labkit.title` of the pristine exercise `exercise_id`, or None when there is none."""
    path = index(directory).get(exercise_id)
    meta = nbformat.read(path, as_version=NOTEBOOK_VERSION).metadata.get("labkit", {}) if path else {}
    return meta.get("title") if isinstance(meta, dict) else None


def role(cell) -> str:
    """The role of a pristine cell (see the module docstring); markdown cells are LOCKED prose."""
    if cell.get("cell_type") != "code":
        return LOCKED
    tags = cell.get("metadata", {}).get("tags", [])
    for name in (ANSWER, PARAMETERS, SETUP, CHECK):
        if name in tags:
            return name
    return LOCKED


def source(cell) -> str:
    text = cell.get("source", "")
    return "".join(text) if isinstance(text, list) else str(text)


def graded_cells(pristine, submission) -> tuple[list[dict], list[str]]:
    """The cells the answers process runs, as [{"id", "role", "source"}] in the pristine order, and the ids
    of answer cells the submission lacks. Set-up cells come from the pristine exercise, answers from the
    submission: an edit to a set-up cell never reaches the grade."""
    theirs = {c.get("id"): c for c in submission.cells if c.get("cell_type") == "code"}
    cells, missing = [], []
    for cell in pristine.cells:
        kind = role(cell)
        if kind not in GRADED_ROLES:
            continue
        if kind == ANSWER:
            if cell.id not in theirs:
                missing.append(cell.id)
                continue
            text = source(theirs[cell.id])
        else:
            text = source(cell)
        cells.append({"id": cell.id, "role": kind, "source": text})
    return cells, missing
