"""`labkit grade`: grade one submission (a JSON report), a folder of them, or one exercise collected from the
hub's exchange (a gradebook CSV); the gradebook keeps what a re-grade needs (the class seed, the deadline)."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from labkit.cli import UsageError
from labkit.cli.paths import writable_file
from labkit.exchange import DEFAULT_EXCHANGE, EXCHANGE_ENV


def register(subparsers) -> None:
    """Add the `grade` command to the `labkit` parser."""
    p = subparsers.add_parser(
        "grade",
        help="grade exercise notebooks: papermill runs each one, the checks run outside it",
        description="Grade a submission (writes a JSON report) or every *.ipynb of a folder (writes a gradebook "
        "CSV and one report per submission). Each submission is executed with papermill in its own process "
        "under --timeout; its answers are then tested in a fresh process, each check under its own limit, on "
        "cases drawn from a seed (the class seed, the exercise and the student), and judged by the grader. "
        "--exchange collects the folder from the hub's exchange first (students hand in with `labkit submit`). "
        "Exit status 0 whenever grading ran, whatever the scores.",
    )
    p.add_argument(
        "submission",
        metavar="SUBMISSION",
        nargs="?",
        default=None,
        help="a submitted .ipynb, or a folder of them (or, instead, --exchange)",
    )
    p.add_argument(
        "--out", metavar="REPORT.json", default=None, help="report path (one submission; default: beside it)"
    )
    p.add_argument(
        "--gradebook",
        metavar="grades.csv",
        default=None,
        help="gradebook CSV: a folder's, or, with one submission, the gradebook whose row it updates",
    )
    _add_run_flags(p)
    _add_class_flags(p)
    p.set_defaults(func=run)


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """How each submission runs: its limits, the seed of its cases, the sandbox."""
    p.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=float,
        default=None,
        help="wall-clock limit of each submission's notebook run (default 300)",
    )
    p.add_argument(
        "--check-timeout",
        metavar="SECONDS",
        type=float,
        default=None,
        help="wall-clock limit of every check's probe (default: each check's own, 30 to 150 s)",
    )
    p.add_argument(
        "--answers-only",
        action="store_true",
        help="skip each notebook's papermill run (the executed copy, which decides nothing): the same "
        "grade from the answer cells alone, without the notebook's run time; for a re-grade",
    )
    p.add_argument("--jobs", metavar="N", type=int, default=1, help="submissions graded at once (default 1)")
    p.add_argument(
        "--seed",
        metavar="N",
        type=int,
        default=None,
        help="class seed: each submission's cases come from it, the exercise and the student "
        "(default 0, or the seed the --gradebook was graded with)",
    )
    p.add_argument(
        "--memory-limit",
        metavar="SIZE",
        default=None,
        help="memory of all of one submission's processes together, e.g. 2G (default: no limit)",
    )
    p.add_argument(
        "--max-processes",
        metavar="N",
        type=int,
        default=None,
        help="processes and threads one submission may run (default 1024, where a cgroup allows)",
    )
    p.add_argument(
        "--sandbox",
        choices=("auto", "bwrap", "none"),
        default="auto",
        help="run submissions in a bubblewrap sandbox: read-only system, no network, no other files "
        "(default auto: where bwrap works)",
    )


def _add_class_flags(p: argparse.ArgumentParser) -> None:
    """What a folder is graded as: its exercise, the class roster, student ids, the deadline, Canvas's CSV."""
    p.add_argument(
        "--exercise",
        metavar="ID",
        default=None,
        help="the folder's exercise: a submission of another one is an error row (default: the id on "
        "more than 3/4 of the folder, if one is)",
    )
    p.add_argument(
        "--roster",
        metavar="roster.csv",
        default=None,
        help="CSV of the class (a 'student' column, or Canvas's SIS Login ID): a row for each student "
        "who did not submit",
    )
    p.add_argument(
        "--student-pattern",
        metavar="REGEX",
        default=None,
        help="how a file name gives the student id: a regex with a (?P<student>...) group "
        "(default: the name without .ipynb)",
    )
    p.add_argument(
        "--deadline",
        metavar="ISO-TIME",
        default=None,
        help="e.g. 2026-12-10T23:59 (local time) or ...Z: the gradebook's late column compares each "
        "file's modification time with it (a file from Canvas's download: its LATE tag); kept in the "
        "gradebook, so a re-grade with --gradebook keeps it (default: the gradebook's)",
    )
    p.add_argument(
        "--exchange",
        metavar="DIR",
        nargs="?",
        const="",
        default=None,
        help="collect the latest submission of --exercise of every student from the exchange (DIR, default "
        f"${EXCHANGE_ENV} or {DEFAULT_EXCHANGE}) into <gradebook stem>-submissions/ beside --gradebook, "
        "and grade that folder",
    )
    p.add_argument(
        "--canvas", metavar="canvas.csv", default=None, help="also write Canvas's grade-import CSV"
    )
    p.add_argument(
        "--canvas-assignment",
        metavar="NAME",
        default=None,
        help="the Canvas assignment column, 'NAME (ID)' as Canvas's gradebook export names it, so that the "
        "import fills that assignment (default: the exercise's title, with its id from a --roster that is "
        "Canvas's export)",
    )


