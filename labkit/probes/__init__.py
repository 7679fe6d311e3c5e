"""One measurement layer for every engine, installed on each rank from outside the engine.

`Probes` bundles what the loop installs on a rank: the comm counter and emulated link (`comm.py`,
wrappers around `torch.distributed`'s collective functions), the event timeline (`timeline.py`) and the
memory probes (`memory.py`). No engine and nothing in `labkit.zero` imports this package; the loop
(`labkit.engines.loop`) installs it before building the engine, so even collectives captured by reference
at build time (DeepSpeed keeps `torch.distributed.all_gather_into_tensor` in its backend) go through it.

    probes = Probes(rank=0, device=torch.device("cpu"), link_gbytes=1.0)
    with probes:                      # wraps torch.distributed's collectives; unwraps on exit
        with probes.step(0), probes.span("compute", "forward"):
            ...
    probes.comm.summary(step=0)       # {"all_gather": {"calls", "payload_bytes", "wire_bytes"}, ...}
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from labkit.probes.clock import RankClock, rank_clock
from labkit.probes.comm import CollectiveCall, CommProbe, EmulatedLink
from labkit.probes.memory import PeakMemory, state_bytes, state_bytes_by_device
from labkit.probes.timeline import Timeline, comm_s, device_sync, exposed_comm_s

__all__ = [
    "Probes",
    "CommProbe",
    "CollectiveCall",
    "EmulatedLink",
    "PeakMemory",
    "RankClock",
    "rank_clock",
    "Timeline",
    "comm_s",
    "exposed_comm_s",
    "state_bytes",
    "state_bytes_by_device",
]


class Probes:
    """The probes of one rank: `comm` (counter + link), `timeline`, `memory` (peak bytes)."""

    def __init__(
        self,
        rank: int,
        device: torch.device,
        link_gbytes: float | None = None,
        nodes: Sequence[int] | None = None,
    ):
        self.timeline = Timeline(rank, sync=device_sync(device), clock=rank_clock(device.type))
        self.comm = CommProbe(self.timeline, link_gbytes, nodes)  # nodes[r]: rank r's node
        self.memory = PeakMemory(device)

    def __enter__(self) -> Probes:
        self.comm.install()
        return self

    def __exit__(self, *exc) -> None:
        self.comm.uninstall()

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Tag the collectives and events inside with `step`."""
        self.timeline.step = step
        try:
            yield
        finally:
            self.timeline.step = None

    def span(self, kind: str, name: str):
        """A timeline event around the block: `with probes.span("compute", "forward"): ...`."""
        return self.timeline.span(kind, name)
