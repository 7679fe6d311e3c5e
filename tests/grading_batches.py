"""Shared by the grading tests (test modules import from here, never from each other): notebooks read and
planted, a kernel's globals after a notebook's cells, check() beside the grade, and ONE grading run that
several modules read (`register`, `grade_registered`).

The shared run: each module registers its exercise's solution and the other submissions it wants graded
`--answers-only` (test_capstone.py, test_exercise08.py); the first test that asks for `shared_grades`
(tests/conftest.py) grades every registered submission with two `labkit grade DIR --gradebook` runs at
once: the solutions the whole way (their notebooks run too) and one `--answers-only --jobs 2` batch of the
rest, each solution again among them. Collection imports every module first, so the run holds what the
session's modules registered, and no more when one module runs alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import nbformat

from labkit.grading import exercises, grader
from labkit.grading.kit import judge_all, load

ROOT = Path(__file__).resolve().parents[1]
ANSWERS_ONLY = "solution, answers only"  # the key of the solution's grade from the answers-only batch
WHOLE_TIMEOUT_S = 240  # each solution's notebook run in the shared batch; generous: 2 shared cores
# A file `<group>--<name>.ipynb` is student <name>'s: the seed each submission draws is its name's alone.
STUDENT_PATTERN = r"^(?:\w+--)?(?P<student>.+?)(?:\.ipynb)?$"
_WHOLE: dict[str, nbformat.NotebookNode] = {}  # {file stem: notebook} graded the whole way
_ANSWERS: dict[str, nbformat.NotebookNode] = {}  # {file stem: notebook} graded --answers-only


def read(path: Path):
    return nbformat.read(path, as_version=4)


def labkit_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "labkit", *args], capture_output=True, text=True, timeout=timeout
    )


def lock_entry(report: dict) -> dict:
    return next(c for c in report["checks"] if c["name"] == "locked cells unchanged")


def answer_checks(report: dict) -> list[dict]:
    return [c for c in report["checks"] if c["name"] != "locked cells unchanged"]


def plant(path: Path, edits: list[tuple[str, str, str]]):
    """The notebook at `path` with each (answer cell id, text of the solution, what the mistake writes
    instead) edit made; each edit must find its text."""
    nb = read(path)
    for cell_id, old, new in edits:
        cell = next(c for c in nb.cells if c.id == cell_id)
        assert old in cell.source, (cell_id, old)
        cell.source = cell.source.replace(old, new)
    return nb


# ------------------------------------------------------------------------------ the shared grading run


def register(group: str, solution: Path, others: dict) -> None:
    """Have the shared run grade `solution` the whole way and, `--answers-only`, again beside `others`
    ({name: notebook}); `reports_of(shared, group)` reads them back under these names."""
    _WHOLE[f"{group}--solution"] = read(solution)
    _ANSWERS[f"{group}--solution"] = read(solution)
    for name, nb in others.items():
        _ANSWERS[f"{group}--{name}"] = nb


def grade_registered(root: Path) -> dict[str, dict]:
    """{file stem: report} of every registered submission: two `labkit grade DIR --gradebook` runs at once
    (the solutions the whole way under WHOLE_TIMEOUT_S, one at a time; the rest `--answers-only --jobs 2`)."""
    start = time.monotonic()
    runs = []
    for folder, notebooks in ((root / "whole", _WHOLE), (root / "answers", _ANSWERS)):
        folder.mkdir()
        for stem, nb in notebooks.items():
            nbformat.write(nb, folder / f"{stem}.ipynb")
        _assert_graded_as_a_mixed_folder(folder)
        flags = (
            ("--timeout", str(WHOLE_TIMEOUT_S)) if notebooks is _WHOLE else ("--answers-only", "--jobs", "2")
        )
        cmd = [sys.executable, "-m", "labkit", "grade", str(folder), "--gradebook", f"{folder}.csv"]
        cmd += ["--student-pattern", STUDENT_PATTERN, *flags]
        runs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for run in runs:
        _out, err = run.communicate(timeout=1800)
        assert run.returncode == 0, err
    reports = {
        f"{folder}:{p.name.removesuffix('.report.json')}": json.loads(p.read_text())
        for folder in ("whole", "answers")
        for p in (root / f"{folder}-reports").glob("*.report.json")
    }
    print(
        f"\nshared grading run: {len(_WHOLE)} whole, {len(_ANSWERS)} answers only: {time.monotonic() - start:.1f} s"
    )
    return reports


def _assert_graded_as_a_mixed_folder(folder: Path) -> None:
    """`labkit grade` takes a folder whose notebooks are mostly one exercise's for that exercise's (the others
    then error rows): the shared folder must be one exercise's alone or mixed below that share."""
    files = grader.submissions(folder)
    majority, ids = grader.folder_exercise(files)
    assert majority is None or set(ids) == {majority}, (
        f"{folder.name}: {dict(ids)} would be graded as {majority}'s folder; register fewer of its submissions"
    )


