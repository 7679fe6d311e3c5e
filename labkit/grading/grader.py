"""Grade one submission, or a folder of them, start to end. The score is summed here, from judges run here.

    1. read the file as a notebook and find its exercise id (metadata.labkit.exercise) among the pristine ones
    2. compare its locked cells with the pristine exercise (locks.py); read its answer cells for labkit's own
       implementation (integrity.py)
    3. execute a working copy with papermill in a contained child process under --timeout (runner.py): the
       evidence, and what the student saw; its outcome is reported, it decides nothing
    4. run the pristine set-up and the submission's answer cells in a fresh contained child, each cell and
       each group of probes under its own limit (extract.py), on cases drawn from the submission's seed
    5. judge each observation here, in the grader, against references computed here (checks/)
Nothing the notebook printed or wrote is read as a grade; the grader never executes the student's code.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path

import nbformat

import labkit
from labkit.grading import exercises, integrity, locks, report, runner, sandbox
from labkit.grading.extract import DEFAULT_CELL_LIMIT_S
from labkit.grading.kit import Exercise, group_limit_s, judge_all, load, submission_seed

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_MAX_PROCESSES = 1024  # tasks (threads count) per child, where a pids cgroup can be made
ANSWERS_START_S = 60.0  # the answers process's own start-up (Python, the check module) in its time bound
GROUP_MARGIN_S = 5.0  # per group of probes: the fork, the stack dump of a stopped one
FOLDER_MAJORITY = 0.75  # one exercise id on more than this share of a folder makes it that exercise's folder
EVIDENCE_SUFFIX = ".executed.ipynb"
NOT_RUN = "not run (--answers-only): the grade comes from the answer cells, run on their own as always"
REPORT_SUFFIX = ".report.json"
FEEDBACK_SUFFIX = ".feedback.md"
DEFAULT_STUDENT_PATTERN = r"^(?P<student>.+?)(?:\.ipynb)?$"  # the file name without .ipynb
_LOG_TAIL_CHARS = 300


@dataclass(frozen=True)
class Options:
    """How to grade: limits (seconds, bytes), the class seed, and what the folder is for.

    `timeout_s` bounds the notebook run; `check_timeout_s` replaces every check's own limit when given;
    `cell_timeout_s` bounds each answer or set-up cell in the answers process. `run_notebook`: False skips
    step 3 (no papermill run, no executed copy): the grade is the same, since that run decides nothing."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    check_timeout_s: float | None = None
    cell_timeout_s: float = DEFAULT_CELL_LIMIT_S
    class_seed: int = 0
    limits: sandbox.Limits = field(
        default_factory=lambda: sandbox.Limits(max_processes=DEFAULT_MAX_PROCESSES)
    )
    exercise: str | None = None  # the folder's exercise: a submission of another one is an error row
    student_pattern: str = DEFAULT_STUDENT_PATTERN
    student: str | None = None  # this submission's student, when the caller knows it
    run_notebook: bool = True


def default_report_path(submission: Path) -> Path:
    """`hw.ipynb` -> `hw.report.json` beside it."""
    return submission.with_name(submission.name.removesuffix(".ipynb") + REPORT_SUFFIX)


def evidence_path(report_path: Path, submission: Path) -> Path:
    """Where the executed notebook is kept: beside the report, named after the submission."""
    return report_path.parent / (submission.name.removesuffix(".ipynb") + EVIDENCE_SUFFIX)


def feedback_path(report_path: Path) -> Path:
    """`alice.report.json` -> `alice.feedback.md` beside it: the page to hand back to the student."""
    return report_path.with_name(report_path.name.removesuffix(REPORT_SUFFIX) + FEEDBACK_SUFFIX)


def student_id(file_name: str, pattern: str = DEFAULT_STUDENT_PATTERN) -> tuple[str, str]:
    """(student id, warning) from a file name: the pattern's `student` group (or its first group)."""
    m = re.search(pattern, file_name)
    stem = file_name.removesuffix(".ipynb")
    if not m:
        return stem, f"the file name does not match --student-pattern {pattern!r}: the student id is {stem!r}"
    value = m.groupdict().get("student") or (m.group(1) if m.groups() else m.group(0))
    return (value or stem), ""


