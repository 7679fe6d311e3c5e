"""Grade one submission, or a folder of them, start to end. The score is summed here, from judges run here.

    1. read the file as a notebook and find its exercise id (metadata.labkit.exercise) among the pristine ones
    2. compare its locked cells with the pristine exercise (locks.py)
    3. execute a working copy with papermill in a child process, hard time limit (runner.py): the evidence
    4. run the pristine set-up and the submission's answer cells in a fresh child process and probe the
       answers there (extract.py)
    5. judge each observation here, in the grader, against references computed here (checks/)
Nothing the notebook printed or wrote is read as a grade; the grader never executes the student's code.
"""

from __future__ import annotations

import json
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import nbformat

from labkit.grading import exercises, locks, report, runner, sandbox
from labkit.grading.checks import Exercise, judge_all, load

DEFAULT_TIMEOUT_S = 300.0
EVIDENCE_SUFFIX = ".executed.ipynb"
REPORT_SUFFIX = ".report.json"
_LOG_TAIL_CHARS = 300


def default_report_path(submission: Path) -> Path:
    """`hw.ipynb` -> `hw.report.json` beside it."""
    return submission.with_name(submission.name.removesuffix(".ipynb") + REPORT_SUFFIX)


def evidence_path(report_path: Path, submission: Path) -> Path:
    """Where the executed notebook is kept: beside the report, named after the submission."""
    return report_path.parent / (submission.name.removesuffix(".ipynb") + EVIDENCE_SUFFIX)


def _not_graded(exercise: Exercise, reason: str) -> list[dict]:
    return [
        {
            "name": c.name,
            "points": 0,
            "max_points": c.points,
            "passed": False,
            "feedback": f"not graded: {reason}",
        }
        for c in exercise.checks
    ]


