"""One sharded unit (a block, or the root's own parameters): gather its weights, free them, scatter its grads.

Each parameter keeps three things:
    shard       this rank's rows, float32: the master copy the optimizer updates (k x trailing shape)
    full        a persistent padded buffer (n*k x trailing shape) in the compute dtype; the module's
                parameter is a view of its first d0 rows. Freeing it resizes its storage to 0 bytes and
                gathering resizes it back, so views autograd saved in forward stay valid for backward.
    shard.grad  this rank's rows of the mean gradient, float32: a view of the unit's `grad_shard`

Communication is coalesced per unit: the shards are copied into one send buffer, one all-gather fills a
receive buffer laid out rank after rank, and each parameter's rows are copied out of it. The gradients go
the other way through one reduce-scatter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from labkit.zero import comm
from labkit.zero.sharding import dim0_rows, shard_dim0


@dataclass
class ShardedParam:
    """A parameter of a unit, sharded on dim 0. Sizes in elements; `offset` is its place in a rank's chunk."""

    name: str
    param: nn.Parameter  # the module's parameter: a view of `full`'s first d0 rows
    full: torch.Tensor  # padded, compute dtype
    shard: torch.Tensor  # this rank's rows, float32 master
    d0: int
    rows: int
    offset: int

    @property
    def shard_numel(self) -> int:
        return self.shard.numel()


class ShardedUnit:
    """The parameters that one module owns directly, sharded across `group`, and their collectives."""

    def __init__(self, name: str, module: nn.Module, params: list[tuple[str, nn.Parameter]], group, dtype):
        self.name = name
        self.module = module
        self.group = group
        self.dtype = dtype
        self.world_size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self.params: list[ShardedParam] = []
        offset = 0
        for pname, p in params:
            rows, padded = dim0_rows(p.shape[0], self.world_size)
            shard = shard_dim0(p.detach().float(), rank, self.world_size)
            full = torch.zeros((padded, *p.shape[1:]), dtype=dtype, device=p.device)
            p.data = full[: p.shape[0]]
            self.params.append(ShardedParam(pname, p, full, shard, p.shape[0], rows, offset))
            offset += shard.numel()
        self.chunk_numel = offset  # elements this rank contributes to each all-gather
        # The gradient shard is persistent state (4 B/param / n in float32): the reduce-scatter writes
        # into it every step and each shard's `.grad` is a view of it.
        self.grad_shard = torch.zeros(offset, dtype=torch.float32, device=self.params[0].shard.device)
        for sp in self.params:
            sp.shard.grad = self.grad_shard[sp.offset : sp.offset + sp.shard_numel].view_as(sp.shard)
        self.gathered = True  # the full buffers hold real weights until the first free()
        self._gather_work = None
        self._recv = None
        self._scatter_work = None
        self._scatter_send = None
        self.free()

    # -------------------------------------------------------------- all-gather: shards -> full weights

    def start_gather(self, async_op: bool) -> None:
        """Issue the all-gather of this unit's weights (copy-in, then one collective)."""
        if self.gathered or self._gather_work is not None:
            return
        send = torch.cat([sp.shard.reshape(-1) for sp in self.params]).to(self.dtype)
        self._recv = torch.empty(self.world_size * self.chunk_numel, dtype=self.dtype, device=send.device)
        work = comm.all_gather(self._recv, send, group=self.group, async_op=async_op)
        self._gather_work = work if async_op else "done"

    def finish_gather(self) -> None:
        """Wait for the all-gather and copy each parameter's rows out of the receive buffer."""
        if self.gathered:
            return
        if self._gather_work is None:
            self.start_gather(async_op=False)
        if self._gather_work != "done":
            self._gather_work.wait()
        by_rank = self._recv.view(self.world_size, self.chunk_numel)
        for sp in self.params:
            sp.full.untyped_storage().resize_(sp.full.numel() * sp.full.element_size())
            sp.full.view(self.world_size, -1).copy_(by_rank[:, sp.offset : sp.offset + sp.shard_numel])
        self._gather_work = self._recv = None
        self.gathered = True

    def free(self) -> None:
        """Drop the full weights: each buffer's storage goes to 0 bytes, the shard stays."""
        for sp in self.params:
            sp.full.untyped_storage().resize_(0)
        self.gathered = False

    # -------------------------------------------------------------- reduce-scatter: full grads -> shard

    def start_reduce_scatter(self, async_op: bool) -> None:
        """Sum the full gradients over ranks into this rank's shard (float32), then free the full ones.

        The send buffer is laid out rank after rank, like the all-gather's receive buffer: rows
        [r*k, (r+1)*k) of every parameter's gradient (zero-padded to n*k rows) go into rank r's chunk.
        """
        n = self.world_size
        send = torch.empty(n, self.chunk_numel, dtype=torch.float32, device=self.params[0].shard.device)
        for sp in self.params:
            chunk = send[:, sp.offset : sp.offset + sp.shard_numel]
            grad = sp.param.grad
            if grad is None:  # a parameter this step did not use: it contributes zeros
                chunk.zero_()
                continue
            if sp.d0 < sp.full.shape[0]:
                grad = torch.cat([grad, grad.new_zeros(sp.full.shape[0] - sp.d0, *grad.shape[1:])])
            chunk.copy_(grad.reshape(n, -1))
            sp.param.grad = None
        self._scatter_work = comm.reduce_scatter(self.grad_shard, send.view(-1), self.group, async_op)
        self._scatter_send = send  # kept alive until the collective completes

    def finish_reduce_scatter(self) -> None:
        """Wait for the reduce-scatter; the gradient shard then holds the sum, divided here into the mean."""
        if self._scatter_send is None:
            return
        if self._scatter_work is not None:
            self._scatter_work.wait()
        self.grad_shard.div_(self.world_size)
        self._scatter_work = self._scatter_send = None

    def shards(self) -> list[torch.Tensor]:
        return [sp.shard for sp in self.params]