def time_bound_s(exercise: Exercise, n_cells: int, options: Options) -> dict[str, float]:
    """Worst-case seconds of each child: the notebook run and the answers process (then the judges, trusted)."""
    groups = sum(group_limit_s(g, options.check_timeout_s) + GROUP_MARGIN_S for g in exercise.groups())
    answers = ANSWERS_START_S + n_cells * options.cell_timeout_s + groups
    notebook = options.timeout_s if options.run_notebook else 0.0
    return {"notebook": notebook, "answers": round(answers, 1), "total": round(notebook + answers, 1)}


def _size_text(size: int | None) -> str:
    """2147483648 -> '2 GiB'."""
    value, unit = float(size or 0), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:g} {unit}"


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


def _read_text(path: Path, limit: int = 200) -> str:
    try:
        return path.read_text(errors="replace").strip()[:limit]
    except OSError:
        return ""


def _log_tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return ""
    lines = [line for line in text.splitlines() if line.strip() and "WARNING" not in line]
    return lines[-1][-_LOG_TAIL_CHARS:] if lines else ""


class _Submission:
    """One grading, its facts gathered as it goes and written out once (`finish`)."""

    def __init__(self, path: Path, report_path: Path, options: Options, catalog: dict[str, Path]):
        self.path, self.report_path, self.options, self.catalog = path, report_path, options, catalog
        self.start = time.monotonic()
        student, warning = (
            (options.student, "") if options.student else student_id(path.name, options.student_pattern)
        )
        self.extra: dict = {
            "student": student,
            "submitted_at": "",
            "class_seed": options.class_seed,
            "labkit_version": labkit.__version__,
            "warnings": [warning] if warning else [],
            "notes": [],
            "limits_hit": [],
        }
        try:
            self.extra["submitted_at"] = report.utc_iso(path.stat().st_mtime)
        except OSError:
            pass
        self.title = ""
        self.pristine = None

    def finish(
        self,
        status: str,
        checks: list[dict],
        reason: str = "",
        exercise_id: str | None = None,
        max_score: float | None = None,
    ) -> dict:
        if exercise_id is None and self.options.exercise:
            exercise_id = self.options.exercise  # an error row still names the folder's exercise and its max
        if max_score is None and not checks and exercise_id in self.catalog:
            max_score = load(exercise_id).max_score
        result = report.build(
            self.path.name,
            exercise_id,
            status,
            checks,
            time.monotonic() - self.start,
            reason,
            max_score if max_score is not None else (0 if not checks else None),
            **self.extra,
        )
        result["feedback_file"] = str(feedback_path(self.report_path))
        report.write(result, self.report_path)
        feedback_path(self.report_path).write_text(report.feedback_markdown(result, self.title))
        return result


