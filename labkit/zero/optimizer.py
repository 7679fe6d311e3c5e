"""AdamW on this rank's shards only: each rank updates 1/n of every parameter, with 1/n of m and v.

The update is `torch.optim.AdamW`'s, written out (decoupled weight decay, bias-corrected moments), so a
sharded run and a single-process run agree to float rounding:

    p <- p * (1 - lr * wd)
    m <- b1 * m + (1 - b1) * g          v <- b2 * v + (1 - b2) * g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)

With `offload=True` the optimizer state (the float32 master copy, m and v) lives in separate host buffers
(pinned when the shard they serve is on a GPU: `pins_host_buffers`): each step copies the gradient shard
in, updates on the host, and copies the new weights back. On a CPU-only machine "host" and "device" are the
same memory, so the offload path runs and costs its copies, but frees nothing; on a GPU it takes m and v
off the device (8 B/param): the float32 shards stay there, the weights the units gather from, and the host
keeps a master copy and a gradient buffer of its own.
"""

from __future__ import annotations

import math

import torch


class ShardedAdamW:
    """AdamW over `shards` (float32 tensors whose `.grad` the reduce-scatter filled)."""

    def __init__(
        self,
        shards: list[torch.Tensor],
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        offload: bool = False,
    ):
        self.shards = shards
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.offload = offload
        self.step_count = 0
        host = "cpu" if offload else None
        self.master = [self._buffer(s, host, copy=True) for s in shards] if offload else shards
        self.exp_avg = [self._buffer(s, host) for s in shards]
        self.exp_avg_sq = [self._buffer(s, host) for s in shards]
        self._grad_in = [self._buffer(s, host) for s in shards] if offload else None

    @staticmethod
    def pins_host_buffers(shard_device: torch.device) -> bool:
        """Whether the host buffers of a shard on `shard_device` are pinned: only for a CUDA shard.

        Decided by the shard, not by `torch.cuda.is_available()`: a CPU rank on a GPU node (forked, or
        with no GPU visible) must not touch CUDA, and pinning asks the CUDA driver for the pages.
        """
        return shard_device.type == "cuda"

    @classmethod
    def _buffer(cls, like: torch.Tensor, device, copy: bool = False) -> torch.Tensor:
        pin = device == "cpu" and cls.pins_host_buffers(like.device)
        buf = torch.zeros(like.shape, dtype=torch.float32, device=device or like.device, pin_memory=pin)
        if copy:
            buf.copy_(like)
        return buf

    @torch.no_grad()
    def step(self) -> None:
        """One AdamW update of every shard (the next reduce-scatter overwrites the gradients)."""
        self.step_count += 1
        b1, b2 = self.betas
        bias1 = 1 - b1**self.step_count
        bias2_sqrt = math.sqrt(1 - b2**self.step_count)
        for i, shard in enumerate(self.shards):
            if shard.grad is None:
                continue
            grad = self._grad_in[i].copy_(shard.grad) if self.offload else shard.grad
            p, m, v = self.master[i], self.exp_avg[i], self.exp_avg_sq[i]
            p.mul_(1 - self.lr * self.weight_decay)
            m.lerp_(grad, 1 - b1)
            v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            denom = (v.sqrt() / bias2_sqrt).add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / bias1)
            if self.offload:
                shard.copy_(p)

    def state_tensors(self) -> list[torch.Tensor]:
        """The optimizer's own tensors: m and v, plus the host master copy and gradient buffer if offloaded."""
        extra = [*self.master, *self._grad_in] if self.offload else []
        return [*self.exp_avg, *self.exp_avg_sq, *extra]

    def state_dict(self) -> dict:
        return {"step": self.step_count, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = state["step"]
        for dst, src in zip(
            self.exp_avg + self.exp_avg_sq, state["exp_avg"] + state["exp_avg_sq"], strict=True
        ):
            dst.copy_(src)
        if self.offload:
            for master, shard in zip(self.master, self.shards, strict=True):
                master.copy_(shard)
