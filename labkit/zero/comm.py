"""The collectives of ZeRO-3, and nothing else: every byte the scratch engine moves goes through here.

    all-gather      (n-1)/n x full size per rank   weights, before forward and again before backward
    reduce-scatter  (n-1)/n x full size per rank   gradients, once per step
    all-reduce      2(r-1)/r x shard size per rank HSDP only: gradient shards across the r replica groups

All call the public `torch.distributed` functions by attribute at call time, so the probes (which wrap
those functions from outside) see exactly what the engine sends, and the emulated link delays them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather(out: torch.Tensor, shard: torch.Tensor, group=None, async_op: bool = False):
    """Concatenate every rank's `shard` (same numel on all ranks) into `out` (n x shard numel).

    Returns the async work handle when `async_op`, else None.
    """
    return dist.all_gather_single(out, shard, group=group, async_op=async_op)


def reduce_scatter(shard_out: torch.Tensor, full: torch.Tensor, group=None, async_op: bool = False):
    """Sum `full` (n x shard numel) over ranks and keep this rank's 1/n slice in `shard_out`.

    Gloo implements this with an all-reduce internally; the lab counts the bytes the ring algorithm
    needs, (n-1)/n x full size, because that is what the algorithm pays on a real interconnect.
    """
    return dist.reduce_scatter_single(shard_out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, group=None) -> None:
    """Sum `tensor` in place over the ranks of `group` (HSDP: one gradient shard across the replicas)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
