"""The capstone's memory checks: what makes it ZeRO-3, weighed around the student's moments on every rank.

The probe side (`Watch`) weighs the full tensors each unit holds (`held_bytes`: whatever its fields reach,
its parameters, `pending` and any attribute the student added, and the storages its parameters had when its
weights were last gathered, while alive) when its `after_forward` returns, the most all units hold together
while the model's forward runs, and the full and sharded gradients left when its `after_grad` returns. In the
step the judges read, those two moments also weigh any tensor Python reaches that holds rows of the unit's
weights that another rank keeps (a copy kept in the answers' globals). The judges compare them with what
ZeRO-3 keeps: nothing full between a unit's forward and backward, at most the root, the block computing and
the one prefetched during the forward, and only gradient shards after the reduce-scatter. The judges size
their bounds by the `labkit.grading.capstone.Run` they are given (the grade's hidden model or the notebook's).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from typing import TYPE_CHECKING, NamedTuple

from labkit.grading.kit import tally

if TYPE_CHECKING:
    from labkit.grading.capstone_run import Run

# --------------------------------------------------------------------------------------------- the probe


# A unit's fields that are not its to hold: the module, its shards (the state ZeRO-3 keeps), its neighbours.
NOT_HELD = ("module", "shards", "next", "prev")
MIN_ROWS_BYTES = 64  # a block of other ranks' rows shorter than this could match other bytes by chance
COPY_DTYPES = ("float16", "bfloat16", "float32", "float64")  # a copy kept in another dtype holds these bytes


class Gathered(NamedTuple):
    """What tells a unit's gathered weights, taken when a gather moment returns: its parameters' storages
    then (weak references) and the bytes of each block of rows that another rank keeps, in each floating
    dtype (COPY_DTYPES), which only a gathered copy of the weights holds (blocks shorter than MIN_ROWS_BYTES,
    or all zeros, are left out)."""

    storages: list[weakref.ref]
    others_rows: list[bytes]


def gathered(unit, rows: bool = True) -> Gathered:
    """`Gathered` of `unit` now (its weights just gathered into its parameters); `rows`: with the blocks of
    other ranks' rows too (a copy of them, only worth taking where `held_bytes` looks `anywhere`)."""
    from labkit.probes.memory import storages

    refs = [weakref.ref(st) for st in storages(unit.params) if st.nbytes()]
    if not rows:
        return Gathered(refs, [])
    import torch

    blocks = []
    for param, shard in zip(unit.params, unit.shards, strict=True):
        k = shard.shape[0]
        for r in range(unit.n):
            if r == unit.rank:
                continue
            rows = param.detach()[r * k : (r + 1) * k]
            for dtype in COPY_DTYPES:
                block = rows.to(getattr(torch, dtype))
                if block.numel() * block.element_size() >= MIN_ROWS_BYTES and bool(block.any()):
                    blocks.append(_raw(block))
    return Gathered(refs, blocks)


def held_bytes(
    unit, seen: Gathered | None = None, anywhere: bool = False, before: frozenset = frozenset()
) -> int:
    """Full-tensor bytes `unit` holds now: the storages of every tensor its fields reach (its parameters,
    `pending`, any attribute the student added; tensors, tuples, lists, dicts, dataclasses) and those of
    `seen.storages` still alive: its parameters' storages when its weights were last gathered. A free that
    swaps a parameter's tensor (`p.data = torch.empty(0)`) leaves the gathered storage to autograd, which
    saved it in forward. `anywhere`: also every storage Python reaches that holds a block of
    `seen.others_rows` (a copy kept in the answers' globals), but for those at the addresses in `before`
    (alive before the run began: a forked rank's copy of its parent's tensors, which may hold the same
    weights). Each storage once, its shards' and their gradients' left out; a freed one holds 0 B.
    """
    from labkit.outputs import output_tensors
    from labkit.probes.memory import storages

    own = {st.data_ptr() for st in storages([*unit.shards, *(s.grad for s in unit.shards)])}
    fields = [value for name, value in vars(unit).items() if name not in NOT_HELD]
    held = {st.data_ptr(): st.nbytes() for st in storages(output_tensors(fields))}
    if seen is not None:
        held.update((st.data_ptr(), st.nbytes()) for st in (ref() for ref in seen.storages) if st is not None)
        if anywhere and seen.others_rows:
            held.update(
                (st.data_ptr(), st.nbytes())
                for st in _holding(seen.others_rows, skip=own | set(held) | before)
            )
    return sum(nbytes for ptr, nbytes in held.items() if ptr not in own)