def _positive(value: float | None, flag: str, example: str) -> None:
    if value is not None and not (math.isfinite(value) and value > 0):
        raise UsageError(
            f"labkit grade: {flag} must be a positive number of seconds (e.g. {example}); got {value:g}"
        )


def _check(args: argparse.Namespace) -> Path:
    """The folder or file to grade (for --exchange, the folder it will collect into), every flag checked."""
    from labkit.grading.kit import has_grader_checks

    if not has_grader_checks():
        raise UsageError(
            "labkit grade: this copy of labkit has no grader checks (the student release leaves them out); "
            "grade with the instructor's copy, and run the last cell of an exercise, check(), for its public checks"
        )
    _check_limits(args)
    target = _exchange_target(args) if args.exchange is not None else _submission_target(args)
    folder = args.exchange is not None or target.is_dir()
    if folder:
        if args.gradebook is None:
            raise UsageError(f"labkit grade: {target} is a folder; pass --gradebook grades.csv to grade it")
        if args.out is not None:
            raise UsageError(
                "labkit grade: --out is for one submission; a folder's reports go beside --gradebook"
            )
    elif args.gradebook is not None and args.out is not None:
        raise UsageError(
            "labkit grade: with --gradebook a re-graded submission's report goes beside it; drop --out"
        )
    if not folder:
        _refuse_ignored_by_one_file(args)
    elif args.deadline is not None and target.is_dir():
        _refuse_deadline_of_canvas_files(args, target)
    _check_outputs(args)
    return target


def _check_limits(args: argparse.Namespace) -> None:
    _positive(args.timeout, "--timeout", "300")
    if args.answers_only and args.timeout is not None:
        raise UsageError(
            "labkit grade: --timeout limits the notebook run, which --answers-only skips; drop one of them"
        )
    _positive(args.check_timeout, "--check-timeout", "60")
    if args.jobs < 1:
        raise UsageError(f"labkit grade: --jobs must be 1 or more; got {args.jobs}")
    if args.max_processes is not None and args.max_processes < 16:
        raise UsageError(
            f"labkit grade: --max-processes must be 16 or more (a kernel alone runs ~10 threads); got {args.max_processes}"
        )


def _submission_target(args: argparse.Namespace) -> Path:
    if args.submission is None:
        raise UsageError(
            "labkit grade: pass a SUBMISSION (a submitted .ipynb or a folder of them), or --exchange to collect "
            "one exercise from the hub's exchange"
        )
    target = Path(args.submission)
    if not target.exists():
        raise UsageError(
            f"labkit grade: {target} does not exist; pass a submitted .ipynb or a folder of them"
        )
    return target


