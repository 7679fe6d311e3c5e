"""The `fsdp1` engine: PyTorch's first FSDP, `FullyShardedDataParallel` around each block, then the root.

In one sentence: each unit's parameters are flattened, in order, into one `FlatParameter` padded to a
multiple of n elements, and each rank keeps one 1/n slice of that buffer; the unit's forward all-gathers
the flat buffer and views the original parameters into it, and its backward reduce-scatters the flat
gradient back into the slice, on which `torch.optim.AdamW` steps. The idiomatic recipe
(`ModuleWrapPolicy({Block})`, the model's decoder layer for a Hugging Face one, `ShardingStrategy.FULL_SHARD`), nothing clever.

Choices, from `RunConfig` and `cfg.options` (anything else is refused, never ignored):
- `use_orig_params=False` (FSDP1's default): the optimizer steps the flat shards themselves, one
  `FlatParameter` per unit, which is what this engine exists to show. AdamW is element-wise with one
  parameter group, so stepping the flat shard is the same arithmetic as stepping the tensors in it (the
  padding stays 0: zero gradient, zero weight). `True` would only be needed for per-parameter groups or
  `torch.compile`, and it adds alignment padding inside the buffer.
- `cfg.reshard_after_forward` (or a bool `options["reshard_after_forward"]`): True is `FULL_SHARD`; False
  is `SHARD_GRAD_OP` (a unit stays gathered from its forward to its backward). Either way FSDP1 keeps the
  root gathered after forward (`_post_forward_reshard` frees nothing for the root): it is gathered once a
  step. An int (FSDP2's partial reshard) has no FSDP1 equivalent: refused.
- `cfg.prefetch`: True sets `forward_prefetch=True` (unit i's pre-forward issues unit i+1's all-gather, in
  the order recorded in step 0) and `backward_prefetch=BACKWARD_PRE` (block i's pre-backward issues block
  i-1's all-gather before block i's gradients are computed). False sets `forward_prefetch=False` and
  `backward_prefetch=None`: no prefetch at all (FSDP1, unlike FSDP2, can switch both off). FSDP1 prefetches
  one unit ahead, so `cfg.prefetch_depth` above 1 is refused. On gloo CPU ranks the gathers
  are synchronous and FSDP1's streams are no-ops: prefetch moves when a gather is issued, it hides nothing.
- `cfg.dtype == "bfloat16"`: `MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)`: the shard is cast to bf16
  before the all-gather, compute is bf16, gradients are reduce-scattered in fp32 into the fp32 master shard.
- `options["hsdp_shard_size"]` = s < world_size: `HYBRID_SHARD` on a (replicate, shard) mesh: the flat
  buffers are sharded over s consecutive ranks, and each gradient shard is all-reduced across the
  world_size / s replicas. With `reshard_after_forward=False` FSDP1's only strategy is the private
  `_HYBRID_SHARD_ZERO2`: refused.
- `cfg.offload == "cpu"`: `CPUOffload(offload_params=True)` (shards, gradients and so the optimizer state on
  the host), on CUDA ranks only: on gloo CPU ranks FSDP1's offload asks for an accelerator and fails,
  so it is refused there; the CUDA path is FSDP1's stock one, not yet run by the
  tests (no GPU in the machines they ran on). "nvme" is DeepSpeed's: refused.
On gloo CPU ranks FSDP1 needs `device_id=torch.device("cpu")` (without it: "needs a non-CPU accelerator");
the engine passes the rank's device, so the same code is right on CUDA.

What the probes see: on CPU FSDP1 all-gathers with the list form `dist.all_gather` (into n views of the
flat buffer), on CUDA with `all_gather_single`; it reduce-scatters with `reduce_scatter_single`. All are
Python functions the comm probe wraps. `model.blocks[i]` become the FSDP wrappers, so the loop's block
spans include each block's own unshard (FSDP1 gathers inside the wrapper's forward, not in a hook).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    FlatParameter,
    MixedPrecision,
    ShardingStrategy,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from labkit import cluster
from labkit.budget import collective_wire_bytes, padded_flat_numel
from labkit.engines.base import ModelEngine, RankInfo, RunConfig, adamw
from labkit.engines.fsdp2 import device_mesh, hsdp_shard_size
from labkit.engines.registry import FSDP1
from labkit.model import block_class
from labkit.names import ALL_GATHER, ALL_REDUCE, NVME, REDUCE_SCATTER
from labkit.probes.memory import STEP_SCALAR_BYTES, STEP_SCALARS, in_categories

NAME = FSDP1
OPTIONS = ("hsdp_shard_size", "reshard_after_forward")  # the cfg.options keys it honours


def check(cfg: RunConfig, world_size: int, device_type: str | None = None) -> int:
    """Raise ValueError, one sentence, for what FSDP1 cannot do as asked; return the shard group size (ranks).

    `device_type` ("cpu" or "cuda"): the ranks' device, for what depends on it (host offload); None skips it.
    """
    unknown = sorted(set(cfg.options) - set(OPTIONS))
    if unknown:
        raise ValueError(
            f"options {unknown}: the fsdp1 engine has no such setting (zero_hpz_partition_size, --hpz, is "
            f"DeepSpeed's ZeRO++ hpZ: run it without fsdp1); fsdp1 takes {', '.join(OPTIONS)}"
        )
    if cfg.offload == NVME:
        raise ValueError(
            f"offload={cfg.offload!r}: FSDP1 offloads to the host only ('cpu', on CUDA ranks); "
            "NVMe is DeepSpeed's ZeRO-Infinity"
        )
    if not isinstance(cfg.options.get("reshard_after_forward", True), bool):
        raise ValueError(
            f"reshard_after_forward={cfg.options['reshard_after_forward']!r}: FSDP1 reshards to all ranks "
            "(True, FULL_SHARD) or not at all (False, SHARD_GRAD_OP); partial resharding is FSDP2's"
        )
    if cfg.prefetch_depth > 1:
        raise ValueError(
            f"prefetch_depth={cfg.prefetch_depth}: FSDP1 prefetches one unit ahead; run the fsdp1 engine with "
            "prefetch_depth=1, or prefetch=False for none"
        )
    if cfg.offload == "cpu" and device_type == "cpu":
        raise ValueError(
            "offload='cpu': FSDP1's CPUOffload needs an accelerator (on gloo CPU ranks it fails with 'Cannot "
            "access accelerator device'); run fsdp1 with offload='none' here, or fsdp2, scratch or deepspeed"
        )
    shard = hsdp_shard_size(cfg, world_size)
    if shard < world_size and not reshards(cfg):
        raise ValueError(
            "hsdp_shard_size with reshard_after_forward=False is FSDP1's private _HYBRID_SHARD_ZERO2; "
            "run HSDP with reshard_after_forward=True"
        )
    return shard


def check_run(cfg: RunConfig) -> None:
    """`check` in the parent before any rank starts (`validation.validate` calls it), for the ranks' device."""
    if cluster.launcher_world_size() is not None:  # under torchrun the ranks take CUDA when there is one
        cuda = torch.cuda.is_available()
    else:
        cuda = cluster.placement(cfg.world_size).device_type == "cuda"
    check(cfg, cfg.world_size, "cuda" if cuda else "cpu")


