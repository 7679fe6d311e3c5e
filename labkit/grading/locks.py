"""Locked cells: every code cell of the pristine exercise that is not an answer cell must come back unchanged.

The check is a SHA-256 of each cell's source (line endings and trailing whitespace normalised, so saving
in another editor is not an edit), compared with the same cell id in the pristine exercise. An edit never
earns anything (the grader runs the pristine set-up, not the submission's), and it is reported.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from labkit.grading.exercises import ANSWER, role, source


def checksum(text: str) -> str:
    """SHA-256 hex digest of a cell's source, ignoring line-ending style and trailing whitespace."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    return hashlib.sha256("\n".join(lines).strip("\n").encode()).hexdigest()


@dataclass
class LockResult:
    """Ids of locked cells whose source changed and of those missing from the submission."""

    checked: int = 0
    edited: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def intact(self) -> bool:
        return not self.edited and not self.missing


def verify(pristine, submission) -> LockResult:
    """Compare every locked code cell of `pristine` with the submission's cell of the same id."""
    theirs = {c.get("id"): c for c in submission.cells}
    result = LockResult()
    for cell in pristine.cells:
        if cell.get("cell_type") != "code" or role(cell) == ANSWER:
            continue
        result.checked += 1
        other = theirs.get(cell.id)
        if other is None or other.get("cell_type") != "code":
            result.missing.append(cell.id)
        elif checksum(source(other)) != checksum(source(cell)):
            result.edited.append(cell.id)
    return result


def cell_label(pristine, cell_id: str) -> str:
    """A cell as a student finds it: 'the cell under "Heading" (id demo-state)', or its id alone."""
    heading = ""
    for cell in pristine.cells:
        if cell.get("cell_type") == "markdown":
            lines = [ln.lstrip("#").strip() for ln in source(cell).splitlines() if ln.startswith("#")]
            heading = lines[-1] if lines else heading
        if cell.get("id") == cell_id:
            return f'the cell under "{heading}" (id {cell_id})' if heading else f"cell {cell_id}"
    return f"cell {cell_id}"


def lock_entry(result: LockResult, pristine=None) -> dict:
    """The report's check entry for the locked cells: worth no points, failed when any was touched.
    With the `pristine` notebook, each cell is named by the heading above it, as the student sees it."""

    def named(ids: list[str]) -> str:
        return ", ".join(cell_label(pristine, i) if pristine is not None else i for i in ids)

    if result.intact:
        feedback = f"all {result.checked} locked cells match the exercise"
    else:
        parts = []
        if result.edited:
            parts.append(f"edited: {named(result.edited)}")
        if result.missing:
            parts.append(f"missing: {named(result.missing)}")
        feedback = (
            f"locked cells changed ({'; '.join(parts)}); they earn no points: the grade used the "
            "exercise's own version of every locked cell"
        )
    return {
        "name": "locked cells unchanged",
        "points": 0,
        "max_points": 0,
        "passed": result.intact,
        "feedback": feedback,
    }