def _exchange_target(args: argparse.Namespace) -> Path:
    """The folder --exchange collects into: <gradebook stem>-submissions/ beside --gradebook."""
    from labkit.exchange import INBOUND, exchange_root

    root = exchange_root(args.exchange)
    if args.submission is not None:
        raise UsageError(
            f"labkit grade: --exchange collects the submissions itself; drop {args.submission}, or drop --exchange"
        )
    if args.gradebook is None:
        raise UsageError(
            "labkit grade: --exchange needs --gradebook grades.csv (the collected folder goes beside it)"
        )
    if args.exercise is None:
        raise UsageError(
            "labkit grade: --exchange collects one exercise; pass --exercise ID (e.g. ex02_shard)"
        )
    if args.student_pattern is not None:
        raise UsageError(
            "labkit grade: --student-pattern reads file names, and --exchange names each collected file after "
            "its student; drop --student-pattern"
        )
    if not (root / INBOUND).is_dir():
        raise UsageError(
            f"labkit grade: --exchange {root} has no {INBOUND}/ folder: it is not the exchange, or nobody has "
            "submitted yet; pass the folder the hub mounts at /srv/exchange"
        )
    return collected_dir(Path(args.gradebook))


def collected_dir(gradebook: Path) -> Path:
    """`ex02.csv` -> `ex02-submissions/` beside it: the submissions --exchange collected."""
    return gradebook.parent / f"{gradebook.stem}-submissions"


def _refuse_ignored_by_one_file(args: argparse.Namespace) -> None:
    ignored = [
        (args.jobs > 1, "--jobs", "grades a folder's submissions side by side"),
        (
            args.deadline is not None and args.gradebook is None,
            "--deadline",
            "fills the gradebook's late column",
        ),
        (
            args.roster is not None and args.canvas is None and args.gradebook is None,
            "--roster",
            "adds a folder's missing students, or matches a file to its student for --gradebook and --canvas",
        ),
    ]
    for given, flag, what in ignored:
        if given:
            raise UsageError(
                f"labkit grade: {flag} {what}, which grading one file without it does not use; drop it"
            )


def _refuse_deadline_of_canvas_files(args: argparse.Namespace, folder: Path) -> None:
    """--deadline judges no file of a folder that Canvas's download named: its LATE tags say which were late."""
    from labkit.grading import grader, report

    files = grader.submissions(folder)
    if files and all(report.canvas_file(f.name) for f in files):
        raise UsageError(
            f"labkit grade: --deadline compares modification times, but every file of {folder} comes from "
            "Canvas's download, whose LATE tag says which were late (the times are the download's); drop --deadline"
        )


def _check_outputs(args: argparse.Namespace) -> None:
    if args.canvas_assignment is not None and args.canvas is None:
        raise UsageError(
            "labkit grade: --canvas-assignment names the column of --canvas's CSV; pass --canvas too, or drop it"
        )
    for flag, value in (("--out", args.out), ("--gradebook", args.gradebook), ("--canvas", args.canvas)):
        if value is not None:
            writable_file("grade", flag, value, make_parents=True)
    if args.canvas and args.gradebook is None:
        raise UsageError("labkit grade: --canvas needs --gradebook (it is written from the gradebook's rows)")
    for flag, value in (("--roster", args.roster),):
        if value is not None and not Path(value).is_file():
            what = "is a folder" if Path(value).is_dir() else "does not exist"
            raise UsageError(f"labkit grade: {flag} {value} {what}; pass a CSV file")
    if args.student_pattern is not None:
        try:
            re.compile(args.student_pattern)
        except re.error as e:
            raise UsageError(f"labkit grade: --student-pattern is not a regular expression ({e})") from None


def _recorded(gradebook: Path | None) -> list[dict]:
    """The rows of an existing --gradebook (a re-grade reads its class seed and deadline), else []."""
    from labkit.grading import report

    if gradebook is None or not gradebook.exists():
        return []
    try:
        return report.read_gradebook(gradebook)
    except UnicodeDecodeError:
        raise UsageError(
            f"labkit grade: --gradebook {gradebook} is not a gradebook (not text); pass a new path or one "
            "this command wrote"
        ) from None


