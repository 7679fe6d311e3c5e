"""The comm counter and the emulated link: wrappers around `torch.distributed`'s collective functions.

Every engine issues its collectives through these Python functions, so one wrapper sees them all: FSDP2
calls `all_gather_single` / `reduce_scatter_single`, DeepSpeed the deprecated `all_gather_into_tensor` /
`reduce_scatter_tensor` (which torch 2.13 implements by calling the new names), DDP `all_reduce` from its
comm hook. The functions and what each one carries are `labkit.collectives.COLLECTIVES`; the wrappers are
one `labkit.collectives.Patch` over whatever wraps them already, and it sees only the outermost call on a
thread, so a deprecated name is counted once.

What a call is charged (per rank):
- `payload_bytes`: the full tensor of the collective: the gathered output of an all-gather, the
  unreduced input of a reduce-scatter, the tensor of an all-reduce or broadcast, the input of an all-to-all.
- `wire_bytes`: what this rank sends in a bandwidth-optimal ring over the call's group
  (`labkit.budget.collective_wire_bytes`, with the group's size, not the world's). It is what the algorithm
  needs, not what the backend happens to do: gloo, for one, runs a reduce-scatter as a full all-reduce
  internally, and we still charge (n-1)/n. An all-to-all is charged every chunk but the one a rank keeps.
- the group's size and global ranks, and `inter_node_bytes`: the part of `wire_bytes` that crosses a node
  boundary (below), so subgroups (HSDP, hpZ) show where their bytes go.

Intra- and inter-node bytes. A ring collective over a group runs in the group's rank order
(`dist.get_process_group_ranks`, ascending global ranks): g0 -> g1 -> ... -> g(n-1) -> g0. In each of its
n-1 steps (2(n-1) for an all-reduce) every rank sends one chunk to its successor and to no one else, so a
rank's whole `wire_bytes` go over one link: they are inter-node when its successor is on another node,
intra-node otherwise. A ring over k > 1 nodes whose ranks come in node blocks therefore has exactly k
crossing links (k of its n ranks send all their bytes across, the others none); one inside a node has none.
`labkit.budget.ring_link_bytes` is the same rule. An all-to-all sends each peer its own chunk, split by the
peer's node; a broadcast, charged as a chain, uses the ring rule. Which node a rank is on comes from
`labkit.cluster.rank_nodes` (torchrun's agent, the DeepSpeed launcher's node, else the host), handed to
the probe once at start; without it every rank is on one node.

Not seen: collectives issued from C++ without the Python functions (DDP's built-in all-reduce, which the
ddp engine replaces with the equivalent Python comm hook; `torch.distributed._functional_collectives`,
used by DTensor redistribution and tensor parallelism), object collectives (their inner tensor collectives
are counted), point-to-point send/recv, and rooted reduce/gather/scatter. On GPU a NCCL call returns once
it is enqueued on its stream, so the edges are taken with the timeline's `now` (the current stream
synchronised first, `labkit.probes.timeline`): a synchronous call's events end when the stream that waits
on it is done, an async call's wait when its `wait()` has made the stream catch up. An async call's "comm"
event then ends at its first wait, the earliest the host learns it is done (NCCL completes its future at
enqueue, so the future's callback would say nothing).

The emulated link (`link_gbytes=X`, GB/s, 1 GB = 1e9 B) makes each collective last at least
wire_bytes / X on a per-rank FIFO link: issued at t, it starts at max(t, link busy until) and completes
wire_bytes / X later, on the rank's clock (`labkit.probes.clock`, which the timeline's compute spans use
too: a neighbour that takes the core from the compute does not shorten the link beside it). A synchronous
call sleeps until then after the real op; an async one returns at once and the remaining delay sits in its
`Work.wait()` (and in its future), so a collective issued early is hidden behind compute, as on a real link.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.utils._pytree import tree_leaves

from labkit.budget import collective_wire_bytes
from labkit.collectives import COLLECTIVES, COUNTED, Patch
from labkit.probes import memory
from labkit.probes.clock import RankClock, rank_clock
from labkit.probes.timeline import Timeline


@dataclass
class CollectiveCall:
    """One outermost collective call on this rank. Bytes per rank; `group_ranks` are global ranks."""

    function: str  # the torch.distributed function called, e.g. "all_gather_single"
    kind: str  # "all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "barrier"
    payload_bytes: int
    wire_bytes: int
    group_size: int
    group_ranks: tuple[int, ...]
    async_op: bool
    step: int | None  # the loop's step when issued; None outside a step
    inter_node_bytes: int = 0  # the part of wire_bytes this rank sends to a peer on another node

    def to_dict(self) -> dict[str, Any]:
        return {
            "function": self.function,
            "kind": self.kind,
            "payload_bytes": self.payload_bytes,
            "wire_bytes": self.wire_bytes,
            "group_size": self.group_size,
            "group_ranks": list(self.group_ranks),
            "async_op": self.async_op,
            "inter_node_bytes": self.inter_node_bytes,
        }


class EmulatedLink:
    """A per-rank FIFO link of `gbytes` GB/s (1 GB = 1e9 B). Times are seconds of `clock`, the rank's clock
    (`labkit.probes.clock`) by default: a transfer lasts its bytes / bandwidth on the clock its compute is
    timed with, so a neighbour that slows the compute does not make the link look faster beside it."""

    def __init__(self, gbytes: float, clock: RankClock | None = None):
        if not gbytes > 0:
            raise ValueError(f"link_gbytes={gbytes!r}: pass a bandwidth above 0 GB/s, e.g. link_gbytes=1.0")
        self.clock = clock if clock is not None else rank_clock()
        self.bytes_per_s = gbytes * 1e9
        self.busy_until_s = 0.0
        self._lock = threading.Lock()

    def schedule(self, issue_s: float, wire_bytes: int) -> float:
        """Queue a transfer issued at `issue_s`; return when it completes."""
        with self._lock:
            start_s = max(issue_s, self.busy_until_s)
            self.busy_until_s = start_s + wire_bytes / self.bytes_per_s
            return self.busy_until_s

    def hold_until(self, end_s: float) -> None:
        """A real op outlasted its modelled time: the link stays busy until it returned."""
        with self._lock:
            self.busy_until_s = max(self.busy_until_s, end_s)


class CommProbe:
    """Counts this rank's collectives, times them into `timeline`, and optionally emulates a link.

    `nodes[r]` is the node of global rank r (from `labkit.cluster.rank_nodes`); None: all on one node.
    """

    def __init__(
        self, timeline: Timeline, link_gbytes: float | None = None, nodes: Sequence[int] | None = None
    ):
        self.timeline = timeline
        self.nodes = list(nodes) if nodes is not None else None
        self.calls: list[CollectiveCall] = []
        self.link: EmulatedLink | None = None
        self.emulate_link(link_gbytes)
        self._patch = Patch(COUNTED, self._wrap, outermost=True)
        self._groups: dict[Any, tuple[int, tuple[int, ...], int]] = {}

    def emulate_link(self, link_gbytes: float | None) -> None:
        """Switch the emulated link on at `link_gbytes` GB/s, or off with None."""
        self.link = None if link_gbytes is None else EmulatedLink(link_gbytes, self.timeline.clock)

    def install(self) -> None:
        """Wrap the collectives it charges (`labkit.collectives.COUNTED`), over whatever wraps them now."""
        if not self._patch.installed:
            self._patch.install()

    def uninstall(self) -> None:
        if self._patch.installed:
            self._patch.remove()

    def summary(self, step: int | None = None, window: slice = slice(None)) -> dict[str, dict[str, int]]:
        """{kind: {"calls", "payload_bytes", "wire_bytes"}} over the calls of `step` (all calls if None).

        `window` narrows the tally to a slice of the calls in the order they were made (one phase of a step).
        """
        out: dict[str, dict[str, int]] = {}
        for call in self.calls[window]:
            if step is not None and call.step != step:
                continue
            row = out.setdefault(call.kind, {"calls": 0, "payload_bytes": 0, "wire_bytes": 0})
            row["calls"] += 1
            row["payload_bytes"] += call.payload_bytes
            row["wire_bytes"] += call.wire_bytes
        return out

    def link_summary(self, step: int | None = None) -> dict[str, dict[str, int]]:
        """{kind: {"intra_node_bytes", "inter_node_bytes"}}: this rank's wire bytes of `step`, by link."""
        out: dict[str, dict[str, int]] = {}
        for call in self.calls:
            if step is not None and call.step != step:
                continue
            row = out.setdefault(call.kind, {"intra_node_bytes": 0, "inter_node_bytes": 0})
            row["intra_node_bytes"] += call.wire_bytes - call.inter_node_bytes
            row["inter_node_bytes"] += call.inter_node_bytes
        return out

    # ------------------------------------------------------------------------------------------ wrapper

    def _wrap(self, name: str, original: Callable) -> Callable:
        """The probed version of collective `name`; the Patch calls it for outermost calls only."""
        kind, payload_arg, _ = COLLECTIVES[name]
        parameters = inspect.signature(original).parameters
        names = list(parameters)
        defaults = {k: p.default for k, p in parameters.items() if p.default is not inspect.Parameter.empty}

        def probed(*args, **kwargs):
            arguments = {**defaults, **dict(zip(names, args, strict=False)), **kwargs}  # inspect.bind is slow
            call = self._describe(name, kind, payload_arg, arguments)
            if call is None:  # this rank is not in the group: torch warns and does nothing
                return original(*args, **kwargs)
            self.calls.append(call)
            queued = call.async_op and _coalescing(arguments.get("group"))
            buffers = [] if queued else _buffers(arguments)
            issue_s = self.timeline.now()
            out = original(*args, **kwargs)
            if queued:  # inside a coalescing manager the op runs at the manager's exit: bytes only
                return out
            if call.async_op and out is not None:
                link_done_s = self.link.schedule(issue_s, call.wire_bytes) if self.link else None
                return _ProbedWork(out, self.timeline, kind, issue_s, link_done_s, buffers)
            returned_s = self.timeline.now()
            if self.link:
                done_s = self.link.schedule(issue_s, call.wire_bytes)
                self.link.clock.sleep_until(done_s)
                self.link.hold_until(returned_s)
            end_s = self.timeline.clock.now()
            self.timeline.add_abs("comm", kind, issue_s, end_s)
            self.timeline.add_abs("wait", kind, issue_s, end_s)
            _settle(buffers)
            return out

        return probed

    def _describe(self, name: str, kind: str, payload_arg: str, arguments: dict) -> CollectiveCall | None:
        group = arguments.get("group") or dist.group.WORLD
        if group not in self._groups:
            group_rank = dist.get_rank(group)
            ranks = tuple(dist.get_process_group_ranks(group)) if group_rank >= 0 else ()
            self._groups[group] = (len(ranks), ranks, group_rank)
        size, ranks, group_rank = self._groups[group]
        if group_rank < 0:
            return None
        payload = _nbytes(arguments[payload_arg]) if payload_arg else 0
        node = self.nodes or [0] * (max(ranks) + 1)
        me = ranks[group_rank]
        if kind == "all_to_all":
            chunks = _sent_bytes_per_peer(name, arguments, payload, size)
            wire = payload - chunks[group_rank]
            inter = sum(b for peer, b in zip(ranks, chunks, strict=True) if node[peer] != node[me])
        elif kind == "barrier":
            wire = inter = 0
        else:
            wire = collective_wire_bytes(kind, payload, size)
            inter = wire if node[ranks[(group_rank + 1) % size]] != node[me] else 0
        return CollectiveCall(
            name, kind, payload, wire, size, ranks, bool(arguments.get("async_op")), self.timeline.step, inter
        )


