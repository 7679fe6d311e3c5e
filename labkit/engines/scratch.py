"""The `scratch` engine: labkit's own ZeRO-3 (`labkit.zero`) driving the lab's model; in the student copy, which
ships no `labkit/zero/`, the learner's own (`labkit.buildalong.learners_engine`: their pieces of 02, 03 and 04,
one root, torch's AdamW), with the same accounting below where the two differ (`labkits_own()`).

Settings from `RunConfig`: `prefetch` and `prefetch_depth` (units gathered ahead), `reshard_after_forward`,
`dtype` ("bfloat16": bf16 gathered weights and compute, float32 gradient reduction, master shards and AdamW),
`offload` ("cpu": the optimizer state in separate host buffers, see `labkit.zero.optimizer`). From `cfg.options` (anything else is refused by
`check_run`, never ignored): `hsdp_shard_size` (int, or "node"), HSDP over shard groups of that many
consecutive ranks, replicated across the others (`labkit.zero.hsdp`); `labkit compare --hsdp` sets it.
`activation_checkpointing` (bool): each block wrapped in torch's non-reentrant `checkpoint_wrapper`
before `ZeRO3` shards it (`labkit.engines.activation_checkpointing`): `before_backward` re-gathers the
block, then autograd recomputes it; the bytes per step do not change. `split_root` (bool; default True for the
lab's model, False for a model whose `units` are named): the root as an input unit (embeddings) and an output unit (final norm, head) kept gathered across the
forward/backward turn (`labkit.zero.hooks`); False: one root, gathered for the whole forward and again for
the whole backward.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from labkit.budget import UnitCost, collective_time_s, collective_wire_bytes, padded_numel
from labkit.budget import exposed_floor as budget_floor
from labkit.course import holds
from labkit.engines import activation_checkpointing
from labkit.engines.base import RankInfo, RunConfig, compute_dtype
from labkit.engines.registry import SCRATCH
from labkit.model import loss_fn
from labkit.names import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from labkit.probes.memory import STEP_SCALAR_BYTES, STEP_SCALARS, in_categories
from labkit.units import INPUT, OUTPUT, ROOT, UnitSpec, unit_plan

NAME = SCRATCH
OPTIONS = ("hsdp_shard_size", "activation_checkpointing", "split_root")  # cfg.options it honours


def labkits_own() -> bool:
    """Whether this copy holds labkit's own ZeRO-3 (the instructor's); the student copy's scratch engine is the
    learner's."""
    return holds("labkit.zero")


def check_run(cfg: RunConfig) -> None:
    """Refuse, in one sentence naming the engine and the setting, any option this engine does not do; in the
    student copy, any run the learner's engine cannot do yet (`learners_engine.refusal`)."""
    if not labkits_own():
        from labkit.buildalong import learners_engine

        said = learners_engine.refusal(cfg)
        if said:
            raise ValueError(said)
        return
    unknown = sorted(set(cfg.options) - set(OPTIONS))
    if unknown:
        whose = ""
        if "zero_hpz_partition_size" in unknown:
            whose = " (zero_hpz_partition_size, --hpz, is DeepSpeed's)"
        raise ValueError(
            f"options {unknown}: the scratch engine has no such setting{whose}; it takes {', '.join(OPTIONS)}"
        )
    shard_size(cfg, cfg.world_size)


def unavailable(cfg: RunConfig) -> str:
    """ "" when this copy's scratch engine can run `cfg`; else `check_run`'s sentence saying why not (in the
    student copy: the learner's engine, before its build cells are written and pass 02's checks)."""
    try:
        check_run(cfg)
    except ValueError as refusal:
        return str(refusal)
    return ""


def shard_size(cfg: RunConfig, world_size: int) -> int:
    """Ranks per shard group: `options["hsdp_shard_size"]` ("node": one node's ranks), else every rank."""
    if "hsdp_shard_size" not in cfg.options:
        return world_size  # without importing fsdp2 (about 1 s per rank)
    from labkit.engines.fsdp2 import hsdp_shard_size  # the one reading of the option, shared with fsdp2

    return hsdp_shard_size(cfg, world_size)


