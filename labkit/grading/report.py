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
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
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
    "counted",
    "seed",
    "class_seed",
    "deadline",
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


def deadline_text(deadline: datetime | None) -> str:
    """The gradebook's `deadline` cell: UTC, to the second ('2026-12-10T22:59:00Z'), or '' for none."""
    return utc_iso(deadline.timestamp()) if deadline is not None else ""


def is_late(submitted_at: str, deadline: datetime | None) -> str:
    """'yes' / 'no' / '' (no deadline or no time)."""
    if deadline is None or not submitted_at:
        return ""
    when = datetime.fromisoformat(submitted_at.replace("Z", "+00:00"))
    return "yes" if when > deadline else "no"


def read_roster(path: Path) -> list[dict]:
    """The roster's rows, each with a "student" key: its first column of `ROSTER_KEYS`, or for a row with that
    cell blank (Canvas's export where a student has no SIS login), the next one it fills; ValueError if none."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = list(csv.DictReader(f))
    except UnicodeDecodeError:
        raise ValueError(f"--roster {path}: not a UTF-8 CSV file; export the roster as CSV") from None
    header = list(rows[0]) if rows else []
    keys = [k for k in ROSTER_KEYS if k in header]
    if not keys:
        raise ValueError(f"--roster {path}: no column named {' or '.join(ROSTER_KEYS[:3])}; found {header}")
    out = []
    for row in rows:
        student = next((row[k].strip() for k in keys if (row.get(k) or "").strip()), "")
        if student and not student.lower().startswith("points possible"):
            out.append({**row, "student": student})
    return out


# --------------------------------------------------------------------------------------- Canvas's downloads

# "Download submissions" names each file <name>[_LATE]_<user id>_<submission id>_<the student's file name>,
# <name> being the student's sortable name ("Last, First") lower-cased without anything but letters and digits;
# Canvas renames a re-uploaded file "02_shard_gather-1.ipynb", "-2", ...: the higher, the later.
_CANVAS_FILE = re.compile(
    r"(?P<name>[a-z0-9]+)_(?P<late>LATE_)?(?P<user_id>\d+)_(?P<submission_id>\d+)_"
    r"(?P<original>.+?)(?:-(?P<resubmission>\d+))?\.ipynb"
)


@dataclass(frozen=True)
class CanvasFile:
    """What the name of a file from Canvas's "Download submissions" says: whose, late or not, which upload."""

    name: str  # the sortable name, squeezed: "Doe, Jane" -> "doejane"
    late: bool
    user_id: str  # Canvas's user id: the ID column of its gradebook
    submission_id: str
    original: str  # the file name the student uploaded, without the resubmission suffix
    resubmission: int  # 0 for the first upload of that name, N for its "-N" copy


def canvas_file(file_name: str) -> CanvasFile | None:
    """The parts of a Canvas download's file name, or None when `file_name` is not named that way."""
    m = _CANVAS_FILE.fullmatch(file_name)
    if not m:
        return None
    return CanvasFile(
        m["name"],
        bool(m["late"]),
        m["user_id"],
        m["submission_id"],
        m["original"] + ".ipynb",
        int(m["resubmission"] or 0),
    )


def canvas_name(display_name: str) -> str:
    """A roster's name as Canvas squeezes it into file names: 'Doe, Jane' and 'Jane Doe' -> 'doejane'."""
    if "," not in display_name and " " in display_name.strip():
        first, _, last = display_name.strip().rpartition(" ")
        display_name = f"{last}{first}"
    return re.sub(r"[^a-z0-9]", "", display_name.lower())


def _roster_name(entry: dict) -> str:
    return next((entry[k] for k in ROSTER_NAMES if entry.get(k)), "")


def match_canvas_file(file: CanvasFile, roster: Sequence[dict]) -> dict | None:
    """The roster entry a Canvas file belongs to: by Canvas's user id (the roster's ID column, which Canvas's
    gradebook export has), else by the squeezed name when exactly one student has it; None when neither."""
    by_id = [r for r in roster if (r.get("ID") or "").strip() == file.user_id]
    if by_id:
        return by_id[0]
    by_name = [r for r in roster if canvas_name(_roster_name(r)) == file.name]
    return by_name[0] if len(by_name) == 1 else None


# ------------------------------------------------------------------------------------------------ gradebook rows


def _feedback_summary(report: dict) -> str:
    failed = [f"{c['name']}: {c['feedback']}" for c in report.get("checks", []) if not c["passed"]]
    return "; ".join(failed)[:_FEEDBACK_CHARS]


