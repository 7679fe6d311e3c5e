"""The `fsdp2` engine: PyTorch's own ZeRO-3, `fully_shard` once per block and once on the root.

In one sentence: every parameter becomes a `Shard(0)` DTensor; a block's pre-forward hook all-gathers its
shards into plain tensors, and its post-backward hook reduce-scatters the full gradient into a `Shard(0)`
gradient, on which `torch.optim.AdamW` updates only the local rows. This file is the idiomatic recipe
(PyTorch's `examples/distributed/FSDP2`), nothing clever, and it asserts the placements it claims.

Options, from `RunConfig` and `cfg.options` (keys below):
- `cfg.reshard_after_forward` (bool) or `options["reshard_after_forward"]` (bool or int, the group size to
  reshard to after forward, a proper divisor of the world size) for every block. The root group keeps
  FSDP2's own default: it stays gathered from forward to backward, because backward starts with it.
- `cfg.prefetch`: True sets explicit prefetch, each block all-gathering the next `cfg.prefetch_depth`
  blocks (default 1) in forward and the previous ones in backward. False (depth 0) leaves FSDP2's defaults: no forward prefetch, and the implicit one-block backward prefetch, which FSDP2
  has no switch to turn off (an empty prefetch list means "use the default").
- `cfg.dtype == "bfloat16"`: `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: bf16 weights
  are gathered and computed with, gradients reduce-scattered in fp32, the fp32 shard is the master copy.
- `options["hsdp_shard_size"]` (int, or "node" for the ranks of one node: LOCAL_WORLD_SIZE): HSDP, a
  (replicate, shard) mesh: each parameter is sharded over a shard group of that many consecutive ranks
  and replicated across the world_size / size groups; all-gathers and reduce-scatters stay inside the
  shard group, and each gradient shard is then all-reduced across the groups. Absent: one shard group.
- `cfg.offload == "cpu"`: `CPUOffloadPolicy`, the shards, gradients and optimizer state live on the host
  and each all-gather copies the shard to the device first. On a CPU-only machine the policy runs its
  code path but moves nothing (host and device are the same memory), and it needs `pin_memory=False`
  there: the default `pin_memory=True` asks for an accelerator and fails.
- `options["activation_checkpointing"]` (bool): each block wrapped in torch's non-reentrant
  `checkpoint_wrapper` before `fully_shard` (`labkit.engines.activation_checkpointing`): backward
  re-gathers the block (its pre-backward hook), then recomputes it; the bytes per step do not change.

The engine does not compile. `torch.compile` never traces FSDP2's hooks in torch 2.13 (each is wrapped in
`torch._dynamo.disable`), so no all-gather or reduce-scatter is ever in a graph; what compiles is a block's
body, and a block compiled before `fully_shard` compiles with `fullgraph=True` (`fsdp2_features.compile_sharded`
shows both from a run).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Shard

from labkit import cluster
from labkit.budget import collective_wire_bytes, padded_numel
from labkit.engines import activation_checkpointing
from labkit.engines.base import ModelEngine, RankInfo, RunConfig, adamw
from labkit.engines.registry import FSDP2
from labkit.names import ALL_GATHER, ALL_REDUCE, NVME, REDUCE_SCATTER
from labkit.probes.memory import STEP_SCALAR_BYTES, STEP_SCALARS, in_categories

NAME = FSDP2
OPTIONS = ("hsdp_shard_size", "reshard_after_forward", "activation_checkpointing")  # cfg.options it honours


def shard_kwargs(cfg: RunConfig, mesh: DeviceMesh) -> dict[str, Any]:
    """The `fully_shard` keywords shared by every group: mesh, mixed precision and offload policies."""
    if cfg.offload == NVME:
        raise ValueError(f"offload={cfg.offload!r}: the fsdp2 engine offloads to 'none' or 'cpu'")
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.dtype == "bfloat16"
        else MixedPrecisionPolicy()
    )
    offload_policy = (
        CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cfg.offload == "cpu" else OffloadPolicy()
    )
    return {"mesh": mesh, "mp_policy": mp_policy, "offload_policy": offload_policy}


def hsdp_shard_size(cfg: RunConfig, world_size: int) -> int:
    """Ranks per HSDP shard group: `options["hsdp_shard_size"]`, "node" = this node's ranks; world_size if unset.

    Shard groups are consecutive ranks, so "node" puts each group on one node (launchers number ranks node
    by node).
    """
    value = cfg.options.get("hsdp_shard_size", world_size)
    if value == "node":
        value = cluster.ranks_per_node(world_size)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or world_size % value:
        raise ValueError(
            f"hsdp_shard_size={value!r}: pass a number of ranks that divides world_size={world_size} "
            "(or 'node' for the ranks of one node)"
        )
    return value


def block_reshard(cfg: RunConfig, world_size: int) -> bool | int:
    """Each block's `reshard_after_forward`: True, False, or the smaller group size to reshard to (ranks)."""
    value = cfg.options.get("reshard_after_forward", cfg.reshard_after_forward)
    if isinstance(value, bool):
        return value
    if not isinstance(value, int) or value <= 1 or value >= world_size or world_size % value:
        raise ValueError(
            f"reshard_after_forward={value!r}: pass True, False, or a group size that divides "
            f"world_size={world_size} and lies strictly between 1 and {world_size}"
        )
    return value


