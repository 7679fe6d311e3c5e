"""The filled pieces of notebook 02's build-along: a minimal ZeRO-3 in six steps, one section per `build` cell.

Each `# -- build: NAME --` section below is, verbatim, the source of the notebook's `build` cell NAME
(tests/test_build.py holds the two together). `PIECES` bundles them for the scaffold (`labkit.build.attach`,
`labkit.build.Learner`); the tests plant mistakes into copies of it.
"""
# ruff: noqa: E402 (each section is a notebook cell, with its own imports)

# -- build: shard --
import torch
import torch.distributed as dist


def shard(full, rank, n):
    """Rank `rank`'s rows of `full` on dim 0: ceil(d0/n) of them, zero-padded at the end (a float32 copy)."""
    rows = -(-full.shape[0] // n)  # ceil(d0 / n): every rank holds the same number of rows
    mine = full[rank * rows : (rank + 1) * rows]  # the last ranks may get fewer real rows, or none
    out = torch.zeros((rows, *full.shape[1:]), dtype=torch.float32, device=full.device)
    out[: mine.shape[0]] = mine
    return out


# -- build: gather --
def gather(shard, d0, group=None):
    """Every rank's shard, concatenated on dim 0 in rank order, minus the padding rows: the full tensor."""
    n = dist.get_world_size(group)
    out = torch.empty((n * shard.shape[0], *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
    dist.all_gather_single(out, shard.contiguous(), group=group)  # each rank sends its 1/n
    return out[:d0]


# -- build: forward --
def load(p, full):
    """Put `full` into p's own storage, so the tensors autograd saves from p (views of it) see it too."""
    if p.shape != full.shape:  # the first gather: attach left a 0-element placeholder
        p.data = torch.empty_like(full)
    p.untyped_storage().resize_(full.numel() * full.element_size())
    p.data.copy_(full)


def free(p):
    """Drop p's full weight: its storage goes to 0 bytes, and with it every view autograd saved."""
    p.untyped_storage().resize_(0)


def before_forward(unit):
    for p, s, d0 in zip(unit.params, unit.shards, unit.d0, strict=True):
        load(p, gather(s, d0, unit.group))


def after_forward(unit):
    for p in unit.params:
        free(p)


# -- build: backward --
def before_backward(unit):
    # after_forward freed the weights, and this unit's backward needs them: gather them again,
    # into the same storage (load), where the tensors autograd saved in forward look for them
    for p, s, d0 in zip(unit.params, unit.shards, unit.d0, strict=True):
        load(p, gather(s, d0, unit.group))


# -- build: reduce_scatter --
def after_grad(unit):
    for p, s in zip(unit.params, unit.shards, strict=True):
        padded = p.grad.new_zeros((unit.n * s.shape[0], *s.shape[1:]))  # pad as the weights were
        padded[: p.grad.shape[0]] = p.grad
        summed = torch.empty_like(s)
        dist.reduce_scatter_single(summed, padded, op=dist.ReduceOp.SUM, group=unit.group)
        s.grad = summed / unit.n  # each rank's grad is its slice's mean: the global mean is sum / n
        p.grad = None
        free(p)


# -- build: adamw --
from labkit.engines.base import RunConfig

lab = RunConfig()  # the hyper-parameters single trains with


def make_optimizer(shards):
    """AdamW over this rank's shards only: its moments are 1/n of single's."""
    return torch.optim.AdamW(shards, lr=lab.lr, betas=lab.betas, eps=lab.eps, weight_decay=lab.weight_decay)


# -- end --
from labkit.build.scaffold import Pieces

PIECES = Pieces(shard, gather, before_forward, after_forward, before_backward, after_grad, make_optimizer)


def build_cells() -> dict[str, str]:
    """{cell name: its source}: the `# -- build: NAME --` sections of this file, stripped."""
    import inspect
    import re
    import sys

    text = inspect.getsource(sys.modules[__name__])
    parts = re.split(r"^# -- (build: (\w+)|end) --\n", text, flags=re.M)
    return {parts[i + 1]: parts[i + 2].strip() + "\n" for i in range(1, len(parts), 3) if parts[i + 1]}