def grade_submission(
    submission: Path,
    report_path: Path | None = None,
    timeout_s: float | None = None,
    catalog: dict[str, Path] | None = None,
    options: Options | None = None,
) -> dict:
    """Grade `submission`; write its report (default `default_report_path`), its feedback page and the
    executed notebook beside it. Returns the report dict; never raises for a bad submission."""
    options = options or Options()
    if timeout_s is not None:
        options = replace(options, timeout_s=timeout_s)
    submission = Path(submission)
    report_path = Path(report_path) if report_path else default_report_path(submission)
    catalog = exercises.index() if catalog is None else catalog
    sub = _Submission(submission, report_path, options, catalog)
    try:
        nb = nbformat.reads(submission.read_text(encoding="utf-8"), as_version=exercises.NOTEBOOK_VERSION)
    except Exception as e:  # noqa: BLE001 (not JSON, not a notebook, unreadable: all the same to the gradebook)
        why = " ".join(str(e).split())[:200] or type(e).__name__
        return sub.finish("error", [], f"not a readable notebook ({type(e).__name__}: {why})")
    exercise_id = exercises.exercise_id(nb)
    if exercise_id is None:
        return sub.finish(
            "error", [], "the notebook has no metadata.labkit.exercise: it is not a labkit exercise"
        )
    if exercise_id not in catalog:
        known = ", ".join(sorted(catalog)) or "none"
        return sub.finish("error", [], f"unknown exercise id {exercise_id!r}; known ids: {known}")
    if options.exercise and exercise_id != options.exercise:
        sub.extra["submitted_exercise"] = exercise_id
        sub.extra["warnings"].append(f"a submission of {exercise_id}, not {options.exercise}")
        return sub.finish(
            "error",
            [],
            f"this notebook is exercise {exercise_id!r}, not {options.exercise!r}, which "
            "this folder is graded for; grade it with its own exercise (or pass --exercise)",
        )
    try:
        exercise = load(exercise_id)
    except LookupError as e:
        return sub.finish("error", [], str(e), exercise_id, max_score=0)
    sub.title = exercise.title
    pristine = sub.pristine = nbformat.read(catalog[exercise_id], as_version=exercises.NOTEBOOK_VERSION)
    lock_result = locks.verify(pristine, nb)
    lock_entry = locks.lock_entry(lock_result, pristine)
    if not lock_result.intact:
        sub.extra["notes"].append(lock_entry["feedback"])
    seed = submission_seed(options.class_seed, exercise_id, sub.extra["student"])
    sub.extra["seed"] = seed
    cells, missing = exercises.graded_cells(pristine, nb)
    sub.extra["limits_s"] = time_bound_s(exercise, len(cells), options)
    with tempfile.TemporaryDirectory(prefix="labkit-grade-") as tmp:
        outcome = _grade_in(Path(tmp), sub, exercise, cells, seed)
    if isinstance(outcome, dict):
        return outcome
    data, answers_outcome = outcome
    return _judge(sub, exercise, data, answers_outcome, cells, missing, seed, lock_entry)


def _run_notebook(tmp: Path, sub: _Submission) -> None:
    """The papermill run, for the evidence and the record of how it went (which never decides the grade)."""
    run = tmp / "run"
    run.mkdir()
    copy = run / sub.path.name
    shutil.copyfile(sub.path, copy)
    executed, result = run / "executed.ipynb", run / "run.json"
    cmd = [sys.executable, "-m", "labkit.grading.runner", str(copy), str(executed), str(result)]
    ran = sandbox.run(cmd, run, sub.options.timeout_s, tmp / "run.log", limits=sub.options.limits)
    sub.extra["timings_s"] = {"notebook": round(ran.wall_s, 3)}
    sub.extra["containment"] = ran.containment
    if executed.exists():
        evidence = evidence_path(sub.report_path, sub.path)
        evidence.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(executed, evidence)
        sub.extra["executed_notebook"] = str(evidence)
    said = _read_json(result)
    if ran.timed_out:
        cell = runner.last_started_cell(executed) if executed.exists() else None
        where = f" (stopped while running {locks.cell_label(sub.pristine, cell)})" if cell else ""
        how = f"did not finish within --timeout {sub.options.timeout_s:g} s{where}"
        sub.extra["limits_hit"].append({"where": "notebook run", "limit": "time", "what": how})
    elif ran.returncode == 0:
        sub.extra["cells_raised"] = said.get("raised", [])
        how = "ran to the end"
    else:
        how = str(said.get("reason") or f"{ran.describe()}: {_log_tail(tmp / 'run.log')}")
        if ran.out_of_memory:
            how += f" (its processes reached the --memory-limit of {_size_text(sub.options.limits.memory_bytes)})"
            sub.extra["limits_hit"].append({"where": "notebook run", "limit": "memory", "what": how})
    sub.extra["notebook_run"] = how
    if how != "ran to the end":
        sub.extra["notes"].append(
            f"the notebook run {how}; the grade comes from your answer cells, run again"
        )


