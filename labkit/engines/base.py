"""What every engine is: a `RunConfig` in, the same three-phase step on every rank, the same result out.

`labkit.engines.loop` builds an engine on each rank with `build(cfg, model, rank_info)` and merges what the
ranks measured into the per-engine record of the `labkit compare` contract. An engine only trains. It never
measures itself: the shared loop wraps its phases in the probes' spans and the probes count its
collectives from outside, so every engine is measured the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from labkit.engines.run_config import RunConfig  # the schema of a run, torch-free for the CLI
from labkit.model import loss_fn


@dataclass(frozen=True)
class RankInfo:
    """Where this rank runs, handed to `build`: its place in the default group and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device  # cpu for gloo ranks, cuda:<local_rank> for NCCL ranks
    backend: str  # "gloo" or "nccl"


def compute_dtype(cfg: RunConfig) -> torch.dtype:
    """The torch dtype `cfg.dtype` names (its choices are torch's own names)."""
    return getattr(torch, cfg.dtype)


def adamw(params, cfg: RunConfig) -> torch.optim.AdamW:
    """`torch.optim.AdamW` with the run's hyper-parameters: the optimizer every engine must match."""
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


class ModelEngine:
    """The step shared by the engines that wrap the model: the loss on this rank's device, a plain backward
    (the wrapper's hooks do the communication), AdamW, and gradients zeroed, not freed, between steps, so
    the state counted between steps is the textbook 16 B/param (/ n once sharded)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
        self.model = model
        self.optimizer = optimizer
        self.device = device

    def forward_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens.to(self.device))
        return loss_fn(logits.float(), targets.to(self.device))

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)


class Engine(Protocol):
    """Built once per rank, inside an initialised process group, around the lab's model.

    The loop calls, per step: `forward_loss` (forward + loss on this rank's slice), `backward`, then
    `optimizer_step` (which also clears gradients for the next step).
    """

    name: str

    def forward_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def optimizer_step(self) -> None: ...

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank keeps between steps, as local shards: keys "params", "grads", "optimizer"."""
        ...
