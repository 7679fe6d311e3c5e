"""Run one untrusted child process with a hard wall-clock limit, and leave nothing of it behind.

The child starts in its own session (so its process group can be killed at once) with a random token in
its environment. The token is inherited by everything it starts, including the Jupyter kernel (which
jupyter_client puts in yet another session) and any ranks or daemons the student's code forks off; when
the child ends or its time is up, every process carrying the token is killed with SIGKILL.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

TOKEN_VAR = "LABKIT_GRADE_TOKEN"
_SWEEPS = 5


@dataclass(frozen=True)
class Outcome:
    """How the child ended: `returncode` (negative: killed by that signal; None: stopped at the limit)."""

    returncode: int | None
    timed_out: bool
    wall_s: float

    def describe(self) -> str:
        """'exited with status 1' / 'was killed by SIGSEGV' / 'ran past its time limit'."""
        if self.timed_out:
            return "ran past its time limit"
        if self.returncode is not None and self.returncode < 0:
            return f"was killed by {signal_name(-self.returncode)}"
        return f"exited with status {self.returncode}"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def run(cmd: list[str], cwd: Path, timeout_s: float, log_path: Path, env: dict | None = None) -> Outcome:
    """Run `cmd` in `cwd` for at most `timeout_s` seconds (wall clock), stdout and stderr to `log_path`.

    Returns once the child and everything it started are gone (the sweep takes milliseconds).
    """
    token = secrets.token_hex(16)
    child_env = {**os.environ, **(env or {}), TOKEN_VAR: token}
    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=child_env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            returncode, timed_out = proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            returncode, timed_out = None, True
        finally:
            _kill_group(proc.pid)
            kill_marked(token)
            proc.wait()
    return Outcome(returncode, timed_out, time.monotonic() - start)


def _kill_group(pgid: int) -> None:
    if pgid == os.getpgrp():
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def marked(token: str) -> list[int]:
    """Pids of live processes whose environment carries `token` (Linux /proc; empty elsewhere)."""
    needle = f"{TOKEN_VAR}={token}".encode()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return pids


def kill_marked(token: str) -> None:
    """SIGKILL every process carrying `token`, and its process group, until none is left."""
    for _ in range(_SWEEPS):
        pids = [p for p in marked(token) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                _kill_group(os.getpgid(pid))
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)
