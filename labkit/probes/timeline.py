"""The per-rank event timeline: what each rank was computing, communicating and waiting on, and when.

An event is `{"rank", "kind", "name", "start_s", "end_s", "step"}` with times in seconds from this
rank's clock zero (the loop zeroes every rank's clock right after a barrier, so ranks line up to within
the barrier's exit skew). Kinds and names:
- "compute", "forward" / "backward" / "optimizer": a phase of the loop's step;
- "compute", "blocks.3.forward" / "blocks.3.backward": one unit's compute, from hooks on `model.blocks[i]`
  (`Timeline.watch_blocks`, which says what a span includes: waits inside it are cut out when drawn);
- "comm", "all_gather" / "reduce_scatter" / "all_reduce" / ...: a collective in flight, from issue to
  completion (async: when its Work is done and the emulated link has delivered it);
- "wait", same names: the calling thread blocked on a collective: a synchronous call, or a `Work.wait()`.
Exposed communication is the total "wait" time (`exposed_comm_s`). `compute_segments` turns a rank's
events into what it was busy with, unit by unit: the spans minus the waits, and the root's own compute
(embeddings, head, loss: what is left of a phase outside the blocks) as "root.forward" / "root.backward".

Times are the rank's clock (`labkit.probes.clock`): on CPU ranks with a core each, wall time less the
moments the rank's thread waited for a core, so a neighbour's load does not stretch a span; elsewhere the
wall clock.

On CUDA the host runs ahead of the device: a kernel or an NCCL collective returns once queued, so host
timestamps alone would make compute spans measure launches and waits about 0. Every edge a timeline
records (`Timeline.now`: spans, block hooks, and the comm probe's issue, return and wait) first runs
`sync`, which on a CUDA rank waits for the current stream (`device_sync`): a span then ends when its
kernels are done, and a wait when the collective the stream waits on is. Only the current stream, not the
device: an all-gather prefetched on FSDP2's or NCCL's own stream keeps flying under the next block's
compute, as gloo's thread does on CPU. On CPU `sync` does nothing.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from labkit.probes.clock import RankClock, rank_clock

PHASES = ("forward", "backward", "optimizer")


def _no_sync() -> None:
    """CPU ranks: ops have finished when they return, so nothing to wait for at a span edge."""


def device_sync(device: torch.device) -> Callable[[], None]:
    """What a timeline runs at each edge on `device`: wait for its current CUDA stream, or nothing (CPU)."""
    if device.type != "cuda":
        return _no_sync
    return lambda: torch.cuda.current_stream(device).synchronize()


class Timeline:
    """Events of one rank. `step` tags new events with the loop's current step (None outside a step).

    `sync` runs before every timestamp the timeline takes (`now`): `device_sync(device)` for the rank's
    device; the default, for CPU, does nothing. `clock` times the edges (default: a CPU rank's clock made
    on this thread, `labkit.probes.clock.rank_clock`).
    """

    def __init__(self, rank: int, sync: Callable[[], None] = _no_sync, clock: RankClock | None = None):
        self.rank = rank
        self.sync = sync
        self.syncs = sync is not _no_sync  # a device whose work completes after the host returns
        self.clock = clock if clock is not None else rank_clock()
        self.t0_s = self.clock.now()
        self.step: int | None = None
        self.events: list[dict] = []
        self._lock = threading.Lock()
        # id(block output) -> (weak ref to it, callbacks run first when its gradient arrives)
        self._outputs: dict[int, tuple[weakref.ref, list[Callable[[], None]]]] = {}

    def reset_clock(self) -> None:
        """Make now time zero (events already recorded keep their times)."""
        self.t0_s = self.clock.now()

    def now(self) -> float:
        """The clock's seconds once the device has caught up (`sync`): the time of an edge."""
        self.sync()
        return self.clock.now()

    def add_abs(self, kind: str, name: str, start_abs_s: float, end_abs_s: float) -> None:
        """Record an event given in the clock's seconds (thread-safe: comm completes elsewhere)."""
        event = {
            "rank": self.rank,
            "kind": kind,
            "name": name,
            "start_s": start_abs_s - self.t0_s,
            "end_s": end_abs_s - self.t0_s,
            "step": self.step,
        }
        with self._lock:
            self.events.append(event)

    @contextmanager
    def span(self, kind: str, name: str) -> Iterator[None]:
        start_s = self.now()
        try:
            yield
        finally:
            self.add_abs(kind, name, start_s, self.now())

    def watch_blocks(self, model: nn.Module) -> list:
        """Compute spans "blocks.{i}.forward" and "blocks.{i}.backward" for each `model.blocks[i]`.

        Call it after the engine is built: its hooks then run after the engine's, so a span starts once
        the engine's pre-forward / pre-backward hook has gathered the block's weights (scratch, FSDP2).
        forward: block pre-forward hook -> post-forward hook (the engine's free of the weights inside).
        backward: the gradient w.r.t. the block's output arrives (after the engine's hook on it) -> the
        gradient w.r.t. its input is computed (before the engine's hooks on that tensor: the previous
        block's gather, FSDP2's and DeepSpeed's post-backward reduce-scatter). Whatever the engine blocks
        on inside a span (DeepSpeed gathers per sub-module, inside; scratch's reduce-scatter without
        prefetch) is a "wait" event, cut out of the span when drawn. A block takes and returns one tensor.
        Returns the hook handles.
        """
        handles = []
        for i, block in enumerate(getattr(model, "blocks", [])):
            handles += self._watch_block(f"blocks.{i}", block)
        return handles

    def _watch_block(self, unit: str, block: nn.Module) -> list:
        forward_starts: list[float] = []
        backward_starts: list[float] = []

        def backward_begins(_grad):
            backward_starts.append(self.now())

        def backward_ends():
            if backward_starts:
                self.add_abs("compute", f"{unit}.backward", backward_starts.pop(), self.now())

        def before_forward(_module, args):
            forward_starts.append(self.now())
            if args and _needs_grad(args[0]):
                self._when_gradient_arrives(args[0], backward_ends)

        def first_after_forward(_module, _args, out):
            # Prepended, so registered on the output before the engine's hooks: when the gradient
            # arrives, the callbacks chained here (the next block's backward_ends) run first.
            if _needs_grad(out):
                self._first_hook(out)

        def after_forward(_module, _args, out):
            if forward_starts:
                self.add_abs("compute", f"{unit}.forward", forward_starts.pop(), self.now())
            if _needs_grad(out):
                out.register_hook(backward_begins)  # after the engine's pre-backward hook on `out`

        return [
            block.register_forward_pre_hook(before_forward),
            block.register_forward_hook(first_after_forward, prepend=True),
            block.register_forward_hook(after_forward),
        ]

    def _first_hook(self, out: torch.Tensor) -> None:
        """A hook on `out` that runs the callbacks `_when_gradient_arrives` chains onto it."""
        callbacks: list[Callable[[], None]] = []
        key = id(out)

        def run(_grad):
            for callback in callbacks:
                callback()

        out.register_hook(run)
        self._outputs[key] = (weakref.ref(out, lambda _ref: self._outputs.pop(key, None)), callbacks)

    def _when_gradient_arrives(self, x: torch.Tensor, callback: Callable[[], None]) -> None:
        """Run `callback` when the gradient w.r.t. `x` is computed, before the engine's hooks on `x`."""
        ref, callbacks = self._outputs.get(id(x), (None, None))
        if ref is not None and ref() is x:
            callbacks.append(callback)  # x is a block's output, whose first hook is ours
        else:
            x.register_hook(lambda _grad: callback())  # x was made by the engine's pre-forward hook


