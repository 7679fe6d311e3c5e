"""Busy neighbours: CPU-bound processes beside a measurement, as a shared hub node has.

A class shares its nodes, so the lab's timings must hold (or say they could not be resolved) while other
kernels compute. `busy_neighbours(count, nice)` starts `count` processes that spin in pure Python at
niceness `nice` (19: a background job; 0: a classmate's kernel at the same priority) and stops them when
the block ends. Each runs in a session of its own, as another user's work does, and since Linux's autogroup
scheduling shares the CPU between sessions before it looks at a process's niceness (a Jupyter kernel runs in
a session of its own too), the session's autogroup gets the same niceness: a nice 19 neighbour is then a
background job to every other session, and a nice 0 one a classmate's kernel at full weight. The tests
run every course notebook beside two at nice 19, and `benchmarks/shared_machine.py` measures the lab
quiet and beside them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

SPIN = "while True: pass"


@contextmanager
def busy_neighbours(count: int = 2, nice: int = 19) -> Iterator[list[subprocess.Popen]]:
    """`count` spinning processes at niceness `nice` for the duration of the block (their Popen objects)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SPIN],
            preexec_fn=partial(_lower_priority, nice),
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(count)
    ]
    try:
        time.sleep(0.2)  # spinning before the test starts
        assert all(p.poll() is None for p in procs), "a neighbour exited at start"
        yield procs
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
        for p in procs:
            p.wait()


def _lower_priority(nice: int) -> None:
    """In the new process, before it spins: `nice` for its session's autogroup and for itself."""
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # no autogroup scheduling here: the process's own niceness is all there is
        pass
    os.nice(nice)


def cpu_seconds(proc: subprocess.Popen) -> float:
    """CPU seconds `proc` has used (user + system), from /proc: what a neighbour took."""
    fields = open(f"/proc/{proc.pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
