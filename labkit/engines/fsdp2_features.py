"""FSDP2 features beyond the plain engine, each a rank-side function that trains briefly and returns facts.

Run any of them with `labkit.launch(fn, world_size, cfg, ...)`; rank 0's dict is what a notebook shows:
HSDP on a 2-D mesh (its collectives counted by labkit's probe per group size), tensor parallelism + FSDP on
one 2x2 mesh, a distributed checkpoint saved on one world size and loaded on another, `ignored_params`,
`torch.compile` of the sharded model (and what Dynamo traced), and torch's own `CommDebugMode` counts (to
set beside labkit's probe). Losses are global means, to compare with `single`. `shard_mesh` and
`build_engine` are the 1-D mesh and the engine on fresh weights that these and `fsdp2_inspect` share.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from labkit.engines import fsdp2
from labkit.engines.base import RunConfig, adamw
from labkit.engines.loop import rank_batch, rank_info, rank_model, train_steps
from labkit.probes import Probes


def shard_mesh() -> DeviceMesh:
    """The 1-D mesh of every rank, named "shard", on this rank's device type (what `fsdp2.build` shards over)."""
    info = rank_info()
    return fsdp2.device_mesh(info.device.type, info.world_size)


def build_engine(cfg: RunConfig, mesh: DeviceMesh | None = None) -> fsdp2.Fsdp2Engine:
    """The fsdp2 engine on fresh weights: `fsdp2.shard_model` over `mesh` (default `shard_mesh()`), asserted."""
    mesh = mesh or shard_mesh()
    model = rank_model(cfg.model, cfg.seed)
    fsdp2.shard_model(model, cfg, mesh)
    fsdp2.assert_sharded(model, mesh)
    return fsdp2.Fsdp2Engine(model, adamw(model.parameters(), cfg), rank_info().device)


def hsdp(cfg: RunConfig, replicas: int = 2) -> dict[str, Any]:
    """HSDP: a (replicate, shard) mesh; each parameter `(Replicate(), Shard(0))`; trained under the probe.

    In torch 2.13 `fully_shard` reads a 2-D mesh as dim 0 = replicate, dim 1 = shard: parameters are
    sharded across the ranks of a row (all-gathers and reduce-scatters stay in the row) and replicated
    down a column (the gradient shards are all-reduced across rows). `comm` is {"KIND over G ranks": wire
    bytes} of the last step, by group size (the loss all-reduce after each step is not counted).
    """
    info = rank_info()
    mesh = fsdp2.device_mesh(info.device.type, info.world_size, info.world_size // replicas)
    engine = build_engine(cfg, mesh)
    with Probes(info.rank, info.device) as probes:
        losses = train_steps(engine, cfg, probes=probes)
    comm: dict[str, int] = {}
    for c in probes.comm.calls:
        if c.step == cfg.steps - 1:
            key = f"{c.kind} over {c.group_size} ranks"
            comm[key] = comm.get(key, 0) + c.wire_bytes
    weight = engine.model.blocks[0].qkv.weight
    return {
        "mesh_dim_names": mesh.mesh_dim_names,
        "mesh": mesh.mesh.tolist(),
        "placements": str(weight.placements),
        "shard_group_ranks": dist.get_process_group_ranks(mesh.get_group("shard")),
        "replicate_group_ranks": dist.get_process_group_ranks(mesh.get_group("replicate")),
        "local_shape": tuple(weight.to_local().shape),
        "full_shape": tuple(weight.shape),
        "comm": comm,
        "losses": losses,
    }


def tp_fsdp(cfg: RunConfig) -> dict[str, Any]:
    """Tensor parallel inside, FSDP across: a 2x2 ("dp", "tp") mesh on 4 ranks.

    Each block's MLP is split Megatron-style on the "tp" dim (fc column-wise, out row-wise: one all-reduce
    of the output per block, issued by DTensor's functional collectives, which labkit's probe does not
    see); then `fully_shard` on the "dp" dim shards every parameter's dim 0 again. The two ranks of a tp
    pair read the same data slice. `mesh` is the rank grid, `dp_group_ranks` / `tp_group_ranks` this rank's
    process group of each dim.
    """
    info = rank_info()
    mesh = init_device_mesh(info.device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    model = rank_model(cfg.model, cfg.seed, info.device)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"fc": ColwiseParallel(), "out": RowwiseParallel()})
    dp_mesh: DeviceMesh = mesh["dp"]
    fsdp2.shard_model(model, cfg, dp_mesh)
    engine = fsdp2.Fsdp2Engine(model, adamw(model.parameters(), cfg), info.device)
    block = model.blocks[0]
    facts = {
        "mesh_dim_names": mesh.mesh_dim_names,
        "mesh": mesh.mesh.tolist(),
        "dp_group_ranks": dist.get_process_group_ranks(mesh.get_group("dp")),
        "tp_group_ranks": dist.get_process_group_ranks(mesh.get_group("tp")),
        "placements": {
            name: (str(p.device_mesh.mesh_dim_names), str(p.placements))
            for name, p in block.named_parameters()
            if name in ("fc.weight", "out.weight", "qkv.weight")
        },
        "fc_local_shape": tuple(block.fc.weight.to_local().shape),
        "fc_full_shape": tuple(block.fc.weight.shape),
    }
    dp_rank = mesh.get_local_rank("dp")
    facts["losses"] = train_steps(engine, cfg, dp=(dp_rank, 2))
    return facts


