"""One sharded unit (a block, or the root's own parameters): gather its weights, free them, scatter its grads.

Each parameter keeps three things:
    shard       this rank's rows, float32: the master copy the optimizer updates (k x trailing shape)
    full        a persistent padded buffer (n*k x trailing shape) in the compute dtype; the module's
                parameter is a view of its first d0 rows. Freeing it resizes its storage to 0 bytes and
                gathering resizes it back, so views autograd saved in forward stay valid for backward.
    shard.grad  this rank's rows of the mean gradient, float32: a view of the unit's `grad_shard`; a frozen
                parameter (`requires_grad=False`) has none: it is gathered, never reduce-scattered

The weights move through three states (`ShardedState`), one method per arrow:

    SHARDED --start_gather--> GATHERING --finish_gather--> UNSHARDED --free--> SHARDED

A call whose work is done already, or under way, does nothing: `start_gather` while gathering (a prefetch
issued it) or unsharded (the weights were kept after forward), `finish_gather` while unsharded, `free`
while sharded. Any other call out of order raises a sentence that says which call comes first.

Communication is coalesced per unit: the shards are copied into one send buffer, one all-gather fills a
receive buffer laid out rank after rank, and each parameter's rows are copied out of it. The gradients of
the trainable parameters go the other way through one reduce-scatter, started and then finished once per
step. Under HSDP (`replicate_group`) the shard is then all-reduced across the replica groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from labkit.zero import comm
from labkit.zero.sharding import dim0_rows, shard_dim0


class ShardedState(Enum):
    """Where a unit's weights are (FSDP2 names its parameters' states the same way, in `_fsdp_param.py`)."""

    SHARDED = auto()
    """Only the shards hold the weights: every full buffer's storage is 0 bytes. A unit's state between uses."""
    GATHERING = auto()
    """The all-gather is issued (asynchronously, when it is a prefetch) into a receive buffer; the full
    buffers are still 0 bytes until `finish_gather` copies the rows into them."""
    UNSHARDED = auto()
    """The full buffers hold the gathered weights, so the module can compute with its parameters."""


class PendingGather(NamedTuple):
    """An all-gather issued but not yet copied out: its handle (None once a synchronous one has returned)
    and its receive buffer (n x chunk elements, rank after rank)."""

    work: dist.Work | None
    recv: torch.Tensor


class PendingReduceScatter(NamedTuple):
    """A reduce-scatter issued but not yet waited for: its handle (None once a synchronous one has
    returned) and its send buffer, which must stay alive until the collective completes."""

    work: dist.Work | None
    send: torch.Tensor


@dataclass
class ShardedParam:
    """A parameter of a unit, sharded on dim 0. Sizes in elements; `offset` is its place in a rank's
    all-gather chunk, `grad_offset` its place in the unit's gradient shard (None: frozen, no gradient)."""

    name: str
    param: nn.Parameter  # the module's parameter: a view of `full`'s first d0 rows
    full: torch.Tensor  # padded, compute dtype
    shard: torch.Tensor  # this rank's rows, float32 master
    d0: int
    rows: int
    offset: int
    grad_offset: int | None = None

    @property
    def shard_numel(self) -> int:
        return self.shard.numel()