def reshards(cfg: RunConfig) -> bool:
    """Whether each block is resharded after its forward (FULL_SHARD) or kept gathered (SHARD_GRAD_OP)."""
    return bool(cfg.options.get("reshard_after_forward", cfg.reshard_after_forward))


def wrap_kwargs(cfg: RunConfig, info: RankInfo) -> dict[str, Any]:
    """The `FullyShardedDataParallel` keywords for this run on this rank (checked by `check`)."""
    shard = check(cfg, info.world_size, info.device.type)
    kwargs: dict[str, Any] = {
        "auto_wrap_policy": ModuleWrapPolicy({block_class(cfg.model)}),
        "device_id": info.device,
        "use_orig_params": False,
        "forward_prefetch": cfg.prefetch,
        "backward_prefetch": BackwardPrefetch.BACKWARD_PRE if cfg.prefetch else None,
        "cpu_offload": CPUOffload(offload_params=cfg.offload == "cpu"),
    }
    if cfg.dtype == "bfloat16":
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if shard < info.world_size:
        kwargs["sharding_strategy"] = ShardingStrategy.HYBRID_SHARD
        kwargs["device_mesh"] = device_mesh(info.device.type, info.world_size, shard)  # FSDP2's HSDP mesh
    else:
        kwargs["sharding_strategy"] = (
            ShardingStrategy.FULL_SHARD if reshards(cfg) else ShardingStrategy.SHARD_GRAD_OP
        )
    return kwargs


def flat_params(root: nn.Module) -> list[FlatParameter]:
    """Each unit's `FlatParameter`, root first, then the blocks in order (one per wrapped unit)."""
    out = [unit._flat_param for unit in FSDP.fsdp_modules(root)]
    for p in out:
        if not isinstance(p, FlatParameter):
            raise AssertionError(
                f"a unit holds a {type(p).__name__}, not a FlatParameter: FSDP1 did not flatten it"
            )
    return out


