"""The scaffold a learner's ZeRO-3 plugs into: units, the four moments as real hooks, an engine for the loop.

The learner writes the pieces (`Pieces`: shard, gather, the four moments, the optimizer); `attach` cuts
the model into units (the root, then each block), shards every parameter with the learner's `shard`,
frees the full ones, and calls the learner's moments from forward / tensor / gradient hooks, in the order
they fire. `Learner(pieces)` is an engine the lab's shared loop (`labkit.engines.loop.run`) builds on
every rank and measures like any other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.engines.base import RankInfo, RunConfig, adamw
from labkit.engines.on_rank import to_rank_device
from labkit.model import loss_fn
from labkit.outputs import needing_grad
from labkit.units import UnitSpec, model_units

MOMENTS = ("before_forward", "after_forward", "before_backward", "after_grad")


@dataclass(eq=False)
class Unit:
    """One unit of the model as the learner's moments see it. Compared by identity (a dict key is fine).

    `params`: the module's own parameters, the full-shape tensors the model computes with (for the root,
    the model's parameters outside `model.blocks`); `shards`: this rank's float32 rows of each, leaf
    tensors the optimizer updates (after_grad sets each `.grad`); `d0`: each parameter's dim-0 size
    (rows). `next` / `prev` are the neighbours in forward order (root, blocks.0, ...). In backward the root
    fires first, then the blocks from the last: `backward_next` is the unit whose backward runs after this
    one's (the root's: the last block; blocks.0's: None, the root is still gathered then). `pending` is
    the learner's: e.g. a prefetched gather (notebook 03).
    """

    name: str
    module: nn.Module
    params: list[nn.Parameter]
    shards: list[torch.Tensor]
    d0: list[int]
    rank: int
    n: int
    group: Any = None
    next: Unit | None = None
    prev: Unit | None = None
    pending: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, {len(self.params)} params, rank {self.rank} of {self.n})"

    @property
    def backward_next(self) -> Unit | None:
        """The unit whose backward runs after this one's, read off the forward order. A property, not a field:
        code that walks a unit's fields (the capstone's memory probe) meets no new loop of units."""
        if self.prev is None:  # the root: its output's gradient comes first, then the last block's
            last = self
            while last.next is not None:
                last = last.next
            return last if last is not self else None
        return self.prev if self.prev.prev is not None else None  # blocks.0: the root is still gathered


@dataclass
class Pieces:
    """The learner's ZeRO-3, one callable per step of the build; None where that step is not written yet.

    shard(full, rank, n) -> Tensor     this rank's ceil(d0/n) rows of `full`, zero-padded, float32
    gather(shard, d0, group=None)      all-gather every rank's shard, keep the first d0 rows
    before_forward(unit)               gather the unit's weights into `unit.params`
    after_forward(unit)                free them
    before_backward(unit)              gather them again: autograd needs them
    after_grad(unit)                   every param has its full `.grad`: reduce-scatter into each shard's
                                       `.grad` (the mean over ranks), drop the full grads and weights
    make_optimizer(shards)             the optimizer over the shards (None: `adamw(shards, cfg)`)

    Prefetch (notebook 03) is these same moments written again, not a new piece: before_forward waits for
    the unit's gather and issues `unit.next`'s, before_backward the same with `unit.backward_next`; the
    scaffold keeps the order of the units, the moments say when each gather is issued and waited for.

    What None does: `attach` needs `shard` (it raises without it); `gather` is only called by the
    learner's own moments and by the checks. A moment left None does nothing when it fires, and with no
    `before_forward` the full weights are kept (nothing would gather them back). With no `after_grad` the
    full gradients stay on `unit.params` and the shards get none, so the optimizer leaves them as they are.
    """

    shard: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None
    gather: Callable[..., torch.Tensor] | None = None
    before_forward: Callable[[Unit], None] | None = None
    after_forward: Callable[[Unit], None] | None = None
    before_backward: Callable[[Unit], None] | None = None
    after_grad: Callable[[Unit], None] | None = None
    make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None


def attach(
    model: nn.Module, pieces: Pieces, group=None, trace: list | None = None, units: UnitSpec = None
) -> list[Unit]:
    """Shard `model` in place with the learner's `pieces` and wire their moments; the units, root first.

    Run it on every rank of `group` (default: the world) inside an initialised process group. `trace`
    gets `(moment, unit.name)` appended as each moment fires, whether or not the learner wrote it.
    `units`: the modules to shard one at a time, as `labkit.zero.ZeRO3` takes them (None: `model.blocks`;
    `instances_of(GPT2Block)` for a Hugging Face GPT-2). The model may take keyword inputs and return any
    mix of tensors, tuples, dicts and dataclasses.
    """
    if pieces.shard is None:
        raise ValueError("pieces.shard is None: write shard(full, rank, n) first, the build's first step")
    if not dist.is_initialized():
        raise RuntimeError("attach needs an initialised process group; run it inside labkit.launch")
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    made = [
        Unit(name, module, params, [], [p.shape[0] for p in params], rank, n, group)
        for name, module, params in unit_params(model, units)
    ]
    for before, after in zip(made, made[1:], strict=False):
        before.next, after.prev = after, before
    for unit in made:
        for param in unit.params:
            unit.shards.append(pieces.shard(param.detach(), rank, n).detach())
            if pieces.before_forward is not None:  # else nothing would gather it back
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    _Moments(pieces, made, trace).install()
    return made


def unit_params(model: nn.Module, units: UnitSpec = None) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """(name, module, its parameters) per unit: the root (the model minus its units), then each unit."""
    return [(name, module, [p for _, p in params]) for name, module, params in model_units(model, units)]


class _Moments:
    """The hooks that call the learner's moments: forward pre/post hooks on each unit's module, a tensor
    hook on its output (before_backward), and a count of accumulated gradients per unit (after_grad)."""

    def __init__(self, pieces: Pieces, units: list[Unit], trace: list | None):
        self.pieces = pieces
        self.units = units
        self.trace = trace
        self.grads_left: dict[Unit, int] = {}
        self.backward_begun: set[Unit] = set()

    def install(self) -> None:
        for unit in self.units:
            unit.module.register_forward_pre_hook(lambda _m, _args, unit=unit: self.before_forward(unit))
            unit.module.register_forward_hook(lambda _m, _args, out, unit=unit: self.after_forward(unit, out))
            for param in unit.params:
                param.register_post_accumulate_grad_hook(lambda _p, unit=unit: self.grad_ready(unit))

    def fire(self, moment: str, unit: Unit) -> None:
        if self.trace is not None:
            self.trace.append((moment, unit.name))
        learner = getattr(self.pieces, moment)
        if learner is not None:
            learner(unit)

    def before_forward(self, unit: Unit) -> None:
        if unit is self.units[0]:  # the model's forward starts: a new step's gradients to count
            self.grads_left = {u: len(u.params) for u in self.units}
            self.backward_begun = set()
        self.fire("before_forward", unit)

    def after_forward(self, unit: Unit, output: Any) -> None:
        """The learner's after_forward; before_backward armed on every output tensor autograd will reach
        (`output`: a tensor, tuple, dict or dataclass, as a Hugging Face block returns)."""
        self.fire("after_forward", unit)
        for tensor in needing_grad(output):
            tensor.register_hook(lambda _grad: self.before_backward(unit))

    def before_backward(self, unit: Unit) -> None:
        if unit not in self.backward_begun:  # once per step, whichever output's gradient comes first
            self.backward_begun.add(unit)
            self.fire("before_backward", unit)

    def grad_ready(self, unit: Unit) -> None:
        self.grads_left[unit] = self.grads_left.get(unit, len(unit.params)) - 1
        if self.grads_left[unit] == 0:
            self.fire("after_grad", unit)


# ------------------------------------------------------------------------------------------------ engine


@dataclass(eq=False)
class Learner:
    """The learner's ZeRO-3 as an engine of the lab's loop: `loop.run(Learner(pieces), cfg)`.

    `build` is what the loop calls on every rank (like an engine module's `build`).
    """

    pieces: Pieces
    name: str = "learner"
    units: UnitSpec = (
        None  # the modules to shard one at a time (None: `model.blocks`), as `attach` takes them
    )

    def build(self, cfg: RunConfig, model: nn.Module, info: RankInfo) -> LearnerEngine:
        return LearnerEngine(self.pieces, cfg, model, info, self.name, self.units)


class LearnerEngine:
    """The model on this rank's device, sharded by `attach`, and the learner's optimizer over the shards.

    `trace` lists (moment, unit) as they fired, every step.
    """

    def __init__(
        self,
        pieces: Pieces,
        cfg: RunConfig,
        model: nn.Module,
        info: RankInfo,
        name: str = "learner",
        units: UnitSpec = None,
    ):
        self.name = name
        self.model = to_rank_device(model, info.device)
        self.trace: list[tuple[str, str]] = []
        self.units = attach(self.model, pieces, trace=self.trace, units=units)
        self.shards = [s for unit in self.units for s in unit.shards]
        make = pieces.make_optimizer or (lambda shards: adamw(shards, cfg))
        self.optimizer = make(self.shards)

    def forward_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(self.model(tokens).float(), targets)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()  # after_grad sets every shard's .grad afresh: nothing to zero

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The shards, their grads, the optimizer's state; and the full parameters (0 B once freed). An optimizer
        over host copies of the shards (notebook 04's offload: on the CPU, none of them a shard's storage) keeps
        its copies, their grads and its state apart, as "host_optimizer"."""
        full = [p for unit in self.units for p in unit.params]
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        own = [p for group in self.optimizer.param_groups for p in group["params"]]
        device = {s.untyped_storage().data_ptr() for s in self.shards}
        host = bool(own) and all(p.is_cpu and p.untyped_storage().data_ptr() not in device for p in own)
        kept = {
            "params": [*self.shards, *full],
            "grads": [t.grad for t in [*self.shards, *full] if t.grad is not None],
            "optimizer": [] if host else state,
        }
        return kept | (
            {"host_optimizer": [*own, *(p.grad for p in own if p.grad is not None), *state]} if host else {}
        )
