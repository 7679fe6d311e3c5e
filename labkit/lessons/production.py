"""FSDP2's production surface, each a rank-side function that trains briefly on CPU ranks and returns facts.

Run any of them with `labkit.launch(fn, world_size, cfg, ...)`; rank 0's dict is what a notebook shows beside
`single_run` (the oracle, in the calling process) and `fsdp2.predicted_wire_bytes` (the byte formula):
gradient accumulation without gradient sync, gradient-norm clipping on DTensor gradients, meta-device init,
the full state dict, `reshard_after_forward` as a group size, and the separate reduce-scatter group. A
distributed checkpoint saved on one world size and resumed on another is `fsdp2_features.dcp_save` /
`dcp_load`. DeepSpeed's counterparts are `production_deepspeed`. Losses are global means.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from labkit.collectives import COLLECTIVES, COUNTED, Patch
from labkit.engines import fsdp2
from labkit.engines.base import RunConfig
from labkit.engines.on_rank import rank_batch, rank_info, train_steps
from labkit.engines.single import SingleEngine
from labkit.lessons.fsdp2_features import build_engine, full_state, shard_mesh
from labkit.model import GPT, batch, build_model, config, count_params, initial_value
from labkit.names import ALL_GATHER, REDUCE_SCATTER
from labkit.probes import PeakMemory, Probes

# ------------------------------------------------------------------------------------ measuring micro-steps


def micro_batches(step: int, cfg: RunConfig, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's slice of step `step`'s global batch, cut into `k` equal micro-batches (tokens, targets)."""
    info = rank_info()
    tokens, targets = rank_batch(step, cfg.model, cfg.seed, info.world_size, info.rank, info.device)
    if tokens.shape[0] % k:
        raise ValueError(
            f"micro_steps={k}: each rank holds {tokens.shape[0]} sequences of {cfg.model!r} at world_size="
            f"{info.world_size}; pass a number of micro-steps that divides it"
        )
    return list(zip(tokens.chunk(k), targets.chunk(k), strict=True))


def phase_comm(probes: Probes, first_call: int, last_call: int | None = None) -> dict[str, dict[str, int]]:
    """{kind: {"calls", "wire_bytes"}} of the probe's calls [first_call, last_call): one phase of a step."""
    tally = probes.comm.summary(window=slice(first_call, last_call))
    return {kind: {"calls": row["calls"], "wire_bytes": row["wire_bytes"]} for kind, row in tally.items()}


def global_mean(values: list[float]) -> float:
    """The mean of this rank's `values`, averaged over every rank (an all-reduce outside any probed step)."""
    total = torch.tensor(sum(values) / len(values))
    if dist.is_initialized():
        dist.all_reduce(total)
        total /= dist.get_world_size()
    return total.item()


# ------------------------------------------------------------------------------------ gradient accumulation


def accumulate(cfg: RunConfig, micro_steps: int = 2) -> dict[str, Any]:
    """Gradient accumulation: `micro_steps` forward/backward passes per AdamW step, gradient sync on the last.

    `model.set_requires_gradient_sync(False)` before every micro-step but the last, True before the last:
    FSDP2 then skips the reduce-scatter and keeps each parameter's full, unsharded gradient (torch 2.13:
    `FSDPParam._unsharded_param.grad`) until the last backward reduce-scatters their sum. Each micro-loss is
    divided by `micro_steps`, so the update is the one on the whole global batch. Returns `losses` (the
    global mean per optimizer step) and `micro` (per micro-step: `sync`, the probe's `forward` and `backward`
    collectives {kind: {"calls", "wire_bytes"}}, and `unsharded_grad_bytes` held after its backward).
    """
    engine = build_engine(cfg)
    info = rank_info()
    losses, micro = [], []
    with Probes(info.rank, info.device) as probes:
        for step in range(cfg.steps):
            micro_losses = []
            for i, (tokens, targets) in enumerate(micro_batches(step, cfg, micro_steps)):
                sync = i == micro_steps - 1
                engine.model.set_requires_gradient_sync(sync)
                with probes.step(step * micro_steps + i):
                    start = len(probes.comm.calls)
                    loss = engine.forward_loss(tokens, targets)
                    middle = len(probes.comm.calls)
                    engine.backward(loss / micro_steps)
                    end = len(probes.comm.calls)
                    held = unsharded_grad_bytes(engine.model)
                    if sync:
                        engine.optimizer_step()
                micro_losses.append(loss.item())
                micro.append(
                    {
                        "step": step,
                        "sync": sync,
                        "forward": phase_comm(probes, start, middle),
                        "backward": phase_comm(probes, middle, end),
                        "unsharded_grad_bytes": held,
                    }
                )
            losses.append(global_mean(micro_losses))
    return {"losses": losses, "micro": micro}


