"""The `ddp` engine: torch `DistributedDataParallel`, every rank a full replica, gradients all-reduced.

Two settings make it measurable and honest: gradients are views into DDP's buckets
(`gradient_as_bucket_view=True`), so the state counted is the memory really held (16 B/param in float32,
no hidden bucket copy); and the all-reduce goes through the stock Python comm hook
(`default_hooks.allreduce_hook`: divide by n, then `dist.all_reduce`), the same arithmetic as DDP's
built-in C++ path, but visible to the probes, which wrap `torch.distributed`'s Python functions.
Limit: DDP waits on that all-reduce inside C++, so its exposed time sits in the backward span and no
"wait" event is recorded for it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from labkit.engines.base import RankInfo, RunConfig, adamw
from labkit.engines.single import autocast, state_tensors
from labkit.model import loss_fn

NAME = "ddp"


class DdpEngine:
    """One DDP replica and its AdamW (same hyper-parameters as `single`)."""

    name = NAME

    def __init__(self, model: nn.Module, cfg: RunConfig, info: RankInfo):
        model = model.to(info.device)
        device_ids = [info.device.index] if info.device.type == "cuda" else None
        self.model = DistributedDataParallel(model, device_ids=device_ids, gradient_as_bucket_view=True)
        self.model.register_comm_hook(None, default_hooks.allreduce_hook)
        self.optimizer = adamw(self.model.parameters(), cfg)
        self.device = info.device
        self.bf16 = cfg.dtype == "bfloat16"

    def forward_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with autocast(self.device, self.bf16):
            logits = self.model(tokens)
        return loss_fn(logits.float(), targets)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)  # keep the grads as bucket views

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return state_tensors(self.model.module, self.optimizer)


def build(cfg: RunConfig, model: nn.Module, rank_info: RankInfo) -> DdpEngine:
    return DdpEngine(model, cfg, rank_info)
