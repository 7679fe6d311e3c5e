"""Exercise 07's reference pieces: the grader's stand-in for a piece of the student's ZeRO-3 that crashed.

When one piece raises (or is not defined), the capstone's probe trains again with this piece in its place, so
that the properties the crashing piece does not touch are still judged on the student's own code
(`labkit.grading.capstone`). Each piece is the solution's, written with torch alone.

`pieces()` compiles this file's source again under a name of its own, outside labkit (`kit.stand_ins`): a
student's hook that calls the stand-in `gather` has not used the grader's code. Nothing here calls the code
the capstone forbids.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from labkit.engines.base import RunConfig
from labkit.grading.capstone import PIECES
from labkit.grading.kit import stand_ins


def _load(p: torch.nn.Parameter, full: torch.Tensor) -> None:
    """The set-up cell's `load`: `full` into p's own storage (autograd's saved views see it in backward)."""
    if p.shape != full.shape:
        p.data = torch.empty_like(full)
    p.untyped_storage().resize_(full.numel() * full.element_size())
    p.data.copy_(full)


def _free(p: torch.nn.Parameter) -> None:
    """The set-up cell's `free`: p's storage to 0 bytes, its shape kept."""
    p.untyped_storage().resize_(0)


def shard(full: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Rank `rank`'s ceil(d0/n) rows of `full`, zero-padded at the end, as a new float32 tensor."""
    rows = -(-full.shape[0] // n)
    mine = full[rank * rows : (rank + 1) * rows]
    out = torch.zeros((rows, *full.shape[1:]), dtype=torch.float32, device=full.device)
    out[: mine.shape[0]] = mine
    return out


def gather(shard: torch.Tensor, d0: int, group=None) -> torch.Tensor:
    """Every rank's shard concatenated on dim 0 in rank order, without the padding rows."""
    n = dist.get_world_size(group)
    out = shard.new_empty((n * shard.shape[0], *shard.shape[1:]))
    dist.all_gather_single(out, shard.contiguous(), group=group)
    return out[:d0]


def _start_gather(unit) -> None:
    """One asynchronous all-gather of all the unit's shards, kept in unit.pending under a key of its own."""
    send = torch.cat([s.reshape(-1) for s in unit.shards])
    recv = send.new_empty(unit.n * send.numel())
    unit.pending["reference gather"] = (
        dist.all_gather_single(recv, send, group=unit.group, async_op=True),
        recv,
    )


def _finish_gather(unit) -> None:
    """Wait for the unit's pending all-gather (or gather now) and load each full weight, read rank-major."""
    if "reference gather" in unit.pending:
        work, recv = unit.pending.pop("reference gather")
        work.wait()
    else:
        send = torch.cat([s.reshape(-1) for s in unit.shards])
        recv = gather(send, unit.n * send.numel(), unit.group)
    by_rank = recv.view(unit.n, -1)
    offset = 0
    for p, s, d0 in zip(unit.params, unit.shards, unit.d0, strict=True):
        rows = by_rank[:, offset : offset + s.numel()]
        _load(p, rows.reshape(unit.n * s.shape[0], *s.shape[1:])[:d0])
        offset += s.numel()


def before_forward(unit) -> None:
    """Finish this unit's gather, then prefetch the next unit's."""
    _finish_gather(unit)
    if unit.next is not None:
        _start_gather(unit.next)


def after_forward(unit) -> None:
    for p in unit.params:
        _free(p)


def before_backward(unit) -> None:
    _finish_gather(unit)


def after_grad(unit) -> None:
    """One packed reduce-scatter of the unit's gradients; each shard's .grad the mean; full tensors dropped."""
    n = unit.n
    columns = []
    for p, s in zip(unit.params, unit.shards, strict=True):
        padded = p.grad.new_zeros((n * s.shape[0], *s.shape[1:]))
        padded[: p.grad.shape[0]] = p.grad
        columns.append(padded.reshape(n, -1))
    send = torch.cat(columns, dim=1)
    mine = send.new_empty(send.numel() // n)
    dist.reduce_scatter_single(mine, send.reshape(-1), op=dist.ReduceOp.SUM, group=unit.group)
    mine /= n
    offset = 0
    for p, s in zip(unit.params, unit.shards, strict=True):
        s.grad = mine[offset : offset + s.numel()].view_as(s)
        offset += s.numel()
        p.grad = None
        _free(p)


def make_optimizer(shards: list[torch.Tensor]) -> torch.optim.Optimizer:
    """AdamW over this rank's shards with the lab's hyper-parameters (`single`'s)."""
    lab = RunConfig()
    return torch.optim.AdamW(shards, lr=lab.lr, betas=lab.betas, eps=lab.eps, weight_decay=lab.weight_decay)


def pieces() -> dict[str, Callable]:
    """{piece name: the reference piece}, compiled from this file outside labkit (`kit.stand_ins`)."""
    return stand_ins(__file__, PIECES)
