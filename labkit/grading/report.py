"""The report of one submission (JSON, the grading contract), its feedback page, and the gradebook of a class.

Report: {"exercise", "status": "graded"|"error"|"timeout"|"memory", "score", "max_score", "runtime_s",
"checks": [{"name", "points", "max_points", "passed", "feedback"}]} plus what the grader knows about the
run (see docs/grading.md). `score` is always the sum of the checks' points as the grader judged them; a
status other than "graded" scores 0.

Gradebook: one CSV row per submission, and per rostered student who did not submit, with the columns
`GRADEBOOK_COLUMNS` and one `check: NAME` column of points per check; `write_canvas` turns it into Canvas's
grade-import CSV.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path

STATUSES = (
    "graded",
    "error",
    "timeout",
    "memory",
)  # memory: the answers process was killed at --memory-limit
MISSING = "missing"  # a gradebook status only: a rostered student with no submission
GRADEBOOK_COLUMNS = (
    "student",
    "name",
    "file",
    "exercise",
    "status",
    "score",
    "max",
    "submitted_at",
    "late",
    "seed",
    "class_seed",
    "feedback",
    "reason",
    "warning",
    "runtime",
    "labkit_version",
)
CHECK_PREFIX = "check: "
ROSTER_KEYS = (
    "student",
    "SIS Login ID",
    "login",
    "username",
    "email",
    "ID",
)  # the first one present is the id
ROSTER_NAMES = ("name", "Student")
CANVAS_COLUMNS = ("Student", "ID", "SIS User ID", "SIS Login ID", "Section")
_FEEDBACK_CHARS = 1000


def build(
    file: str,
    exercise: str | None,
    status: str,
    checks: list[dict],
    runtime_s: float,
    reason: str = "",
    max_score: float | None = None,
    **extra,
) -> dict:
    """A report dict. `max_score` defaults to the checks' total; the score is their points when graded."""
    if status not in STATUSES:
        raise ValueError(f"status {status!r}: use one of {', '.join(STATUSES)}")
    total = sum(c["max_points"] for c in checks) if max_score is None else max_score
    score = round(sum(c["points"] for c in checks), 2) if status == "graded" else 0
    return {
        "file": file,
        "exercise": exercise,
        "status": status,
        "score": score,
        "max_score": total,
        "runtime_s": round(runtime_s, 3),
        "reason": reason,
        "checks": checks,
        **extra,
    }


