"""`labkit feedback`: a student reads the feedback returned to them through the hub's exchange; with
`--return GRADEBOOK`, the instructor returns each graded student's feedback page there (labkit.exchange)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from labkit.exchange import DEFAULT_EXCHANGE, EXCHANGE_ENV, FEEDBACK, USER_ENV

DEFAULT_COPY = "labkit-feedback"  # in the student's home, where JupyterLab's file browser shows it


def register(subparsers) -> None:
    """Add the `feedback` command to the `labkit` parser."""
    p = subparsers.add_parser(
        "feedback",
        help="read your returned feedback (students); --return GRADEBOOK hands a class's back (instructors)",
        description=f"Students: copy the feedback pages returned to you (${USER_ENV}) from the exchange's "
        f"{FEEDBACK}/<you>/ into ~/{DEFAULT_COPY}/ (open them in JupyterLab) and print each one's score. "
        "Instructors: --return GRADEBOOK writes the feedback page of each student's counted submission of "
        f"that gradebook to {FEEDBACK}/<student>/<exercise id>.feedback.md in the exchange.",
    )
    p.add_argument(
        "--exchange",
        metavar="DIR",
        default=None,
        help=f"the exchange folder (default ${EXCHANGE_ENV}, else {DEFAULT_EXCHANGE})",
    )
    p.add_argument(
        "--to",
        metavar="DIR",
        default=None,
        help=f"where a student's pages are copied (default ~/{DEFAULT_COPY})",
    )
    p.add_argument(
        "--return",
        dest="return_from",
        metavar="GRADEBOOK",
        default=None,
        help="instructors: return the feedback pages of this gradebook's counted submissions",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from labkit import exchange
    from labkit.cli import UsageError

    root = exchange.exchange_root(args.exchange)
    if not root.is_dir():
        raise UsageError(
            f"labkit feedback: the exchange {root} does not exist here; pass --exchange DIR, set "
            f"${EXCHANGE_ENV}, or ask for the exchange volume to be mounted"
        )
    if args.return_from is not None:
        if args.to is not None:
            raise UsageError(
                "labkit feedback: --to is where a student's own pages are copied, which --return does not do; drop it"
            )
        return _return(Path(args.return_from), root)
    return _read(root, Path(args.to) if args.to else Path.home() / DEFAULT_COPY)


def _read(root: Path, to: Path) -> int:
    """The student's side: copy their pages into `to` and print each page's title line."""
    from labkit import exchange

    user = exchange.current_user()
    pages = exchange.feedback_pages(root, user)
    if not pages:
        print(f"no feedback returned to {user} yet ({root / FEEDBACK / user} is empty)")
        return 0
    to.mkdir(parents=True, exist_ok=True)
    for page in pages:
        shutil.copyfile(page, to / page.name)
        title = page.read_text(encoding="utf-8").splitlines()[0].lstrip("# ")
        print(f"{title}  ->  {to / page.name}")
    return 0


def returnable(rows: list[dict], reports: Path) -> tuple[list[tuple[dict, Path]], list[str]]:
    """([(row, its feedback page)] to return, [why each other submission row is not]): a student's counted
    submission with an exercise and a page on disk."""
    from labkit.grading import grader

    ready, skipped = [], []
    for row in rows:
        if not row.get("file") or not (row.get("counted") or "yes").startswith("yes"):
            continue  # a missing student, or a superseded submission
        page = reports / (row["file"].removesuffix(".ipynb") + grader.FEEDBACK_SUFFIX)
        if not row.get("exercise") or not page.is_file():
            skipped.append(f"{row['file']} (no exercise or no feedback page in {reports})")
        else:
            ready.append((row, page))
    return ready, skipped


def _return(gradebook: Path, root: Path) -> int:
    """The instructor's side: every counted submission's page to feedback/<student>/<exercise>.feedback.md."""
    from labkit import exchange
    from labkit.cli import UsageError
    from labkit.grading import grader, report

    if not gradebook.is_file():
        raise UsageError(
            f"labkit feedback: --return {gradebook} is not a file; pass the gradebook you graded"
        )
    try:
        rows = report.read_gradebook(gradebook)
    except UnicodeDecodeError:
        raise UsageError(f"labkit feedback: --return {gradebook} is not a gradebook (not text)") from None
    ready, skipped = returnable(rows, grader.reports_dir(gradebook))
    returned = 0
    for row, page in ready:
        try:
            exchange.return_feedback(root, row["student"], row["exercise"], page)
            returned += 1
        except (ValueError, OSError) as e:
            skipped.append(f"{row['file']} ({getattr(e, 'strerror', None) or e})")
    print(f"returned {returned} feedback pages to {root / FEEDBACK}/<student>/")
    if skipped:
        print(f"not returned ({len(skipped)}): " + "; ".join(skipped))
    return 0