def reports_of(shared: dict[str, dict], group: str) -> dict[str, dict]:
    """{name: report} of `group`'s registered submissions: "solution" the whole way, ANSWERS_ONLY the same
    solution's answers-only grade, and each other name's answers-only grade."""
    prefix = f"answers:{group}--"
    out = {key.removeprefix(prefix): r for key, r in shared.items() if key.startswith(prefix)}
    out[ANSWERS_ONLY] = out.pop("solution")
    out["solution"] = shared[f"whole:{group}--solution"]
    return out


def assert_answers_only_grades_as_the_whole_run(reports: dict[str, dict]) -> None:
    """The solution's two grades (`reports_of`): the same seed and points per check; only one notebook run."""
    whole, answers_only = reports["solution"], reports[ANSWERS_ONLY]
    assert answers_only["seed"] == whole["seed"]  # the same student: the same hidden cases
    assert [(c["name"], c["points"]) for c in answers_only["checks"]] == [
        (c["name"], c["points"]) for c in whole["checks"]
    ]
    assert "executed_notebook" in whole and "executed_notebook" not in answers_only
    assert answers_only["notebook_run"].startswith("not run (--answers-only)")
    assert answers_only["timings_s"]["notebook"] == 0 < whole["timings_s"]["notebook"]
    assert answers_only["limits_s"]["total"] == answers_only["limits_s"]["answers"]


# ------------------------------------------------------------------------------ check() beside the grade


def run_cells(cells: list[str]) -> dict:
    """A kernel's globals after running `cells` in order, with IPython's input history `In` beside them."""
    namespace: dict = {"__name__": "__main__"}
    for text in cells:
        exec(text, namespace)
    namespace["In"] = ["", *cells]
    return namespace


def graded_kernel(nb) -> dict:
    """A kernel's globals after the cells the grade runs of notebook `nb` (parameters, set-up, answers)."""
    return run_cells(
        [c.source for c in nb.cells if c.cell_type == "code" and exercises.role(c) in exercises.GRADED_ROLES]
    )


def public_entries(exercise_id: str, namespace: dict, seed: int = 3) -> list[dict]:
    """The report entries of the student release's check() (the public checks), probed and judged here on
    `namespace` (`graded_kernel`)."""
    from labkit.grading import public
    from labkit.grading.kit import probe_all

    exercise = public.load(exercise_id, exercise_id)
    return judge_all(exercise, probe_all(exercise, namespace, seed), seed)


def public_and_grade(exercise_id: str, nb, seed: int = 3) -> tuple[list[dict], list[dict]]:
    """The report entries of the student release's check() (the public checks) and of the grade's checks,
    both probed and judged here on the graded cells of `nb`."""
    from labkit.grading.kit import probe_all

    namespace = graded_kernel(nb)
    exercise = load(exercise_id)
    shown = public_entries(exercise_id, namespace, seed)
    return shown, judge_all(exercise, probe_all(exercise, namespace, seed), seed)


def assert_check_and_grade_agree(
    exercise_id: str, nb, says: str | tuple[str, str] = "", graded: list[dict] | None = None
) -> tuple[list[dict], list[dict]]:
    """A planted mistake (`says`: a phrase its feedback names, or the grade's and check()'s own phrases where
    the grade compares with the engine and check() states the rule) loses points in the grade and fails a line
    of check(), naming it in both; the solution (`says` empty) passes both in full. `graded`: the grade's
    entries for `nb` where a `labkit grade` run already graded it (its report's answer checks), else the
    grade's checks run here."""
    if graded is None:
        shown, graded = public_and_grade(exercise_id, nb)
    else:
        shown = public_entries(exercise_id, graded_kernel(nb))
    if not says:
        assert all(e["passed"] for e in shown + graded), (shown, graded)
        return shown, graded
    in_grade, in_check = (says, says) if isinstance(says, str) else says
    lost = [e for e in graded if e["points"] < e["max_points"]]
    failing = [e for e in shown if not e["passed"]]
    assert lost and failing, (exercise_id, shown, graded)
    assert any(in_grade in e["feedback"] for e in lost), (in_grade, lost)
    assert any(in_check in e["feedback"] for e in failing), (in_check, failing)
    return shown, graded
