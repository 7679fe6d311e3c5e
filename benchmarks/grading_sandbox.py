"""What the grader's sandbox costs: one batch of submissions graded with and without it, the batches alternating.

    python benchmarks/grading_sandbox.py [--submissions 30] [--jobs 3] [--reps 1] [--out benchmarks/results.md]

The batch cycles through the course's solutions and pristine exercises (every exercise, capstone included)
until it holds `--submissions` notebooks; `labkit grade FOLDER --gradebook` grades it with `--sandbox bwrap`
(bubblewrap: read-only system, no network, its own process limits) and with `--sandbox none`, in the order
none, bwrap, bwrap, none, ... so that a machine that slows down slows both alike. A figure is the whole
batch's wall time (s); the ratio is bwrap's median over none's (the grading issue's target: at most 1.5).
Both batches must give the same scores, or the script stops: a sandbox that changes a grade is a bug.
It writes its section into `--out` in place (the rest of the file is run_all.py's).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sections import write_section  # benchmarks/sections.py (a script's own folder is on sys.path)

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## The grader's sandbox"
TARGET_RATIO = 1.5
MODES = ("none", "bwrap")


def build_batch(folder: Path, submissions: int) -> None:
    """`submissions` notebooks in `folder`: the solutions and pristine exercises, in turn, repeated."""
    sources = [
        p
        for pair in zip(
            sorted((ROOT / "solutions").glob("*.ipynb")),
            sorted((ROOT / "exercises").glob("*.ipynb")),
            strict=True,
        )
        for p in pair
    ]
    for i, source in zip(range(submissions), itertools.cycle(sources)):
        shutil.copy(source, folder / f"s{i:02d}_{source.parent.name}_{source.name}")


def grade_batch(folder: Path, mode: str, jobs: int, work: Path) -> tuple[float, dict[str, str]]:
    """(wall seconds, {file: score}) of one `labkit grade` of `folder` with `--sandbox mode`."""
    gradebook = work / f"grades-{mode}-{time.monotonic_ns()}.csv"
    command = [
        sys.executable,
        "-m",
        "labkit",
        "grade",
        str(folder),
        "--gradebook",
        str(gradebook),
        "--jobs",
        str(jobs),
        "--sandbox",
        mode,
    ]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=work)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(
            f"benchmarks/grading_sandbox.py: `labkit grade --sandbox {mode}` failed: {done.stderr.strip()}"
        )
    with open(gradebook, newline="") as f:
        scores = {row["file"]: row["score"] for row in csv.DictReader(f)}
    shutil.rmtree(gradebook.with_name(gradebook.stem + "-reports"), ignore_errors=True)
    return elapsed, scores


def measure(submissions: int, jobs: int, reps: int) -> dict[str, list[float]]:
    """{mode: [wall seconds per batch]}, the modes alternating none, bwrap, bwrap, none, ..."""
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="labkit-bench-grading-") as tmp:
        work = Path(tmp)
        folder = work / "submissions"
        folder.mkdir()
        build_batch(folder, submissions)
        first_scores = None
        for rep in range(reps):
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                elapsed, scores = grade_batch(folder, mode, jobs, work)
                if first_scores is not None and scores != first_scores:
                    sys.exit(f"benchmarks/grading_sandbox.py: --sandbox {mode} changed the scores: {scores}")
                first_scores = scores
                times[mode].append(elapsed)
                print(f"{mode}: {elapsed:.1f} s", flush=True)
    return times


def section_lines(times: dict[str, list[float]], submissions: int, jobs: int) -> list[str]:
    """The results.md section: each mode's batch times and median, and the ratio against the target."""
    medians = {mode: statistics.median(t) for mode, t in times.items()}
    ratio = medians["bwrap"] / medians["none"]
    verdict = "met" if ratio <= TARGET_RATIO else f"missed by {ratio / TARGET_RATIO - 1:.0%}"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return [
        f"{SECTION} ({submissions} submissions, `labkit grade --jobs {jobs}`; wall s per batch)",
        "",
        f"{os.cpu_count()} CPUs; load average {load} (1, 5, 15 min) as it ended. The batch cycles through "
        "the solutions and pristine exercises; both modes gave the same scores.",
        "",
        "| sandbox | batches (s) | median s |",
        "|---|---|---|",
        *(
            f"| {mode} | {', '.join(f'{t:.1f}' for t in times[mode])} | {medians[mode]:.1f} |"
            for mode in MODES
        ),
        "",
        f"- bwrap / none: {ratio:.2f} (target at most {TARGET_RATIO}: {verdict})",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--submissions", type=int, default=30, help="notebooks in the batch")
    parser.add_argument(
        "--jobs", type=int, default=3, help="submissions graded at once (labkit grade --jobs)"
    )
    parser.add_argument("--reps", type=int, default=1, help="batches per mode")
    parser.add_argument("--out", default="benchmarks/results.md")
    args = parser.parse_args(argv)
    if shutil.which("bwrap") is None:
        print(
            "benchmarks/grading_sandbox.py: bubblewrap (bwrap) is not installed here; install the Debian "
            "package bubblewrap",
            file=sys.stderr,
        )
        return 2
    times = measure(args.submissions, args.jobs, args.reps)
    lines = section_lines(times, args.submissions, args.jobs)
    write_section(args.out, SECTION, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
