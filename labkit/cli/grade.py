"""`labkit grade`: grade one submission (a JSON report) or a folder of them (a gradebook CSV)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from labkit.cli import UsageError


def register(subparsers) -> None:
    """Add the `grade` command to the `labkit` parser."""
    p = subparsers.add_parser(
        "grade",
        help="grade exercise notebooks: papermill runs each one, the checks run outside it",
        description="Grade a submission (writes a JSON report) or every *.ipynb of a folder (writes a gradebook "
        "CSV and one report per submission). Each submission is executed with papermill in its own process "
        "under --timeout; its answers are then tested in a fresh process and judged by the grader. The "
        "executed notebook is kept beside each report. Exit status 0 whenever grading ran, whatever the scores.",
    )
    p.add_argument("submission", metavar="SUBMISSION", help="a submitted .ipynb, or a folder of them")
    p.add_argument(
        "--out", metavar="REPORT.json", default=None, help="report path (one submission; default: beside it)"
    )
    p.add_argument(
        "--gradebook", metavar="grades.csv", default=None, help="gradebook CSV (a folder of submissions)"
    )
    p.add_argument("--timeout", metavar="SECONDS", type=float, default=None,
                   help="wall-clock limit per submission for each run of its code (default 300)")  # fmt: skip
    p.add_argument("--jobs", metavar="N", type=int, default=1, help="submissions graded at once (default 1)")
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> Path:
    target = Path(args.submission)
    if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
        raise UsageError(
            f"labkit grade: --timeout must be a positive number of seconds (e.g. 300); got {args.timeout:g}"
        )
    if args.jobs < 1:
        raise UsageError(f"labkit grade: --jobs must be 1 or more; got {args.jobs}")
    if target.is_dir():
        if args.gradebook is None:
            raise UsageError(f"labkit grade: {target} is a folder; pass --gradebook grades.csv to grade it")
        if args.out is not None:
            raise UsageError(
                "labkit grade: --out is for one submission; a folder's reports go beside --gradebook"
            )
    elif target.exists():
        if args.gradebook is not None:
            raise UsageError(f"labkit grade: --gradebook is for a folder; {target} is one file (use --out)")
    else:
        raise UsageError(
            f"labkit grade: {target} does not exist; pass a submitted .ipynb or a folder of them"
        )
    return target


def run(args: argparse.Namespace) -> int:
    """Grade, print a line per submission (and each check for one), write the report(s)."""
    target = _check(args)
    from labkit.grading import grader, report

    timeout_s = grader.DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout
    if target.is_dir():
        files = grader.submissions(target)
        print(
            f"grading {len(files)} submissions in {target} ({args.jobs} at a time, --timeout {timeout_s:g} s each)"
        )
        reports = grader.grade_folder(
            target, Path(args.gradebook), timeout_s, args.jobs, progress=lambda s: print(s, flush=True)
        )
        graded = sum(r["status"] == "graded" for r in reports)
        print(
            f"{graded}/{len(reports)} graded; gradebook {args.gradebook}, reports in {grader.reports_dir(Path(args.gradebook))}"
        )
        return 0
    out = Path(args.out) if args.out else grader.default_report_path(target)
    result = grader.grade_submission(target, out, timeout_s)
    print(f"{target.name}  {report.summary_line(result)}")
    if result["checks"]:
        print(report.format_checks(result))
    print(
        f"report {out}"
        + (f", executed notebook {result['executed_notebook']}" if "executed_notebook" in result else "")
    )
    return 0
