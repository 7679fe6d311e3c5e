"""Activation checkpointing, one option for every engine that takes it: each block's forward runs under
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`, so backward recomputes the block's
activations instead of keeping them from forward.

`RunConfig(options={"activation_checkpointing": True})` on single, ddp, scratch and fsdp2. The wrap is
torch's `checkpoint_wrapper` put in place of each `model.blocks[i]` before the engine shards the model
(FSDP2's idiomatic order, as in torchtitan): the sharding hooks then sit on the wrapper, outside the
checkpointed region. Backward first runs the wrapper's pre-backward gather, then the recompute of the
inner block with those gathered weights; the recompute never fires the sharding hooks again, so a step
moves the same bytes as without checkpointing.

The deepspeed engine refuses it (`ds_config.ACTIVATION_CHECKPOINTING_REFUSAL`): DeepSpeed's own
checkpointing is a call in the model's forward. torch's wrapper does run under it, with the same losses:
with the blocks as ZeRO-3 leaf modules it keeps the calls and bytes; without, the recompute fires
DeepSpeed's sub-module hooks again and gathers more (docs/measured.md).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from labkit.engines.base import RunConfig

OPTION = "activation_checkpointing"


def enabled(cfg: RunConfig) -> bool:
    """Whether `cfg` asks for activation checkpointing (`cfg.options["activation_checkpointing"]`)."""
    return bool(cfg.options.get(OPTION, False))


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Replace each `model.blocks[i]` by a non-reentrant `checkpoint_wrapper` around it; return `model`.

    Call it before sharding. The wrapper owns the block as `_checkpoint_wrapped_module`, so parameter
    names gain that segment (state dicts strip it again).
    """
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return model


def apply(model: nn.Module, cfg: RunConfig) -> nn.Module:
    """`checkpoint_blocks(model)` when `cfg` enables the option, else `model` as it is."""
    return checkpoint_blocks(model) if enabled(cfg) else model