def unsharded_grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of the full (unsharded) gradients FSDP2 holds for `model` now, its accumulation buffers included.

    torch 2.13 keeps them on each `FSDPParam`: `_unsharded_param.grad` (the parameter dtype) or
    `unsharded_accumulated_grad` (the reduce dtype, under mixed precision); both are private names.
    """
    total = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                for grad in (
                    unsharded.grad if unsharded is not None else None,
                    fsdp_param.unsharded_accumulated_grad,
                ):
                    if grad is not None:
                        total += grad.numel() * grad.element_size()
    return total


# ------------------------------------------------------------------------------------------------ clipping


def clipped_steps(
    engine: Any, cfg: RunConfig, max_norm: float, world: tuple[int, int]
) -> dict[str, list[float]]:
    """`cfg.steps` steps with `torch.nn.utils.clip_grad_norm_(max_norm)` between backward and AdamW.

    `world` = (rank, ranks): each rank takes its slice of the global batch. Returns the global mean `losses`
    and `norms`, the total gradient norm before clipping (on FSDP2's DTensor gradients `clip_grad_norm_`
    returns a DTensor, made whole with `full_tensor()`).
    """
    rank, ranks = world
    losses, norms = [], []
    for step in range(cfg.steps):
        tokens, targets = batch(step, cfg.model, cfg.seed, ranks, rank)
        loss = engine.forward_loss(tokens, targets)
        engine.backward(loss)
        norm = torch.nn.utils.clip_grad_norm_(engine.model.parameters(), max_norm)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).item())
        engine.optimizer_step()
        losses.append(global_mean([loss.item()]))
    return {"losses": losses, "norms": norms}


def clip(cfg: RunConfig, max_norm: float = 0.5) -> dict[str, list[float]]:
    """FSDP2 with gradient-norm clipping: `clipped_steps` on the sharded model (see `single_run` for the oracle)."""
    info = rank_info()
    return clipped_steps(build_engine(cfg), cfg, max_norm, (info.rank, info.world_size))


def single_run(cfg: RunConfig, max_norm: float | None = None) -> dict[str, Any]:
    """The oracle in this process, no process group: `single` on the global batch for `cfg.steps` steps.

    Returns `losses`, `norms` (the total gradient norm before clipping to `max_norm`; None: not clipped, and
    no norms) and `state`, the final weights (a CPU state dict).
    """
    engine = SingleEngine(build_model(cfg.model, cfg.seed), cfg, torch.device("cpu"))
    out: dict[str, Any] = {"losses": [], "norms": []}
    for step in range(cfg.steps):
        tokens, targets = batch(step, cfg.model, cfg.seed)
        loss = engine.forward_loss(tokens, targets)
        engine.backward(loss)
        if max_norm is not None:
            out["norms"].append(torch.nn.utils.clip_grad_norm_(engine.model.parameters(), max_norm).item())
        engine.optimizer_step()
        out["losses"].append(loss.item())
    out["state"] = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    return out


# ------------------------------------------------------------------------------------------ meta-device init


def meta_init(cfg: RunConfig) -> dict[str, Any]:
    """Build the model on the meta device, `fully_shard` it, `to_empty`, then fill each shard; train.

    PyTorch's `reset_parameters` of each layer is not the lab's rule (that lives in `build_model`), so
    `init_shards` fills each rank's rows by it, one parameter at a time. `init_peak_bytes` is the peak of
    live tensor bytes from the meta build to the filled shards (`PeakMemory`); `built_peak_bytes` the same
    for the usual path (the full model built, then sharded); `full_model_bytes` the fp32 model. `losses`
    and `built_losses` are the two engines' training, `max_abs_diff` their weights after init (0: bit-equal).
    """
    if config(cfg.model).family != "gpt":
        raise ValueError(
            f"meta_init builds the lab's GPT; {cfg.model!r} is a {config(cfg.model).family} model"
        )
    info = rank_info()
    mesh = shard_mesh()

    def build_on_meta() -> torch.nn.Module:
        with torch.device("meta"):
            model = GPT(config(cfg.model))
        fsdp2.shard_model(model, cfg, mesh)
        model.to_empty(device=info.device)
        init_shards(model, cfg.seed, mesh)
        return model

    model, init_peak = peak_bytes_of(build_on_meta)
    fsdp2.assert_sharded(model, mesh)
    built, built_peak = peak_bytes_of(lambda: build_engine(cfg, mesh))
    diff = max(
        (p.to_local() - q.to_local()).abs().max().item()
        for p, q in zip(model.parameters(), built.model.parameters(), strict=True)
    )
    engine = fsdp2.Fsdp2Engine(model, fsdp2.sharded_adamw(model.parameters(), cfg), info.device)
    return {
        "device_after_to_empty": str(next(model.parameters()).device),
        "init_peak_bytes": init_peak,
        "built_peak_bytes": built_peak,
        "full_model_bytes": 4 * count_params(build_model(cfg.model)),
        "max_abs_diff": diff,
        "losses": train_steps(engine, cfg),
        "built_losses": train_steps(built, cfg),
    }


def peak_bytes_of(build: Callable[[], Any]) -> tuple[Any, int]:
    """`build()` and the peak of live tensor bytes while it ran, less what was live before (`PeakMemory`)."""
    memory = PeakMemory(rank_info().device)
    memory.note_prior()
    memory.start()
    out = build()
    return out, memory.stop()


def init_shards(model: torch.nn.Module, seed: int, mesh: DeviceMesh) -> None:
    """Fill each rank's shard of every parameter as `build_model(name, seed)` fills the full tensor
    (`labkit.model.initial_value`, one generator seeded `seed`, in parameter order). To stay bit-equal with
    that stream each rank draws one full parameter at a time and keeps its own rows (FSDP2's `torch.chunk`
    of dim 0): one parameter, never the model, is ever whole.
    """
    gen = torch.Generator().manual_seed(seed)
    rank, ranks = mesh.get_local_rank(), mesh.size()
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = initial_value(name, p.shape, gen)
            chunks = full.chunk(ranks, dim=0)
            if rank < len(chunks):
                p.to_local().copy_(chunks[rank])


# --------------------------------------------------------------------------------------- full state dict


def export_full_state(cfg: RunConfig) -> dict[str, Any]:
    """Train `cfg.steps` steps, then export the unsharded weights on rank 0 (`get_model_state_dict` with
    `StateDictOptions(full_state_dict=True, cpu_offload=True)`, via `fsdp2_features.full_state`).

    Returns `losses` and `state` (rank 0: {name: full CPU tensor}; None elsewhere), to set beside
    `single_run(cfg)["state"]`.
    """
    engine = build_engine(cfg)
    losses = train_steps(engine, cfg)
    state = full_state(engine)
    return {"losses": losses, "state": state and state["model"]}


# ------------------------------------------------------------------------------- reshard_after_forward=int


def reshard_choices(cfg: RunConfig, choices: tuple[bool | int, ...] = (True, 2, False)) -> dict[str, Any]:
    """Each block's `reshard_after_forward` in turn (True, a smaller group size, False), on fresh engines.

    Per choice (keyed by its text): the last step's `forward` and `backward` collectives ({"KIND over G
    ranks": wire bytes}), `peak_mem_bytes` over one more step (`PeakMemory`, as the loop measures it) and
    `losses`. An int reshards each block to groups of that many ranks after forward, so backward
    all-gathers inside them. It must divide the world size (torch 2.13's `_get_post_forward_mesh_info`: "a
    factor of" the shard group; 1 means False, the world size True); the engine refuses any other int
    first, in a sentence, returned as `refused`.
    """
    info = rank_info()
    out = {}
    for choice in choices:
        run = replace(cfg, options={**cfg.options, "reshard_after_forward": choice})
        memory = PeakMemory(info.device)
        memory.note_prior()
        try:
            engine = build_engine(run)
        except ValueError as refusal:  # every rank refuses the same choice, before any collective
            out[str(choice)] = {"refused": str(refusal)}
            continue
        with Probes(info.rank, info.device) as probes:
            losses = train_steps(engine, run)
            phases = _phased_step(engine, run, cfg.steps, probes)
            memory.start(t for ts in engine.state_tensors().values() for t in ts)
            _phased_step(engine, run, cfg.steps + 1, probes)
            phases["peak_mem_bytes"] = memory.stop()
        out[str(choice)] = phases | {"losses": losses}
    return out


def _phased_step(engine: fsdp2.Fsdp2Engine, cfg: RunConfig, step: int, probes: Probes) -> dict[str, Any]:
    """One training step under `probes`: its forward and backward collectives, by kind and group size."""
    info = rank_info()
    tokens, targets = rank_batch(step, cfg.model, cfg.seed, info.world_size, info.rank, info.device)
    with probes.step(step):
        start = len(probes.comm.calls)
        loss = engine.forward_loss(tokens, targets)
        middle = len(probes.comm.calls)
        engine.backward(loss)
        end = len(probes.comm.calls)
        engine.optimizer_step()
    return {"forward": _by_group(probes, start, middle), "backward": _by_group(probes, middle, end)}


def _by_group(probes: Probes, first_call: int, last_call: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for call in probes.comm.calls[first_call:last_call]:
        key = f"{call.kind} over {call.group_size} ranks"
        out[key] = out.get(key, 0) + call.wire_bytes
    return out


# --------------------------------------------------------------------------- a reduce-scatter group apart

NO_SEPARATE_GROUP = (
    "this torch has no FSDPModule.set_separate_reduce_scatter_group (torch 2.13 added it): reduce-scatters "
    "share the all-gathers' process group"
)


def separate_reduce_scatter_group(cfg: RunConfig) -> dict[str, Any]:
    """`set_separate_reduce_scatter_group()`: reduce-scatters on a process group of their own.

    The same ranks, a second communicator, so a reduce-scatter need not queue behind an all-gather. Returns
    `groups` ({kind: the process-group names its calls used, as seen by wrapping torch.distributed}),
    `shard_group` (the mesh's group name), `group_ranks` ({kind: the global ranks of its group}), `comm` (the probe's wire bytes per kind, last step) and `losses`;
    or `refused`, a sentence, on a torch without it.
    """
    if not hasattr(FSDPModule, "set_separate_reduce_scatter_group"):
        return {"refused": NO_SEPARATE_GROUP}
    info = rank_info()
    mesh = shard_mesh()
    engine = build_engine(cfg, mesh)
    engine.model.set_separate_reduce_scatter_group()
    with Probes(info.rank, info.device) as probes, group_names() as seen:
        losses = train_steps(engine, cfg, probes=probes)
    return {
        "groups": {
            kind: sorted(names) for kind, names in seen.items() if kind in (ALL_GATHER, REDUCE_SCATTER)
        },
        "shard_group": mesh.get_group().group_name,
        "group_ranks": {call.kind: list(call.group_ranks) for call in probes.comm.calls},
        "comm": {kind: row["wire_bytes"] for kind, row in probes.comm.summary(cfg.steps - 1).items()},
        "losses": losses,
    }


@contextmanager
def group_names() -> Iterator[dict[str, set[str]]]:
    """{kind: names of the process groups its calls ran on}, filled while inside, by wrapping the collectives
    `labkit.collectives.COUNTED` (install it inside the probe: patches stack, the last one runs first)."""
    seen: dict[str, set[str]] = {}

    def wrap(name: str, original: Callable) -> Callable:
        signature = inspect.signature(original)

        def recorded(*args, **kwargs):
            group = signature.bind_partial(*args, **kwargs).arguments.get("group") or dist.group.WORLD
            seen.setdefault(COLLECTIVES[name].kind, set()).add(group.group_name)
            return original(*args, **kwargs)

        return recorded

    with Patch(COUNTED, wrap, outermost=True):
        yield seen


# ------------------------------------------------------------------------------- a learner's accumulation step


def run_accumulation(
    step_fn: Callable[..., float], micro_steps: int, seed: int, steps: int = 2
) -> list[dict]:
    """Rank side: `steps` optimizer steps on FSDP2 with the lab's model (`tiny`, seed `seed`), each
    `step_fn(model, micro_batches)` (exercise 08's `accumulate_gradients`: forward and backward over this
    rank's batch cut into `micro_steps` micro-batches) then AdamW. Per step: `loss` (the global mean of what
    `step_fn` returned) and `reduce_scatter` ({"calls", "wire_bytes"} this rank sent during the step)."""
    info = rank_info()
    cfg = RunConfig(model="tiny", world_size=info.world_size, steps=steps, seed=seed)
    engine = build_engine(cfg)
    out = []
    with Probes(info.rank, info.device) as probes:
        for step in range(steps):
            with probes.step(step):
                loss = step_fn(engine.model, micro_batches(step, cfg, micro_steps))
                engine.optimizer_step()
            sent = probes.comm.summary(step).get(REDUCE_SCATTER, {"calls": 0, "wire_bytes": 0})
            out.append(
                {
                    "loss": global_mean([float(loss)]),
                    REDUCE_SCATTER: {k: sent[k] for k in ("calls", "wire_bytes")},
                }
            )
    return out