_LINK_AWARE = frozenset({"wait", "get_future", "is_completed"})  # what _ProbedWork answers itself
SETTLE_TIMEOUT_S = 1.0  # the most `_settle` waits for a backend's worker to drop a Work (s)
STORAGE_SETTLE_S = 0.005  # then, the most it waits for the views of the buffers that Work held (s)
_RELEASED = distributed_c10d.Work()  # a _ProbedWork's `_inner` once it let go of the real Work (never waited)


class _CommEvent:
    """An async collective's "comm" event, recorded once: by its future's done callback (on the backend's
    worker thread) or by the first `wait()`, whichever comes first. The callback holds this, not the Work,
    so the worker thread never holds the last reference to a Work and its buffers."""

    def __init__(self, timeline: Timeline, kind: str, issue_s: float, link_done_s: float | None):
        self.timeline, self.kind, self.issue_s, self.link_done_s = timeline, kind, issue_s, link_done_s
        self._recorded = False
        self._lock = threading.Lock()

    def record(self, real_done_s: float) -> None:
        with self._lock:
            if self._recorded:
                return
            self._recorded = True
        self.timeline.add_abs("comm", self.kind, self.issue_s, max(real_done_s, self.link_done_s or 0.0))

    def on_done(self, _future) -> None:
        self.record(self.timeline.clock.now())