def _needs_grad(x) -> bool:
    return isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled()


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


# ------------------------------------------------------------------------------------- busy, unit by unit

Interval = tuple[float, float]


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of `intervals` (start, end), as sorted disjoint intervals; empty ones dropped."""
    out: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def subtract_intervals(intervals: Iterable[Interval], holes: Iterable[Interval]) -> list[Interval]:
    """`intervals` with every point of `holes` removed: sorted, disjoint pieces (seconds in, seconds out)."""
    holes = merge_intervals(holes)
    out = []
    for start, end in merge_intervals(intervals):
        for h_start, h_end in holes:
            if h_end <= start or h_start >= end:
                continue
            if h_start > start:
                out.append((start, h_start))
            start = max(start, h_end)
        if end > start:
            out.append((start, end))
    return out


def compute_segments(events: Sequence[dict], rank: int) -> list[dict]:
    """What `rank`'s compute thread did, unit by unit, with the waits cut out: events in the same shape.

    "compute" segments: each block span minus the waits ("blocks.3.backward"); what is left of a forward /
    backward phase outside its blocks and the waits, before the first block and after the last
    ("root.forward", "root.backward": embeddings, head, loss) or between two blocks ("between.forward":
    the engine's own work from one unit to the next); the optimizer minus the waits. "wait" segments: the waits,
    overlapping ones merged (named by their collectives, "all_gather+reduce_scatter"). No two segments
    overlap, so their sum is the time the thread was busy or blocked.
    """
    mine = [e for e in events if e["rank"] == rank]
    waits = _merged_waits(e for e in mine if e["kind"] == "wait")
    holes = [(w["start_s"], w["end_s"]) for w in waits]
    units = [e for e in mine if e["kind"] == "compute" and e["name"] not in PHASES]
    out = [{**w, "rank": rank} for w in waits]

    def add(e: dict, name: str, pieces: Iterable[Interval]) -> None:
        out.extend(
            {"rank": rank, "kind": "compute", "name": name, "start_s": s, "end_s": t, "step": e.get("step")}
            for s, t in pieces
        )

    for e in units:
        add(e, e["name"], subtract_intervals([(e["start_s"], e["end_s"])], holes))
    for e in mine:
        if e["kind"] != "compute" or e["name"] not in PHASES:
            continue
        inside = [(u["start_s"], u["end_s"]) for u in units if e["start_s"] <= u["start_s"] < e["end_s"]]
        rest = subtract_intervals([(e["start_s"], e["end_s"])], [*inside, *holes])
        if e["name"] == "optimizer" or not inside:
            add(e, e["name"] if e["name"] == "optimizer" else f"root.{e['name']}", rest)
            continue
        first_s, last_s = min(s for s, _ in inside), max(t for _, t in inside)
        add(e, f"root.{e['name']}", [(s, t) for s, t in rest if t <= first_s or s >= last_s])
        add(e, f"between.{e['name']}", [(s, t) for s, t in rest if first_s < t and s < last_s])
    return sorted(out, key=lambda s: s["start_s"])


def busy_s(events: Sequence[dict], rank: int) -> float:
    """Seconds `rank`'s compute thread computed, the waits on collectives cut out (`compute_segments`)."""
    return sum(s["end_s"] - s["start_s"] for s in compute_segments(events, rank) if s["kind"] == "compute")


def _merged_waits(waits: Iterable[dict]) -> list[dict]:
    """Wait events, overlapping ones merged into one, named after the collectives waited on."""
    out: list[dict] = []
    for w in sorted(waits, key=lambda e: e["start_s"]):
        if w["end_s"] <= w["start_s"]:
            continue
        if out and w["start_s"] <= out[-1]["end_s"]:
            last = out[-1]
            last["end_s"] = max(last["end_s"], w["end_s"])
            if w["name"] not in last["name"].split("+"):
                last["name"] += f"+{w['name']}"
        else:
            out.append(
                {
                    "kind": "wait",
                    "name": w["name"],
                    "start_s": w["start_s"],
                    "end_s": w["end_s"],
                    "step": w.get("step"),
                }
            )
    return out