class ScratchEngine:
    """The model sharded by `ZeRO3` and a `ShardedAdamW` over this rank's trainable shards.

    `units`: which modules to shard one at a time (`ZeRO3`'s `units`; None: `model.blocks`), for a model
    that is not the lab's.
    """

    name = NAME

    def __init__(self, model: nn.Module, cfg: RunConfig, info: RankInfo, units: UnitSpec = None):
        from labkit.zero import ShardedAdamW, ZeRO3
        from labkit.zero.hsdp import hsdp_groups

        self.model = model.to(info.device)
        g = shard_size(cfg, info.world_size)
        groups = hsdp_groups(g) if g < info.world_size else None
        self.zero = ZeRO3(
            self.model,
            group=groups.shard if groups else None,
            reshard_after_forward=cfg.reshard_after_forward,
            prefetch=cfg.prefetch,
            compute_dtype=compute_dtype(cfg),
            units=units,
            replicate_group=groups.replicate if groups else None,
            split_root=split_root(cfg, units),
            prefetch_depth=cfg.prefetch_depth or 1,  # ZeRO3 takes a depth of 1 or more, prefetch on or off
        )
        self.optimizer = ShardedAdamW(
            self.zero.trainable_shards(),
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            offload=cfg.offload == "cpu",
        )

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


def split_root(cfg: RunConfig, units: UnitSpec = None) -> bool:
    """Whether this run cuts the root into input and output units: `options["split_root"]`, by default for
    the lab's model (`units` None: its blocks, whose order is the forward's) and not for named units; never
    in the student copy (the learner's scaffold keeps one root)."""
    return bool(cfg.options.get("split_root", units is None and labkits_own()))


def unit_costs(model: nn.Module, cfg: RunConfig, world_size: int, units: UnitSpec = None) -> list[UnitCost]:
    """Each unit of this engine's plan, in forward order, with the wire bytes of its collectives per rank.

    A unit is gathered before its forward and, when it was resharded after forward, again before its
    backward (the output unit never is: it is kept across the turn): (g-1)/g x its padded bytes in the
    compute dtype each time, over the shard group of g ranks (g = world_size without HSDP); its trainable
    gradients are reduce-scattered once in float32: (g-1)/g x padded elements x 4 B. The input unit (the
    embeddings: lookups) has no compute of its own to hide a collective behind.
    """
    g = shard_size(cfg, world_size)
    compute_bytes = cfg.compute_bytes
    out = []
    for name, _, params in unit_plan(model, units, split_root(cfg, units)):  # `units` as the engine got them
        padded = sum(padded_numel(tuple(p.shape), g) for _, p in params)
        trained = sum(padded_numel(tuple(p.shape), g) for _, p in params if p.requires_grad)
        out.append(
            UnitCost(
                name,
                collective_wire_bytes(ALL_GATHER, padded * compute_bytes, g),
                collective_wire_bytes(REDUCE_SCATTER, trained * 4, g),
                cfg.reshard_after_forward and name != OUTPUT,
                name != INPUT,
            )
        )
    return out


