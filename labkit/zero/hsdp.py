"""HSDP (hybrid sharding): ZeRO-3 inside groups of g ranks, plain data parallelism across the n/g groups.

In one sentence: each parameter is sharded over a shard group of g consecutive ranks, which gathers and
reduce-scatters it as ZeRO-3 does, and each gradient shard is then all-reduced across the r = n/g replica
groups (the ranks holding the same shard, one in each shard group), in that order, as FSDP2 does. State is
16 B/param / g; the all-gathers and reduce-scatters stay inside a group (a node, on a real cluster), and
only the all-reduce of 1/g of the gradients crosses between groups.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist


class HsdpGroups(NamedTuple):
    """This rank's two process groups: the g ranks it shards with, and the r ranks holding its shard."""

    shard: dist.ProcessGroup
    replicate: dist.ProcessGroup
    shard_size: int  # g, ranks
    replicas: int  # r = n / g, groups


def hsdp_groups(shard_size: int) -> HsdpGroups:
    """Cut the default group into shard groups of `shard_size` consecutive ranks and the replica groups
    across them (rank k of every shard group). Collective: every rank calls it, in the same order."""
    n, rank = dist.get_world_size(), dist.get_rank()
    if shard_size < 1 or n % shard_size:
        raise ValueError(
            f"shard_size={shard_size!r}: pass a number of ranks that divides the world size {n}, e.g. "
            "the ranks of one node"
        )
    replicas = n // shard_size
    shard = replicate = None
    for start in range(0, n, shard_size):  # every rank creates every group, in one order
        group = dist.new_group(list(range(start, start + shard_size)))
        if start <= rank < start + shard_size:
            shard = group
    for k in range(shard_size):
        group = dist.new_group(list(range(k, n, shard_size)))
        if rank % shard_size == k:
            replicate = group
    return HsdpGroups(shard, replicate, shard_size, replicas)
