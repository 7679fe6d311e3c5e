"""The four moments of ZeRO-3, as hooks on each unit of the model.

    before_forward   all-gather the unit's weights (or wait for the prefetched gather); prefetch the next
    after_forward    free them again (reshard_after_forward), and arm before_backward on the output
    before_backward  all-gather the weights again for the backward pass; prefetch the previous unit
    after_grad       when every trainable parameter of the unit has its gradient: reduce-scatter into the
                     shards, free the full gradients and the full weights

The units are the modules `labkit.zero.units` cuts the model into (by default each block of
`model.blocks`) plus the root (every other parameter: embeddings, final norm, head, shared weights), whose
"forward" is the whole model's: gathered as the model starts, freed when it returns. `finish_backward`
closes the step: it reduces what no hook reduced (a unit or parameter this step did not use).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from labkit.zero.prefetch import Prefetcher
from labkit.zero.unit import ShardedParam, ShardedState, ShardedUnit
from labkit.zero.units import UnitSpec, instances_of, model_units

__all__ = ["ZeRO3", "instances_of", "model_units"]


class ZeRO3:
    """Shard `model` in place across `group`: each unit (by default each block of `model.blocks`) is
    gathered and reduced on its own, the rest is the root.

    `units`: the modules to shard one at a time, or a policy such as `instances_of(SomeLayer)` (see
    `labkit.zero.units`). `reshard_after_forward`: free each unit's weights after its forward (and gather
    them again for backward); False keeps them until the gradients are reduced (ZeRO-2-like traffic, more
    memory). `prefetch`: overlap the next unit's all-gather with this unit's compute. `compute_dtype`:
    dtype of the gathered weights (torch.bfloat16 for mixed precision); the shards, the gradient
    reduction and the optimizer stay float32. `replicate_group`: HSDP's replica group (`labkit.zero.hsdp`),
    with `group` the shard group. `trace`: a list to append (moment, unit) to.
    """

    def __init__(self, model: nn.Module, group=None, reshard_after_forward: bool = True,
                 prefetch: bool = True, compute_dtype: torch.dtype = torch.float32, trace: list | None = None,
                 *, units: UnitSpec = None, replicate_group=None):  # fmt: skip
        if not dist.is_initialized():
            raise RuntimeError("ZeRO3 needs an initialised process group; run it inside labkit.launch")
        self.model = model
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.prefetcher = Prefetcher(prefetch)
        self.trace = trace
        self.units = [
            ShardedUnit(name, module, params, group, compute_dtype, replicate_group)
            for name, module, params in model_units(model, units)
            if params  # a root without parameters of its own (all of them in units) is no unit
        ]
        self.root = next((u for u in self.units if u.module is model), None)
        self._grads_left: dict[ShardedUnit, int] = {}
        self._reducing: list[ShardedUnit] = []
        model.register_forward_pre_hook(lambda module, args: self.start_step())
        for unit in self.units:
            self._install(unit)

    # ---------------------------------------------------------------------------------------- hooks

    def start_step(self) -> None:
        """The model's forward begins: every unit waits for all of its trainable parameters' gradients."""
        self._grads_left = {u: len(u.trainable) for u in self.units}

    def before_forward(self, unit: ShardedUnit) -> None:
        self._log("before_forward", unit)
        self.prefetcher.saw_forward(unit)
        unit.start_gather(async_op=False)  # nothing to do when a prefetch issued it already
        unit.finish_gather()
        nxt = self.prefetcher.next_in_forward(unit)
        if nxt is not None:
            nxt.start_gather(async_op=True)

    def after_forward(self, unit: ShardedUnit, output: torch.Tensor) -> torch.Tensor:
        self._log("after_forward", unit)
        if self.reshard_after_forward:
            unit.free()
        if torch.is_grad_enabled() and output.requires_grad:
            output.register_hook(lambda grad: self.before_backward(unit))
        return output

    def before_backward(self, unit: ShardedUnit) -> None:
        self._log("before_backward", unit)
        self.prefetcher.saw_backward(unit)
        unit.start_gather(async_op=False)  # nothing to do when prefetched, or kept since forward
        unit.finish_gather()
        nxt = self.prefetcher.next_in_backward(unit)
        if nxt is not None:
            nxt.start_gather(async_op=True)

    def after_grad(self, unit: ShardedUnit) -> None:
        self._log("after_grad", unit)
        unit.start_reduce_scatter(async_op=self.prefetcher.enabled)
        unit.free()
        self._reducing.append(unit)

    def finish_backward(self) -> None:
        """After `loss.backward()`: close the step, so every shard has its `.grad` and every unit is sharded.

        A unit some trainable parameter of which this step did not use got no `after_grad` from the hooks:
        it is reduced here (that parameter's gradient is 0, not last step's). A prefetched gather no hook
        finished (a unit this step skipped) is finished and dropped, so the next step gathers the updated
        shards; a unit without trainable parameters, gathered for backward, is freed. Then the
        reduce-scatters still in flight are waited for. Which units and parameters a step uses must be the
        same on every rank, so that every rank issues the same collectives in the same order.
        """
        for unit in self.units:
            if unit.state is ShardedState.GATHERING:
                unit.finish_gather()
            if unit.trainable and unit not in self._reducing:
                self.after_grad(unit)
            unit.free()
        for unit in self._reducing:
            unit.finish_reduce_scatter()
        self._reducing = []
        self.prefetcher.finish_recording()

    # ---------------------------------------------------------------------------------------- wiring

    def _install(self, unit: ShardedUnit) -> None:
        unit.module.register_forward_pre_hook(lambda module, args: self.before_forward(unit))
        unit.module.register_forward_hook(lambda module, args, out: self.after_forward(unit, out))
        for sp in unit.trainable:  # a frozen parameter gets no gradient, so no hook
            sp.param.register_post_accumulate_grad_hook(lambda p, unit=unit: self._grad_ready(unit))

    def _grad_ready(self, unit: ShardedUnit) -> None:
        self._grads_left[unit] -= 1
        if self._grads_left[unit] == 0:
            self.after_grad(unit)

    def _log(self, moment: str, unit: ShardedUnit) -> None:
        if self.trace is not None:
            self.trace.append((moment, unit.name))

    # ---------------------------------------------------------------------------------------- views

    def shards(self) -> list[torch.Tensor]:
        """Every float32 master shard this rank owns, frozen ones included, root first then units in order."""
        return [s for unit in self.units for s in unit.shards()]

    def trainable_shards(self) -> list[torch.Tensor]:
        """The shards an optimizer updates: those of trainable parameters, each with a `.grad` view."""
        return [sp.shard for unit in self.units for sp in unit.trainable]

    def named_shards(self) -> list[tuple[str, torch.Tensor]]:
        """(parameter name in the model, this rank's shard), in the order of `shards()`."""
        return [(name, sp.shard) for name, sp in self._named_params()]

    def _named_params(self) -> Iterator[tuple[str, ShardedParam]]:
        """(name in the model, sharded parameter) for every parameter, in the order of `shards()`."""
        for unit in self.units:
            prefix = "" if unit is self.root else f"{unit.name}."
            yield from ((prefix + sp.name, sp) for sp in unit.params)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded float32 weights, gathered on every rank of the shard group (tests, checkpoints)."""
        from labkit.zero.sharding import unshard_dim0

        out = {}
        d0 = {name: sp.d0 for name, sp in self._named_params()}
        for name, shard in self.named_shards():
            parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(parts, shard.contiguous(), group=self.group)
            out[name] = unshard_dim0(parts, d0[name])
        return out
