"""Sharded checkpoints: every rank writes only its own shards; any world size can read them back.

    DIR/meta.json      model parameter names and full shapes, the world size that wrote it
    DIR/rank{r}.pt     rank r's master shards, AdamW m and v shards, and the step count

Loading at another world size rebuilds each full tensor from the old shards (dropping their padding) and
cuts the new rank's rows from it, so a run resumed on 2 ranks from a checkpoint of 4 continues exactly.
Every file is read onto this rank's device (`map_location`): a file written by CUDA rank r would
otherwise load onto cuda:r, a GPU this rank may not have, and the shards of one tensor onto different
devices before they are joined.
"World size" is the shard group's: under HSDP the first shard group writes (the others hold copies of
the same shards) and a load cuts rows for the loading shard group. Frozen shards are saved like the rest.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from labkit.zero.hooks import ZeRO3
from labkit.zero.optimizer import ShardedAdamW
from labkit.zero.sharding import shard_dim0, unshard_dim0


def _full_shapes(zero: ZeRO3) -> dict[str, list[int]]:
    prefix = {u: "" if u.module is zero.model else f"{u.name}." for u in zero.units}
    return {prefix[u] + sp.name: [sp.d0, *sp.shard.shape[1:]] for u in zero.units for sp in u.params}


def _optimizer_names(zero: ZeRO3, optimizer: ShardedAdamW) -> list[str]:
    """The model name of each shard `optimizer` updates (all of them, or only the trainable ones)."""
    name_of = {id(shard): name for name, shard in zero.named_shards()}
    return [name_of[id(shard)] for shard in optimizer.shards]


def save(path: str, zero: ZeRO3, optimizer: ShardedAdamW) -> None:
    """Write this rank's shards under directory `path` (collective: every rank calls it)."""
    rank, world_size = dist.get_rank(zero.group), dist.get_world_size(zero.group)
    if dist.get_rank() != rank:  # HSDP: a replica of the first shard group's shards, written by it
        dist.barrier()
        return
    os.makedirs(path, exist_ok=True)
    names = _optimizer_names(zero, optimizer)
    state = {
        "params": {n: s.clone() for n, s in zero.named_shards()},
        "exp_avg": dict(zip(names, (t.clone() for t in optimizer.exp_avg), strict=True)),
        "exp_avg_sq": dict(zip(names, (t.clone() for t in optimizer.exp_avg_sq), strict=True)),
        "step": optimizer.step_count,
    }
    torch.save(state, os.path.join(path, f"rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(path, "meta.json"), "w") as f:
            json.dump({"world_size": world_size, "shapes": _full_shapes(zero)}, f, indent=1)
    dist.barrier()


def load(path: str, zero: ZeRO3, optimizer: ShardedAdamW) -> None:
    """Fill this rank's shards and AdamW state from the checkpoint in `path`, written at any world size."""
    meta_path = os.path.join(path, "meta.json")
    if not os.path.exists(meta_path):
        raise ValueError(
            f"{path!r} holds no labkit checkpoint (no meta.json); pass the directory `save` wrote"
        )
    with open(meta_path) as f:
        meta = json.load(f)
    expected = _full_shapes(zero)
    if meta["shapes"] != expected:
        first = next(
            k for k in sorted({*meta["shapes"], *expected}) if meta["shapes"].get(k) != expected.get(k)
        )
        raise ValueError(
            f"the checkpoint in {path!r} is of another model (parameter {first!r} differs); "
            "load it into the model it was saved from"
        )
    device = zero.shards()[0].device  # this rank's device, where its shards live
    old = [
        torch.load(os.path.join(path, f"rank{r}.pt"), map_location=device) for r in range(meta["world_size"])
    ]
    rank, world_size = dist.get_rank(zero.group), dist.get_world_size(zero.group)

    def reshard(kind: str, name: str) -> torch.Tensor:
        full = unshard_dim0([o[kind][name] for o in old], expected[name][0])
        return shard_dim0(full, rank, world_size)

    with torch.no_grad():
        for name, shard in zero.named_shards():
            shard.copy_(reshard("params", name))
    names = _optimizer_names(zero, optimizer)
    optimizer.load_state_dict(
        {
            "step": old[0]["step"],
            "exp_avg": [reshard("exp_avg", name) for name in names],
            "exp_avg_sq": [reshard("exp_avg_sq", name) for name in names],
        }
    )
