"""State bytes and peak memory per rank, measured on the real tensors.

`state_bytes(engine.state_tensors())` sums the storages behind an engine's params, grads and optimizer
state (local shards only: a DTensor or other wrapper subclass counts its inner tensors). Views that share a
storage are counted once, and a storage counts whole: a shard padded to ceil(rows/n) rows, or a flat
buffer that several parameters view, costs what it really holds. `state_bytes_by_device` splits the same
bytes by the device each storage lives on, so an engine that offloads on a GPU shows what went to "cpu".

`PeakMemory` measures the peak of live tensor bytes over the measured steps, and `start_bytes`, the
baseline live when it started. Both leave out `prior_bytes`, what was live before the run began
(`note_prior`, called before the model is built): tensors of an earlier run in the same ranks that its
engine left alive (DeepSpeed and FSDP1 leave their models behind, held by hooks in autograd's C++ side
that `gc` cannot collect), so each run's figures are its own. On CPU ranks those storages are left out by
identity, so one of them freed during the run (a cache an earlier engine let go) moves neither figure. A
rank forked by `labkit.cluster` does not see what it inherited from its parent at all (the parent's objects
sit in the collector's permanent generation while it forks), which leaves those out the same way.
- GPU: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`, reset once the garbage of what
  ran before (an earlier engine of `run_many`, held in reference cycles) is collected and the device has
  finished its queued work; the baseline is `memory_allocated` then. The caching allocator's own count:
  device memory only, host-offloaded state is not in it.
- CPU: live storages are tracked exactly. At `start`, the storages of every tensor Python can reach (after
  a `gc.collect()`) plus the engine's state tensors (grads live in C++ until first touched) are live. Then
  a `TorchDispatchMode` sees every op's outputs and adds each new storage (and any change of size of a
  known one, which is how `resize_` and `set_` show); `UntypedStorage.resize_` (FSDP2 frees and re-allocates
  its unsharded parameters that way) is watched too; a weak reference on each storage subtracts its bytes
  the moment it is freed. Limits: scratch buffers an op allocates and frees inside itself (kernel
  workspaces, gloo's internal buffers) and tensors created on other threads are not seen, so this is a
  lower bound on allocator memory; bytes are allocated bytes, not resident pages (a 2 GB `torch.empty`
  counts in full even if the OS has not backed it yet); the mode runs Python on every op (about 2x the
  step time of the tiny model), which is why the loop measures peak memory in a step of its own.
  While it measures, the comm probe's `wait()` returns only once gloo's worker thread has let go of the
  collective's buffers (`labkit.probes.comm._settle`): that thread drops its Work a moment after waking the
  waiter, and a buffer it dropped last would be freed at a time no run repeats.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def storages(tensors: Iterable) -> Iterator[torch.UntypedStorage]:
    """The storages behind `tensors` (None entries skipped; wrapper subclasses unwrapped; meta skipped)."""
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(t):
            inner_names, _ = t.__tensor_flatten__()
            yield from storages(getattr(t, n) for n in inner_names)
        elif t.device.type != "meta" and t.layout == torch.strided:
            yield t.untyped_storage()


CATEGORIES = ("params", "grads", "optimizer")

# An engine's accounting names AdamW's per-tensor `step` on a line of its own: torch's AdamW keeps one 0-dim
# float32 (4 B) per tensor it updates, on the CPU unless `capturable` or `fused`. It is optimizer state.
STEP_SCALARS = "AdamW step scalars"
STEP_SCALAR_BYTES = 4


def in_categories(terms: dict[str, int]) -> dict[str, int]:
    """An accounting with `STEP_SCALARS` on a line of its own, in the probe's categories (bytes): the step
    scalars join "optimizer", the other keys stay as they are."""
    out = {key: b for key, b in terms.items() if key != STEP_SCALARS}
    out["optimizer"] = out.get("optimizer", 0) + terms.get(STEP_SCALARS, 0)
    return out


def state_bytes(state: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Bytes per category ("params", "grads", "optimizer"), each storage counted once (first category).

    Only those three keys: an engine lists buffers it keeps in host memory apart (the scratch engine's
    offloaded optimizer is "host_optimizer"), so these are the bytes it keeps on its device.
    """
    seen: dict[int, torch.UntypedStorage] = {}  # holds the storages, so their ids stay unique
    out = {}
    for key in CATEGORIES:
        total = 0
        for st in storages(state.get(key, [])):
            if id(st) not in seen:
                seen[id(st)] = st
                total += st.nbytes()
        out[key] = total
    return out


