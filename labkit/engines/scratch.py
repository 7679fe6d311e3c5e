"""The `scratch` engine: labkit's own ZeRO-3 (`labkit.zero`) driving the lab's model.

Options from `RunConfig`: `prefetch`, `reshard_after_forward`, `dtype` ("bfloat16": bf16 gathered weights
and compute, float32 gradient reduction, master shards and AdamW), `offload` ("cpu": the optimizer state
in separate host buffers, see `labkit.zero.optimizer`). From `cfg.options` (anything else is refused by
`check_run`, never ignored): `hsdp_shard_size` (int, or "node"), HSDP over shard groups of that many
consecutive ranks, replicated across the others (`labkit.zero.hsdp`); `labkit compare --hsdp` sets it.
`activation_checkpointing` (bool): each block wrapped in torch's non-reentrant `checkpoint_wrapper`
before `ZeRO3` shards it (`labkit.engines.activation_checkpointing`): `before_backward` re-gathers the
block, then autograd recomputes it; the bytes per step do not change.
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.budget import collective_wire_bytes, padded_numel
from labkit.engines import activation_checkpointing
from labkit.engines.base import RankInfo, RunConfig
from labkit.model import loss_fn
from labkit.zero import ShardedAdamW, ZeRO3
from labkit.zero.hsdp import hsdp_groups
from labkit.zero.units import UnitSpec, model_units

NAME = "scratch"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
OPTIONS = ("hsdp_shard_size", "activation_checkpointing")  # the cfg.options keys it honours


def check_run(cfg: RunConfig) -> None:
    """Refuse, in one sentence naming the engine and the setting, any option this engine does not do."""
    unknown = sorted(set(cfg.options) - set(OPTIONS))
    if unknown:
        whose = ""
        if "zero_hpz_partition_size" in unknown:
            whose = " (zero_hpz_partition_size, --hpz, is DeepSpeed's)"
        raise ValueError(
            f"options {unknown}: the scratch engine has no such setting{whose}; it takes {', '.join(OPTIONS)}"
        )
    shard_size(cfg, cfg.world_size)


def shard_size(cfg: RunConfig, world_size: int) -> int:
    """Ranks per shard group: `options["hsdp_shard_size"]` ("node": one node's ranks), else every rank."""
    if "hsdp_shard_size" not in cfg.options:
        return world_size  # without importing fsdp2 (about 1 s per rank)
    from labkit.engines.fsdp2 import hsdp_shard_size  # the one reading of the option, shared with fsdp2

    return hsdp_shard_size(cfg, world_size)


class ScratchEngine:
    """The model sharded by `ZeRO3` and a `ShardedAdamW` over this rank's trainable shards.

    `units`: which modules to shard one at a time (`ZeRO3`'s `units`; None: `model.blocks`), for a model
    that is not the lab's.
    """

    name = NAME

    def __init__(self, model: nn.Module, cfg: RunConfig, info: RankInfo, units: UnitSpec = None):
        self.model = model.to(info.device)
        g = shard_size(cfg, info.world_size)
        groups = hsdp_groups(g) if g < info.world_size else None
        self.zero = ZeRO3(
            self.model,
            group=groups.shard if groups else None,
            reshard_after_forward=cfg.reshard_after_forward,
            prefetch=cfg.prefetch,
            compute_dtype=DTYPES[cfg.dtype],
            units=units,
            replicate_group=groups.replicate if groups else None,
        )
        self.optimizer = ShardedAdamW(
            self.zero.trainable_shards(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
            weight_decay=cfg.weight_decay, offload=cfg.offload == "cpu",
        )  # fmt: skip

    def forward_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(self.model(tokens).float(), targets)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.zero.finish_backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        shards = self.zero.shards()
        state = {
            "params": shards,
            "grads": [s.grad for s in shards if s.grad is not None],
            "optimizer": [] if self.optimizer.offload else self.optimizer.state_tensors(),
        }
        if self.optimizer.offload:
            state["host_optimizer"] = self.optimizer.state_tensors()
        return state


def predicted_wire_bytes(
    model: nn.Module, cfg: RunConfig, world_size: int, units: UnitSpec = None
) -> dict[str, int]:
    """Per rank per step, the all-gather, reduce-scatter (and HSDP all-reduce) wire bytes of this engine.

    Every unit (each block and the root) is gathered before its forward and, when it was resharded
    after forward, again before its backward: 2 x (g-1)/g x its padded bytes in the compute dtype, over
    the shard group of g ranks (g = world_size without HSDP); its trainable gradients are reduce-scattered
    once in float32: (g-1)/g x padded elements x 4 B; under HSDP each unit's gradient shard (its padded
    elements / g) is then all-reduced across the r = world_size / g replicas: 2(r-1)/r x shard x 4 B.
    """
    g = shard_size(cfg, world_size)
    replicas = world_size // g
    compute_bytes = DTYPES[cfg.dtype].itemsize
    gathers = 2 if cfg.reshard_after_forward else 1
    out = {"all_gather": 0, "reduce_scatter": 0} | ({"all_reduce": 0} if replicas > 1 else {})
    for _, _, params in model_units(model, units):  # `units` as the engine was given them
        padded = sum(padded_numel(tuple(p.shape), g) for _, p in params)
        trained = sum(padded_numel(tuple(p.shape), g) for _, p in params if p.requires_grad)
        out["all_gather"] += gathers * collective_wire_bytes("all_gather", padded * compute_bytes, g)
        out["reduce_scatter"] += collective_wire_bytes("reduce_scatter", trained * 4, g)
        if replicas > 1:
            out["all_reduce"] += collective_wire_bytes("all_reduce", trained // g * 4, replicas)
    return out


def build(cfg: RunConfig, model: nn.Module, rank_info: RankInfo) -> ScratchEngine:
    return ScratchEngine(activation_checkpointing.apply(model, cfg), cfg, rank_info)


def hook_trace(model_name: str = "tiny", steps: int = 2) -> list[tuple[int, str, str]]:
    """On this rank, train `steps` scratch steps and return (step, moment, unit) for every hook that fired.

    Run it under `labkit.launch`; the notebook on the scratch engine prints rank 0's list.
    """
    import torch.distributed as dist

    from labkit.engines.loop import rank_batch, rank_model

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