def _grade_in(tmp: Path, sub: _Submission, exercise: Exercise, cells: list[dict], seed: int):
    """Steps 3 and 4 in the folder `tmp`: (observations data, the answers process's outcome), or a final report."""
    if sub.options.run_notebook:
        _run_notebook(tmp, sub)
    else:
        sub.extra["timings_s"] = {"notebook": 0.0}
        sub.extra["notebook_run"] = NOT_RUN
    answers = tmp / "answers"
    answers.mkdir()
    job, out = answers / "job.json", answers / "observations.json"
    job.write_text(
        json.dumps(
            {
                "exercise": exercise.id,
                "seed": seed,
                "cells": cells,
                "cell_limit_s": sub.options.cell_timeout_s,
                "check_limit_s": sub.options.check_timeout_s,
            }
        )
    )
    cmd = [sys.executable, "-m", "labkit.grading.extract", str(job), str(out)]
    bound = sub.extra["limits_s"]["answers"]
    probed = sandbox.run(cmd, answers, bound, tmp / "answers.log", limits=sub.options.limits)
    sub.extra["timings_s"]["answers"] = round(probed.wall_s, 3)
    sub.extra.setdefault("containment", probed.containment)
    data = _read_json(out)
    if isinstance(data.get("cells"), list):
        return data, probed
    progress = _read_text(answers / "progress.txt")
    during = f" while running {progress}" if progress else ""
    if probed.timed_out:
        reason = f"the answer cells, run again on their own, did not finish within {bound:g} s{during}"
        sub.extra["limits_hit"].append({"where": progress or "answers", "limit": "time", "what": reason})
        return sub.finish("timeout", [*_not_graded(exercise, reason)], reason, exercise.id)
    reason = f"the answer cells, run again on their own, {probed.describe()}{during}"
    if probed.out_of_memory:
        sub.extra["limits_hit"].append({"where": progress or "answers", "limit": "memory", "what": reason})
        return sub.finish("memory", _not_graded(exercise, reason), reason, exercise.id)
    if (probed.returncode or 0) >= 0 and (tail := _log_tail(tmp / "answers.log")):
        reason += f": {tail}"
    return sub.finish("error", _not_graded(exercise, reason), reason, exercise.id)


def _judge(
    sub: _Submission,
    exercise: Exercise,
    data: dict,
    probed: sandbox.Outcome,
    cells: list[dict],
    missing: list[str],
    seed: int,
    lock_entry: dict,
) -> dict:
    """Step 5: the integrity flags, then every observation judged here."""
    judged = time.monotonic()
    notes = [f"answer cell {cell_id!r} is missing from the submission" for cell_id in missing]
    for cell in data["cells"]:
        if isinstance(cell, dict) and cell.get("error"):
            verb = "" if cell.get("timed_out") else "raised "
            notes.append(f"cell {cell.get('id')!r} {verb}{cell['error']}")
            if cell.get("timed_out"):
                sub.extra["limits_hit"].append(
                    {"where": f"cell {cell.get('id')!r}", "limit": "time", "what": str(cell["error"])}
                )
    flags = _integrity_flags(sub, exercise, cells, data.get("origins"), data.get("uses"))
    observations = data.get("observations") if isinstance(data.get("observations"), dict) else {}
    if len(observations) < len(exercise.checks):
        progress = "the answers process stopped before it"
        observations = {**{c.name: {"error": progress} for c in exercise.checks}, **observations}
    memory = sub.options.limits.memory_bytes
    for name, seen in observations.items():
        if not isinstance(seen, dict):
            continue
        if seen.get("limit") == "time":
            sub.extra["limits_hit"].append(
                {"where": f"check {name!r}", "limit": "time", "what": str(seen.get("error"))}
            )
        elif (seen.get("signal") == "SIGKILL" and probed.out_of_memory) or (
            memory and str(seen.get("error", "")).startswith("MemoryError")
        ):
            seen["error"] = f"{seen.get('error')} (it reached the --memory-limit of {_size_text(memory)})"
            sub.extra["limits_hit"].append(
                {"where": f"check {name!r}", "limit": "memory", "what": seen["error"]}
            )
        if str(seen.get("error", "")).startswith("BlockingIOError") and sub.options.limits.max_processes:
            limit = sub.options.limits.max_processes
            seen["error"] = f"{seen['error']} (a new process past the --max-processes of {limit})"
            sub.extra["limits_hit"].append(
                {"where": f"check {name!r}", "limit": "processes", "what": seen["error"]}
            )
    checks = judge_all(exercise, observations, seed, notes, flags)
    sub.extra["timings_s"]["judge"] = round(time.monotonic() - judged, 3)
    return sub.finish("graded", [*checks, lock_entry], "", exercise.id)


