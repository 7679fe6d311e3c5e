"""Time `labkit slides --execute` for the whole course, and count what each deck carries.

    python benchmarks/slides.py [--out benchmarks/results.md]

Writes its one section of the results file in place (`run_all.py` calls it too). The target, from the
slides issue: every deck built from a fresh run of its notebook in under 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sections import write_section  # benchmarks/sections.py (a script's own folder is on sys.path)

SECTION = "## The workshop decks, `labkit slides --execute`"
TARGET_S = 600.0


def build(out_dir: str) -> tuple[float, dict[str, float]]:
    """(wall seconds of the whole build, seconds per deck as the command reports them)."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "labkit", "slides", "--execute", "--out", out_dir],
        check=True,
        capture_output=True,
        text=True,
    )
    wall_s = time.perf_counter() - start
    decks = {
        Path(m[1]).name: float(m[2])
        for m in re.finditer(r"^(\S+\.slides\.html) \(([\d.]+) s\)$", done.stdout, re.M)
    }
    return wall_s, decks


def carried(deck: Path) -> tuple[int, int, int]:
    """(slides, slides with speaker notes, figures) of one deck's HTML."""
    html = deck.read_text(encoding="utf-8")
    return html.count("<section"), html.count('<aside class="notes"'), html.count("<img")


def section_lines(wall_s: float, decks: dict[str, float], out_dir: str) -> list[str]:
    verdict = "met" if wall_s < TARGET_S else f"missed by {wall_s - TARGET_S:.0f} s"
    lines = [
        SECTION,
        "",
        f"{os.cpu_count()} CPUs; load average {', '.join(f'{x:.1f}' for x in os.getloadavg())} (1, 5, 15 min) as "
        "it ended. Each notebook executed once (papermill), then converted; seconds per deck include its run.",
        "",
        "| deck | s | slides | with notes | figures |",
        "|---|---|---|---|---|",
    ]
    for name, seconds in decks.items():
        slides, notes, figures = carried(Path(out_dir) / name)
        lines.append(f"| {name} | {seconds:.1f} | {slides} | {notes} | {figures} |")
    lines += ["", f"whole build {wall_s:.0f} s (target < {TARGET_S:.0f} s): {verdict}"]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="labkit-slides-") as out_dir:
        wall_s, decks = build(out_dir)
        lines = section_lines(wall_s, decks, out_dir)
    write_section(args.out, SECTION, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
