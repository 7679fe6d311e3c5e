"""Inspections of FSDP2's own surface, each a rank-side function that returns what it read off real tensors.

Run any of them with `labkit.launch(fn, world_size, cfg, ...)` (notebook 05 does): what `fully_shard` turns
a parameter into, one mixed-precision policy per block, `Replicate()` against `Shard(0)` for one tensor,
and the `fsdp` log of a first step with and without per-block wraps. Bytes are counted by labkit's probe.
The HSDP, compile, checkpoint and tensor-parallel runs are in `fsdp2_features`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from labkit.engines import fsdp2
from labkit.engines.base import RunConfig, adamw
from labkit.engines.on_rank import rank_batch, rank_info, rank_model, train_steps
from labkit.lessons.fsdp2_features import build_engine, shard_mesh
from labkit.model import loss_fn
from labkit.names import ALL_GATHER
from labkit.probes import Probes

PLACEMENT_NAMES = ("blocks.0.qkv.weight", "blocks.0.ln1.bias", "tok.weight")


def param_placements(cfg: RunConfig, names: Sequence[str] = PLACEMENT_NAMES) -> dict[str, Any]:
    """What `fully_shard` turned each named parameter into on this rank: type, mesh, placements, shapes."""
    params = dict(build_engine(cfg).model.named_parameters())
    out = {}
    for name in names:
        p = params[name]
        sharded = isinstance(p, DTensor)
        out[name] = {
            "type": type(p).__name__,
            "is_dtensor": sharded,
            "mesh": str(p.device_mesh) if sharded else None,
            "placements": str(p.placements) if sharded else None,
            "global_shape": tuple(p.shape),
            "local_shape": tuple(p.to_local().shape) if sharded else tuple(p.shape),
        }
    return out


def mixed_precision_by_block(cfg: RunConfig, bf16_blocks: Sequence[int] = (0, 1)) -> dict[str, Any]:
    """One `MixedPrecisionPolicy` per block: bf16 weights for `bf16_blocks`, fp32 for the rest.

    Returns per block the dtype its weights had while it ran forward, the all-gather payload measured for
    it by the probe in the last step (bytes), and the losses. Gradients are reduced in fp32 everywhere.
    """
    info = rank_info()
    mesh = shard_mesh()
    model = rank_model(cfg.model, cfg.seed, info.device)
    policies = {
        True: MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        # float32 named explicitly, so the block casts a bf16 input from the block before it back up.
        False: MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32),
    }
    seen: dict[int, str] = {}
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, mp_policy=policies[i in bf16_blocks])
    fully_shard(model, mesh=mesh)
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda mod, _a, i=i: seen.__setitem__(i, str(mod.fc.weight.dtype)))
    engine = fsdp2.Fsdp2Engine(model, adamw(model.parameters(), cfg), info.device)
    with Probes(info.rank, info.device) as probes:
        losses = train_steps(engine, cfg, probes=probes)
    gathers = [c for c in probes.comm.calls if c.kind == ALL_GATHER and c.step == cfg.steps - 1]
    return {
        "param_dtype": {i: seen.get(i) for i in range(len(model.blocks))},
        "block_numel": {i: sum(p.numel() for p in b.parameters()) for i, b in enumerate(model.blocks)},
        "all_gather_payload_bytes": [c.payload_bytes for c in gathers],
        "losses": losses,
    }


def replicate_vs_shard(cfg: RunConfig, name: str = "pos.weight") -> dict[str, Any]:
    """One parameter as a DTensor placed `Replicate()` and `Shard(0)` on the 1-D mesh: local shape and bytes."""
    mesh = shard_mesh()
    full = dict(rank_model(cfg.model, cfg.seed).named_parameters())[name].detach()
    out = {}
    for placement in (Replicate(), Shard(0)):
        local = distribute_tensor(full, mesh, [placement]).to_local()
        out[repr(placement)] = {
            "local_shape": tuple(local.shape),
            "local_bytes": local.numel() * local.element_size(),
        }
    return out


def first_step_logs(cfg: RunConfig, per_block: bool = True) -> dict[str, Any]:
    """The `fsdp` log of a first step (what `TORCH_LOGS=+fsdp` prints), with or without per-block wraps.

    `per_block=False` is the classic misconfigured shard: `fully_shard` on the root only, so the whole
    model is one group, gathered in one all-gather before the first layer runs. Returns the log lines, the
    all-gather calls of the step and the largest one's payload (bytes) against the model's parameter bytes.
    """
    info = rank_info()
    mesh = shard_mesh()
    model = rank_model(cfg.model, cfg.seed, info.device)
    if per_block:
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = adamw(model.parameters(), cfg)
    with _fsdp_log() as lines, Probes(info.rank, info.device) as probes, probes.step(0):
        # FSDP2 moves the forward's inputs to the device, not the targets: both come from rank_batch.
        tokens, targets = rank_batch(0, cfg.model, cfg.seed, info.world_size, info.rank, info.device)
        loss_fn(model(tokens), targets).backward()
        optimizer.step()
    gathers = [c.payload_bytes for c in probes.comm.calls if c.kind == ALL_GATHER]
    return {
        "log": lines,
        "all_gather_calls": len(gathers),
        "largest_all_gather_payload_bytes": max(gathers, default=0),
        "model_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


@contextmanager
def _fsdp_log() -> Iterator[list[str]]:
    """Collect torch's `fsdp` debug log lines into a list instead of printing them on each rank.

    `torch._logging.set_logs` is the in-process form of `TORCH_LOGS=+fsdp` (ranks forked from a notebook
    have imported torch already, so the environment variable would be read too late).
    """
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    torch._logging.set_logs(fsdp=logging.DEBUG)
    logger = logging.getLogger("torch.distributed.fsdp")
    saved = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [handler], False
    try:
        yield lines
    finally:
        logger.handlers, logger.propagate = saved
        torch._logging.set_logs()