def _integrity_flags(
    sub: _Submission, exercise: Exercise, cells: list[dict], origins, uses
) -> dict[str, str]:
    """{check name: why it earns nothing} by the integrity rule (`integrity.flags`), noted in the report."""
    flags, found = integrity.flags(exercise, cells, origins, uses)
    if found:
        sub.extra["integrity"] = found
        sub.extra["warnings"].append("answers use labkit's own implementation: " + ", ".join(sorted(flags)))
    return flags


# ------------------------------------------------------------------------------------------------- folders


def submissions(directory: Path) -> list[Path]:
    """The notebooks of a folder to grade: `*.ipynb` at its top level, except kept evidence."""
    return sorted(p for p in Path(directory).glob("*.ipynb") if not p.name.endswith(EVIDENCE_SUFFIX))


def reports_dir(gradebook: Path) -> Path:
    """`grades.csv` -> `grades-reports/` beside it (`<gradebook stem>-reports/`): a report, a feedback page
    and an executed notebook per submission."""
    return gradebook.parent / f"{gradebook.stem}-reports"


def report_target(gradebook: Path, submission: Path) -> Path:
    return reports_dir(gradebook) / (submission.name.removesuffix(".ipynb") + REPORT_SUFFIX)


def folder_exercise(files: list[Path]) -> tuple[str | None, Counter]:
    """The exercise a folder is for: the id on more than `FOLDER_MAJORITY` of its readable notebooks, else None."""
    ids: Counter = Counter()
    for path in files:
        try:
            ex_id = exercises.exercise_id(nbformat.reads(path.read_text(encoding="utf-8"), as_version=4))
        except Exception:  # noqa: BLE001 (unreadable: graded, and reported, as such)
            continue
        if ex_id:
            ids[ex_id] += 1
    if ids:
        top, count = ids.most_common(1)[0]
        if count > FOLDER_MAJORITY * sum(ids.values()):
            return top, ids
    return None, ids


def grade_folder(
    directory: Path,
    gradebook: Path,
    timeout_s: float | None = None,
    jobs: int = 1,
    progress: Callable[[str], None] | None = None,
    options: Options | None = None,
    roster: list[dict] | None = None,
    deadline=None,
) -> list[dict]:
    """Grade every submission of `directory` with `jobs` at a time; write the gradebook CSV and a report per
    submission under `reports_dir(gradebook)`. `progress` gets one line per submission as it finishes.
    Returns the reports in file order. One submission's failure never stops the others."""
    options = options or Options()
    if timeout_s is not None:
        options = replace(options, timeout_s=timeout_s)
    files = submissions(directory)
    catalog = exercises.index()
    for ex_id in catalog:
        load(ex_id)  # import every check module before any student code has run anywhere
    if options.exercise is None:
        inferred, _ = folder_exercise(files)
        options = replace(options, exercise=inferred)

    def one(path: Path) -> dict:
        target = report_target(Path(gradebook), path)
        try:
            return grade_submission(path, target, None, catalog, options)
        except Exception as e:  # noqa: BLE001 (a grader bug on one file is reported on that file's row)
            failed = report.build(
                path.name,
                options.exercise,
                "error",
                [],
                0.0,
                f"the grader failed: {type(e).__name__}: {e}",
                0,
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
    max_score = load(options.exercise).max_score if options.exercise in catalog else None
    rows = report.gradebook_rows(ordered, roster, deadline, options.exercise, max_score)
    report.write_gradebook(rows, Path(gradebook))
    return ordered
