"""`check(exercise_id, globals())`: instant feedback inside the student's notebook.

It runs the same probes and judges as the grader, but in the student's kernel, on whatever that kernel
holds; it is a convenience, and the official grade never looks at it (the grader re-runs the answer cells
in a fresh process and judges them in its own). Each call draws new inputs, like the grader does.
Where the grader's checks are not installed (a student release: `labkit release --student`), it runs the
public checks of `labkit.grading.public` instead, and says so.
"""

from __future__ import annotations

import secrets

from labkit.grading import integrity, public
from labkit.grading.checks import Exercise, judge_all, load, probe_all
from labkit.grading.exercises import exercise_dir, exercise_title
from labkit.grading.report import format_points


def check(exercise_id: str, namespace: dict, seed: int | None = None) -> None:
    """Probe the answers in `namespace` (pass `globals()`), judge them, and print one line per check.

    An answer that is labkit's own implementation earns nothing here either (the integrity rule)."""
    exercise, note = _checks(exercise_id)
    seed = secrets.randbelow(2**31) if seed is None else seed
    names = {n for c in exercise.checks for n in c.answers}
    origins = integrity.answer_origins(namespace, names, exercise.forbidden, exercise.allowed)
    flags = {
        c.name: f"no points: `{name}` is {origins[name]}, labkit's own implementation; write it yourself"
        for c in exercise.checks
        for name in c.answers
        if name in origins
    }
    for c in exercise.checks:  # after a kernel restart nothing is defined until its cell runs again
        missing = [f"`{name}`" for name in c.answers if name not in namespace]
        if missing and c.name not in flags:
            flags[c.name] = (
                f"{', '.join(missing)} not defined in this kernel: run its answer cell again (after a kernel "
                "restart, run the cells above it first)"
            )
    entries = judge_all(exercise, probe_all(exercise, namespace, seed), seed, flags=flags)
    score = sum(e["points"] for e in entries)
    print(f"{exercise.title}: {format_points(round(score, 2))}/{exercise.max_score} ({note})")
    for e in entries:
        mark = "ok " if e["passed"] else "no "
        print(f"  {mark} {format_points(e['points'])}/{e['max_points']}  {e['name']}: {e['feedback']}")


def _checks(exercise_id: str) -> tuple[Exercise, str]:
    """The grader's checks where installed, else the public ones; and the note the first line ends with."""
    try:
        return load(exercise_id), "feedback only; the grader re-runs your answer cells"
    except LookupError:
        title = exercise_title(exercise_id, exercise_dir()) or exercise_id
        note = "public checks only: the grade runs your answer cells again, on cases you have not seen"
        return public.load(exercise_id, title), note