def shard_model(model: nn.Module, cfg: RunConfig, mesh: DeviceMesh) -> FSDPModule:
    """`fully_shard` each block, then the root (tok, pos, ln_f, head form the root group); set prefetch."""
    common = shard_kwargs(cfg, mesh)
    reshard = block_reshard(cfg, mesh.size(-1))
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard, **common)
    fully_shard(model, **common)
    if cfg.prefetch:
        set_explicit_prefetch(model, cfg.prefetch_depth)
    return model  # type: ignore[return-value]


def set_explicit_prefetch(model: nn.Module, depth_blocks: int) -> None:
    """Block i all-gathers blocks i+1..i+depth during its forward and i-1..i-depth during its backward."""
    if depth_blocks < 1:
        raise ValueError(f"prefetch_depth={depth_blocks}: pass 1 or more blocks, or prefetch=False")
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + depth_blocks])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - depth_blocks) : i][::-1])


def sharded_adamw(params, cfg: RunConfig) -> torch.optim.AdamW:
    """The lab's AdamW over an FSDP2 model's parameters: DTensors in one param group, plain tensors (`ignored_params`)
    in another.

    AdamW's foreach path (the default for CUDA tensors) refuses plain tensors and DTensors in one call ("got mixed
    torch.Tensor and DTensor"); a group of each kind keeps every call to one kind. The update of each parameter
    is the same; with no plain tensor it is one group, as `adamw` makes it.
    """
    params = list(params)
    kinds = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return adamw([{"params": kind} for kind in kinds if kind], cfg)


def placements(model: nn.Module) -> dict[str, str]:
    """Each parameter's DTensor placements as text, e.g. {"blocks.0.qkv.weight": "(Shard(dim=0),)"}."""
    return {
        name: str(p.placements) if isinstance(p, DTensor) else type(p).__name__
        for name, p in model.named_parameters()
    }


def assert_sharded(model: nn.Module, mesh: DeviceMesh) -> None:
    """Every parameter is a DTensor on `mesh`, sharded on dim 0 over the mesh's last (shard) dimension."""
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            raise AssertionError(
                f"{name} is a {type(p).__name__}, not a DTensor: fully_shard did not wrap it"
            )
        if p.device_mesh != mesh or p.placements[-1] != Shard(0):
            raise AssertionError(
                f"{name} has placements {p.placements} on {p.device_mesh}, expected Shard(0)"
            )


