"""The four moments of ZeRO-3, as hooks on each unit of the model.

    before_forward   all-gather the unit's weights (or wait for the prefetched gather); prefetch the next
    after_forward    free them again (reshard_after_forward), and arm before_backward on the output
    before_backward  all-gather the weights again for the backward pass; prefetch the previous unit
    after_grad       when every trainable parameter of the unit has its gradient: reduce-scatter into the
                     shards, free the full gradients and the full weights

The units are the modules `labkit.units` cuts the model into (by default each block of
`model.blocks`) plus the root (every other parameter: embeddings, final norm, head, shared weights), whose
"forward" is the whole model's: gathered as the model starts, freed when it returns. `finish_backward`
closes the step: it reduces what no hook reduced (a unit or parameter this step did not use).

With `split_root` the root is cut into an input unit and an output unit (`labkit.units.split_root`),
so each is gathered only around its own compute. The input unit (the embeddings) is gathered as the model
starts and freed as the first unit starts; its backward begins when its modules' outputs get their
gradients, after the first unit's backward, behind which its gather is prefetched. The output unit (final
norm, head) is gathered as its first module starts (after the last unit) and kept across the
forward/backward turn, where it is needed again at once (FSDP2 keeps its root the same way): one all-gather
fewer per step, its weights held meanwhile.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labkit.outputs import needing_grad
from labkit.units import INPUT, OUTPUT, ROOT, UnitSpec, unit_plan
from labkit.zero.prefetch import Prefetcher
from labkit.zero.unit import ShardedParam, ShardedState, ShardedUnit

__all__ = ["ZeRO3"]


class ZeRO3:
    """Shard `model` in place across `group`: each unit (by default each block of `model.blocks`) is
    gathered and reduced on its own, the rest is the root.

    `units`: the modules to shard one at a time, or a policy such as `instances_of(SomeLayer)` (see
    `labkit.units`). `reshard_after_forward`: free each unit's weights after its forward (and gather
    them again for backward); False keeps them until the gradients are reduced (ZeRO-2-like traffic, more
    memory). `prefetch`: overlap the next unit's all-gather with this unit's compute. `compute_dtype`:
    dtype of the gathered weights (torch.bfloat16 for mixed precision); the shards, the gradient
    reduction and the optimizer stay float32. `replicate_group`: HSDP's replica group (`labkit.zero.hsdp`),
    with `group` the shard group. `trace`: a list to append (moment, unit) to. `split_root`: the root as an
    input and an output unit (module docstring). `prefetch_depth`: how many units ahead to gather.
    """

    def __init__(
        self,
        model: nn.Module,
        group=None,
        reshard_after_forward: bool = True,
        prefetch: bool = True,
        compute_dtype: torch.dtype = torch.float32,
        trace: list | None = None,
        *,
        units: UnitSpec = None,
        replicate_group=None,
        split_root: bool = False,
        prefetch_depth: int = 1,
    ):
        if not dist.is_initialized():
            raise RuntimeError("ZeRO3 needs an initialised process group; run it inside labkit.launch")
        self.model = model
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.prefetcher = Prefetcher(prefetch, prefetch_depth)
        self.trace = trace
        self.units = [
            ShardedUnit(name, module, params, group, compute_dtype, replicate_group)
            for name, module, params in unit_plan(model, units, split_root)
        ]
        named = {u.name: u for u in self.units if u.module is model}
        self.root, self.input_unit, self.output_unit = (named.get(k) for k in (ROOT, INPUT, OUTPUT))
        first_unit = next((u.module for u in self.units if u.module is not model), None)
        self._grads_left: dict[ShardedUnit, int] = {}
        self._backward_begun: set[ShardedUnit] = set()
        self._reducing: list[ShardedUnit] = []
        model.register_forward_pre_hook(lambda module, args: self.start_step())
        for unit in self.units:
            if unit is self.input_unit:
                self._install_input(unit, first=first_unit)
            elif unit is self.output_unit:
                self._install_output(unit)
            else:
                self._install(unit)

    # ---------------------------------------------------------------------------------------- hooks

    def start_step(self) -> None:
        """The model's forward begins: every unit waits for all of its trainable parameters' gradients."""
        self._grads_left = {u: len(u.trainable) for u in self.units}
        self._backward_begun = set()

    def before_forward(self, unit: ShardedUnit) -> None:
        self._log("before_forward", unit)
        self.prefetcher.saw_forward(unit)
        unit.start_gather(async_op=False)  # nothing to do when a prefetch issued it already
        unit.finish_gather()
        for ahead in self.prefetcher.ahead_in_forward(unit):
            ahead.start_gather(async_op=True)

    def after_forward(self, unit: ShardedUnit, output: Any) -> None:
        """Free the weights (not the output unit's when a backward follows: module docstring); arm
        before_backward on the output's tensors (`output`: any pytree; None: armed elsewhere, as the input
        unit's are on its modules' outputs). A no-grad or eval forward keeps nothing gathered."""
        self._log("after_forward", unit)
        armed = [] if output is None else needing_grad(output)
        backward_follows = self.model.training and (bool(armed) or output is None and torch.is_grad_enabled())
        kept = unit is self.output_unit and backward_follows
        if self.reshard_after_forward and not kept:
            unit.free()
        self._arm_backward(unit, output)

    def before_backward(self, unit: ShardedUnit) -> None:
        if unit in self._backward_begun:  # a unit with two outputs (the input unit's embeddings): the first
            return
        self._backward_begun.add(unit)
        self._log("before_backward", unit)
        self.prefetcher.saw_backward(unit)
        unit.start_gather(async_op=False)  # nothing to do when prefetched, or kept since forward
        unit.finish_gather()
        for ahead in self.prefetcher.ahead_in_backward(unit):
            ahead.start_gather(async_op=True)

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
        self._watch_grads(unit)

    def _install_input(self, unit: ShardedUnit, first: nn.Module) -> None:
        """The input unit's forward runs from the model's start to the first unit's; its backward begins at
        the first gradient of its modules' outputs (after the first unit's backward, not inside it)."""
        self.model.register_forward_pre_hook(lambda module, args: self.before_forward(unit))
        first.register_forward_pre_hook(lambda module, args: self._input_ends(unit))
        for module in self._modules_of(unit):
            module.register_forward_hook(lambda module, args, out: self._arm_backward(unit, out))
        self._watch_grads(unit)

    def _input_ends(self, unit: ShardedUnit) -> None:
        self.after_forward(unit, None)  # returns None: a forward pre-hook's result would replace the args

    def _install_output(self, unit: ShardedUnit) -> None:
        """The output unit's forward runs from its first module's start (after the last unit's forward) to the
        model's end: the model's output is its own."""
        first = self._modules_of(unit)[0]
        first.register_forward_pre_hook(lambda module, args: self.before_forward(unit))
        self.model.register_forward_hook(lambda module, args, out: self.after_forward(unit, out))
        self._watch_grads(unit)

    def _modules_of(self, unit: ShardedUnit) -> list[nn.Module]:
        """The modules that hold a root part's parameters, in module order (its parameters have model names)."""
        paths = dict.fromkeys(sp.name.rpartition(".")[0] for sp in unit.params)
        return [self.model.get_submodule(path) for path in paths]

    def _arm_backward(self, unit: ShardedUnit, output: Any) -> None:
        """before_backward on the first gradient to reach any tensor of `output` (a pytree; before_backward
        runs once per unit and step)."""
        for tensor in needing_grad(output):
            tensor.register_hook(lambda grad: self.before_backward(unit))

    def _watch_grads(self, unit: ShardedUnit) -> None:
        """A hook on each trainable parameter (a frozen one gets no gradient) counts the unit's gradients.

        The hooks live in autograd's C++ side, where Python's garbage collector cannot see that they
        hold this object: they hold it weakly (the module hooks, which it can see, keep it alive as long
        as the model), or every ZeRO3 ever built would keep its model's weights alive in the process.
        """
        zero, unit_ref = weakref.ref(self), weakref.ref(unit)
        for sp in unit.trainable:
            sp.param.register_post_accumulate_grad_hook(lambda p: zero()._grad_ready(unit_ref()))

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
            prefix = (
                "" if unit.module is self.model else f"{unit.name}."
            )  # the root and its parts: model names
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
