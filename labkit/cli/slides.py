"""`labkit slides [--out DIR] [--notebooks DIR] [--execute]`: a reveal.js deck per notebook (see labkit.slides)."""

from __future__ import annotations

import argparse
import math

EXECUTE_TIMEOUT_S = 600.0  # per notebook, with --execute


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "slides",
        help="build a reveal.js deck per course notebook and an index page (viewable offline)",
        description="Build DIR/NN_name.slides.html for every notebooks/NN_*.ipynb, made for a room (outputs "
        "only, code where a cell is tagged slide-code, one headline and a lead per slide, the rest of the prose in "
        "the speaker notes, each slide fitted to the screen), its one-page cheat sheet (DIR/NN_name.cheatsheet.md "
        "and .html, from docs/cheatsheets/NN_name.md) and DIR/index.html (titles, run times, cheat sheets). "
        "reveal.js is copied beside the decks, so nothing is fetched when they are viewed. By default the "
        "notebooks are converted as they are (committed ones carry no outputs: no figures); --notebooks points at "
        "executed copies, --execute runs each one first (minutes; figures at twice the notebook's resolution).",
    )
    p.add_argument("--out", metavar="DIR", default="slides", help="output folder (default: ./slides)")
    p.add_argument(
        "--notebooks",
        metavar="DIR",
        default=None,
        help="folder of NN_*.ipynb (default: the checkout's notebooks/)",
    )
    p.add_argument("--execute", action="store_true", help="execute each notebook before converting it")
    p.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=float,
        default=None,
        help=f"per notebook, with --execute (default {EXECUTE_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--reveal-url-prefix",
        metavar="URL",
        default=None,
        help="load reveal.js from URL instead of the vendored copy placed beside the decks",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from labkit.cli import UsageError
    from labkit.cli.paths import writable_folder

    if args.timeout is not None and not args.execute:
        raise UsageError(
            "labkit slides: --timeout limits each notebook's run, which only --execute starts; drop it"
        )
    if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
        raise UsageError(
            f"labkit slides: --timeout must be a positive number of seconds; got {args.timeout:g}"
        )
    writable_folder("slides", "--out", args.out)
    from labkit.slides import build

    decks = build(
        args.out,
        args.notebooks,
        execute=args.execute,
        timeout_s=EXECUTE_TIMEOUT_S if args.timeout is None else args.timeout,
        reveal_url_prefix=args.reveal_url_prefix,
    )
    sheets = sum(1 for d in decks if d.with_name(d.name.replace(".slides.html", ".cheatsheet.html")).exists())
    print(f"{len(decks)} decks, {sheets} cheat sheets and index.html in {args.out}")
    return 0