class _ProbedWork(distributed_c10d.Work):
    """The Work of an async collective, seen through the probe: `wait`, `get_future` and `is_completed`
    include the emulated link; every other public attribute is the real Work's.

    It subclasses `Work` because callers test `isinstance(work, Work)` before waiting (FSDP2 does), and
    torch's C++ side reaches a Python Work's `wait` and `get_future` through that base. The "comm" event
    runs from issue to completion (the real op done and the emulated link through); each `wait()` adds a
    "wait" event: the time the calling thread was blocked, link delay included.

    `buffers` (`_buffers`): while a CPU peak is measured, the first `wait()` lets go of the real Work and
    returns once the backend has let go of the buffers too (`_settle`); a later `wait()` returns at once,
    `is_completed()` says True and `get_future()` refuses.
    """

    def __init__(
        self,
        inner,
        timeline: Timeline,
        kind: str,
        issue_s: float,
        link_done_s: float | None,
        buffers: list[Buffer],
    ):
        super().__init__()
        self._inner = inner
        self._link_done_s = link_done_s
        self._event = _CommEvent(timeline, kind, issue_s, link_done_s)
        self._buffers = buffers
        try:
            future = inner.get_future()
        except RuntimeError:  # a backend whose Work has no future: completion is seen at wait()
            future = None
        self._future = future
        if future is not None and not timeline.syncs:  # a CUDA future completes at enqueue: see wait()
            future.add_done_callback(self._event.on_done)

    def __getattribute__(self, name: str):
        # `__getattr__` would not do: the base class has every Work method, answering for an empty Work.
        if name.startswith("_") or name in _LINK_AWARE:
            return object.__getattribute__(self, name)
        return getattr(object.__getattribute__(self, "_inner"), name)

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._inner is _RELEASED:  # waited for before, and let go of
            return True
        timeline = self._event.timeline
        start_s = timeline.now()
        ok = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        if self._buffers and memory.measuring_cpu():  # done: only the backend's worker may still hold it
            self._inner, self._future = _RELEASED, None
            _settle(self._buffers)
        self._buffers = []
        if self._link_done_s is not None:
            timeline.clock.sleep_until(self._link_done_s)
        end_s = timeline.now()
        self._event.record(end_s)
        timeline.add_abs("wait", self._event.kind, start_s, end_s)
        return ok

    def get_future(self) -> torch.futures.Future:
        if self._inner is _RELEASED:
            raise RuntimeError(
                "this collective's Work was let go of at its wait(); ask for its future before"
            )
        if self._future is None or self._link_done_s is None:
            return self._inner.get_future()
        link_done_s, clock = self._link_done_s, self._event.timeline.clock

        def after_link(fut: torch.futures.Future):
            clock.sleep_until(link_done_s)
            return fut.value()

        return self._future.then(after_link)

    def is_completed(self) -> bool:
        if self._inner is _RELEASED:
            return True
        link_done = self._link_done_s is None or self._event.timeline.clock.now() >= self._link_done_s
        return self._inner.is_completed() and link_done


