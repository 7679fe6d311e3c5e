"""Where each element of a block lands when it is cut into n shards: the FSDP2 way (dim 0, per parameter) and
the FSDP1 way. Arithmetic only: the cutting itself is the build's (notebook 02) and labkit's engine's.

FSDP2 / labkit:  each parameter is padded on dim 0 to a multiple of n rows; rank r keeps rows
                 [r*k, (r+1)*k) with k = ceil(d0 / n). Every shard is a real tensor with the parameter's
                 trailing shape, so an optimizer or a hook can still see "the shard of qkv.weight".
FSDP1:           all of a block's parameters are flattened into one buffer, padded to a multiple of n
                 elements, and rank r keeps the r-th 1/n of it; a shard may hold the tail of one
                 parameter and the head of the next, so the tensors disappear into a FlatParameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn


def dim0_rows(d0: int, world_size: int) -> tuple[int, int]:
    """(rows per rank, padded rows) for a dim-0 size `d0` sharded over `world_size` ranks."""
    rows = math.ceil(d0 / world_size)
    return rows, rows * world_size


def owned_rows(full, rank: int, world_size: int):
    """The real rows of `full` that rank `rank` holds in the dim-0 layout (a view): up to ceil(d0/n) of them
    from row rank x ceil(d0/n); fewer or none on the last ranks, whose other rows are padding."""
    rows, _ = dim0_rows(full.shape[0], world_size)
    return full[rank * rows : (rank + 1) * rows]


@dataclass(frozen=True)
class Segment:
    """A piece of one parameter inside a layout: elements [start, stop) of the rank's shard or flat buffer."""

    param: str
    rank: int
    start: int
    stop: int
    padding: bool = False


def dim0_layout(module: nn.Module, world_size: int) -> list[Segment]:
    """Per-parameter dim-0 layout of `module`: for each parameter and rank, its slice of that rank's shards.

    Offsets are elements in the rank's concatenated shards (the order the all-gather sends them in).
    """
    segments, offsets = [], [0] * world_size
    for name, p in module.named_parameters():
        rows, _ = dim0_rows(p.shape[0], world_size)
        row_numel = p[0].numel() if p.dim() > 1 else 1
        for r in range(world_size):
            real = max(0, min(rows, p.shape[0] - r * rows)) * row_numel
            size = rows * row_numel
            segments.append(Segment(name, r, offsets[r], offsets[r] + real))
            if real < size:
                segments.append(Segment(name, r, offsets[r] + real, offsets[r] + size, padding=True))
            offsets[r] += size
    return segments


def flat_layout(module: nn.Module, world_size: int) -> list[Segment]:
    """FSDP1 layout of `module`: its parameters flattened in order into one buffer padded to a multiple of n.

    Offsets are elements of the whole flat buffer; `rank` is the rank whose 1/n slice holds the segment
    (a parameter that straddles a shard boundary appears as two segments).
    """
    sizes = [(name, p.numel()) for name, p in module.named_parameters()]
    total = sum(s for _, s in sizes)
    shard = math.ceil(total / world_size)
    pieces = [*sizes, ("<padding>", shard * world_size - total)]
    segments, start = [], 0
    for name, size in pieces:
        stop = start + size
        while start < stop:
            rank = start // shard
            cut = min(stop, (rank + 1) * shard)
            segments.append(Segment(name, rank, start, cut, padding=name == "<padding>"))
            start = cut
    return segments


def padding_elements(segments: list[Segment]) -> int:
    """Total padding (elements) in a layout."""
    return sum(s.stop - s.start for s in segments if s.padding)
