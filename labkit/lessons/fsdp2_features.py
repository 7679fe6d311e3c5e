"""FSDP2 features beyond the plain engine, each a rank-side function that trains briefly and returns facts.

Run any of them with `labkit.launch(fn, world_size, cfg, ...)`; rank 0's dict is what a notebook shows:
HSDP on a 2-D mesh (its collectives counted by labkit's probe per group size), tensor parallelism + FSDP on
one 2x2 mesh, a distributed checkpoint saved on one world size and loaded on another, `ignored_params`,
`torch.compile` with FSDP2 (the graphs Dynamo compiled and the frames it ran eagerly: FSDP2's hooks are never
traced), and torch's own `CommDebugMode` counts (to set beside labkit's probe). Losses are global means, to compare with `single`. `shard_mesh` and
`build_engine` are the 1-D mesh and the engine on fresh weights that these and `fsdp2_inspect` share.
"""

from __future__ import annotations

import inspect
import os
import re
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
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from labkit.engines import fsdp2
from labkit.engines.base import RunConfig
from labkit.engines.on_rank import rank_batch, rank_info, rank_model, train_steps
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
    return fsdp2.Fsdp2Engine(model, fsdp2.sharded_adamw(model.parameters(), cfg), rank_info().device)


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
    engine = fsdp2.Fsdp2Engine(model, fsdp2.sharded_adamw(model.parameters(), cfg), info.device)
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
    engine = fsdp2.Fsdp2Engine(model, fsdp2.sharded_adamw(model.parameters(), cfg), info.device)
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


def compile_sharded(cfg: RunConfig, backend: str = "inductor") -> dict[str, Any]:
    """What `torch.compile` makes of an FSDP2 model in torch 2.13, from the run, three ways on fresh engines.

    torch 2.13 wraps every FSDP2 hook in `torch._dynamo.disable` (reason "skipping FSDP hooks", read from
    `_fsdp_common.py`: `hook_disable_reason`), so no all-gather or reduce-scatter is ever in a graph.
    - `torch.compile(sharded_model)`: `graphs` (each graph Dynamo handed the backend: the module whose forward
      it is, the child modules and ops in it, how many times it ran per step), `skipped_frames` (frames Dynamo
      gave up on and ran eagerly, with its reason), `graph_breaks` (Dynamo's counter, which does not count a skipped
      frame), `losses`, `first_step_s` (compiling) and `later_step_s` (the mean of the others), seconds.
    - `fullgraph_error`: `torch.compile(sharded_model, fullgraph=True)` refused, and where it was raised.
    - `blocks_first`: each block compiled with `fullgraph=True`, then sharded (FSDP2's hooks then sit outside
      the compiled module): its `graphs`, `losses` and step times.
    Returns `skipped` with a reason instead when inductor cannot build kernels here (no C++ compiler).
    """
    if backend == "inductor" and shutil.which(os.environ.get("CXX", "c++")) is None:
        return {"skipped": "torch.compile's inductor backend needs a C++ compiler (c++ or $CXX) on PATH"}
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    reason = re.search(r'reason="([^"]+)"', inspect.getsource(_fsdp_common._dynamo_disable))
    facts: dict[str, Any] = {"backend": backend, "hook_disable_reason": reason and reason.group(1)}
    facts |= _compile_whole(cfg, backend)
    facts["fullgraph_error"] = _fullgraph_error(cfg, backend)
    facts["blocks_first"] = _compile_blocks_first(cfg, backend)
    return facts


class _GraphLog:
    """A Dynamo backend that records each graph it is given, then hands it to `backend`: the module whose
    forward the graph is (found in `model` by the child modules its ops ran in), those children, its ops
    (in order, each once), and how many times the compiled graph has run (`calls`)."""

    def __init__(self, backend: str, model: torch.nn.Module):
        self.inner = torch._dynamo.lookup_backend(backend)
        self.model = model
        self.graphs: list[dict[str, Any]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        children = {
            re.split(r"[.\[]", path.removeprefix("L['self']."))[0]
            for node in gm.graph.nodes
            for path, _ in node.meta.get("nn_module_stack", {}).values()
        }
        ops = [
            getattr(node.target, "__name__", str(node.target))
            for node in gm.graph.nodes
            if node.op in ("call_function", "call_method")
        ]
        owner = next(
            (_class_name(m) for m in self.model.modules() if set(dict(m.named_children())) == children), "?"
        )
        record = {
            "forward_of": owner,
            "children": sorted(children),
            "ops": list(dict.fromkeys(ops)),
            "calls": 0,
        }
        self.graphs.append(record)
        compiled = self.inner(gm, example_inputs)

        def run(*args: Any) -> Any:
            record["calls"] += 1
            return compiled(*args)

        return run

    def per_step(self, steps: int) -> list[dict[str, Any]]:
        """The graphs, `calls` turned into runs per step over `steps` steps."""
        return [g | {"calls": g["calls"] / steps} for g in self.graphs]


def _class_name(module: torch.nn.Module) -> str:
    """The module's own class name: `fully_shard` swaps its class for a subclass named FSDP<name>."""
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)).__name__