def _options(args: argparse.Namespace, recorded: list[dict]):
    """The grader's Options from the flags (and the class seed the gradebook records, for a re-grade)."""
    from labkit.grading import exercises, grader, report, sandbox

    try:
        memory = sandbox.parse_size(args.memory_limit) if args.memory_limit is not None else None
    except ValueError as e:
        raise UsageError(f"labkit grade: --memory-limit {e}") from None
    if memory is not None and memory < 256 * 2**20:
        raise UsageError(
            f"labkit grade: --memory-limit {args.memory_limit} is below 256M: Python and a kernel need more"
        )
    if args.sandbox == "bwrap" and not sandbox.bwrap_usable():
        raise UsageError(
            "labkit grade: --sandbox bwrap, but bubblewrap cannot build a sandbox here; install the "
            "Debian package bubblewrap, or pass --sandbox auto or none"
        )
    if args.exercise is not None and args.exercise not in exercises.index():
        known = ", ".join(sorted(exercises.index()))
        raise UsageError(f"labkit grade: --exercise {args.exercise!r} is not an exercise; known ids: {known}")
    seed = args.seed
    if seed is None and (kept := report.recorded(recorded, "class_seed")) is not None:
        seed = int(kept)
    limits = sandbox.Limits(memory, args.max_processes or grader.DEFAULT_MAX_PROCESSES, args.sandbox)
    return grader.Options(
        timeout_s=grader.DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout,
        check_timeout_s=args.check_timeout,
        class_seed=0 if seed is None else seed,
        limits=limits,
        exercise=args.exercise,
        student_pattern=args.student_pattern or grader.DEFAULT_STUDENT_PATTERN,
        run_notebook=not args.answers_only,
    )


def _deadline(args: argparse.Namespace, recorded: list[dict]):
    """--deadline, else the deadline the gradebook records (so a re-grade keeps `late`), else None."""
    from labkit.grading import report

    text, flag = args.deadline, "--deadline"
    if text is None:
        text, flag = report.recorded(recorded, "deadline"), "the gradebook's deadline"
    if not text:
        return None
    try:
        deadline = report.parse_deadline(text)
    except ValueError:
        raise UsageError(
            f"labkit grade: {flag} {text!r} is not an ISO date or time; write it like 2026-12-10T23:59"
        ) from None
    if args.deadline is None:
        print(f"deadline {report.deadline_text(deadline)}, as the gradebook records it")
    return deadline


def run(args: argparse.Namespace) -> int:
    """Grade, print a line per submission (and each check for one), write the report(s) and gradebook."""
    target = _check(args)
    from labkit.grading import grader, report

    gradebook = Path(args.gradebook) if args.gradebook else None
    recorded = _recorded(gradebook)
    options = _options(args, recorded)
    try:
        roster = report.read_roster(Path(args.roster)) if args.roster else None
    except (ValueError, OSError) as e:
        raise UsageError(f"labkit grade: {str(e).splitlines()[0]}") from None
    deadline = _deadline(args, recorded)
    if args.exchange is not None:
        return _grade_exchange(target, gradebook, options, args, roster, deadline)
    if target.is_dir():
        status = _grade_folder(target, gradebook, options, args, roster, deadline)
        if target.resolve() == collected_dir(gradebook).resolve():
            _keep_exchange_counts(gradebook, recorded)
        return status
    out = grader.report_target(gradebook, target) if gradebook else Path(args.out) if args.out else None
    out = out or grader.default_report_path(target)
    result = grader.grade_submission(target, out, options=options)
    print(f"{target.name}  {report.summary_line(result)}")
    if result["checks"]:
        print(report.format_checks(result))
    evidence = f", executed notebook {result['executed_notebook']}" if "executed_notebook" in result else ""
    print(f"report {out}, feedback {result['feedback_file']}{evidence}")
    if gradebook is not None:
        row = report.gradebook_row(result, deadline)
        if roster is not None:
            report.match_roster([row], roster)
        rows = report.update_gradebook(gradebook, row)
        print(f"gradebook {gradebook}: the row of {target.name} updated")
        _canvas(args, rows, roster, result.get("exercise"))
    return 0