def _nbytes(value) -> int:
    """Bytes of a tensor, or of every tensor in a (nested) list of them."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return sum(_nbytes(v) for v in value)


def _buffers(arguments: dict) -> list[Buffer]:
    """The CPU tensors a collective is given, each with its references counted now, before the call.

    gloo's Work holds its tensors, and its worker thread drops the Work a moment after the caller's wait
    returns: a caller that drops its buffers first leaves their free to that thread, at a time no run
    repeats (a CPU peak then sometimes includes them). `_settle` waits for the worker instead, so each
    buffer is freed by the last of the program's own references. Taken at every call: a collective issued
    before a peak is measured (a prefetch) may be waited for inside it.
    """
    tensors = [t for t in tree_leaves(list(arguments.values())) if isinstance(t, torch.Tensor)]
    return [
        Buffer(t, _tensor_references(t), _storage_references(t)) for t in tensors if t.device.type == "cpu"
    ]


class Buffer(NamedTuple):
    """A collective's CPU tensor and torch's counts of references to it and to its storage before the call."""

    tensor: torch.Tensor
    tensor_references: int
    storage_references: int


def in_flight(objects: list) -> set[int]:
    """The storage addresses of the CPU tensors of every async collective in `objects` (`gc.get_objects()`)
    issued and not yet waited for: a receive buffer still holds whatever its memory held before."""
    return {
        b.tensor.untyped_storage().data_ptr() for o in objects if type(o) is _ProbedWork for b in o._buffers
    }


def _tensor_references(t: torch.Tensor) -> int:
    """References to the tensor: its Python object counts once, each copy of it a Work holds once."""
    return t._use_count()


def _storage_references(t: torch.Tensor) -> int:
    """References to its storage: each tensor viewing it once (gloo keeps views of a buffer too)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _settle(buffers: list[Buffer]) -> None:
    """While a CPU peak is measured (`memory.measuring_cpu`), wait for the backend to let go of `buffers`;
    otherwise return at once.

    First until no tensor has more references than before its collective (the Work is gone), at most
    SETTLE_TIMEOUT_S; then until no storage has more (the views the Work held are gone too), at most
    STORAGE_SETTLE_S: a caller that made views of its own meanwhile (DeepSpeed, of its flat buffers) keeps
    the count up, and the wait cannot tell its views from the Work's.
    """
    if not memory.measuring_cpu():
        return
    for count, field, limit_s in (
        (_tensor_references, "tensor_references", SETTLE_TIMEOUT_S),
        (_storage_references, "storage_references", STORAGE_SETTLE_S),
    ):
        deadline_s = time.perf_counter() + limit_s
        while any(count(b.tensor) > getattr(b, field) for b in buffers) and time.perf_counter() < deadline_s:
            time.sleep(0)


def _sent_bytes_per_peer(name: str, arguments: dict, payload: int, size: int) -> list[int]:
    """The chunk of an all-to-all's input that goes to each group rank (this rank's own chunk stays)."""
    if name == "all_to_all":
        return [_nbytes(t) for t in arguments["input_tensor_list"]]
    splits = arguments.get("input_split_sizes")
    if not splits:
        return [payload // size] * size
    tensor = arguments["input"]
    row_bytes = payload // tensor.shape[0] if tensor.shape[0] else 0
    return [s * row_bytes for s in splits]


def _coalescing(group) -> bool:
    """True inside `distributed_c10d._coalescing_manager`, where calls are queued, not run."""
    return (group or dist.group.WORLD) in distributed_c10d._world.pg_coalesce_state