def _fresh_dynamo() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


def _compile_whole(cfg: RunConfig, backend: str) -> dict[str, Any]:
    """`torch.compile(sharded_model)`: the graphs, the frames Dynamo skipped, losses and step times."""
    _fresh_dynamo()
    engine = build_engine(cfg)
    log = _GraphLog(backend, engine.model)
    eager = engine.model
    engine.model = torch.compile(eager, backend=log)
    trained = _train_logged(engine, cfg, log)
    counters = torch._dynamo.utils.counters
    frames = {type(m).forward.__code__: f"{_class_name(m)}.forward" for m in eager.modules()}
    skips = [_skip(message, frames) for message in counters["unimplemented"]]
    return trained | {
        "skipped_frames": [s for s in skips if s["frame"]],
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def _train_logged(engine: fsdp2.Fsdp2Engine, cfg: RunConfig, log: _GraphLog) -> dict[str, Any]:
    """`cfg.steps` steps: the losses, the first (compiling) step's seconds, the later steps' mean seconds, and
    `log`'s graphs with their runs per step counted over the later steps (compiled already)."""
    start_s = time.perf_counter()
    losses = train_steps(engine, replace(cfg, steps=1))
    first_step_s = time.perf_counter() - start_s
    for g in log.graphs:
        g["calls"] = 0
    start_s = time.perf_counter()
    losses += train_steps(engine, replace(cfg, steps=cfg.steps - 1), first_step=1)
    later = max(1, cfg.steps - 1)
    return {
        "graphs": log.per_step(later),
        "losses": losses,
        "first_step_s": first_step_s,
        "later_step_s": (time.perf_counter() - start_s) / later,
    }


def _skip(message: str, frames: dict) -> dict[str, Any]:
    """One of Dynamo's give-up messages: its first line, the function it would not trace, whether the break
    sat in a loop (which makes Dynamo run the whole frame eagerly), and that frame's `Class.forward` (None
    when the message names no skipped frame: a first attempt, traced again up to the break)."""
    function = re.search(r"the function `(\w+)` in file `[^`]*?([\w.]+)`", message)
    frame = re.search(r"frame skipped: (\w+) \((.+) line (\d+)\)", message)
    where = None
    if frame:
        where = next(
            (
                name
                for code, name in frames.items()
                if (code.co_name, code.co_filename, code.co_firstlineno)
                == (frame[1], frame[2], int(frame[3]))
            ),
            f"{frame[1]} ({os.path.basename(frame[2])} line {frame[3]})",
        )
    return {
        "reason": message.splitlines()[0],
        "function": function and f"{function[1]} in {function[2]}",
        "in_loop": "graph break in loop" in message,
        "frame": where,
    }


def _fullgraph_error(cfg: RunConfig, backend: str) -> str:
    """What `torch.compile(sharded_model, fullgraph=True)` raises on the first forward, and where (file,
    function of the last frame Dynamo was tracing)."""
    _fresh_dynamo()
    engine = build_engine(cfg)
    model = torch.compile(engine.model, backend=backend, fullgraph=True)
    tokens, _ = rank_batch(0, cfg.model, cfg.seed, dist.get_world_size(), dist.get_rank(), rank_info().device)
    try:
        model(tokens)
    except torch._dynamo.exc.Unsupported as e:
        frames = re.findall(r'File "([^"]+)", line \d+, in (\w+)', str(e))
        where = f", raised in {os.path.basename(frames[-1][0])} ({frames[-1][1]})" if frames else ""
        return f"{type(e).__name__}: {str(e).splitlines()[0]}{where}"
    return "no error: Dynamo traced the whole forward"


def _compile_blocks_first(cfg: RunConfig, backend: str) -> dict[str, Any]:
    """Each block `torch.compile(block, fullgraph=True)`, then `fsdp2.shard_model`: graphs, losses, times."""
    _fresh_dynamo()
    info = rank_info()
    model = rank_model(cfg.model, cfg.seed, info.device)
    log = _GraphLog(backend, model)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend=log, fullgraph=True)
    fsdp2.shard_model(model, cfg, shard_mesh())
    fsdp2.assert_sharded(model, shard_mesh())
    engine = fsdp2.Fsdp2Engine(model, fsdp2.sharded_adamw(model.parameters(), cfg), info.device)
    return _train_logged(engine, cfg, log)


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