def _grade_exchange(target: Path, gradebook: Path, options, args, roster, deadline) -> int:
    """Collect each student's latest submission of the exercise from the exchange, grade the folder, and say
    in the gradebook's `counted` column of how many submissions it was the latest."""
    from labkit import exchange
    from labkit.grading import report

    root = exchange.exchange_root(args.exchange)
    collected = exchange.collect(root, args.exercise, target)
    if not collected and roster is None:
        raise UsageError(
            f"labkit grade: the exchange {root} holds no submission of {args.exercise} "
            f"({exchange.INBOUND}/<user>/{args.exercise}/); nothing to grade yet"
        )
    earlier = sum(c.attempts - 1 for c in collected)
    print(
        f"collected {len(collected)} submissions of {args.exercise} from {root} into {target} "
        f"(the latest of each student's; {earlier} earlier ones stay in the exchange)"
    )
    status = _grade_folder(target, gradebook, options, args, roster, deadline)
    several = {
        c.file.name: {"counted": f"yes: the latest of {c.attempts} submissions"}
        for c in collected
        if c.attempts > 1
    }
    if several:
        report.amend_gradebook(gradebook, several)
    return status


def _keep_exchange_counts(gradebook: Path, recorded: list[dict]) -> None:
    """A re-graded folder that --exchange collected keeps what its gradebook said of each file's attempts
    (the exchange's earlier submissions are not in the folder to be counted again)."""
    from labkit.grading import report

    said = {
        r["file"]: r["counted"] for r in recorded if r.get("file") and r.get("counted", "").startswith("yes:")
    }
    rows = report.read_gradebook(gradebook)
    kept = {
        r["file"]: {"counted": said[r["file"]]}
        for r in rows
        if r.get("counted") == "yes" and r["file"] in said
    }
    if kept:
        report.amend_gradebook(gradebook, kept)


def _grade_folder(target: Path, gradebook: Path, options, args, roster, deadline) -> int:
    from labkit.grading import grader, report

    files = grader.submissions(target)
    if not files and roster is None:  # with a roster, a row per missing student is still worth writing
        raise UsageError(
            f"labkit grade: {target} holds no submission (*.ipynb); pass the folder the notebooks were collected in"
        )
    runs = (
        f"--timeout {options.timeout_s:g} s for each notebook run" if options.run_notebook else "answers only"
    )
    print(
        f"grading {len(files)} submissions in {target} ({args.jobs} at a time, seed {options.class_seed}, {runs})"
    )
    canvas_named = sum(report.canvas_file(f.name) is not None for f in files)
    if canvas_named and deadline is not None:
        print(
            f"{canvas_named} files come from Canvas's download: their late column is Canvas's LATE tag; "
            f"the deadline judges the {len(files) - canvas_named} others"
        )
    reports = grader.grade_folder(
        target, gradebook, None, args.jobs, lambda s: print(s, flush=True), options, roster, deadline
    )
    graded = sum(r["status"] == "graded" for r in reports)
    exercise_ids = sorted({r["exercise"] for r in reports if r["exercise"]})
    print(
        f"{graded}/{len(reports)} graded; gradebook {gradebook}, reports in {grader.reports_dir(gradebook)}"
    )
    if len(exercise_ids) > 1 and options.exercise is None:
        print(
            f"this folder holds {len(exercise_ids)} exercises ({', '.join(exercise_ids)}); pass --exercise ID "
            "to grade it as one exercise's folder, with the others flagged"
        )
    if reports and "containment" in reports[0]:
        print("contained by: " + "; ".join(f"{k}: {v}" for k, v in reports[0]["containment"].items()))
    _canvas(
        args, report.read_gradebook(gradebook), roster, exercise_ids[0] if len(exercise_ids) == 1 else None
    )
    return 0


def _canvas(args, rows, roster, exercise_id: str | None) -> None:
    """Write --canvas's import file; say its column, and every submission it could not give a student."""
    if not args.canvas:
        return
    from labkit.grading import report
    from labkit.grading.kit import load

    title = args.canvas_assignment or (load(exercise_id).title if exercise_id else "labkit exercise")
    column, warning = report.canvas_column(title, list(roster[0]) if roster else ())
    left_out = report.write_canvas([r for r in rows if r.get("student")], roster, Path(args.canvas), column)
    print(f"Canvas grade import {args.canvas} (assignment column {column!r})")
    if warning:
        print(f"warning: {warning}")
    if left_out:
        files = ", ".join(r.get("file") or r["student"] for r in left_out)
        print(
            f"warning: {len(left_out)} submissions match no student of the roster and are not in {args.canvas}: "
            f"{files}; add the student to the roster or rename the file, then grade again (until then the "
            "student's row, if rostered, says missing)"
        )
