"""The per-rank event timeline: what each rank was computing, communicating and waiting on, and when.

An event is `{"rank", "kind", "name", "start_s", "end_s", "step"}` with times in seconds from this
rank's clock zero (the loop zeroes every rank's clock right after a barrier, so ranks line up to within
the barrier's exit skew). Kinds:
- "compute": a phase of the loop's step ("forward", "backward", "optimizer") or one block's forward
  ("blocks.3.forward", from forward pre/post hooks on `model.blocks[i]`, registered after the engine's own
  hooks so a block's span starts once its weights are there);
- "comm": a collective in flight, from issue to completion (async: when its Work is done and the emulated
  link has delivered it);
- "wait": the calling thread blocked on a collective: a synchronous call, or a `Work.wait()`.
Exposed communication is the total "wait" time (`exposed_comm_s`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import nn


class Timeline:
    """Events of one rank. `step` tags new events with the loop's current step (None outside a step)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.t0_s = time.perf_counter()
        self.step: int | None = None
        self.events: list[dict] = []
        self._lock = threading.Lock()

    def reset_clock(self) -> None:
        """Make now time zero (events already recorded keep their times)."""
        self.t0_s = time.perf_counter()

    def add_abs(self, kind: str, name: str, start_abs_s: float, end_abs_s: float) -> None:
        """Record an event given in `time.perf_counter()` seconds (thread-safe: comm completes elsewhere)."""
        event = {"rank": self.rank, "kind": kind, "name": name, "start_s": start_abs_s - self.t0_s,
                 "end_s": end_abs_s - self.t0_s, "step": self.step}  # fmt: skip
        with self._lock:
            self.events.append(event)

    @contextmanager
    def span(self, kind: str, name: str) -> Iterator[None]:
        start_s = time.perf_counter()
        try:
            yield
        finally:
            self.add_abs(kind, name, start_s, time.perf_counter())

    def watch_blocks(self, model: nn.Module) -> list:
        """A "compute" span per forward of each `model.blocks[i]`; returns the hook handles."""
        handles = []
        for i, block in enumerate(getattr(model, "blocks", [])):
            name = f"blocks.{i}.forward"
            starts: list[float] = []

            def before(_module, _args, starts=starts):
                starts.append(time.perf_counter())

            def after(_module, _args, _out, starts=starts, name=name):
                if starts:
                    self.add_abs("compute", name, starts.pop(), time.perf_counter())

            handles.append(block.register_forward_pre_hook(before))
            handles.append(block.register_forward_hook(after))
        return handles


def exposed_comm_s(events: Iterable[dict], rank: int | None = None) -> float:
    """Seconds the compute thread spent blocked on collectives: the sum of "wait" events (of `rank`)."""
    return sum(
        e["end_s"] - e["start_s"]
        for e in events
        if e["kind"] == "wait" and (rank is None or e["rank"] == rank)
    )


def comm_s(events: Iterable[dict], rank: int | None = None) -> float:
    """Seconds of collectives in flight (sum of "comm" events of `rank`); overlapping ones add up."""
    return sum(
        e["end_s"] - e["start_s"]
        for e in events
        if e["kind"] == "comm" and (rank is None or e["rank"] == rank)
    )
