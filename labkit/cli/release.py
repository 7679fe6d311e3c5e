"""`labkit release --student OUT`: the student copy of the course, for nbgitpuller (see labkit.release)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers) -> None:
    """Add the `release` command to the `labkit` parser."""
    p = subparsers.add_parser(
        "release",
        help="write the student copy of the course (no solutions, no grader checks) for nbgitpuller",
        description="Write OUT: the notebooks, the pristine exercises, the docs a student reads and the labkit "
        "the notebooks import, without solutions/ or the grader's checks (check() then runs the public "
        "checks). OUT is new, empty, or an earlier release (everything but its .git is replaced): commit "
        "and push it as the repository the students' nbgitpuller links pull.",
    )
    p.add_argument("--student", metavar="OUT", required=True, help="the folder to write the release into")
    p.add_argument(
        "--executed",
        metavar="DIR",
        help="executed copies of the course notebooks (papermill's): their outputs fill the cheat sheets' figures",
    )
    p.add_argument(
        "--reference",
        action="store_true",
        help="also write reference/: the notebooks that have build cells, filled with the course's own pieces (hand "
        "it out after the build's deadline); the exercises' solutions stay out",
    )
    p.add_argument(
        "--past",
        metavar="ID[,ID...]",
        default="",
        help="with --reference: the exercises whose deadline has passed too (reference/ may show their answers: "
        "the capstone's hooks are 02's pieces)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from labkit.cli import UsageError
    from labkit.cli.paths import writable_folder
    from labkit.release import release_student

    out = writable_folder("release", "--student", args.student)
    if args.executed and not Path(args.executed).is_dir():
        raise UsageError(
            f"labkit release: --executed {args.executed} is not a folder; pass the folder of executed notebooks"
        )
    past = tuple(filter(None, args.past.split(",")))
    if past and not args.reference:
        raise UsageError(
            "labkit release: --past names exercises reference/ may show; pass it with --reference"
        )
    if past:
        from labkit.grading.exercises import index

        known = sorted(index())
        unknown = [ex for ex in past if ex not in known]
        if unknown:
            raise UsageError(
                f"labkit release: --past {unknown[0]}: no such exercise; pass ids of {', '.join(known)}"
            )
    try:
        files = release_student(
            out, Path(args.executed) if args.executed else None, reference=args.reference, past=past
        )
    except OSError as e:
        raise UsageError(
            f"labkit release: --student {args.student}: cannot write there ({e.strerror}); pass a folder you can write"
        ) from None
    held = ", and reference/: the build cells filled" if args.reference else ""
    print(f"student release: {len(files)} files in {args.student} (no solutions/, no grader checks{held})")
    return 0
