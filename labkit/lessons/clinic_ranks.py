"""The debugging clinic's broken runs and their fixes on FSDP2, each a rank-side function (notebook 09).

Run any with `labkit.launch(fn, world_size, cfg)`, or all at once with `fsdp2_cases`. Each returns the
broken run's figure beside the fixed run's, measured on the same ranks by the lab's probes and torch's own
tools: reduce-scatters per optimizer step (accumulation), peak bytes of a state dict (checkpointing), the
error and the tie of a shared weight (tied embeddings), weights a step left unchanged (bf16 without masters).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from labkit.engines import fsdp2
from labkit.engines.base import RunConfig
from labkit.engines.on_rank import rank_info, rank_model, train_steps
from labkit.lessons.fsdp2_features import build_engine, shard_mesh
from labkit.lessons.production import peak_bytes_of, run_accumulation, single_run, unsharded_grad_bytes
from labkit.model import build_model, count_params, loss_fn
from labkit.names import REDUCE_SCATTER

# ------------------------------------------------------------------- accumulation with a no_sync that is not

TRACKER_WARNINGS = ("Full backward hook is firing", "FSDP2-wrapped module .* returned a view tensor")
Watch = Callable[[int], AbstractContextManager]  # a context around micro-step i


def ddp_style_accumulation(model: torch.nn.Module, micro: list, each: Watch = nullcontext) -> float:
    """The broken loop: DDP's `no_sync()` on every micro-step but the last, if the model has one.

    An FSDP2 model has none, so the guard quietly picks a context that does nothing: every micro-step's
    backward reduce-scatters. `each(i)` is a context around micro-step i. Returns the mean micro-loss.
    """
    losses = []
    for i, (tokens, targets) in enumerate(micro):
        last = i == len(micro) - 1
        with each(i), nullcontext() if last else getattr(model, "no_sync", nullcontext)():
            loss = loss_fn(model(tokens), targets)
            (loss / len(micro)).backward()
        losses.append(loss.item())
    return sum(losses) / len(losses)


def fsdp2_accumulation(model: torch.nn.Module, micro: list, each: Watch = nullcontext) -> float:
    """The fix: `set_requires_gradient_sync(False)` on every micro-step but the last, True on the last."""
    losses = []
    for i, (tokens, targets) in enumerate(micro):
        model.set_requires_gradient_sync(i == len(micro) - 1)
        with each(i):
            loss = loss_fn(model(tokens), targets)
            (loss / len(micro)).backward()
        losses.append(loss.item())
    return sum(losses) / len(losses)


@contextmanager
def counted(model: torch.nn.Module, seen: dict[str, Any]) -> Iterator[None]:
    """One micro-step under torch's `CommDebugMode` (one per forward and backward: its module tracker
    loses its place across a second forward), its op counts added to `seen["comm_debug"]` and FSDP2's
    unsharded gradient bytes after it appended to `seen["held_grad_bytes"]`."""
    mode = CommDebugMode()
    with mode, warnings.catch_warnings():
        for said in TRACKER_WARNINGS:  # the tracker's own hooks warn; the loop under it does not
            warnings.filterwarnings("ignore", message=said)
        yield
    counts = seen.setdefault("comm_debug", {})
    for op, n in mode.get_comm_counts().items():
        name = str(op).split(".")[-1]
        counts[name] = counts.get(name, 0) + n
    seen.setdefault("held_grad_bytes", []).append(unsharded_grad_bytes(model))


def accumulation(cfg: RunConfig, micro_steps: int) -> dict[str, Any]:
    """Both loops, `cfg.steps` optimizer steps each. Per loop: `losses`, `reduce_scatters` per optimizer
    step (the lab's probe), `comm_debug` (torch's `CommDebugMode`: {c10d op: calls} over the first optimizer
    step) and `held_grad_bytes` (FSDP2's unsharded gradients alive after each of its micro-steps)."""
    out = {}
    for name, loop in (("broken", ddp_style_accumulation), ("fixed", fsdp2_accumulation)):
        seen: dict[str, Any] = {}

        def watched(model, micro, loop=loop, seen=seen):
            if seen:
                return loop(model, micro)
            return loop(model, micro, each=lambda i, model=model, seen=seen: counted(model, seen))

        steps = run_accumulation(watched, micro_steps, cfg.seed, cfg.steps)
        out[name] = {
            "losses": [s["loss"] for s in steps],
            "reduce_scatters": [s[REDUCE_SCATTER]["calls"] for s in steps],
            **seen,
        }
    return out


# --------------------------------------------------------------------------------- a full state dict everywhere


def state_dict_peaks(cfg: RunConfig) -> dict[str, Any]:
    """Peak live bytes on this rank while taking the model's state dict after `cfg.steps` steps, three ways.

    `full_everywhere` (the broken one): `full_state_dict=True`, every rank all-gathers and keeps the whole
    model; `full_on_rank0`: with `cpu_offload=True`, torch keeps it on rank 0 only and each other rank holds
    one gathered parameter at a time (and the next ones' as they arrive, until gloo's worker lets go of it); `sharded` (DCP's default): each rank's DTensor shards, nothing gathered.
    `full_model_bytes` is the fp32 model (4 B x its parameters), `largest_param_bytes` its largest tensor.
    """
    engine = build_engine(cfg)
    train_steps(engine, cfg)
    ways = {
        "full_everywhere": StateDictOptions(full_state_dict=True),
        "full_on_rank0": StateDictOptions(full_state_dict=True, cpu_offload=True),
        "sharded": StateDictOptions(),
    }
    peaks = {}
    for way, options in ways.items():
        state, peaks[way] = peak_bytes_of(
            lambda options=options: get_model_state_dict(engine.model, options=options)
        )
        del state
    whole = build_model(cfg.model)  # the unsharded fp32 model, for its sizes
    return {
        "peak_bytes": peaks,
        "full_model_bytes": 4 * count_params(whole),
        "largest_param_bytes": max(4 * p.numel() for p in whole.parameters()),
    }


# ------------------------------------------------------------------------------ a tied weight in two units


def tied_embeddings(cfg: RunConfig) -> dict[str, Any]:
    """GPT-2's head shares its weight with the token embedding (`cfg.model` "hf-gpt2"), sharded two ways.

    `broken`: the head in a unit of its own, then the blocks and the root; `fixed`: the embedding and the
    head in one unit (`fully_shard([wte, lm_head])`, what torch's error asks for), then the same. Per way:
    `tied` (the head's weight is still the embedding's after sharding), `error` (the first step's, or None)
    and `losses` (None if it failed); `single_losses` are `production.single_run(cfg)`'s, the oracle.
    """
    out = {}
    for way in ("broken", "fixed"):
        model = rank_model(cfg.model, cfg.seed)
        hf, mesh = model.hf, shard_mesh()
        fully_shard(hf.lm_head if way == "broken" else [hf.transformer.wte, hf.lm_head], mesh=mesh)
        fsdp2.shard_model(model, cfg, mesh)
        engine = fsdp2.Fsdp2Engine(model, fsdp2.sharded_adamw(model.parameters(), cfg), rank_info().device)
        tied = hf.lm_head.weight is hf.transformer.wte.weight
        try:  # every rank fails alike, at its first forward, before any collective
            losses, error = train_steps(engine, cfg), None
        except ValueError as e:
            losses, error = None, str(e)
        out[way] = {"tied": tied, "error": error, "losses": losses}
    out["single_losses"] = single_run(cfg)[
        "losses"
    ]  # the oracle, here where Transformers is imported already
    return out


# ----------------------------------------------------------------------------- bf16 weights with no master


def unchanged_by_a_step(cfg: RunConfig) -> dict[str, Any]:
    """The share of weight elements one AdamW step at `cfg.lr` leaves unchanged, two ways of training in bf16.

    `broken`: the model cast to bf16 before sharding, so AdamW updates bf16 weights and an update under
    half a bf16 step rounds away; `fixed`: fp32 weights with `MixedPrecisionPolicy(param_dtype=bf16)` (the
    engine's `dtype="bfloat16"`), so AdamW updates fp32 masters, as DeepSpeed's bf16 mode does. Per way:
    `unchanged` (fraction of this rank's elements), `dtype` (of the weights AdamW updates), `losses`.
    """
    out = {}
    for way in ("broken", "fixed"):
        model = rank_model(cfg.model, cfg.seed)
        run = cfg
        if way == "broken":
            model.to(torch.bfloat16)
        else:
            run = replace(cfg, dtype="bfloat16")
        fsdp2.shard_model(model, run, shard_mesh())
        engine = fsdp2.Fsdp2Engine(model, fsdp2.sharded_adamw(model.parameters(), run), rank_info().device)
        shards = [p.to_local() for p in model.parameters()]
        before = [t.detach().clone() for t in shards]
        losses = train_steps(engine, replace(run, steps=1))
        same = sum((a == b).sum().item() for a, b in zip(before, shards, strict=True))
        out[way] = {
            "unchanged": same / sum(t.numel() for t in shards),
            "dtype": str(shards[0].dtype).removeprefix("torch."),
            "losses": losses,
        }
    return out


def fsdp2_cases(cfg: RunConfig, micro_steps: int, fine_tune_lr: float) -> dict[str, Any]:
    """Every FSDP2 case of the clinic in one launch (`cfg` the lab's model; the tied case runs GPT-2)."""
    return {
        "accumulation": accumulation(cfg, micro_steps),
        "state_dict": state_dict_peaks(cfg),
        "tied": tied_embeddings(replace(cfg, model="hf-gpt2")),
        "bf16": unchanged_by_a_step(replace(cfg, lr=fine_tune_lr)),
    }
