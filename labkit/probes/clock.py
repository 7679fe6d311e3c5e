"""A rank's clock: seconds that a neighbour on the same cores cannot inflate.

On a shared machine a wall-clock span also counts the moments the rank's thread stood ready to run while
another process (a classmate's kernel, a browser) held its core. Linux counts those moments per thread
(the run delay, the second field of `/proc/self/task/<tid>/schedstat`), so on CPU ranks the lab times with
the wall clock less the run delay of the rank's compute thread: it advances while the thread computes and
while it is blocked (a collective, the emulated link, a sleep), not while it waits for a core.

It falls back to the wall clock, and says so in `kind`, where the subtraction would not mean that:
- a CUDA rank, whose device keeps working while its host thread waits for a core (the timeline
  synchronises the stream at each edge, so the wall clock there times the device);
- more of the lab's ranks than cores (`shares_cores`): the ranks then wait for cores held by each other,
  which is part of the step being measured, not a neighbour's;
- a kernel without the count (not Linux, or schedstat compiled out).
"""

from __future__ import annotations

import os
import threading
import time

RANK = "rank"  # wall time less this thread's run delay
WALL = "wall"  # plain wall time


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def ranks_share_cores(local_ranks: int | None = None) -> bool:
    """True when this node's ranks outnumber its cores (`LOCAL_WORLD_SIZE` unless `local_ranks` is given)."""
    n = local_ranks if local_ranks is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return n > usable_cores()


class RankClock:
    """`now()`: seconds on the calling process's clock for the thread that made it (see the module).

    `kind` is RANK (wall less run delay) or WALL. Safe to read from any thread: the run delay read is
    the maker's, so a collective's completion seen on a backend thread is stamped on the rank's clock.
    """

    def __init__(self, wall: bool = False):
        self._fd: int | None = None
        self._last = float("-inf")
        if not wall:
            try:
                self._fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
                self._run_delay_ns()
            except (OSError, ValueError, IndexError):
                self.close()
        self.kind = WALL if self._fd is None else RANK

    def _run_delay_ns(self) -> int:
        return int(os.pread(self._fd, 96, 0).split()[1])

    def now(self) -> float:
        """Seconds (an arbitrary zero): the wall clock, less the run delay so far where `kind` is RANK. Never
        less than a value it returned before (the kernel counts run delay on a clock of its own, which can
        disagree with the wall clock's by a fraction of a microsecond)."""
        if self._fd is None:
            return time.perf_counter()
        t = max(self._last, time.perf_counter() - self._run_delay_ns() * 1e-9)
        self._last = t
        return t

    def run_delay_s(self) -> float:
        """Seconds the maker thread has stood ready without a core (0.0 on a WALL clock)."""
        return 0.0 if self._fd is None else self._run_delay_ns() * 1e-9

    def sleep_until(self, t_s: float) -> None:
        """Block until `now()` reaches `t_s`: a wait that ends on this clock, whatever the neighbours do."""
        while (remaining_s := t_s - self.now()) > 0:
            time.sleep(remaining_s)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()


_made = (
    threading.local()
)  # this thread's clocks, {(pid, wall): RankClock}: a clock reads its maker's run delay


def rank_clock(device_type: str = "cpu", local_ranks: int | None = None) -> RankClock:
    """The clock a rank on `device_type` times with: RANK on CPU ranks with a core each, WALL otherwise.
    One per thread and kind, made on first use, so a step timed in a loop opens no file (keyed by process
    too: a forked child's thread must not read its parent's run delay)."""
    key = (os.getpid(), device_type != "cpu" or ranks_share_cores(local_ranks))
    clocks = _made.__dict__.setdefault("clocks", {})
    if key not in clocks:
        clocks[key] = RankClock(wall=key[1])
    return clocks[key]
