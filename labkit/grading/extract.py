"""The answers, in a fresh process: `python -m labkit.grading.extract JOB OUT`.

JOB (written by the grader) names the exercise, the seed, the time limits and the cells to run: the pristine
exercise's `parameters` and `setup` cells and the submission's `answer` cells, in notebook order. This process
imports the check module first and runs each cell in one namespace, each under its own time limit (a cell that
raises or runs past it is recorded, and the next one runs), while `integrity.UseWatch` notes the forbidden
labkit code the answer cells import or call. Then each group of checks (see
`labkit.grading.kit`) runs its probes in a forked child of its own, under the group's limit: a probe that
hangs, crashes or exhausts a resource costs only its own checks, and the report says where it was stopped.
OUT gets the observations after every group. Nothing here is trusted: OUT is data for the grader's judges.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import select
import signal
import sys
import time
import traceback
from pathlib import Path

from labkit.grading import integrity
from labkit.grading.kit import Check, group_limit_s, load, probe_one, set_deadline
from labkit.grading.sandbox import signal_name

DEFAULT_CELL_LIMIT_S = 30.0
_STACK_WAIT_S = 0.3  # for a stopped probe's stack dump to be written
_CELL_FRAME = re.compile(r'File "<cell (?P<cell>[^>]+)>", line (?P<line>\d+) in (?P<func>\S+)')


class CellTimeout(BaseException):
    """Raised in a cell that ran past its limit (a BaseException, so `except Exception` does not hide it)."""


def _where(cell_id: str, line: int, sources: dict[str, str], func: str = "") -> str:
    lines = sources.get(cell_id, "").splitlines()
    text = lines[line - 1].strip() if 0 < line <= len(lines) else ""
    inside = f" in {func}" if func and func != "<module>" else ""
    return f"line {line} of cell {cell_id!r}{inside}" + (f": `{text[:80]}`" if text else "")


def run_cell(text: str, cell_id: str, namespace: dict, limit_s: float, sources: dict[str, str]) -> dict:
    """Execute one cell's source in `namespace` for at most `limit_s` s: {"error": None or what went wrong,
    "timed_out": bool}. The alarm repeats every second, so a loop that catches it is interrupted again."""

    def alarm(signum, frame):
        raise CellTimeout

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s, 1.0)
    try:
        exec(compile(text, f"<cell {cell_id}>", "exec"), namespace)
    except CellTimeout as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename.startswith("<cell ")]
        last = frames[-1] if frames else None
        where = (
            f" (stopped at {_where(last.filename[6:-1], last.lineno, sources, last.name)})" if last else ""
        )
        return {"error": f"did not finish within {limit_s:g} s{where}", "timed_out": True}
    except BaseException as e:  # noqa: BLE001 (SystemExit and KeyboardInterrupt too: the next cell still runs)
        line = traceback.format_exception_only(type(e), e)[-1].strip()
        return {"error": line.splitlines()[0][:300], "timed_out": False}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return {"error": None, "timed_out": False}


def _wait(pid: int, limit_s: float) -> int | None:
    """The wait status of child `pid`, or None if it is still running after `limit_s` seconds."""
    deadline = time.monotonic() + limit_s
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if fd is not None:
                select.select([fd], [], [], left)
            else:
                time.sleep(min(left, 0.02))
    finally:
        if fd is not None:
            os.close(fd)


def _child(
    checks: tuple[Check, ...], namespace: dict, seed: int, limit_s: float, out: Path, stack: Path
) -> None:
    """In the forked child: the group's probes, one line of result each, written as soon as it is known."""
    os.setpgid(0, 0)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)  # libgomp's pool is not fork-safe once the parent computed
    faulthandler.register(signal.SIGUSR1, file=open(stack, "w"), all_threads=True)  # noqa: SIM115
    set_deadline(limit_s)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    for check in checks:
        result = probe_one(check, namespace, seed)
        os.write(fd, (json.dumps({"name": check.name, **result}) + "\n").encode())


