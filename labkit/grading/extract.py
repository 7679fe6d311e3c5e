"""The answers, in a fresh process: `python -m labkit.grading.extract JOB OUT`.

JOB (written by the grader) names the exercise, the seed and the cells to run: the pristine exercise's
`parameters` and `setup` cells and the submission's `answer` cells, in notebook order. This process imports
the check module first, runs each cell in one namespace (a cell that raises is recorded and the next one
runs), then runs every check's probe on that namespace and writes the observations to OUT. Nothing here
is trusted: OUT is data for the grader's judges, which compare it with references computed in the grader.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from labkit.grading.checks import load, probe_all


def run_cell(text: str, cell_id: str, namespace: dict) -> str | None:
    """Execute one cell's source in `namespace`; None, or "Type: message" of what it raised."""
    try:
        exec(compile(text, f"<cell {cell_id}>", "exec"), namespace)
    except BaseException as e:  # noqa: BLE001 (SystemExit and KeyboardInterrupt too: the next cell still runs)
        line = traceback.format_exception_only(type(e), e)[-1].strip()
        return line.splitlines()[0][:300]
    return None


def main(argv: list[str]) -> int:
    job_path, out_path = (Path(a) for a in argv)
    job = json.loads(job_path.read_text())
    exercise = load(job["exercise"])
    namespace: dict = {"__name__": "__main__"}
    ran = [
        {"id": c["id"], "role": c["role"], "error": run_cell(c["source"], c["id"], namespace)}
        for c in job["cells"]
    ]
    observations = probe_all(exercise, namespace, int(job["seed"]))
    out_path.write_text(json.dumps({"cells": ran, "observations": observations}))
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # threads the answers may have left running must not keep this process alive