def state_bytes_by_device(state: dict[str, list[torch.Tensor]]) -> dict[str, dict[str, int]]:
    """{device ("cpu", "cuda:0"): {category: bytes}} over every key of `state`, each storage counted once.

    A key counts under the category it ends with ("host_optimizer" is optimizer state), and on the
    device its storage is on: the scratch engine's host buffers, FSDP2's CPUOffloadPolicy shards and
    DeepSpeed's offloaded fp32 partition all show under "cpu" on a GPU rank. Keys in CATEGORIES go first,
    so a storage shared with them is not counted twice.
    """
    seen: dict[int, torch.UntypedStorage] = {}
    out: dict[str, dict[str, int]] = {}
    keys = [*CATEGORIES, *(k for k in state if k not in CATEGORIES)]
    for key in keys:
        category = next((c for c in CATEGORIES if key.endswith(c)), None)
        if category is None:
            continue
        for st in storages(state.get(key, [])):
            if id(st) not in seen:
                seen[id(st)] = st
                row = out.setdefault(str(st.device), dict.fromkeys(CATEGORIES, 0))
                row[category] += st.nbytes()
    return out


_measuring_cpu = 0  # CPU peaks being measured in this process (`PeakMemory.start` to `stop`)


def measuring_cpu() -> bool:
    """Whether a `PeakMemory` measures a CPU peak now (the comm probe then settles collectives' buffers)."""
    return _measuring_cpu > 0


class PeakMemory:
    """Peak live tensor bytes of this rank between `start()` and `stop()` (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.prior_bytes = 0  # live before the run began (`note_prior`), left out of both figures (bytes)
        self.start_bytes = 0  # live at `start`: the baseline the peak includes (bytes)
        self.peak_bytes = 0
        self._tracker: _LiveStorages | None = None
        self._prior: dict[int, weakref.ref] = {}  # CPU: the storages live at `note_prior`, by id

    def note_prior(self) -> int:
        """Record what is live now, before the run builds anything; return it (bytes)."""
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.synchronize(self.device)
            self.prior_bytes = torch.cuda.memory_allocated(self.device)
        else:  # each storage once, as `_LiveStorages` counts them (no tracker: nothing is watched yet)
            prior = {id(st): st for st in reachable_storages()}
            self._prior = {key: weakref.ref(st) for key, st in prior.items()}
            self.prior_bytes = sum(st.nbytes() for st in prior.values())
        return self.prior_bytes

    def start(self, state_tensors: Iterable[torch.Tensor] = ()) -> None:
        if self.device.type == "cuda":
            gc.collect()  # what earlier runs left in reference cycles is still allocated until collected
            torch.cuda.synchronize(self.device)  # frees queued behind kernels happen before the reset
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = torch.cuda.memory_allocated(self.device) - self.prior_bytes
            return
        self._tracker = _LiveStorages(skip=self._prior)
        self._tracker.add(reachable_storages())
        self._tracker.add(storages(state_tensors))
        self.start_bytes = self._tracker.live_bytes
        self._tracker.start()
        global _measuring_cpu
        _measuring_cpu += 1

    def stop(self) -> int:
        """Stop measuring; return the peak (bytes), less `prior_bytes`."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self.prior_bytes
        elif self._tracker is not None:
            global _measuring_cpu
            _measuring_cpu -= 1
            self._tracker.stop()
            self.peak_bytes = self._tracker.peak_bytes
            self._tracker = None
        return self.peak_bytes


def reachable_storages() -> list[torch.UntypedStorage]:
    """The storages of every tensor Python can reach, once the garbage of reference cycles is collected."""
    gc.collect()
    reachable = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]  # no __class__ lookups
    return list(storages(reachable))


class _LiveStorages(TorchDispatchMode):
    """Live storage bytes, kept exact by weak references; `peak_bytes` is their maximum so far.

    The storages in `skip` (id -> weak reference, while the reference still points at them) are not counted.
    """

    def __init__(self, skip: dict[int, weakref.ref] | None = None):
        super().__init__()
        self._skip = skip or {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._nbytes: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._lock = threading.Lock()
        self._resize = None

    def add(self, sts: Iterable[torch.UntypedStorage]) -> None:
        for st in sts:
            self._see(st)

    def _see(self, st: torch.UntypedStorage) -> None:
        key = id(st)
        prior = self._skip.get(key)
        if prior is not None and prior() is st:
            return
        nbytes = st.nbytes()
        with self._lock:
            old = self._nbytes.get(key)
            if old is None:
                self._refs[key] = weakref.ref(st, lambda _, key=key: self._freed(key))
                old = 0
            self._nbytes[key] = nbytes
            self.live_bytes += nbytes - old
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _freed(self, key: int) -> None:
        with self._lock:
            self.live_bytes -= self._nbytes.pop(key, 0)
            self._refs.pop(key, None)

    def start(self) -> None:
        original = torch.UntypedStorage.resize_
        self._resize = original
        tracker = self

        def resize_(storage, size):
            out = original(storage, size)
            tracker._see(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        self.__enter__()

    def stop(self) -> None:
        self.__exit__(None, None, None)
        torch.UntypedStorage.resize_ = self._resize

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.add(storages(tree_leaves(out)))
        return out
