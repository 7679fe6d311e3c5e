"""The report of one submission (JSON, the grading contract) and the gradebook of a folder (CSV).

Report: {"exercise", "status": "graded"|"error"|"timeout", "score", "max_score", "runtime_s",
"checks": [{"name", "points", "max_points", "passed", "feedback"}]} plus "file", "reason" (why a
submission was not graded), "executed_notebook" (the evidence) and "timings_s". `score` is always the sum
of the checks' points as the grader judged them; a status other than "graded" scores 0.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable
from pathlib import Path

STATUSES = ("graded", "error", "timeout")
GRADEBOOK_COLUMNS = ("file", "exercise", "status", "score", "max", "runtime")


def build(file: str, exercise: str | None, status: str, checks: list[dict], runtime_s: float,
          reason: str = "", max_score: float | None = None, **extra) -> dict:  # fmt: skip
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


def write_gradebook(reports: Iterable[dict], path: Path) -> None:
    """One row per report: file, exercise, status, score, max (max_score), runtime (seconds)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(GRADEBOOK_COLUMNS)
        for r in reports:
            writer.writerow([r["file"], r["exercise"] or "", r["status"], format_points(r["score"]),
                             format_points(r["max_score"]), f"{r['runtime_s']:.2f}"])  # fmt: skip


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