def write(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def format_points(value: float) -> str:
    return f"{value:g}"


def summary_line(report: dict) -> str:
    """'graded  ex02_shard  5/6  (7.1 s)' or 'timeout  ex01_memory  0/6  (21.0 s): <reason>'."""
    head = (
        f"{report['status']:<7}  {report['exercise'] or '-'}  "
        f"{format_points(report['score'])}/{format_points(report['max_score'])}  ({report['runtime_s']:.1f} s)"
    )
    return head + (f": {report['reason']}" if report["reason"] else "")


def format_checks(report: dict) -> str:
    """One line per check: mark, points, name, feedback."""
    lines = []
    for c in report["checks"]:
        mark = "ok " if c["passed"] else "no "
        points = f"{format_points(c['points'])}/{format_points(c['max_points'])}"
        lines.append(f"  {mark} {points:>7}  {c['name']}: {c['feedback']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ feedback page


def feedback_markdown(report: dict, title: str = "") -> str:
    """The page a student gets back: the score, each check with its points and feedback, and what else to know."""
    name = title or report.get("exercise") or report["file"]
    lines = [f"# {name}: {format_points(report['score'])}/{format_points(report['max_score'])}", ""]
    lines.append(f"Submission `{report['file']}`, graded with labkit {report.get('labkit_version', '?')}.")
    if report["status"] != "graded":
        lines += ["", f"**Not graded ({report['status']}):** {report['reason']}"]
    if report["checks"]:
        lines += ["", "| | points | check | feedback |", "|---|---|---|---|"]
        for c in report["checks"]:
            mark = "ok" if c["passed"] else "**no**"
            text = str(c["feedback"]).replace("|", "\\|").replace("\n", " ")
            points = f"{format_points(c['points'])}/{format_points(c['max_points'])}"
            lines.append(f"| {mark} | {points} | {c['name']} | {text} |")
    notes = [*report.get("notes", [])]
    if notes:
        lines += ["", "Also:", *(f"- {n}" for n in notes)]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ gradebook


def utc_iso(timestamp: float) -> str:
    """Seconds since the epoch -> '2026-12-03T14:18:03Z'."""
    return datetime.fromtimestamp(timestamp, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_deadline(text: str) -> datetime:
    """An ISO 8601 date or time ('2026-12-10', '2026-12-10T23:59', with or without a zone; no zone: local)."""
    value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    if len(text.strip()) == 10:  # a date alone: the end of that day
        value = value.replace(hour=23, minute=59, second=59)
    return value if value.tzinfo else value.astimezone()


def is_late(submitted_at: str, deadline: datetime | None) -> str:
    """'yes' / 'no' / '' (no deadline or no time)."""
    if deadline is None or not submitted_at:
        return ""
    when = datetime.fromisoformat(submitted_at.replace("Z", "+00:00"))
    return "yes" if when > deadline else "no"


def read_roster(path: Path) -> list[dict]:
    """The roster's rows, each with a "student" key (its first column of `ROSTER_KEYS`); ValueError if none."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = list(csv.DictReader(f))
    except UnicodeDecodeError:
        raise ValueError(f"--roster {path}: not a UTF-8 CSV file; export the roster as CSV") from None
    header = list(rows[0]) if rows else []
    key = next((k for k in ROSTER_KEYS if k in header), None)
    if key is None:
        raise ValueError(f"--roster {path}: no column named {' or '.join(ROSTER_KEYS[:3])}; found {header}")
    out = []
    for row in rows:
        student = (row.get(key) or "").strip()
        if student and not student.lower().startswith("points possible"):
            out.append({**row, "student": student})
    return out


def _feedback_summary(report: dict) -> str:
    failed = [f"{c['name']}: {c['feedback']}" for c in report.get("checks", []) if not c["passed"]]
    return "; ".join(failed)[:_FEEDBACK_CHARS]


def gradebook_row(report: dict, deadline: datetime | None = None) -> dict:
    """One report as a gradebook row (the check columns included)."""
    row = {
        "student": report.get("student", ""),
        "name": report.get("name", ""),
        "file": report["file"],
        "exercise": report["exercise"] or "",
        "status": report["status"],
        "score": format_points(report["score"]),
        "max": format_points(report["max_score"]),
        "submitted_at": report.get("submitted_at", ""),
        "late": is_late(report.get("submitted_at", ""), deadline),
        "seed": str(report.get("seed", "")),
        "class_seed": str(report.get("class_seed", "")),
        "feedback": _feedback_summary(report),
        "reason": report["reason"],
        "warning": "; ".join(report.get("warnings", [])),
        "runtime": f"{report['runtime_s']:.2f}",
        "labkit_version": report.get("labkit_version", ""),
    }
    for c in report.get("checks", []):
        if c.get("max_points"):
            row[CHECK_PREFIX + c["name"]] = format_points(c["points"])
    return row


def gradebook_rows(
    reports: Sequence[dict],
    roster: Sequence[dict] | None = None,
    deadline: datetime | None = None,
    exercise: str | None = None,
    max_score: float | None = None,
) -> list[dict]:
    """Rows for `reports` (with roster warnings: not on it, several submissions) and for absent students."""
    rows = [gradebook_row(r, deadline) for r in reports]
    by_student: dict[str, list[dict]] = {}
    for row in rows:
        by_student.setdefault(row["student"], []).append(row)
    for student, theirs in by_student.items():
        if len(theirs) > 1:
            for row in theirs:
                row["warning"] = _join(row["warning"], f"{len(theirs)} submissions for student {student!r}")
    if roster is None:
        return rows
    names = {r["student"]: next((r[k] for k in ROSTER_NAMES if r.get(k)), "") for r in roster}
    for row in rows:
        if row["student"] not in names:
            row["warning"] = _join(row["warning"], "not on the roster")
        else:
            row["name"] = row["name"] or names[row["student"]]
    for student, name in names.items():
        if student not in by_student:
            rows.append(missing_row(student, name, exercise, max_score))
    return rows


def missing_row(student: str, name: str, exercise: str | None, max_score: float | None) -> dict:
    return {
        "student": student,
        "name": name,
        "file": "",
        "exercise": exercise or "",
        "status": MISSING,
        "score": "0",
        "max": "" if max_score is None else format_points(max_score),
        "reason": "no submission",
    }


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


def _columns(rows: Iterable[dict], first: Sequence[str] = GRADEBOOK_COLUMNS) -> list[str]:
    checks = list(dict.fromkeys(k for row in rows for k in row if k.startswith(CHECK_PREFIX)))
    at = list(first).index("feedback") if "feedback" in first else len(first)
    extra = [k for k in dict.fromkeys(k for row in rows for k in row) if k not in first and k not in checks]
    return [*first[:at], *checks, *first[at:], *extra]


def write_gradebook(rows: Sequence[dict], path: Path) -> None:
    """The gradebook CSV: `GRADEBOOK_COLUMNS`, with the check columns before `feedback`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = _columns(rows)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns, restval="")
        writer.writeheader()
        writer.writerows(rows)


def read_gradebook(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def update_gradebook(path: Path, row: dict) -> list[dict]:
    """Replace the row of `row["file"]` (or the student's `missing` row) in the gradebook at `path`, or add it."""
    rows = read_gradebook(path) if path.exists() else []
    header = list(rows[0]) if rows else []
    for i, old in enumerate(rows):
        same_file = old.get("file") == row["file"]
        placeholder = old.get("status") == MISSING and old.get("student") == row.get("student")
        if same_file or placeholder:
            kept = {k: old[k] for k in ("name",) if old.get(k) and not row.get(k)}
            rows[i] = {**row, **kept}
            break
    else:
        rows.append(row)
    ordered = _columns(rows, first=[c for c in header if not c.startswith(CHECK_PREFIX)] or GRADEBOOK_COLUMNS)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, ordered, restval="")
        writer.writeheader()
        writer.writerows(rows)
    return rows


def write_canvas(rows: Sequence[dict], roster: Sequence[dict] | None, path: Path, assignment: str) -> None:
    """Canvas's grade-import CSV: Student, ID, SIS User ID, SIS Login ID, Section, then `assignment` (points).

    The identity columns come from the roster when it has them (Canvas's own gradebook export does), else the
    student id fills Student and SIS Login ID. A student with several rows gets the highest score."""
    by_id = {r["student"]: r for r in roster or []}
    best: dict[str, dict] = {}
    for row in rows:
        student = row.get("student", "")
        if student and (student not in best or float(row["score"] or 0) > float(best[student]["score"] or 0)):
            best[student] = row
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*CANVAS_COLUMNS, assignment])
        for student, row in best.items():
            known = by_id.get(student, {})
            writer.writerow(
                [
                    known.get("Student") or row.get("name") or student,
                    known.get("ID", ""),
                    known.get("SIS User ID", ""),
                    known.get("SIS Login ID") or student,
                    known.get("Section", ""),
                    row["score"],
                ]
            )
