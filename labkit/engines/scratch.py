"""The `scratch` engine: labkit's own ZeRO-3 (`labkit.zero`) driving the lab's model.

Options from `RunConfig`: `prefetch`, `reshard_after_forward`, `dtype` ("bfloat16": bf16 gathered weights
and compute, float32 gradient reduction, master shards and AdamW), `offload` ("cpu": the optimizer state
in separate host buffers, see `labkit.zero.optimizer`).
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.budget import collective_wire_bytes, padded_numel
from labkit.engines.base import RankInfo, RunConfig
from labkit.model import loss_fn
from labkit.zero import ShardedAdamW, ZeRO3

NAME = "scratch"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ScratchEngine:
    """The model sharded by `ZeRO3` and a `ShardedAdamW` over this rank's shards."""

    name = NAME

    def __init__(self, model: nn.Module, cfg: RunConfig, info: RankInfo):
        self.model = model.to(info.device)
        self.zero = ZeRO3(
            self.model,
            reshard_after_forward=cfg.reshard_after_forward,
            prefetch=cfg.prefetch,
            compute_dtype=DTYPES[cfg.dtype],
        )
        self.optimizer = ShardedAdamW(
            self.zero.shards(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
            offload=cfg.offload == "cpu",
        )  # fmt: skip

    def forward_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(self.model(tokens).float(), targets)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.zero.finish_backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        shards = self.zero.shards()
        state = {
            "params": shards,
            "grads": [s.grad for s in shards if s.grad is not None],
            "optimizer": [] if self.optimizer.offload else self.optimizer.state_tensors(),
        }
        if self.optimizer.offload:
            state["host_optimizer"] = self.optimizer.state_tensors()
        return state


def predicted_wire_bytes(model: nn.Module, cfg: RunConfig, world_size: int) -> dict[str, int]:
    """Per rank per step, the all-gather and reduce-scatter wire bytes of the scratch engine (bytes).

    Every unit (each block and the root) is gathered before its forward and, when it was resharded
    after forward, again before its backward: 2 x (n-1)/n x its padded bytes in the compute dtype; its
    gradients are reduce-scattered once in float32: (n-1)/n x padded elements x 4 B.
    """
    n = world_size
    compute_bytes = DTYPES[cfg.dtype].itemsize
    padded = sum(padded_numel(tuple(p.shape), n) for p in model.parameters())
    gathers = 2 if cfg.reshard_after_forward else 1
    return {
        "all_gather": gathers * collective_wire_bytes("all_gather", padded * compute_bytes, n),
        "reduce_scatter": collective_wire_bytes("reduce_scatter", padded * 4, n),
    }


def build(cfg: RunConfig, model: nn.Module, rank_info: RankInfo) -> ScratchEngine:
    return ScratchEngine(model, cfg, rank_info)


def hook_trace(model_name: str = "tiny", steps: int = 2) -> list[tuple[int, str, str]]:
    """On this rank, train `steps` scratch steps and return (step, moment, unit) for every hook that fired.

    Run it under `labkit.launch`; the notebook on the scratch engine prints rank 0's list.
    """
    import torch.distributed as dist

    from labkit.model import batch, build_model

    trace: list = []
    model = build_model(model_name)
    zero = ZeRO3(model, trace=trace)
    optimizer = ShardedAdamW(zero.shards())
    out = []
    for step in range(steps):
        tokens, targets = batch(step, model_name, world_size=dist.get_world_size(), rank=dist.get_rank())
        loss_fn(model(tokens), targets).backward()
        zero.finish_backward()
        optimizer.step()
        out += [(step, moment, unit) for moment, unit in trace]
        trace.clear()
    return out