def predicted_wire_bytes(
    model: nn.Module, cfg: RunConfig, world_size: int, units: UnitSpec = None
) -> dict[str, int]:
    """Per rank per step, the all-gather, reduce-scatter (and HSDP all-reduce) wire bytes of this engine:
    the sum of `unit_costs`; under HSDP each unit's gradient shard (its padded elements / g) is then
    all-reduced across the r = world_size / g replicas: 2(r-1)/r x shard x 4 B.
    """
    g = shard_size(cfg, world_size)
    replicas = world_size // g
    costs = unit_costs(model, cfg, world_size, units)
    out = {
        ALL_GATHER: sum(u.gather_wire_bytes * (1 + u.backward_gather) for u in costs),
        REDUCE_SCATTER: sum(u.reduce_wire_bytes for u in costs),
    }
    if replicas > 1:
        trained = [
            sum(padded_numel(tuple(p.shape), g) for _, p in params if p.requires_grad)
            for _, _, params in unit_plan(model, units, split_root(cfg, units))
        ]
        out[ALL_REDUCE] = sum(collective_wire_bytes(ALL_REDUCE, t // g * 4, replicas) for t in trained)
    return out


def state_bytes_by_term(model: nn.Module, cfg: RunConfig, world_size: int) -> dict[str, int]:
    """Bytes per rank between steps, as `labkit.probes.state_bytes` counts `state_tensors()`: "params",
    "grads", "optimizer" (AdamW's two moments; "host_optimizer" with `offload="cpu"`) and `STEP_SCALARS`.

    Each parameter keeps its fp32 master shard (padded on dim 0 to a multiple of g, the shard group: g =
    world_size without HSDP), 4 B x padded elements / g; a trained one also its fp32 gradient shard (4 B) and
    AdamW's exp_avg and exp_avg_sq (8 B). `ShardedAdamW` counts its steps in one Python int, so it keeps
    no step scalar: 0 B. Without padding or frozen parameters that is 16 B/param / g. The student copy's
    engine (the learner's) runs torch's AdamW: one float32 `step` per trained shard, and offloaded (04) a
    host copy of each trained shard with its gradient beside m and v (16 B), its step scalars with them.
    """
    g = shard_size(cfg, world_size)
    params = list(model.parameters())
    every = sum(padded_numel(tuple(p.shape), g) // g for p in params)
    trained = sum(padded_numel(tuple(p.shape), g) // g for p in params if p.requires_grad)
    offloaded, own = cfg.offload == "cpu", labkits_own()
    host_copies = 0 if own or not offloaded else 8  # the learner's offload: a host copy and its gradient
    steps = 0 if own else STEP_SCALAR_BYTES * sum(p.requires_grad for p in params)
    moments = {"optimizer": 0} | {"host_optimizer" if offloaded else "optimizer": (8 + host_copies) * trained}
    return {"params": 4 * every, "grads": 4 * trained, **moments, STEP_SCALARS: steps}


def state_bytes_accounting(model: nn.Module, cfg: RunConfig, world_size: int) -> dict[str, int]:
    """`state_bytes_by_term` in the probe's categories: params, grads, optimizer (and host_optimizer), bytes;
    step scalars the learner's offloaded AdamW keeps on the host count there."""
    terms = state_bytes_by_term(model, cfg, world_size)
    if "host_optimizer" in terms and not labkits_own():
        terms["host_optimizer"] += terms.pop(STEP_SCALARS)
    return in_categories(terms)


def exposed_floor(
    model: nn.Module, cfg: RunConfig, world_size: int, units: UnitSpec = None, machine: dict | None = None
) -> dict:
    """`labkit.budget.exposed_floor` of this engine's unit plan at `cfg.prefetch_depth` (1 without prefetch: the
    floor prefetch could reach); in seconds too ("floor_s", "comm_s") when `cfg.link_gbytes` or a calibrated
    `machine` prices a collective."""
    seconds = None
    if cfg.link_gbytes or machine:
        g = shard_size(cfg, world_size)
        seconds = partial(collective_time_s, world_size=g, link_gbytes=cfg.link_gbytes, machine=machine)
    costs = unit_costs(model, cfg, world_size, units)
    scheduled = costs if split_root(cfg, units) else as_scheduled(costs)
    return budget_floor(scheduled, cfg.prefetch_depth or 1, seconds)


def as_scheduled(costs: list[UnitCost]) -> list[UnitCost]:
    """`costs` of a plan whose root is kept whole (no split), in the order their collectives run, for
    `exposed_floor`. The root has two sides: it is gathered first in the forward, where only its embedding
    lookups (no compute) run before the first unit, and gathered again first in the backward, beside its head's
    backward; its gradients are reduced last, after the embeddings' backward. So it is weighed as two entries,
    first and last."""
    if not costs or costs[0].name != ROOT:  # a model whose parameters all sit in its units: no root to weigh
        return costs
    root, *units = costs
    head = root._replace(reduce_wire_bytes=0, forward_gather=False)  # its backward gather, before the head's
    return [root._replace(backward_gather=False, computes=False), *units, head]


def engine(model: nn.Module, cfg: RunConfig, info: RankInfo, units: UnitSpec = None):
    """This copy's scratch engine on this rank: `ScratchEngine`, or the learner's in the student copy."""
    if labkits_own():
        return ScratchEngine(model, cfg, info, units)
    from labkit.buildalong import learners_engine

    return learners_engine.build(cfg, model, info, units)


def build(cfg: RunConfig, model: nn.Module, rank_info: RankInfo):
    return engine(activation_checkpointing.apply(model, cfg), cfg, rank_info)
