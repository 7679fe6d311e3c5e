"""DeepSpeed's production options on CPU ranks, each a rank-side function that trains briefly and returns facts.

Run with `labkit.launch(fn, world_size, cfg, ...)`, beside `production.single_run` and the engine's
`deepspeed.predicted_wire_bytes`: `gradient_accumulation_steps`, the `torch_autocast` section, and bf16
master weights and gradients (`bf16_master_weights_and_grads`). Each builds the lab's engine on its
`ds_config`, with the section changed.
"""

from __future__ import annotations

from typing import Any

import torch

from labkit.engines import deepspeed as deepspeed_engine
from labkit.engines.base import RunConfig, adamw
from labkit.engines.ds_config import ds_config
from labkit.engines.on_rank import rank_info, rank_model, train_steps
from labkit.lessons.production import global_mean, micro_batches, phase_comm
from labkit.model import config as model_config
from labkit.probes import Probes


def build_engine(cfg: RunConfig, **sections: Any) -> deepspeed_engine.DeepSpeedEngine:
    """The deepspeed engine on fresh weights, `ds_config(cfg)` with the top-level `sections` replaced."""
    info = rank_info()
    model = rank_model(cfg.model, cfg.seed)
    config = ds_config(cfg, info.world_size) | sections
    return deepspeed_engine.initialize(model, config, adamw(model.parameters(), cfg))


def accumulate(cfg: RunConfig, micro_steps: int = 2) -> dict[str, Any]:
    """`gradient_accumulation_steps = micro_steps`: DeepSpeed's own accumulation, as the engine is driven.

    Every micro-step calls `engine.backward(loss)` (DeepSpeed divides the loss by the accumulation steps)
    and `engine.step()` (which steps AdamW only at the accumulation boundary). Returns `losses` (the global
    mean per optimizer step) and `micro`: per micro-step, `boundary` (DeepSpeed's
    `is_gradient_accumulation_boundary()`) and the probe's `forward`, `backward` and `optimizer` collectives
    ({kind: {"calls", "wire_bytes"}}).
    """
    info = rank_info()
    global_batch = model_config(cfg.model).global_batch
    engine = build_engine(
        cfg,
        gradient_accumulation_steps=micro_steps,
        train_micro_batch_size_per_gpu=global_batch // (info.world_size * micro_steps),
    )
    losses, micro = [], []
    with Probes(info.rank, info.device) as probes:
        for step in range(cfg.steps):
            micro_losses = []
            for i, (tokens, targets) in enumerate(micro_batches(step, cfg, micro_steps)):
                boundary = engine.engine.is_gradient_accumulation_boundary()
                with probes.step(step * micro_steps + i):
                    marks = [len(probes.comm.calls)]
                    loss = engine.forward_loss(tokens, targets)
                    marks.append(len(probes.comm.calls))
                    engine.backward(loss)
                    marks.append(len(probes.comm.calls))
                    engine.optimizer_step()
                    marks.append(len(probes.comm.calls))
                micro_losses.append(loss.item())
                phases = {
                    phase: phase_comm(probes, marks[j], marks[j + 1])
                    for j, phase in enumerate(("forward", "backward", "optimizer"))
                }
                micro.append({"step": step, "boundary": boundary} | phases)
            losses.append(global_mean(micro_losses))
    return {"losses": losses, "micro": micro}


def torch_autocast(cfg: RunConfig) -> dict[str, Any]:
    """The config's `torch_autocast` section (bf16): fp32 weights, bf16 compute and bf16 communication.

    DeepSpeed 0.19.8 runs the forward under `torch.autocast` and marks the parameters of `nn.Linear`
    modules (its `lower_precision_safe_modules` default) with a bf16 `comm_dtype`: those are all-gathered
    and reduce-scattered in bf16, the rest (embeddings, LayerNorm) in fp32. Returns `losses` and `comm`
    (the last step's {kind: wire bytes}). DeepSpeed keeps the autocast setting in module globals, so a later
    engine in the same process runs with it too: call this last in a rank.
    """
    info = rank_info()
    engine = build_engine(cfg, torch_autocast={"enabled": True, "dtype": "bfloat16"})
    with Probes(info.rank, info.device) as probes:
        losses = train_steps(engine, cfg, probes=probes)
    last = probes.comm.summary(cfg.steps - 1)
    return {"losses": losses, "comm": {kind: row["wire_bytes"] for kind, row in last.items()}}


def bf16_master_weights(cfg: RunConfig) -> dict[str, Any]:
    """bf16 with `bf16_master_weights_and_grads` and `bf16_optimizer_states`: no fp32 copy at all.

    Returns `losses` and the dtypes DeepSpeed keeps (`master_dtype`, `optimizer_state_dtypes`: {AdamW state key: dtype}); or
    `refused`, one sentence with the error DeepSpeed raised, where it does not run on these ranks.
    """
    bf16 = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    try:
        engine = build_engine(cfg, bf16=bf16)
        losses = train_steps(engine, cfg)
    except Exception as error:  # noqa: BLE001 (DeepSpeed's own error, whatever its type, is the answer)
        return {
            "refused": f"bf16_master_weights_and_grads does not run here: DeepSpeed raised {type(error).__name__}: {error}"
        }
    zero = engine.engine.optimizer
    states = {
        k: str(t.dtype) for s in zero.optimizer.state.values() for k, t in s.items() if torch.is_tensor(t)
    }
    return {
        "losses": losses,
        "master_dtype": str(zero.fp32_partitioned_groups_flat[0].dtype),
        "optimizer_state_dtypes": states,
    }