class Fsdp2Engine(ModelEngine):
    """One rank of the fsdp2 engine: the sharded model and an AdamW over its local shards."""

    name = NAME

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Local shards only: each DTensor's `to_local()`; AdamW's exp_avg, exp_avg_sq and step per tensor.

        fp32 AdamW keeps 4 (param) + 4 (grad) + 8 (two moments) = 16 B per parameter / n, plus one 4-byte
        `step` scalar per parameter tensor. FSDP2 pads each parameter's shard storage to ceil(dim0 / n)
        rows; `to_local()` is the unpadded view, so uneven shapes show their padding only in the
        all-gather sizes, not here.
        """
        params = list(self.model.parameters())
        optimizer = [
            _local(t) for p in params for t in self.optimizer.state.get(p, {}).values() if torch.is_tensor(t)
        ]
        return {
            "params": [_local(p.data) for p in params],
            "grads": [_local(p.grad) for p in params if p.grad is not None],
            "optimizer": optimizer,
        }


def predicted_wire_bytes(model: nn.Module, cfg: RunConfig, world_size: int) -> dict[str, int]:
    """Per rank per step, the all-gather and reduce-scatter wire bytes this engine's wrap plan implies.

    `model` is the unsharded lab model. Groups: one per block, and the root (everything else). Forward
    all-gathers every group; backward all-gathers each block again when it was resharded after forward
    (over the smaller group when `reshard_after_forward` is an int), never the root, which FSDP2 keeps
    gathered; every group's gradients are reduce-scattered once, in fp32. Each parameter is padded on
    dim 0 to a multiple of the world size (FSDP2's layout), and each group is one collective. Under HSDP
    (`hsdp_shard_size` = s) all of that happens inside a shard group of s ranks (padding to a multiple of
    s), and each group's fp32 gradient shard is all-reduced across the world_size / s replicas.
    """
    n = hsdp_shard_size(cfg, world_size)
    param_bytes = cfg.compute_bytes
    reshard = block_reshard(cfg, n)
    block_ids = {id(p) for b in model.blocks for p in b.parameters()}
    groups = [list(b.parameters()) for b in model.blocks]
    groups.append([p for p in model.parameters() if id(p) not in block_ids])
    gathered, reduced, all_reduced = 0, 0, 0
    replicas = world_size // n
    for i, group in enumerate(groups):
        numel = sum(padded_numel(p.shape, n) for p in group)
        gathered += collective_wire_bytes(ALL_GATHER, numel * param_bytes, n)
        is_block = i < len(model.blocks)
        if is_block and reshard is not False:
            backward_group = n if reshard is True else reshard
            gathered += collective_wire_bytes(ALL_GATHER, numel * param_bytes, backward_group)
        reduced += collective_wire_bytes(REDUCE_SCATTER, numel * 4, n)
        all_reduced += collective_wire_bytes(ALL_REDUCE, numel // n * 4, replicas)
    out = {ALL_GATHER: gathered, REDUCE_SCATTER: reduced}
    return out | ({ALL_REDUCE: all_reduced} if replicas > 1 else {})


def state_bytes_by_term(model: nn.Module, cfg: RunConfig, world_size: int, rank: int = 0) -> dict[str, int]:
    """Bytes `rank` keeps between steps, as `Fsdp2Engine.state_tensors` shows them to `labkit.probes`:
    "params", "grads", "optimizer" (AdamW's two moments) and `STEP_SCALARS`, on a line of its own.

    FSDP2 cuts dim 0 of each parameter into chunks of ceil(d0 / s) rows (s: the shard group, `world_size`
    without HSDP), so a rank holds between 0 and ceil(d0 / s) rows of it: fp32 shard 4 B and gradient 4 B per
    element it holds, AdamW's two moments 8 B, and one 4-byte step scalar per parameter tensor (AdamW keeps
    one per tensor it updates). With every d0 divisible by s that is 16 B/param / s + 4 B per tensor.
    """
    s = hsdp_shard_size(cfg, world_size)
    r = rank % s
    held = 0
    for p in model.parameters():
        rows = -(-p.shape[0] // s)
        held += max(0, min(rows, p.shape[0] - r * rows)) * (p.numel() // p.shape[0])
    tensors = len(list(model.parameters()))
    return {
        "params": 4 * held,
        "grads": 4 * held,
        "optimizer": 8 * held,
        STEP_SCALARS: STEP_SCALAR_BYTES * tensors,
    }


def state_bytes_accounting(
    model: nn.Module, cfg: RunConfig, world_size: int, rank: int = 0
) -> dict[str, int]:
    """`state_bytes_by_term` in the probe's three categories: params, grads, optimizer (bytes)."""
    return in_categories(state_bytes_by_term(model, cfg, world_size, rank))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def device_mesh(device_type: str, world_size: int, shard_size: int | None = None) -> DeviceMesh:
    """The mesh FSDP2 shards over: 1-D ("shard",) of every rank, or 2-D ("replicate", "shard") for HSDP.

    `shard_size` ranks (consecutive) share each parameter's shards; None or `world_size` is full sharding.
    """
    shard = shard_size or world_size
    if shard == world_size:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (world_size // shard, shard), mesh_dim_names=("replicate", "shard"))


def build(cfg: RunConfig, model: nn.Module, rank_info: RankInfo) -> Fsdp2Engine:
    """Shard `model` over a 1-D mesh of all ranks (gloo CPU mesh or NCCL GPU mesh), then build its AdamW.

    With `hsdp_shard_size` below the world size the mesh is 2-D, (replicate, shard): HSDP.

    The optimizer is built after sharding, from the `Shard(0)` DTensors: while a group is unsharded,
    `model.parameters()` yields its full plain tensors, which FSDP2 frees after use.
    """
    n = rank_info.world_size
    mesh = device_mesh(rank_info.device.type, n, hsdp_shard_size(cfg, n))
    activation_checkpointing.apply(model, cfg)  # before fully_shard: FSDP2's hooks go on the wrapper
    shard_model(model, cfg, mesh)
    assert_sharded(model, mesh)
    return Fsdp2Engine(model, sharded_adamw(model.parameters(), cfg), rank_info.device)
