"""Shared by the engine tests: the single-process AdamW oracle, the per-rank loop (labkit's own), a comparison.

The oracle runs in the test process, on one intra-op thread as every rank does (`on_rank.train_rank`): on a
busy 2-core machine torch's two threads spin against the ranks and the neighbours (measured: tiny's 10 steps
in 12-21 s on two threads, under 1.3 s on one), and each configuration is trained once per session.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from labkit.engines.base import RunConfig
from labkit.model import batch, build_model, loss_fn

_REFERENCE: dict[
    tuple, list[float]
] = {}  # the oracle's losses by what they depend on (see `reference_losses`)


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one intra-op thread inside the block (as on every rank), the caller's count restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def reference_losses(cfg: RunConfig) -> list[float]:
    """Plain `torch.optim.AdamW` on the whole global batch in one process: the losses every engine must hit.

    float32 whatever `cfg.dtype` says; trained once per (model, seed, steps, AdamW hyper-parameters) in a
    session, on one thread (`one_thread`), and a fresh list returned each time.
    """
    key = (cfg.model, cfg.seed, cfg.steps, cfg.lr, tuple(cfg.betas), cfg.eps, cfg.weight_decay)
    if key not in _REFERENCE:
        with one_thread():
            _REFERENCE[key] = _train_reference(cfg)
    return list(_REFERENCE[key])


def _train_reference(cfg: RunConfig) -> list[float]:
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