class Fsdp1Engine(ModelEngine):
    """One rank of the fsdp1 engine: the wrapped model and an AdamW over its flat shards."""

    name = NAME

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Per unit: the local flat shard, its flat gradient shard, AdamW's exp_avg, exp_avg_sq and step.

        `state_bytes_accounting` is what these add up to.
        """
        params = flat_params(self.model)
        optimizer = [
            t for p in params for t in self.optimizer.state.get(p, {}).values() if torch.is_tensor(t)
        ]
        return {
            "params": [p.data for p in params],
            "grads": [p.grad for p in params if p.grad is not None],
            "optimizer": optimizer,
        }


def unit_numels(model: nn.Module) -> list[int]:
    """Elements per FSDP1 unit of the unsharded lab model: the root (all but the blocks), then each block."""
    in_blocks = sum(p.numel() for b in model.blocks for p in b.parameters())
    root = sum(p.numel() for p in model.parameters()) - in_blocks
    return [root, *(sum(p.numel() for p in b.parameters()) for b in model.blocks)]


def state_bytes_by_term(model: nn.Module, cfg: RunConfig, world_size: int) -> dict[str, int]:
    """Bytes per rank between steps, as `labkit.probes.state_bytes` counts them: "params", "grads",
    "optimizer" (AdamW's two moments) and `STEP_SCALARS`, on a line of its own.

    Each unit's flat buffer is padded to a multiple of s (the shard group: world_size, or
    `hsdp_shard_size`) elements and each rank keeps P_u / s of it, in fp32 whatever `cfg.dtype`:
    params 4 x sum(P_u)/s, grads 4 x sum(P_u)/s, optimizer 8 x sum(P_u)/s (exp_avg, exp_avg_sq), and one
    4-byte step scalar per unit (AdamW keeps one per tensor it updates: here a flat parameter). Without
    padding that is 16 B/param / s + 4 B per unit.
    """
    s = check(cfg, world_size)
    units = unit_numels(model)
    shard_numel = sum(padded_flat_numel(numel, s) // s for numel in units)
    return {
        "params": 4 * shard_numel,
        "grads": 4 * shard_numel,
        "optimizer": 8 * shard_numel,
        STEP_SCALARS: STEP_SCALAR_BYTES * len(units),
    }


def state_bytes_accounting(model: nn.Module, cfg: RunConfig, world_size: int) -> dict[str, int]:
    """`state_bytes_by_term` in the probe's three categories: params, grads, optimizer (bytes)."""
    return in_categories(state_bytes_by_term(model, cfg, world_size))


def predicted_wire_bytes(model: nn.Module, cfg: RunConfig, world_size: int) -> dict[str, int]:
    """Per rank per step, the wire bytes of FSDP1's collectives for this run (bytes, ring formula).

    `model` is the unsharded lab model. Each unit is one flat buffer of P_u elements padded to a multiple
    of s (the shard group) and one collective per use: forward all-gathers every unit; backward
    all-gathers each block again under FULL_SHARD (never the root, which FSDP1 keeps gathered after
    forward; nothing under SHARD_GRAD_OP), in 2 B under bf16 else 4 B; each unit's gradient is
    reduce-scattered once, in fp32. Under HSDP each fp32 gradient shard P_u / s is then all-reduced
    across the world_size / s replicas.
    """
    s = check(cfg, world_size)
    param_bytes = cfg.compute_bytes
    replicas = world_size // s
    gathered, reduced, all_reduced = 0, 0, 0
    for i, numel in enumerate(unit_numels(model)):
        padded = padded_flat_numel(numel, s)
        gathers = 2 if i > 0 and reshards(cfg) else 1  # unit 0 is the root
        gathered += gathers * collective_wire_bytes(ALL_GATHER, padded * param_bytes, s)
        reduced += collective_wire_bytes(REDUCE_SCATTER, padded * 4, s)
        all_reduced += collective_wire_bytes(ALL_REDUCE, padded // s * 4, replicas)
    out = {ALL_GATHER: gathered, REDUCE_SCATTER: reduced}
    return out | ({ALL_REDUCE: all_reduced} if replicas > 1 else {})


def build(cfg: RunConfig, model: nn.Module, rank_info: RankInfo) -> Fsdp1Engine:
    """Wrap each block, then the root, in `FullyShardedDataParallel` on the rank's device; AdamW on shards.

    Every rank builds the same weights (`build_model` is deterministic), so no `sync_module_states`
    broadcast is needed. `model.blocks[i]` become the FSDP wrappers of the same `Block` objects.
    """
    wrapped = FSDP(model, **wrap_kwargs(cfg, rank_info))
    flat_params(wrapped)  # asserts every unit holds a FlatParameter
    return Fsdp1Engine(wrapped, adamw(wrapped.parameters(), cfg), rank_info.device)