def _read_json(path: Path) -> dict:
    """A JSON object a child wrote, or {} when it is missing or malformed (children are not trusted)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _log_tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return ""
    lines = [line for line in text.splitlines() if line.strip() and "WARNING" not in line]
    return lines[-1][-_LOG_TAIL_CHARS:] if lines else ""


def grade_submission(
    submission: Path,
    report_path: Path | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    catalog: dict[str, Path] | None = None,
) -> dict:
    """Grade `submission`; write its report (default `default_report_path`) and keep the executed notebook
    beside it. `timeout_s` (seconds, wall clock) limits each of the two runs of the student's code: the
    papermill execution and the answers process. Returns the report dict; never raises for a bad submission.
    """
    submission = Path(submission)
    report_path = Path(report_path) if report_path else default_report_path(submission)
    start = time.monotonic()
    extra: dict = {}

    def finish(
        status: str, checks: list[dict], reason: str = "", exercise_id: str | None = None, **kw
    ) -> dict:
        result = report.build(
            submission.name, exercise_id, status, checks, time.monotonic() - start, reason, **kw, **extra
        )
        report.write(result, report_path)
        return result

    try:
        nb = nbformat.reads(submission.read_text(encoding="utf-8"), as_version=exercises.NOTEBOOK_VERSION)
    except Exception as e:  # noqa: BLE001 (not JSON, not a notebook, unreadable: all the same to the gradebook)
        why = " ".join(str(e).split())[:200] or type(e).__name__
        return finish("error", [], f"not a readable notebook ({type(e).__name__}: {why})", max_score=0)
    exercise_id = exercises.exercise_id(nb)
    if exercise_id is None:
        return finish(
            "error",
            [],
            "the notebook has no metadata.labkit.exercise: it is not a labkit exercise",
            max_score=0,
        )
    catalog = exercises.index() if catalog is None else catalog
    if exercise_id not in catalog:
        known = ", ".join(sorted(catalog)) or "none"
        return finish(
            "error", [], f"unknown exercise id {exercise_id!r}; known ids: {known}", exercise_id, max_score=0
        )
    try:
        exercise = load(exercise_id)
    except LookupError as e:
        return finish("error", [], str(e), exercise_id, max_score=0)
    pristine = nbformat.read(catalog[exercise_id], as_version=exercises.NOTEBOOK_VERSION)
    lock_entry = locks.lock_entry(locks.verify(pristine, nb))
    evidence = evidence_path(report_path, submission)

    with tempfile.TemporaryDirectory(prefix="labkit-grade-") as tmp:
        tmp = Path(tmp)
        work, answers = tmp / "work", tmp / "answers"
        work.mkdir()
        answers.mkdir()
        copy = work / submission.name
        shutil.copyfile(submission, copy)
        executed = tmp / EVIDENCE_SUFFIX.lstrip(".")
        run_result = tmp / "run.json"
        cmd = [sys.executable, "-m", "labkit.grading.runner", str(copy), str(executed), str(run_result)]
        ran = sandbox.run(cmd, work, timeout_s, tmp / "run.log")
        extra["timings_s"] = {"notebook": round(ran.wall_s, 3)}
        if executed.exists():
            evidence.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(executed, evidence)
            extra["executed_notebook"] = str(evidence)
        said = _read_json(run_result)
        if ran.returncode == 0:
            extra["cells_raised"] = said.get("raised", [])

        if ran.timed_out:
            cell = runner.last_started_cell(executed) if executed.exists() else None
            where = f" (stopped while running cell {cell!r})" if cell else ""
            reason = f"the notebook did not finish within --timeout {timeout_s:g} s{where}"
            return finish("timeout", [*_not_graded(exercise, reason), lock_entry], reason, exercise_id)
        if ran.returncode != 0:
            reason = str(
                said.get("reason") or f"the notebook run {ran.describe()}: {_log_tail(tmp / 'run.log')}"
            )
            return finish("error", [*_not_graded(exercise, reason), lock_entry], reason, exercise_id)

        seed = secrets.randbelow(2**31)
        extra["seed"] = seed
        cells, missing = exercises.graded_cells(pristine, nb)
        job, out = tmp / "job.json", tmp / "observations.json"
        job.write_text(json.dumps({"exercise": exercise_id, "seed": seed, "cells": cells}))
        cmd = [sys.executable, "-m", "labkit.grading.extract", str(job), str(out)]
        probed = sandbox.run(cmd, answers, timeout_s, tmp / "answers.log")
        extra["timings_s"]["answers"] = round(probed.wall_s, 3)
        if probed.timed_out:
            reason = f"the answer cells did not finish within --timeout {timeout_s:g} s when run again on their own"
            return finish("timeout", [*_not_graded(exercise, reason), lock_entry], reason, exercise_id)
        data = _read_json(out) if probed.returncode == 0 else {}
        if "observations" not in data:
            reason = f"the answer cells, run again on their own, {probed.describe()}: {_log_tail(tmp / 'answers.log')}"
            return finish("error", [*_not_graded(exercise, reason), lock_entry], reason, exercise_id)

    judged = time.monotonic()
    notes = [f"answer cell {cell_id!r} is missing from the submission" for cell_id in missing]
    cells_run = data.get("cells")
    for cell in cells_run if isinstance(cells_run, list) else []:
        if isinstance(cell, dict) and cell.get("error"):
            notes.append(f"cell {cell.get('id')!r} raised {cell['error']}")
    checks = judge_all(exercise, data.get("observations", {}), seed, notes)
    extra["timings_s"]["judge"] = round(time.monotonic() - judged, 3)
    return finish("graded", [*checks, lock_entry], "", exercise_id)


def submissions(directory: Path) -> list[Path]:
    """The notebooks of a folder to grade: `*.ipynb` at its top level, except kept evidence."""
    return sorted(p for p in Path(directory).glob("*.ipynb") if not p.name.endswith(EVIDENCE_SUFFIX))


def reports_dir(gradebook: Path) -> Path:
    """`grades.csv` -> `grades-reports/` beside it: one report and one executed notebook per submission."""
    return gradebook.parent / f"{gradebook.stem}-reports"


def grade_folder(
    directory: Path,
    gradebook: Path,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    jobs: int = 1,
    progress: Callable[[str], None] | None = None,
) -> list[dict]:
    """Grade every submission of `directory` with `jobs` at a time; write the gradebook CSV and a report per
    submission under `reports_dir(gradebook)`. `progress` gets one line per submission as it finishes.
    Returns the reports in file order. One submission's failure never stops the others."""
    files = submissions(directory)
    out_dir = reports_dir(Path(gradebook))
    catalog = exercises.index()
    for ex_id in catalog:
        load(ex_id)  # import every check module before any student code has run anywhere

    def one(path: Path) -> dict:
        target = out_dir / (path.name.removesuffix(".ipynb") + REPORT_SUFFIX)
        try:
            return grade_submission(path, target, timeout_s, catalog)
        except Exception as e:  # noqa: BLE001 (a grader bug on one file is reported on that file's row)
            failed = report.build(
                path.name, None, "error", [], 0.0, f"the grader failed: {type(e).__name__}: {e}", 0
            )
            report.write(failed, target)
            return failed

    results: dict[Path, dict] = {}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(one, path): path for path in files}
        for done, future in enumerate(as_completed(futures), 1):
            path = futures[future]
            results[path] = future.result()
            if progress:
                progress(f"[{done}/{len(files)}] {path.name}  {report.summary_line(results[path])}")
    ordered = [results[p] for p in files]
    report.write_gradebook(ordered, Path(gradebook))
    return ordered
