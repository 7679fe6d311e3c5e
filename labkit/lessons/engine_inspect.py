"""What notebook 02 reads off two engines on live ranks: FSDP1's flat parameters and the scratch engine's hooks.

Each function runs on the ranks (`labkit.launch(fn, world_size, ...)`) and returns plain data: `inspect_flat`
what each FSDP1 unit's real `FlatParameter` holds, `hook_trace` every hook the scratch engine fired, in order.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FlatParameter
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from labkit.engines import fsdp1
from labkit.engines.base import RunConfig
from labkit.engines.on_rank import rank_batch, rank_info, rank_model
from labkit.model import build_model, loss_fn


def inspect_flat(cfg: RunConfig) -> list[dict[str, Any]]:
    """On this rank (under `labkit.launch`): what each unit's real `FlatParameter` holds, root first.

    Per unit: its name, whether it is a `FlatParameter` (torch makes it an `nn.Parameter` flagged
    `_is_flat_param`, so `type()` says Parameter), the original parameters it flattens (names relative to
    the model, shapes), `flat_numel` (their elements), `padded_numel` (the all-gathered buffer),
    `shard_numel` (this rank's slice), `shard_padding` (padding elements in this slice) and `segments`:
    (name, start, stop) of each piece of a parameter in this rank's slice, in elements of the whole flat
    buffer (`labkit.layout.flat_layout`'s offsets).
    """
    info = rank_info()
    engine = fsdp1.build(cfg, build_model(cfg.model, cfg.seed), info)
    out = []
    for unit in FSDP.fsdp_modules(engine.model):
        p = unit._flat_param
        prefix = "" if unit is engine.model else f"{_unit_name(engine.model, unit)}."
        shard_numel = p.numel()
        rank_in_group = unit.rank  # rank inside the shard group (HSDP: inside the replica)
        segments = [
            (
                prefix + fqn,
                rank_in_group * shard_numel + s.offset_in_shard,
                rank_in_group * shard_numel + s.offset_in_shard + s.numel_in_shard,
            )
            for fqn, s in zip(p._fqns, p._shard_param_infos, strict=True)
            if s.in_shard
        ]
        out.append(
            {
                "unit": prefix[:-1] or "root",
                "is_flat_parameter": isinstance(p, FlatParameter),
                "type": type(p).__name__,
                "params": [
                    (prefix + fqn, tuple(shape)) for fqn, shape in zip(p._fqns, p._shapes, strict=True)
                ],
                "flat_numel": p._unpadded_unsharded_size.numel(),
                "padded_numel": shard_numel * unit.world_size,
                "shard_numel": shard_numel,
                "shard_padding": p._shard_numel_padded,
                "segments": segments,
            }
        )
    return out


def _unit_name(root: nn.Module, unit: nn.Module) -> str:
    """`unit`'s name in the model without FSDP1's `_fsdp_wrapped_module.` prefixes, e.g. "blocks.0"."""
    for name, module in root.named_modules():
        if module is unit:
            return name.replace("_fsdp_wrapped_module.", "")
    raise ValueError("unit is not a module of root")


def hook_trace(model_name: str = "tiny", steps: int = 2) -> list[tuple[int, str, str]]:
    """On this rank, train `steps` scratch steps and return (step, moment, unit) for every hook that fired.

    Run it under `labkit.launch`, in the instructor's copy (labkit's own ZeRO-3 is not in the student copy).
    """
    from labkit.zero import ShardedAdamW, ZeRO3

    trace: list = []
    model = rank_model(model_name)
    zero = ZeRO3(model, trace=trace)
    optimizer = ShardedAdamW(zero.shards())
    out = []
    for step in range(steps):
        tokens, targets = rank_batch(step, model_name, 0, dist.get_world_size(), dist.get_rank())
        loss_fn(model(tokens), targets).backward()
        zero.finish_backward()
        optimizer.step()
        out += [(step, moment, unit) for moment, unit in trace]
        trace.clear()
    return out