def run_group(
    checks: tuple[Check, ...],
    namespace: dict,
    seed: int,
    limit_s: float,
    scratch: Path,
    sources: dict[str, str],
) -> dict[str, dict]:
    """The observations of one group's probes, run in a forked child stopped after `limit_s` seconds."""
    out, stack = scratch / "probe.jsonl", scratch / "probe.stack"
    for path in (out, stack):
        path.unlink(missing_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError as e:
        return {c.name: {"error": f"could not start a process to run it ({e})"} for c in checks}
    if pid == 0:
        try:
            _child(checks, namespace, seed, limit_s, out, stack)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    status = _wait(pid, limit_s)
    timed_out, where = status is None, ""
    if timed_out:
        try:
            os.kill(pid, signal.SIGUSR1)
            time.sleep(_STACK_WAIT_S)
        except ProcessLookupError:
            pass
        where = _stopped_at(stack, sources)
    try:
        os.killpg(pid, signal.SIGKILL)  # the child and whatever it left in its process group
    except (ProcessLookupError, PermissionError):
        pass
    if status is None:
        _, status = os.waitpid(pid, 0)
    results = {}
    try:
        for line in out.read_text().splitlines():
            entry = json.loads(line)
            if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                results[entry.pop("name")] = entry
    except (OSError, ValueError):
        pass
    for check in checks:
        if check.name in results:
            continue
        if timed_out:
            results[check.name] = {"error": f"it did not finish within {limit_s:g} s{where}", "limit": "time"}
        elif os.WIFSIGNALED(status):
            name = signal_name(os.WTERMSIG(status))
            results[check.name] = {"error": f"the process running it was killed by {name}", "signal": name}
        else:
            code = os.WEXITSTATUS(status)
            results[check.name] = {"error": f"no result came back (its process exited with status {code})"}
    return results


def _stopped_at(stack: Path, sources: dict[str, str]) -> str:
    """' (stopped at line 4 of cell 'answer-gather' in gather_full: `while True:`)', from the child's dump."""
    try:
        dump = stack.read_text(errors="replace")
    except OSError:
        return ""
    m = _CELL_FRAME.search(dump)
    return f" (stopped at {_where(m['cell'], int(m['line']), sources, m['func'])})" if m else ""


def _write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    job_path, out_path = (Path(a) for a in argv)
    job = json.loads(job_path.read_text())
    exercise = load(job["exercise"])
    seed = int(job["seed"])
    cell_limit_s = float(job.get("cell_limit_s", DEFAULT_CELL_LIMIT_S))
    check_limit_s = job.get("check_limit_s")
    progress = out_path.with_name("progress.txt")
    sources = {c["id"]: c["source"] for c in job["cells"]}
    namespace: dict = {"__name__": "__main__"}
    answers = [c["id"] for c in job["cells"] if c["role"] == "answer"]
    watch = integrity.UseWatch(
        exercise.forbidden, exercise.allowed, answers, out_path.with_name("uses.log")
    ).install()
    ran = []
    for c in job["cells"]:
        progress.write_text(f"cell {c['id']!r}")
        ran.append(
            {
                "id": c["id"],
                "role": c["role"],
                **run_cell(c["source"], c["id"], namespace, cell_limit_s, sources),
            }
        )
    names = sorted({name for check in exercise.checks for name in check.answers})
    data = {
        "cells": ran,
        "observations": {},
        "origins": integrity.answer_origins(namespace, names, exercise.forbidden, exercise.allowed),
        "uses": watch.found(),
    }
    _write(out_path, data)
    # A collective the answers imported by name is still seen by the probes' patches.
    if "torch.distributed" in sys.modules:
        from labkit import collectives

        collectives.late_bound(namespace)
    for group in exercise.groups():
        progress.write_text(f"check {group[0].name!r}")
        limit_s = group_limit_s(group, check_limit_s)
        data["observations"].update(run_group(group, namespace, seed, limit_s, out_path.parent, sources))
        data["uses"] = watch.found()
        _write(out_path, data)
    progress.write_text("done")
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # threads the answers may have left running must not keep this process alive
