"""Grading of exercise notebooks: papermill runs a submission in its own process; its answers are probed
in a second, fresh process; the grader judges what came back against references it computes itself.

    exercises.py  the pristine exercises: ids, and the role of each cell (answer, setup, parameters, ...)
    locks.py      locked cells: a checksum of each one's source against the pristine exercise
    sandbox.py    a child in its own session with a hard wall-clock limit, killed with all it started
    runner.py     the papermill execution of a working copy (evidence; timeout and dead-kernel status)
    extract.py    the fresh answers process: pristine set-up + the student's answer cells, then the probes
    checks/       one module per exercise: each check's probe and judge
    grader.py     one submission or a folder, start to end; the score is summed there
    report.py     the JSON report and the gradebook CSV
    feedback.py   check() inside the notebook, for the student only

`labkit grade` (labkit/cli/grade.py) is the command line; docs/grading.md says why the grade can be trusted.
"""

from __future__ import annotations

from typing import Any

__all__ = ["grade_folder", "grade_submission"]


def __getattr__(name: str) -> Any:
    # Lazy, so that the answers process and a notebook's check() import only the checks they need.
    if name in __all__:
        from labkit.grading import grader

        return getattr(grader, name)
    raise AttributeError(f"module 'labkit.grading' has no attribute {name!r}")
