"""The `scratch` engine: labkit's own ZeRO-3 (`labkit.zero`) driving the lab's model.

Options from `RunConfig`: `prefetch`, `reshard_after_forward`, `dtype` ("bfloat16": bf16 gathered weights
and compute, float32 gradient reduction, master shards and AdamW), `offload` ("cpu": the optimizer state
in separate host buffers, see `labkit.zero.optimizer`).
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.engines.base import RankInfo, RunConfig
from labkit.model import loss_fn
from labkit.zero import ShardedAdamW, ZeRO3

NAME = "scratch"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ScratchEngine:
    """The model sharded by `ZeRO3` and a `ShardedAdamW` over this rank's shards."""

    name = NAME

    def __init__(self, model: nn.Module, cfg: RunConfig, info: RankInfo):
        self.model = model.to(info.device)
        self.zero = ZeRO3(
            self.model,
            reshard_after_forward=cfg.reshard_after_forward,
            prefetch=cfg.prefetch,
            compute_dtype=DTYPES[cfg.dtype],
        )
        self.optimizer = ShardedAdamW(
            self.zero.shards(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
            offload=cfg.offload == "cpu",
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


def build(cfg: RunConfig, model: nn.Module, rank_info: RankInfo) -> ScratchEngine:
    return ScratchEngine(model, cfg, rank_info)