def full_state(engine: fsdp2.Fsdp2Engine) -> dict[str, dict[str, torch.Tensor]] | None:
    """The unsharded model and optimizer state dicts on rank 0, None elsewhere (every rank takes part)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(engine.model, options=options)
    optim_sd = get_optimizer_state_dict(engine.model, engine.optimizer, options=options)
    if dist.get_rank() != 0:
        return None
    flat_optim = {f"{k}.{s}": v for k, st in optim_sd["state"].items() for s, v in st.items()}
    return {"model": model_sd, "optimizer": flat_optim}


def dcp_save(cfg: RunConfig, path: str, continue_steps: int = 0) -> dict[str, Any]:
    """Train `cfg.steps` steps, save a sharded distributed checkpoint to `path`; optionally train on.

    Returns the losses, the full state at save time (rank 0) and the losses of `continue_steps` steps
    trained on without interruption, for a resumed run to reproduce.
    """
    engine = build_engine(cfg)
    losses = train_steps(engine, cfg)
    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
    if dist.get_rank() == 0 and os.path.exists(path):
        shutil.rmtree(path)
    dist.barrier()
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)
    state = full_state(engine)
    more = replace(cfg, steps=continue_steps)
    return {
        "losses": losses,
        "state": state,
        "files": sorted(os.listdir(path)),
        "continued_losses": train_steps(engine, more, first_step=cfg.steps) if continue_steps else [],
    }


def dcp_load(cfg: RunConfig, path: str, first_step: int, steps: int) -> dict[str, Any]:
    """Load the checkpoint at `path` into a fresh engine on this world size (DCP reshards), train on.

    Returns the full state right after loading (rank 0) and the losses of `steps` steps from `first_step`.
    """
    engine = build_engine(cfg)
    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        engine.model, engine.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    loaded = full_state(engine)
    return {
        "state": loaded,
        "losses": train_steps(engine, replace(cfg, steps=steps), first_step=first_step),
    }


def ignored_params(
    cfg: RunConfig, names: tuple[str, ...] = ("pos.weight",), sync: bool = False
) -> dict[str, Any]:
    """`fully_shard(..., ignored_params=...)`: those parameters stay plain, whole on every rank, unreduced.

    FSDP2 neither shards nor reduces them, so each rank's copy learns from its own slice only and the
    replicas drift apart, unless the caller all-reduces their gradients itself (`sync=True`, which then
    matches `single`).
    """
    info = rank_info()
    mesh = shard_mesh()
    model = rank_model(cfg.model, cfg.seed, info.device)  # FSDP2 does not move ignored parameters
    params = dict(model.named_parameters())
    ignored = {params[name] for name in names}
    common = fsdp2.shard_kwargs(cfg, mesh)
    for block in model.blocks:
        fully_shard(block, **common)
    fully_shard(model, ignored_params=ignored, **common)
    engine = fsdp2.Fsdp2Engine(model, adamw(model.parameters(), cfg), info.device)
    if sync:
        for p in ignored:
            p.register_post_accumulate_grad_hook(_average_grad)
    losses = train_steps(engine, cfg)
    first = params[names[0]]
    copies = [torch.empty_like(first.detach()) for _ in range(info.world_size)]
    dist.all_gather(copies, first.detach())
    return {
        "types": {name: type(params[name]).__name__ for name in names},
        "is_dtensor": {name: isinstance(params[name], DTensor) for name in names},
        "shape": tuple(first.shape),
        "max_abs_diff_between_ranks": max((c - copies[0]).abs().max().item() for c in copies),
        "losses": losses,
    }


def _average_grad(p: torch.Tensor) -> None:
    dist.all_reduce(p.grad)
    p.grad.div_(dist.get_world_size())


def compile_sharded(cfg: RunConfig, backend: str = "inductor", explain: bool = False) -> dict[str, Any]:
    """`torch.compile(model, backend=backend)` the sharded model; the first (compiling) step and the mean of
    the later ones timed (seconds).

    Returns `skipped` with a reason instead when inductor cannot build kernels here (no C++ compiler).
    `graph_breaks` is Dynamo's own count of graph breaks in this process (measured: 0 with torch 2.13, whose
    Dynamo traces through FSDP2's hooks), `graphs` the number of distinct graphs it compiled. `explain`
    adds what `torch._dynamo.explain` reports of one forward before compiling (see `_explain`).
    """
    if backend == "inductor" and shutil.which(os.environ.get("CXX", "c++")) is None:
        return {"skipped": "torch.compile's inductor backend needs a C++ compiler (c++ or $CXX) on PATH"}
    engine = build_engine(cfg)
    facts: dict[str, Any] = {"backend": backend, **(_explain(engine, cfg) if explain else {})}
    engine.model = torch.compile(engine.model, backend=backend)
    start_s = time.perf_counter()
    losses = train_steps(engine, replace(cfg, steps=1))
    first_step_s = time.perf_counter() - start_s
    start_s = time.perf_counter()
    losses += train_steps(engine, replace(cfg, steps=cfg.steps - 1), first_step=1)
    later_step_s = (time.perf_counter() - start_s) / max(1, cfg.steps - 1)
    counters = torch._dynamo.utils.counters
    return facts | {
        "losses": losses,
        "first_step_s": first_step_s,
        "later_step_s": later_step_s,
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
    }


def _explain(engine: fsdp2.Fsdp2Engine, cfg: RunConfig) -> dict[str, Any]:
    """What Dynamo traces of one forward of the sharded model (`torch._dynamo.explain`), then reset.

    `collectives_in_forward_graphs` names the FSDP2 collective and copy ops Dynamo put into its graphs
    (empty: the hooks ran eagerly, outside the graphs).
    """
    info = rank_info()
    tokens, _ = rank_batch(0, cfg.model, cfg.seed, info.world_size, info.rank, info.device)
    explained = torch._dynamo.explain(engine.model)(tokens)
    ops = {getattr(op, "__name__", str(op)) for graph_ops in explained.ops_per_graph for op in graph_ops}
    targets = {str(node.target) for graph in explained.graphs for node in graph.graph.nodes}
    torch._dynamo.reset()  # the compiled run traces afresh
    return {
        "graph_count": explained.graph_count,
        "graph_break_count": explained.graph_break_count,
        "break_reasons": [str(b.reason).splitlines()[0] for b in explained.break_reasons],
        "ops_traced": sorted(ops),
        "collectives_in_forward_graphs": sorted(
            t for t in targets if any(k in t for k in ("all_gather", "reduce_scatter", "fsdp"))
        ),
    }


def comm_debug_counts(
    cfg: RunConfig, beside: Callable[[], AbstractContextManager] = nullcontext
) -> dict[str, int]:
    """torch's `CommDebugMode` count of each collective op in one fsdp2 step (after one warm-up step).

    It counts calls, not bytes; the names are c10d's (e.g. `_allgather_base_`), to set beside labkit's
    probe, which counts the same calls by their `torch.distributed` function. `beside()` is a context
    entered around the same step (and nothing else), e.g. `lambda: probes.step(1)` to tag the probe's calls.
    """
    engine = build_engine(cfg)
    train_steps(engine, replace(cfg, steps=1))
    tokens, targets = rank_batch(1, cfg.model, cfg.seed, dist.get_world_size(), dist.get_rank())
    mode = CommDebugMode()
    with beside(), mode:
        engine.backward(engine.forward_loss(tokens, targets))
        engine.optimizer_step()
    return {str(op).split(".")[-1]: count for op, count in mode.get_comm_counts().items()}
