"""A parameter cut into n dim-0 shards and put back together: the FSDP2 way, whose layout `labkit.layout` draws.

Rank r keeps rows [r*k, (r+1)*k) of each parameter, k = ceil(d0 / n), zero-padded to k rows, so every shard
has the parameter's trailing shape.
"""

from __future__ import annotations

import torch

from labkit.layout import dim0_rows


def shard_dim0(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s dim-0 shard of `full`, zero-padded to ceil(d0/n) rows (a new contiguous tensor)."""
    rows, padded = dim0_rows(full.shape[0], world_size)
    out = full.new_zeros((rows, *full.shape[1:]))
    lo, hi = rank * rows, min((rank + 1) * rows, full.shape[0])
    if hi > lo:
        out[: hi - lo] = full[lo:hi]
    return out


def unshard_dim0(shards: list[torch.Tensor], d0: int) -> torch.Tensor:
    """Inverse of `shard_dim0` over all ranks: concatenate the shards and drop the padding rows."""
    return torch.cat(shards)[:d0]
