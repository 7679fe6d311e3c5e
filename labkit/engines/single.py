"""The `single` engine, the oracle: one process, the full model, plain `torch.optim.AdamW`, the global batch.

Every other engine must reproduce its losses (float32: to relative 1e-4). bfloat16 means autocast: matmuls
in bf16, the weights, gradients and AdamW state stay float32 (the master copy). Tolerances, tested on the
tiny model over 10 steps: bf16 ddp vs bf16 single within relative 1e-3, bf16 vs float32 single within
1e-2 (the loss is a mean over many tokens, so rounding averages out; docs/measured.md has the figures).
`options["activation_checkpointing"]`: each block recomputed in backward (`activation_checkpointing`).
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.engines import activation_checkpointing
from labkit.engines.base import ModelEngine, RankInfo, RunConfig, adamw
from labkit.engines.registry import SINGLE

NAME = SINGLE
OPTIONS = ("activation_checkpointing",)  # the cfg.options keys it honours


class SingleEngine(ModelEngine):
    """The full model and its AdamW on one rank, bf16 compute under autocast when asked. Gradients are
    zeroed, not freed, between steps, so the state between steps is the textbook 16 B/param in float32."""

    name = NAME

    def __init__(self, model: nn.Module, cfg: RunConfig, device: torch.device):
        super().__init__(model.to(device), adamw(model.parameters(), cfg), device)
        self.bf16 = cfg.dtype == "bfloat16"

    def forward_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with autocast(self.device, self.bf16):
            return super().forward_loss(tokens, targets)

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return state_tensors(self.model, self.optimizer)


def autocast(device: torch.device, bf16: bool) -> torch.autocast:
    """bf16 compute under autocast when `bf16`, else a no-op: the weights stay float32 either way."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    """Params, grads and every tensor of the optimizer state (AdamW: exp_avg, exp_avg_sq, a 4-byte step)."""
    params = list(model.parameters())
    return {
        "params": params,
        "grads": [p.grad for p in params if p.grad is not None],
        "optimizer": [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)],
    }


def build(cfg: RunConfig, model: nn.Module, rank_info: RankInfo) -> SingleEngine:
    return SingleEngine(activation_checkpointing.apply(model, cfg), cfg, rank_info.device)