def gradebook_row(report: dict, deadline: datetime | None = None) -> dict:
    """One report as a gradebook row (the check columns included). A file named by Canvas's download is
    late when Canvas tagged it LATE (its modification time is the download's, not the submission's), and
    its student is the name in it unless a --student-pattern chose another part."""
    canvas = canvas_file(report["file"])
    student = report.get("student", "")
    if canvas and student == report["file"].removesuffix(".ipynb"):
        student = canvas.name
    row = {
        "student": student,
        "name": report.get("name", ""),
        "file": report["file"],
        "exercise": report["exercise"] or "",
        "status": report["status"],
        "score": format_points(report["score"]),
        "max": format_points(report["max_score"]),
        "submitted_at": report.get("submitted_at", ""),
        "late": ("yes" if canvas.late else "no")
        if canvas
        else is_late(report.get("submitted_at", ""), deadline),
        "counted": "yes",
        "seed": str(report.get("seed", "")),
        "class_seed": str(report.get("class_seed", "")),
        "deadline": deadline_text(deadline),
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
    """Rows for `reports` (matched to the roster, Canvas's file names read, the latest of a student's
    submissions counted) and a `missing` row per rostered student without one."""
    rows = [gradebook_row(r, deadline) for r in reports]
    if roster is not None:
        match_roster(rows, roster)
    mark_latest(rows)
    if roster is None:
        return rows
    submitted = {row["student"] for row in rows}
    for entry in roster:
        if entry["student"] not in submitted:
            rows.append(missing_row(entry["student"], _roster_name(entry), exercise, max_score))
    return rows


def match_roster(rows: list[dict], roster: Sequence[dict]) -> None:
    """Give each row its roster student and name (a Canvas file by its user id or name); warn on the others."""
    entries = {r["student"]: r for r in roster}
    for row in rows:
        entry = entries.get(row["student"])
        canvas = canvas_file(row["file"])
        if entry is None and canvas is not None:
            entry = match_canvas_file(canvas, roster)
        if entry is None:
            why = (
                f" (no roster row has Canvas ID {canvas.user_id} or the name {canvas.name!r})"
                if canvas
                else ""
            )
            row["warning"] = _join(row["warning"], f"not on the roster{why}")
            continue
        row["student"] = entry["student"]
        row["name"] = row["name"] or _roster_name(entry)


def _who(row: dict) -> str:
    """Whose submission a row is: its student, or for an unmatched Canvas file, Canvas's user id."""
    canvas = canvas_file(row.get("file", ""))
    if canvas and row.get("student") == canvas.name:
        return f"canvas user {canvas.user_id}"
    return row.get("student", "")


def _latest_key(row: dict) -> tuple:
    canvas = canvas_file(row["file"])
    return (canvas.resubmission if canvas else 0, row.get("submitted_at", ""), row["file"])


def mark_latest(rows: list[dict]) -> None:
    """Set each submission row's `counted`: of a student's several files, the latest counts (Canvas's
    highest -N upload, else the latest submitted_at); the others say which file superseded them."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        if row.get("file") and _who(row):
            groups.setdefault(_who(row), []).append(row)
    for theirs in groups.values():
        if len(theirs) == 1:
            if not theirs[0].get("counted", "").startswith("yes"):
                theirs[0]["counted"] = "yes"
            continue
        ordered = sorted(theirs, key=_latest_key)
        latest = ordered[-1]
        latest["counted"] = f"yes: the latest of {len(theirs)} submissions"
        for row in ordered[:-1]:
            row["counted"] = f"no: {latest['file']} is later"


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


# ------------------------------------------------------------------------------------------- gradebook file


def _columns(rows: Iterable[dict], first: Sequence[str] = GRADEBOOK_COLUMNS) -> list[str]:
    checks = list(dict.fromkeys(k for row in rows for k in row if k.startswith(CHECK_PREFIX)))
    at = list(first).index("feedback") if "feedback" in first else len(first)
    extra = [k for k in dict.fromkeys(k for row in rows for k in row) if k not in first and k not in checks]
    return [*first[:at], *checks, *first[at:], *extra]


def write_gradebook(rows: Sequence[dict], path: Path, columns: Sequence[str] = GRADEBOOK_COLUMNS) -> None:
    """The gradebook CSV: `columns` (missing ones added), with the check columns before `feedback`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    known = [*columns, *(c for c in GRADEBOOK_COLUMNS if c not in columns)]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, _columns(rows, known), restval="")
        writer.writeheader()
        writer.writerows(rows)


