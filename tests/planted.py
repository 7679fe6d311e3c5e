"""Planted mistakes shared by the build-along tests: the filled 02's pieces with one thing changed."""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.buildalong.cells import notebook_namespace

FILLED = notebook_namespace()  # the instructor's copy: 02's build cells filled


def after_grad(op=dist.ReduceOp.SUM, divide=True, drop_grad=True, free=True):
    """The filled after_grad with one thing changed: the reduce op, the `/ n`, dropping p.grad, or freeing p."""

    def changed(unit):
        for p, s in zip(unit.params, unit.shards, strict=True):
            padded = p.grad.new_zeros((unit.n * s.shape[0], *s.shape[1:]))
            padded[: p.grad.shape[0]] = p.grad
            summed = torch.empty_like(s)
            dist.reduce_scatter_single(summed, padded, op=op, group=unit.group)
            s.grad = summed / unit.n if divide else summed
            if drop_grad:
                p.grad = None
            if free:
                FILLED["free"](p)

    return changed
