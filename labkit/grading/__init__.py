"""Grading of exercise notebooks: papermill runs a submission in its own process; its answers are probed
in a second, fresh process; the grader judges what came back against references it computes itself.

    exercises.py  the pristine exercises: ids, and the role of each cell (answer, setup, parameters, ...)
    locks.py      locked cells: a checksum of each one's source against the pristine exercise
    integrity.py  the rule that an answer cell must not use labkit's own implementation of it
    sandbox.py    a child in its own session with a hard wall-clock limit, contained (cgroups, rlimits via
                  _contain.py, bubblewrap), killed with all it started
    runner.py     the papermill execution of a working copy (evidence; how it ended)
    extract.py    the fresh answers process: pristine set-up + the student's answer cells, each under a limit,
                  then each group of probes in a forked child under its own limit
    ranks.py      a probe's ranks, with every collective on record: a mismatch said in one sentence
    kit.py        what a check is (Check, Exercise), loading, probing and judging them, the checks' helpers
    checks/       one module per exercise: each check's probe and judge, edge cases first, seeded
    grader.py     one submission or a folder, start to end; the seed is derived and the score summed there
    report.py     the JSON report, the student's feedback page, the gradebook and Canvas's import CSV
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
