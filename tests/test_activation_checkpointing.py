"""Activation checkpointing on the engines (`options["activation_checkpointing"]`): the same losses as the
oracle (recomputing is the same math), the same bytes per step (the sharding hooks sit outside the
checkpointed region), a lower peak, by as much as `labkit.budget` says; DeepSpeed refuses it in one sentence.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_helpers import assert_close, reference_losses
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from labkit import budget
from labkit.engines import fsdp2, loop, scratch, single, validation
from labkit.engines.activation_checkpointing import OPTION
from labkit.engines.base import RankInfo, RunConfig
from labkit.engines.ds_config import ACTIVATION_CHECKPOINTING_REFUSAL, ds_config
from labkit.model import batch, build_model, config, count_params

AC = {OPTION: True}


def test_checkpointing_keeps_losses_and_bytes_and_lowers_the_peak():
    base = RunConfig(world_size=2, steps=3)
    ac = replace(base, options=AC)
    runs = {
        # Each plain run just before its checkpointed one (`run_many` on what a run can leave alive).
        "scratch": ("scratch", base),
        "scratch, checkpointed": ("scratch", ac),
        "fsdp2": ("fsdp2", base),
        "fsdp2, checkpointed": ("fsdp2", ac),
        "scratch, checkpointed, kept after forward": ("scratch", replace(ac, reshard_after_forward=False)),
        "ddp": ("ddp", base),
        "ddp, checkpointed": ("ddp", ac),
    }
    records = dict(zip(runs, loop.run_many(list(runs.values())), strict=True))
    oracle = reference_losses(base)
    for record in records.values():
        assert_close(record["losses"], oracle)  # recomputation is the same arithmetic: rel 1e-4 of single

    model = build_model()
    for name, engine in (("scratch", scratch), ("fsdp2", fsdp2)):
        plain, checkpointed = records[name], records[f"{name}, checkpointed"]
        wire = {k: row["wire_bytes"] for k, row in checkpointed["comm"].items()}
        # With reshard_after_forward the before-backward gather brings each unit back for the recompute and
        # the recompute gathers nothing more: 3 x (n-1)/n x the parameter bytes, as without checkpointing.
        assert wire == engine.predicted_wire_bytes(model, base, 2), name
        assert checkpointed["comm"] == plain["comm"], name
        assert max(checkpointed["peak_mem_bytes"]) < max(plain["peak_mem_bytes"]), name
        assert checkpointed["state_bytes"] == plain["state_bytes"], name
    # Kept after forward, the recompute uses the weights forward gathered: 2 x (n-1)/n.
    kept = records["scratch, checkpointed, kept after forward"]
    assert {k: r["wire_bytes"] for k, r in kept["comm"].items()} == scratch.predicted_wire_bytes(
        model, replace(base, reshard_after_forward=False), 2
    )
    # DDP holds no gathered blocks: its peak minus its state is the activations alone, which labkit.budget
    # predicts with checkpointing and without (the block inputs, the last block recomputed at its backward).
    above = {
        ckpt: max(records[name]["peak_mem_bytes"]) - sum(records[name]["state_bytes"].values())
        for ckpt, name in ((False, "ddp"), (True, "ddp, checkpointed"))
    }
    shape = budget.model_options(config(base.model), base.world_size)
    predicted = {
        ckpt: budget.plan(
            count_params(model), 2, "ddp", precision="fp32", activation_checkpointing=ckpt, **shape
        )["activation_bytes_per_rank"]
        for ckpt in (False, True)
    }
    assert above[True] / above[False] == pytest.approx(predicted[True] / predicted[False], rel=0.05)
    assert above == pytest.approx(predicted, rel=0.01), (above, predicted)


def test_single_checkpointed_is_the_oracle_with_wrapped_blocks():
    cfg = RunConfig(world_size=1, steps=3, options=AC)
    engine = single.build(cfg, build_model(), RankInfo(0, 1, 0, torch.device("cpu"), "gloo"))
    assert all(isinstance(b, CheckpointWrapper) for b in engine.model.blocks)
    losses = []
    for step in range(cfg.steps):
        loss = engine.forward_loss(*batch(step))
        engine.backward(loss)
        engine.optimizer_step()
        losses.append(loss.item())
    assert_close(losses, reference_losses(cfg), rel=1e-6)


def test_deepspeed_refuses_checkpointing_in_one_sentence_and_fsdp1_does_not_ignore_it():
    cfg = RunConfig(world_size=2, options=AC)
    with pytest.raises(ValueError) as refused:
        ds_config(cfg, 2)
    message = str(refused.value)
    assert message == ACTIVATION_CHECKPOINTING_REFUSAL and "\n" not in message
    assert "deepspeed.checkpointing.checkpoint" in message and "scratch or fsdp2" in message
    with pytest.raises(ValueError, match="activation_checkpointing"):
        validation.validate(["fsdp1"], cfg)
    validation.validate(["single", "ddp", "scratch", "fsdp2"], cfg)  # the engines that take it
