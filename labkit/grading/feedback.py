"""`check(exercise_id, globals())`: instant feedback inside the student's notebook.

It runs the same probes and judges as the grader, in the student's kernel, on the cells the grade would run
(the pristine set-up and the answer cells as last run, rebuilt from the kernel's history by
`labkit.grading.kernel`); it is a convenience, and the official grade never looks at it (the grader re-runs
the answer cells in a fresh process and judges them in its own). Each call draws new inputs, like the grader.
Where the grader's checks are not installed (a student release: `labkit release --student`), it runs the
public checks of `labkit.grading.public` instead, and says so.
"""

from __future__ import annotations

import secrets
import tempfile
from pathlib import Path

import nbformat

from labkit.grading import integrity, kernel, public
from labkit.grading.exercises import ANSWER, exercise_dir, exercise_title, index
from labkit.grading.kit import Exercise, judge_all, load, probe_all
from labkit.grading.report import format_points


def check(exercise_id: str, namespace: dict, seed: int | None = None) -> None:
    """Probe the answers in `namespace` (pass `globals()`), judge them, and print one line per check.

    In a Jupyter kernel (`namespace` holds IPython's input history, `In`) it judges what the grade would run:
    the pristine set-up and the answer cells as last run, in a fresh namespace (`labkit.grading.kernel`), and
    warns when an answer uses a name only another cell defines, or a locked cell ran edited. The integrity
    rule applies as in the grade (`integrity.flags`): an answer cell that uses labkit's own implementation,
    in its source or as it runs (`integrity.UseWatch`, while the cells and the probes run), earns nothing."""
    exercise, note = _checks(exercise_id)
    seed = secrets.randbelow(2**31) if seed is None else seed
    names = {n for c in exercise.checks for n in c.answers}
    cells, warnings = _as_graded(exercise_id, namespace, names)
    answer_ids = [c["id"] for c in cells if c["role"] == ANSWER]
    with tempfile.TemporaryDirectory(prefix="labkit-check-") as tmp:
        log = Path(tmp) / "uses.log"
        watch = integrity.UseWatch(exercise.forbidden, exercise.allowed, answer_ids, log).install()
        try:
            namespace, cell_errors = kernel.run_cells(cells) if cells else (namespace, [])
            origins = integrity.answer_origins(namespace, names, exercise.forbidden, exercise.allowed)
            observations = probe_all(exercise, namespace, seed)
        finally:
            watch.remove()
        uses = watch.found()
    flags, _found = integrity.flags(exercise, cells, origins, uses)
    for c in exercise.checks:  # after a kernel restart nothing is defined until its cell runs again
        missing = [f"`{name}`" for name in c.answers if name not in namespace]
        if missing and c.name not in flags:
            flags[c.name] = (
                f"{', '.join(missing)} not defined in this kernel: run its answer cell again (after a kernel "
                "restart, run the cells above it first)"
            )
    entries = judge_all(exercise, observations, seed, cell_errors, flags=flags)
    score = sum(e["points"] for e in entries)
    print(f"{exercise.title}: {format_points(round(score, 2))}/{exercise.max_score} ({note})")
    for e in entries:
        mark = "ok " if e["passed"] else "no "
        print(f"  {mark} {format_points(e['points'])}/{e['max_points']}  {e['name']}: {e['feedback']}")
    for warning in warnings:
        print(f"  warning: {warning}")


def _as_graded(exercise_id: str, namespace: dict, answer_names: set[str]) -> tuple[list[dict], list[str]]:
    """(the cells the grade would run, rebuilt from the kernel's history, and warnings), or no cells when there
    is no history or no pristine exercise at hand (labkit installed without the course, or the grader's
    sandbox, which hides it): `namespace` is then probed as it is."""
    history = namespace.get("In")
    try:
        path = index(exercise_dir()).get(exercise_id)
    except ValueError:  # no course folder
        path = None
    if not isinstance(history, list) or path is None:
        return [], []
    rebuilt = kernel.rebuild(nbformat.read(path, as_version=4), history, set(namespace), answer_names)
    return rebuilt.cells, rebuilt.warnings


def _checks(exercise_id: str) -> tuple[Exercise, str]:
    """The grader's checks where installed, else the public ones; and the note the first line ends with."""
    try:
        return load(exercise_id), "feedback only; the grader re-runs your answer cells"
    except LookupError:
        title = exercise_title(exercise_id, exercise_dir()) or exercise_id
        note = "public checks only: the grade runs your answer cells again, on cases you have not seen"
        return public.load(exercise_id, title), note