class ShardedUnit:
    """The parameters that one module owns directly, sharded across `group`, and their collectives.

    `replicate_group` (HSDP): the ranks holding the same shards in the other shard groups; each gradient
    shard is all-reduced across them after the reduce-scatter. The mean is over both groups' ranks.
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        params: list[tuple[str, nn.Parameter]],
        group,
        dtype,
        replicate_group=None,
    ):
        self.name = name
        self.module = module
        self.group = group
        self.replicate_group = replicate_group
        self.dtype = dtype
        self.world_size = dist.get_world_size(group)
        self.replicas = 1 if replicate_group is None else dist.get_world_size(replicate_group)
        self.params = self._shard(params, dist.get_rank(group))
        self.trainable = [sp for sp in self.params if sp.grad_offset is not None]
        self.chunk_numel = sum(sp.shard_numel for sp in self.params)  # elements sent to each all-gather
        # The gradient shard is persistent state (4 B/param / n in float32): the reduce-scatter writes
        # into it every step and each trainable shard's `.grad` is a view of it.
        grad_numel = sum(sp.shard_numel for sp in self.trainable)
        self.grad_shard = torch.zeros(grad_numel, dtype=torch.float32, device=self.params[0].shard.device)
        for sp in self.trainable:
            at = sp.grad_offset
            sp.shard.grad = self.grad_shard[at : at + sp.shard_numel].view_as(sp.shard)
        self.state = ShardedState.UNSHARDED  # the full buffers hold real weights until the first free()
        self._gather: PendingGather | None = None  # set exactly while GATHERING
        self._reduce_scatter: PendingReduceScatter | None = None
        self.free()

    def _shard(self, params: list[tuple[str, nn.Parameter]], rank: int) -> list[ShardedParam]:
        """Cut each parameter's rows for this rank and make the module's parameter a view of its full buffer."""
        out, offset, grad_offset = [], 0, 0
        for pname, p in params:
            rows, padded = dim0_rows(p.shape[0], self.world_size)
            shard = shard_dim0(p.detach().float(), rank, self.world_size)
            full = torch.zeros((padded, *p.shape[1:]), dtype=self.dtype, device=p.device)
            p.data = full[: p.shape[0]]
            at = grad_offset if p.requires_grad else None
            out.append(ShardedParam(pname, p, full, shard, p.shape[0], rows, offset, at))
            offset += shard.numel()
            grad_offset += shard.numel() if p.requires_grad else 0
        return out

    # -------------------------------------------------------------- all-gather: shards -> full weights

    def start_gather(self, async_op: bool) -> None:
        """SHARDED -> GATHERING: issue the all-gather of this unit's weights (copy-in, then one collective)."""
        if self.state is not ShardedState.SHARDED:
            return  # already in flight (a prefetch), or the weights were kept
        send = torch.cat([sp.shard.reshape(-1) for sp in self.params]).to(self.dtype)
        recv = torch.empty(self.world_size * self.chunk_numel, dtype=self.dtype, device=send.device)
        work = comm.all_gather(recv, send, group=self.group, async_op=async_op)
        self._gather = PendingGather(work, recv)
        self.state = ShardedState.GATHERING

    def finish_gather(self) -> None:
        """GATHERING -> UNSHARDED: wait for the all-gather and copy each parameter's rows out of it."""
        if self.state is ShardedState.UNSHARDED:
            return
        self._assert_in_states("finish_gather()", ShardedState.GATHERING, hint="call start_gather() first")
        handle, recv = self._gather
        if handle is not None:
            handle.wait()
        by_rank = recv.view(self.world_size, self.chunk_numel)
        for sp in self.params:
            sp.full.untyped_storage().resize_(sp.full.numel() * sp.full.element_size())
            sp.full.view(self.world_size, -1).copy_(by_rank[:, sp.offset : sp.offset + sp.shard_numel])
        self._gather = None
        self.state = ShardedState.UNSHARDED

    def free(self) -> None:
        """UNSHARDED -> SHARDED: drop the full weights (each buffer's storage goes to 0 bytes); the shard stays."""
        self._assert_in_states(
            "free()", ShardedState.UNSHARDED, ShardedState.SHARDED, hint="call finish_gather() first"
        )
        for sp in self.params:
            sp.full.untyped_storage().resize_(0)
        self.state = ShardedState.SHARDED

    def _assert_in_states(self, action: str, *states: ShardedState, hint: str) -> None:
        if self.state not in states:
            allowed = " or ".join(s.name.lower() for s in states)
            raise RuntimeError(
                f"{action} needs unit {self.name} {allowed}, but it is {self.state.name.lower()}; {hint}"
            )

    # -------------------------------------------------------------- reduce-scatter: full grads -> shard

    def start_reduce_scatter(self, async_op: bool) -> None:
        """Sum the full gradients over ranks into this rank's shard (float32), then free the full ones.

        The send buffer is laid out rank after rank, like the all-gather's receive buffer: rows
        [r*k, (r+1)*k) of every trainable parameter's gradient (zero-padded to n*k rows) go into rank r's
        chunk. A parameter this step did not use has no gradient and sends zeros: its mean gradient is 0.
        """
        if self._reduce_scatter is not None:
            raise RuntimeError(
                f"start_reduce_scatter() on unit {self.name} while its last reduce-scatter is in flight; "
                "call finish_reduce_scatter() first"
            )
        n = self.world_size
        send = torch.empty(n, self.grad_shard.numel(), dtype=torch.float32, device=self.grad_shard.device)
        for sp in self.trainable:
            chunk = send[:, sp.grad_offset : sp.grad_offset + sp.shard_numel]
            grad = sp.param.grad
            if grad is None:  # a parameter this step did not use: it contributes zeros
                chunk.zero_()
                continue
            if sp.d0 < sp.full.shape[0]:
                grad = torch.cat([grad, grad.new_zeros(sp.full.shape[0] - sp.d0, *grad.shape[1:])])
            chunk.copy_(grad.reshape(n, -1))
            sp.param.grad = None
        work = comm.reduce_scatter(self.grad_shard, send.view(-1), self.group, async_op)
        self._reduce_scatter = PendingReduceScatter(work, send)

    def finish_reduce_scatter(self) -> None:
        """Wait for the reduce-scatter; the gradient shard then holds the shard group's sum, summed across
        the replica groups under HSDP, and divided here into the mean over every rank."""
        if self._reduce_scatter is None:
            raise RuntimeError(
                f"finish_reduce_scatter() on unit {self.name}, which has no reduce-scatter in flight; "
                "call start_reduce_scatter() first"
            )
        handle, _send = self._reduce_scatter
        if handle is not None:
            handle.wait()
        if self.replicas > 1:  # HSDP: after the reduce-scatter in the shard group, across the replicas
            comm.all_reduce(self.grad_shard, self.replicate_group)
        self.grad_shard.div_(self.world_size * self.replicas)
        self._reduce_scatter = None

    def shards(self) -> list[torch.Tensor]:
        return [sp.shard for sp in self.params]