def _holding(blocks: list[bytes], skip: set[int]) -> list:
    """The storages of the tensors Python reaches (not those at the addresses in `skip`, nor those of a
    collective in flight) whose bytes hold any of `blocks`."""
    import gc

    import torch

    from labkit.probes.comm import in_flight
    from labkit.probes.memory import storages

    objects = gc.get_objects()
    tensors = [o for o in objects if issubclass(type(o), torch.Tensor)]  # no __class__ lookups
    skip = skip | in_flight(objects)  # a receive buffer not yet written holds its memory's stale bytes
    found = {}
    for st in storages(tensors):
        ptr = st.data_ptr()
        if ptr in skip or ptr in found or st.nbytes() < MIN_ROWS_BYTES or st.device.type != "cpu":
            continue
        raw = _raw(torch.empty(0, dtype=torch.uint8).set_(st))
        if any(block in raw for block in blocks):
            found[ptr] = st
    return list(found.values())


def _alive_now() -> list:
    """Weak references to the storages of every tensor Python reaches now (a storage freed later, whose
    address a new tensor may reuse, is then no longer among them)."""
    import weakref

    from labkit.probes.memory import reachable_storages

    return [weakref.ref(st) for st in reachable_storages()]


def _raw(t) -> bytes:
    """The bytes of a contiguous CPU tensor, through a copy (a storage numpy has viewed cannot be resized:
    the student's `load` and `free` must still work)."""
    import torch

    return t.reshape(-1).view(torch.uint8).clone().numpy().tobytes()


class Watch:
    """The student's moments, weighed as they return: what each unit still holds after its forward and
    after its gradients are reduced, and the most the units hold together while the model's forward runs.
    Each step overwrites the last: the judge reads a steady step."""

    def __init__(self, pieces):
        self.pieces = pieces
        self._before = _alive_now()  # made in the rank before the model: what the run's tensors are not
        self.after_forward: dict[str, int] = {}
        self.after_grad: dict[str, dict] = {}
        self.peak = {"bytes": 0, "unit": ""}
        self.units: list = []
        self.gathered: dict[str, Gathered] = {}  # unit name -> `gathered` at the unit's last gather

    def wrapped(self):
        """The pieces with four moments weighed (the other fields as the student wrote them)."""
        p = self.pieces
        moments = {
            "before_forward": self._before_forward,
            "after_forward": self._after_forward,
            "before_backward": self._before_backward,
            "after_grad": self._after_grad,
        }
        return dataclasses.replace(
            p,
            **{
                name: functools.partial(watch, getattr(p, name))
                for name, watch in moments.items()
                if getattr(p, name) is not None
            },
        )

    def _before_forward(self, moment, unit) -> None:
        if unit.prev is None:  # the root: the model's forward starts
            self.units = [unit]
            while self.units[-1].next is not None:
                self.units.append(self.units[-1].next)
            self.peak = {"bytes": 0, "unit": ""}
        moment(unit)
        self._gathered(unit)
        total = sum(self._held(u) for u in self.units)
        if total > self.peak["bytes"]:
            self.peak = {"bytes": total, "unit": unit.name}

    def _held(self, unit, anywhere: bool = False) -> int:
        """`held_bytes`; `anywhere` only in the step whose CPU peak the loop measures (the last, the one the
        judges read), where the comm probe also frees a collective's buffers in the program's own order."""
        from labkit.probes.memory import measuring_cpu

        before = frozenset(st.data_ptr() for st in (ref() for ref in self._before) if st is not None)
        return held_bytes(unit, self.gathered.get(unit.name), anywhere and measuring_cpu(), before)

    def _after_forward(self, moment, unit) -> None:
        moment(unit)
        self.after_forward[unit.name] = self._held(unit, anywhere=True)

    def _before_backward(self, moment, unit) -> None:
        moment(unit)
        self._gathered(unit)

    def _gathered(self, unit) -> None:
        """Note what tells `unit`'s gathered weights; their rows only in the step weighed `anywhere`."""
        from labkit.probes.memory import measuring_cpu

        self.gathered[unit.name] = gathered(unit, rows=measuring_cpu())

    def _after_grad(self, moment, unit) -> None:
        moment(unit)
        full_grads = sum(p.grad.untyped_storage().nbytes() for p in unit.params if p.grad is not None)
        shard_grads = sum(
            s.grad.numel() * s.grad.element_size()
            for s in unit.shards
            if s.grad is not None and tuple(s.grad.shape) == tuple(s.shape)
        )
        self.after_grad[unit.name] = {
            "weights": self._held(unit, anywhere=True),
            "grads": full_grads,
            "shard_grads": shard_grads,
        }


