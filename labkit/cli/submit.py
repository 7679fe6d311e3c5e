"""`labkit submit NOTEBOOK`: a student hands in an exercise through the hub's exchange (labkit.exchange)."""

from __future__ import annotations

import argparse
from pathlib import Path

from labkit.exchange import DEFAULT_EXCHANGE, EXCHANGE_ENV, INBOUND, USER_ENV


def register(subparsers) -> None:
    """Add the `submit` command to the `labkit` parser."""
    p = subparsers.add_parser(
        "submit",
        help="hand in an exercise notebook through the hub's exchange (students)",
        description="Copy NOTEBOOK into the exchange the hub mounts in every server, under "
        f"{INBOUND}/<you>/<exercise id>/<UTC time>.ipynb, you being ${USER_ENV}. Submit as often as you "
        "like: the latest submission before grading is the one graded; `labkit feedback` shows the "
        "feedback once your instructor returns it.",
    )
    p.add_argument(
        "notebook",
        metavar="NOTEBOOK",
        help="the exercise you filled in, e.g. exercises/02_shard_gather.ipynb",
    )
    p.add_argument(
        "--exchange",
        metavar="DIR",
        default=None,
        help=f"the exchange folder (default ${EXCHANGE_ENV}, else {DEFAULT_EXCHANGE})",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Submit, and say what was submitted, as whom, when, and where it went."""
    from labkit import exchange
    from labkit.cli import UsageError

    notebook = Path(args.notebook)
    if not notebook.is_file():
        what = "is a folder" if notebook.is_dir() else "does not exist"
        raise UsageError(f"labkit submit: {notebook} {what}; pass your exercise's .ipynb")
    root = exchange.exchange_root(args.exchange)
    user = exchange.current_user()
    try:
        done = exchange.submit(notebook, root, user)
    except OSError as e:
        raise UsageError(
            f"labkit submit: could not write in the exchange {root} ({e.strerror}); ask your instructor to "
            "check the exchange volume"
        ) from None
    when = done.submitted_at.strftime("%Y-%m-%d %H:%M:%S UTC")
    print(f"submitted {notebook} ({done.exercise}) as {user} at {when}: {done.path}")
    earlier = len(exchange.submissions(root, done.exercise).get(user, [])) - 1
    if earlier:
        print(
            f"your {earlier} earlier submissions of {done.exercise} stay; this latest one is the one graded"
        )
    return 0
