"""Shared by the tests that run the student release's notebooks (test modules import from here, never from
each other); the release itself is the session's `student_release` fixture (tests/conftest.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat

from labkit.course import course_path
from labkit.release import file_text, normalised_lines, telling


def learners_copy(release: Path, tmp_path: Path) -> Path:
    """A copy of the session's student release under `tmp_path`: the learner's own, to write in."""
    return Path(shutil.copytree(release, tmp_path / "student"))


def executed_from_release(release: Path, path: Path, monkeypatch, timeout_s: int = 300) -> list[str]:
    """Run `path` with papermill, the kernel importing the release's labkit; each code cell's printed text."""
    import papermill as pm

    monkeypatch.setenv("PYTHONPATH", str(release))
    out = path.with_suffix(".executed.ipynb")
    pm.execute_notebook(
        str(path),
        str(out),
        kernel_name="labkit",
        cwd=str(path.parent),
        progress_bar=False,
        execution_timeout=timeout_s,
    )
    cells = nbformat.read(out, as_version=4).cells
    return ["".join(o.get("text", "") for o in c.outputs) for c in cells if c.cell_type == "code"]


def executed_text(release: Path, path: Path, monkeypatch) -> str:
    """`executed_from_release`'s printed text, joined, under the course's own per-notebook limit."""
    return "\n".join(executed_from_release(release, path, monkeypatch, timeout_s=420))


def answer_lines_shown(release: Path, notebook: str, cell) -> tuple[set[str], list[str]]:
    """(the telling lines of build cell `cell` of `notebook` that its stub does not show, each "file: line" of
    the release that shows one of them); the release's copy of the cell must be its stub."""
    theirs = {c["id"]: c for c in json.loads((release / notebook).read_text())["cells"]}
    assert "".join(theirs[cell.id]["source"]) == cell.metadata["labkit"]["stub"].rstrip("\n")
    given = set(normalised_lines(cell.metadata["labkit"]["stub"]))
    answer = {line for line in normalised_lines(cell.source) if telling(line) and line not in given}
    shown = [
        f"{path.relative_to(release)}: {line}"
        for path in sorted(p for p in release.rglob("*") if p.is_file() and ".git" not in p.parts)
        for line in answer & set(normalised_lines(file_text(path)))
    ]
    return answer, shown


def type_in_the_filled_cells(release: Path, notebook: str) -> None:
    """The learner writes every build cell of `notebook` in the release: here, the instructor's filled cells."""
    filled = {c["id"]: c["source"] for c in json.loads(course_path(notebook).read_text())["cells"]}
    path = release / notebook
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if "build" in cell["metadata"].get("tags", []):
            cell["source"] = filled[cell["id"]]
    path.write_text(json.dumps(nb))
