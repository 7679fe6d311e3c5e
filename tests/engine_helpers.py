"""Shared by the engine tests: the single-process AdamW oracle and a bare per-rank training loop."""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.engines.base import RunConfig
from labkit.model import batch, build_model, loss_fn


def reference_losses(cfg: RunConfig) -> list[float]:
    """Plain `torch.optim.AdamW` on the whole global batch in one process: the losses every engine must hit."""
    model = build_model(cfg.model, cfg.seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    losses = []
    for step in range(cfg.steps):
        tokens, targets = batch(step, cfg.model, cfg.seed)
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def train(
    engine, cfg: RunConfig, first_step: int = 0, data_ranks: tuple[int, int] | None = None
) -> list[float]:
    """Run `cfg.steps` steps of `engine` on this rank; return the global mean loss of each step.

    `data_ranks` = (data-parallel rank, data-parallel size) when not every rank takes its own slice
    (tensor parallelism); by default each rank of the world takes one slice.
    """
    dp_rank, dp_size = data_ranks or (dist.get_rank(), dist.get_world_size())
    losses = []
    for step in range(first_step, first_step + cfg.steps):
        tokens, targets = batch(step, cfg.model, cfg.seed, dp_size, dp_rank)
        loss = engine.forward_loss(tokens, targets)
        engine.backward(loss)
        engine.optimizer_step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def assert_close(losses: list[float], reference: list[float], rel: float = 1e-4) -> None:
    assert len(losses) == len(reference)
    for step, (got, want) in enumerate(zip(losses, reference, strict=True)):
        assert abs(got - want) <= rel * abs(want), f"step {step}: {got} vs reference {want} (rel {rel})"
