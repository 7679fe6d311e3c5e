"""Shared by the engine tests: the single-process AdamW oracle, the per-rank loop (labkit's own), a comparison."""

from __future__ import annotations

import torch

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


def assert_close(losses: list[float], reference: list[float], rel: float = 1e-4) -> None:
    assert len(losses) == len(reference)
    for step, (got, want) in enumerate(zip(losses, reference, strict=True)):
        assert abs(got - want) <= rel * abs(want), f"step {step}: {got} vs reference {want} (rel {rel})"