# -------------------------------------------------------------------------------------------- the judges


def _numel(run: Run, unit: str) -> int:
    """Elements of one unit's full parameters, unpadded: what `load` puts into them."""
    return sum(math.prod(shape) for shape, _ in run.unit_shapes()[unit])


def full_weight_bound(run: Run) -> int:
    """Most full-weight bytes a rank may hold while the model's forward runs: the root's padded weights
    (its forward is the whole model's), the block computing and the block whose gather is prefetched."""
    blocks = [name for name in run.unit_shapes() if name != "root"]
    per_block = max(run.padded_elements(name) for name in blocks)
    return 4 * (run.padded_elements("root") + 2 * per_block)


def freed_judge(got: list, run: Run) -> tuple[float, str]:
    """Each unit holds no full weight once its after_forward returns, and the forward's peak stays within
    `full_weight_bound`."""
    units = list(run.unit_shapes())
    bound = full_weight_bound(run)
    least = 4 * (_numel(run, "root") + _numel(run, "blocks.0"))
    cases = []
    for rank, seen in enumerate(got):
        for unit in units:
            held = seen["after_forward"].get(unit)
            cases.append(
                (
                    held == 0,
                    f"rank {rank}: {unit}'s after_forward never returned"
                    if held is None
                    else f"rank {rank}: {unit} still held {held:,} B of full weights after its forward "
                    "returned (in its parameters, in what the unit keeps, or in a storage autograd saved: "
                    "free a parameter's storage, not its tensor): free them in after_forward (from a "
                    "unit's forward to its backward ZeRO-3 keeps only the shards)",
                )
            )
        peak = seen["peak"]
        if int(peak["bytes"]) < least:  # no run gathers less: the weights never reached unit.params
            return 0.0, (
                f"rank {rank}: at most {int(peak['bytes']):,} B of full weights were held during the forward, "
                f"less than the root's and one block's own ({least:,} B): gather into unit.params"
            )
        cases.append(
            (
                int(peak["bytes"]) <= bound,
                f"rank {rank}: {int(peak['bytes']):,} B of full weights were held at once during the forward "
                f"(after {peak['unit']}'s before_forward), more than the root, the block computing and the "
                f"one prefetched ({bound:,} B): gather one unit ahead, not the model",
            )
        )
    return tally(cases)


def sharded_grads_judge(got: list, run: Run) -> tuple[float, str]:
    """After each unit's reduce-scatter: no full gradient or weight left, and fp32 gradient shards of the
    shards' own shapes."""
    cases = []
    for rank, seen in enumerate(got):
        for unit in run.unit_shapes():
            done = seen["after_grad"].get(unit)
            if done is None:
                cases.append((False, f"rank {rank}: {unit}'s after_grad never ran"))
                continue
            problems = []
            if done["grads"]:
                problems.append(
                    f"kept {done['grads']:,} B of full gradients (set each p.grad to None once reduced)"
                )
            if done["weights"]:
                problems.append(
                    f"held {done['weights']:,} B of full weights or gradients (free the weights and keep "
                    "no full tensor in after_grad)"
                )
            want = 4 * run.padded_elements(unit) // run.ranks
            if done["shard_grads"] != want:
                problems.append(
                    f"left {done['shard_grads']:,} B of gradient shards of their shards' shapes, want {want:,} B"
                )
            cases.append(
                (not problems, f"rank {rank}: after its reduce-scatter {unit} {'; '.join(problems)}")
            )
    return tally(cases)
