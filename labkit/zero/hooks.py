"""The four moments of ZeRO-3, as hooks on each unit of the model.

    before_forward   all-gather the unit's weights (or wait for the prefetched gather); prefetch the next
    after_forward    free them again (reshard_after_forward), and arm before_backward on the output
    before_backward  all-gather the weights again for the backward pass; prefetch the previous unit
    after_grad       when every parameter of the unit has its gradient: reduce-scatter into the shards,
                     free the full gradients and the full weights

The units are the blocks plus the root (the parameters outside any block: embeddings, final norm, head),
whose "forward" is the whole model's: gathered as the model starts, freed when it returns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from labkit.zero.prefetch import Prefetcher
from labkit.zero.unit import ShardedUnit


def model_units(model: nn.Module) -> list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]:
    """(name, module, its named parameters) per unit: the root (the model minus its blocks), then each
    `model.blocks[i]`; a ValueError in a sentence for a model without blocks."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise ValueError(
            f"{type(model).__name__} has no `blocks` ModuleList to shard; ZeRO-3 here shards a model "
            "whose repeated layers are in model.blocks (like labkit.model.GPT)"
        )
    in_blocks = {id(p) for p in blocks.parameters()}
    root = [(n, p) for n, p in model.named_parameters() if id(p) not in in_blocks]
    return [
        ("root", model, root),
        *((f"blocks.{i}", b, list(b.named_parameters())) for i, b in enumerate(blocks)),
    ]


class ZeRO3:
    """Shard `model` in place across `group`: each block of `model.blocks` is a unit, the rest is the root.

    `reshard_after_forward`: free each unit's weights after its forward (and gather them again for
    backward); False keeps them until the gradients are reduced (ZeRO-2-like traffic, more memory).
    `prefetch`: overlap the next unit's all-gather with this unit's compute.
    `compute_dtype`: dtype of the gathered weights (torch.bfloat16 for mixed precision); the shards,
    the gradient reduction and the optimizer stay float32. `trace`: a list to append (moment, unit) to.
    """

    def __init__(self, model: nn.Module, group=None, reshard_after_forward: bool = True,
                 prefetch: bool = True, compute_dtype: torch.dtype = torch.float32, trace: list | None = None):  # fmt: skip
        if not dist.is_initialized():
            raise RuntimeError("ZeRO3 needs an initialised process group; run it inside labkit.launch")
        self.model = model
        self.reshard_after_forward = reshard_after_forward
        self.prefetcher = Prefetcher(prefetch)
        self.trace = trace
        self.units = [ShardedUnit(*unit, group, compute_dtype) for unit in model_units(model)]
        self.root, self.blocks = self.units[0], self.units[1:]
        self._grads_left: dict[ShardedUnit, int] = {}
        self._reducing: list[ShardedUnit] = []
        for unit in self.units:
            self._install(unit)

    # ---------------------------------------------------------------------------------------- hooks

    def before_forward(self, unit: ShardedUnit) -> None:
        self._log("before_forward", unit)
        self.prefetcher.saw_forward(unit)
        unit.start_gather(async_op=False)  # nothing to do when a prefetch issued it already
        unit.finish_gather()
        if unit is self.root:
            self._grads_left = {u: len(u.params) for u in self.units}
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
        """Wait for the gradient reduce-scatters still in flight; then every shard has its `.grad`."""
        for unit in self._reducing:
            unit.finish_reduce_scatter()
        self._reducing = []
        self.prefetcher.finish_recording()

    # ---------------------------------------------------------------------------------------- wiring

    def _install(self, unit: ShardedUnit) -> None:
        unit.module.register_forward_pre_hook(lambda module, args: self.before_forward(unit))
        unit.module.register_forward_hook(lambda module, args, out: self.after_forward(unit, out))
        for sp in unit.params:
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
        """Every float32 master shard this rank owns, root first then blocks in order."""
        return [s for unit in self.units for s in unit.shards()]

    def named_shards(self) -> list[tuple[str, torch.Tensor]]:
        """(parameter name in the model, this rank's shard), in the order of `shards()`."""
        prefix = {u: "" if u is self.root else f"{u.name}." for u in self.units}
        return [(prefix[u] + sp.name, sp.shard) for u in self.units for sp in u.params]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unsharded float32 weights, gathered on every rank (for tests and checkpoints)."""
        from labkit.zero.sharding import unshard_dim0

        out = {}
        for name, shard in self.named_shards():
            parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(self.root.group))]
            dist.all_gather(parts, shard.contiguous(), group=self.root.group)
            d0 = dict(self.model.named_parameters())[name].shape[0]
            out[name] = unshard_dim0(parts, d0)
        return out
