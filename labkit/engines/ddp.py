"""The `ddp` engine: torch `DistributedDataParallel`, every rank a full replica, gradients all-reduced.

Two settings make it measurable and honest: gradients are views into DDP's buckets
(`gradient_as_bucket_view=True`), so the state counted is the memory really held (16 B/param in float32,
no hidden bucket copy); and the all-reduce goes through the stock Python comm hook
(`default_hooks.allreduce_hook`: divide by n, then `dist.all_reduce`), the same arithmetic as DDP's
built-in C++ path, but visible to the probes, which wrap `torch.distributed`'s Python functions.
Limit: DDP waits on that all-reduce inside C++, so its exposed time sits in the backward span and no
"wait" event is recorded for it. `options["activation_checkpointing"]` wraps each block before DDP
(`labkit.engines.activation_checkpointing`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from labkit.engines import activation_checkpointing
from labkit.engines.base import RankInfo, RunConfig
from labkit.engines.registry import DDP
from labkit.engines.single import SingleEngine, state_tensors

NAME = DDP
OPTIONS = ("activation_checkpointing",)  # the cfg.options keys it honours


class DdpEngine(SingleEngine):
    """One DDP replica and its AdamW: `single`'s step, on a DDP-wrapped model."""

    name = NAME

    def __init__(self, model: nn.Module, cfg: RunConfig, info: RankInfo):
        model = model.to(info.device)
        device_ids = [info.device.index] if info.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        super().__init__(ddp, cfg, info.device)  # zero_grad(set_to_none=False) keeps grads as bucket views

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return state_tensors(self.model.module, self.optimizer)


def build(cfg: RunConfig, model: nn.Module, rank_info: RankInfo) -> DdpEngine:
    return DdpEngine(activation_checkpointing.apply(model, cfg), cfg, rank_info)