def read_gradebook(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def recorded(rows: Sequence[dict], column: str) -> str | None:
    """The one value the gradebook's rows record in `column` (class_seed, deadline), or None if not one."""
    values = {row.get(column) for row in rows} - {None, ""}
    return values.pop() if len(values) == 1 else None


def update_gradebook(path: Path, row: dict) -> list[dict]:
    """Replace the row of `row["file"]` (or the student's `missing` row) in the gradebook at `path`, or add it.
    A re-graded file keeps the student and name its row had (matched to the roster when it was graded)."""
    rows = read_gradebook(path) if path.exists() else []
    header = [c for c in (list(rows[0]) if rows else []) if not c.startswith(CHECK_PREFIX)]
    for i, old in enumerate(rows):
        same_file = old.get("file") == row["file"]
        placeholder = old.get("status") == MISSING and old.get("student") == row.get("student")
        if same_file or placeholder:
            kept = ("student", "name") if same_file else ("name",)
            rows[i] = {**row, **{k: old[k] for k in kept if old.get(k)}}
            break
    else:
        rows.append(row)
    mark_latest(rows)
    write_gradebook(rows, path, header or GRADEBOOK_COLUMNS)
    return rows


def amend_gradebook(path: Path, changes: dict[str, dict]) -> list[dict]:
    """Set the given cells of the rows of the files named in `changes` ({file: {column: value}})."""
    rows = read_gradebook(path)
    for row in rows:
        row.update(changes.get(row.get("file", ""), {}))
    write_gradebook(rows, path, [c for c in rows[0] if not c.startswith(CHECK_PREFIX)] if rows else ())
    return rows


# ------------------------------------------------------------------------------------------ Canvas's import

_ASSIGNMENT_ID = re.compile(r"(?P<name>.+) \((?P<id>\d+)\)")


def canvas_column(assignment: str, roster_columns: Iterable[str] = ()) -> tuple[str, str]:
    """(the grade column's header, a warning or ''). Canvas fills an existing assignment from a column named
    `NAME (ID)`, as its gradebook export names it: `assignment` if it has the id, else the export's column of
    that name (the roster may be Canvas's export). Without an id the warning says what to pass."""
    if _ASSIGNMENT_ID.fullmatch(assignment):
        return assignment, ""
    ids = [c for c in roster_columns if _ASSIGNMENT_ID.fullmatch(c)]
    same = [c for c in ids if _ASSIGNMENT_ID.fullmatch(c)["name"] == assignment]
    if len(same) == 1:
        return same[0], ""
    hint = f" (the roster's assignments: {', '.join(ids[:5])})" if ids else ""
    return assignment, (
        f"the column {assignment!r} carries no assignment id, so Canvas may create a new assignment "
        f"instead of filling yours; pass --canvas-assignment 'NAME (ID)' as Canvas's gradebook export names "
        f"it{hint}"
    )


def _canvas_choice(rows: Sequence[dict]) -> dict[str, dict]:
    """{student: the row that counts}: the counted submission, else the student's `missing` row."""
    rows = [dict(r) for r in rows]
    mark_latest(rows)
    chosen: dict[str, dict] = {}
    for row in rows:
        student = row.get("student", "")
        counts = row.get("counted", "").startswith("yes") or row.get("status") == MISSING
        if student and counts and student not in chosen:
            chosen[student] = row
    return chosen


def write_canvas(
    rows: Sequence[dict], roster: Sequence[dict] | None, path: Path, assignment: str
) -> list[dict]:
    """Canvas's grade-import CSV: Student, ID, SIS User ID, SIS Login ID, Section, then the `assignment`
    column (its header as given: `canvas_column`), one row per student, the submission that counts.

    With a roster, a row's identity comes from it, and a row whose student is not on it is left out and
    returned (an import row with blank IDs matches nobody); without one, the student id fills Student and SIS
    Login ID, and a Canvas file's user id the ID. Returns the rows left out."""
    by_id = {r["student"]: r for r in roster or []}
    lines, left_out = [], []
    for student, row in _canvas_choice(rows).items():
        known = by_id.get(student)
        if roster is not None and known is None:
            left_out.append(row)
            continue
        canvas = canvas_file(row.get("file", ""))
        known = known or {"ID": canvas.user_id if canvas else ""}
        lines.append(
            [
                known.get("Student") or row.get("name") or student,
                known.get("ID", ""),
                known.get("SIS User ID", ""),
                known.get("SIS Login ID") or ("" if canvas and roster is None else student),
                known.get("Section", ""),
                row["score"],
            ]
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*CANVAS_COLUMNS, assignment])
        writer.writerows(lines)
    return left_out
