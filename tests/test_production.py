"""The production surface (`labkit.lessons.production`, `production_deepspeed`) against `single` and the byte formula.

Two launches for the whole file (starting ranks and DeepSpeed cost seconds): every 2-rank feature in one, then
the 4-rank ones, which also resume the 2-rank distributed checkpoint on 4 ranks.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_helpers import assert_close, one_thread, reference_losses
from torch import nn

import labkit
from labkit.budget import collective_wire_bytes, padded_flat_numel
from labkit.engines import deepspeed, fsdp2
from labkit.engines.base import RunConfig
from labkit.lessons import fsdp2_features, production, production_deepspeed
from labkit.model import build_model, count_params

TIMEOUT_S = 300
MICRO_STEPS = 2
MAX_NORM = 0.5  # below the first gradient's norm (1.32 on tiny), so every step clips
REL = 1e-5  # float32 on either side: only the order of the sums differs
BF16_REL = 1e-3  # bf16 compute vs `single` under bf16 autocast (measured below 2e-4 over 3 steps)
CFG2 = RunConfig(world_size=2, steps=3)
CFG4 = RunConfig(world_size=4, steps=2)
RESUMED_STEPS = 2


_SINGLE: dict[str, dict] = {}


def single_run(cfg: RunConfig, max_norm: float | None = None) -> dict:
    """`production.single_run` in this process, on one thread as on a rank (`one_thread`), once per
    (cfg, max_norm) in this module: the bf16 oracle serves two tests."""
    key = repr((cfg, max_norm))
    if key not in _SINGLE:
        with one_thread():
            _SINGLE[key] = production.single_run(cfg, max_norm)
    return _SINGLE[key]


def _on_two(cfg: RunConfig, path: str) -> dict:
    return {
        "accumulate": production.accumulate(cfg, MICRO_STEPS),
        "clip": production.clip(cfg, MAX_NORM),
        "meta": production.meta_init(cfg),
        "export": production.export_full_state(cfg),
        "dcp": fsdp2_features.dcp_save(cfg, path, continue_steps=RESUMED_STEPS),
        "ds_accumulate": production_deepspeed.accumulate(cfg, MICRO_STEPS),
        "ds_bf16_master": production_deepspeed.bf16_master_weights(replace(cfg, dtype="bfloat16")),
        "ds_autocast": production_deepspeed.torch_autocast(cfg),  # last: DeepSpeed keeps it for the process
    }


def _on_four(cfg: RunConfig, path: str, first_step: int) -> dict:
    return {
        "reshard": production.reshard_choices(cfg, (True, 2, False, 3)),
        "separate": production.separate_reduce_scatter_group(cfg),
        "dcp": fsdp2_features.dcp_load(cfg, path, first_step, RESUMED_STEPS),
    }


@pytest.fixture(scope="module")
def facts(tmp_path_factory) -> dict:
    path = str(tmp_path_factory.mktemp("production") / "ckpt")
    two = labkit.launch(_on_two, 2, CFG2, path, timeout=TIMEOUT_S)[0]
    four = labkit.launch(_on_four, 4, CFG4, path, CFG2.steps, timeout=TIMEOUT_S)[0]
    return {"two": two, "four": four}


def _wire(phases: dict) -> dict[str, int]:
    """{kind: wire bytes} over the phases of one micro-step."""
    out: dict[str, int] = {}
    for phase in phases.values():
        for kind, row in phase.items():
            out[kind] = out.get(kind, 0) + row["wire_bytes"]
    return out


def test_fsdp2_accumulation_reduce_scatters_only_on_the_last_micro_step(facts):
    got = facts["two"]["accumulate"]
    assert_close(got["losses"], reference_losses(CFG2), REL)
    model = build_model(CFG2.model)
    plan = fsdp2.predicted_wire_bytes(model, CFG2, 2)
    blocks = len(model.blocks)
    assert [m["sync"] for m in got["micro"]] == [False, True] * CFG2.steps
    for m in got["micro"]:
        # Every micro-step gathers as a whole step does: each group in forward, each block again in backward.
        assert m["forward"]["all_gather"]["calls"] + m["backward"]["all_gather"]["calls"] == 2 * blocks + 1
        if m["sync"]:
            assert _wire({k: m[k] for k in ("forward", "backward")}) == plan
            assert m["backward"]["reduce_scatter"]["calls"] == blocks + 1
            assert m["unsharded_grad_bytes"] == 0, "the reduce-scatter consumed the full gradients"
        else:
            assert _wire({k: m[k] for k in ("forward", "backward")}) == {"all_gather": plan["all_gather"]}
            # No reduce-scatter: every rank keeps the whole fp32 gradient (tiny shards without padding).
            assert m["unsharded_grad_bytes"] == 4 * count_params(model)


def test_deepspeed_accumulation_reduce_scatters_every_micro_step(facts):
    got = facts["two"]["ds_accumulate"]
    assert_close(got["losses"], reference_losses(CFG2), REL)
    plan = deepspeed.predicted_wire_bytes(build_model(CFG2.model), CFG2, 2)
    assert [m["boundary"] for m in got["micro"]] == [False, True] * CFG2.steps
    for m in got["micro"][MICRO_STEPS:]:  # the first step traces DeepSpeed's fetch order (broadcasts)
        # ZeRO-3 reduces each micro-step's gradients into its partition: a whole step's reduce-scatter each time.
        assert _wire({k: m[k] for k in ("forward", "backward")}) == plan
        # AdamW (and its 8-byte gradient-norm all-reduce) only at the boundary.
        assert m["optimizer"] == ({"all_reduce": {"calls": 1, "wire_bytes": 8}} if m["boundary"] else {})


def test_clipping_dtensor_gradients_matches_single(facts):
    got = facts["two"]["clip"]
    want = single_run(CFG2, MAX_NORM)
    assert all(norm > MAX_NORM for norm in want["norms"]), "every step must clip"
    assert_close(got["norms"], want["norms"], REL)
    assert_close(got["losses"], want["losses"], REL)
    with pytest.raises(AssertionError):  # clipping changed the training
        assert_close(want["losses"], reference_losses(CFG2), REL)


def test_meta_init_never_holds_the_full_model_and_trains_as_the_built_one(facts):
    got = facts["two"]["meta"]
    assert got["device_after_to_empty"] == "cpu"
    assert got["max_abs_diff"] == 0.0, "each shard filled by build_model's rule, bit for bit"
    assert got["losses"] == got["built_losses"]
    assert_close(got["losses"], reference_losses(CFG2), REL)
    assert got["init_peak_bytes"] < got["full_model_bytes"] <= got["built_peak_bytes"]


def test_full_state_dict_export_equals_single_weights(facts):
    got = facts["two"]["export"]
    want = single_run(CFG2)
    assert_close(got["losses"], want["losses"], REL)
    assert sorted(got["state"]) == sorted(want["state"])
    for name, tensor in want["state"].items():
        assert got["state"][name].shape == tensor.shape and got["state"][name].device.type == "cpu"
        # AdamW turns rounding-level gradient differences into up to lr-sized steps where m / sqrt(v) is
        # sensitive (measured max 3.2e-5 after 3 steps at lr 1e-3).
        assert torch.allclose(got["state"][name], tensor, rtol=0, atol=CFG2.lr / 10), name


def test_checkpoint_saved_on_two_ranks_resumes_on_four(facts):
    saved, loaded = facts["two"]["dcp"], facts["four"]["dcp"]
    for part in ("model", "optimizer"):
        want, got = saved["state"][part], loaded["state"][part]
        assert sorted(want) == sorted(got)
        assert all(torch.equal(want[k], got[k]) for k in want), part
    assert_close(loaded["losses"], saved["continued_losses"], REL)
    uninterrupted = reference_losses(replace(CFG2, steps=CFG2.steps + RESUMED_STEPS))
    assert_close(saved["losses"] + loaded["losses"], uninterrupted, REL)


def test_reshard_after_forward_to_a_smaller_group(facts):
    got = facts["four"]["reshard"]
    model = build_model(CFG4.model)
    reference = reference_losses(CFG4)
    backward_gather = {"True": "all_gather over 4 ranks", "2": "all_gather over 2 ranks", "False": None}
    for choice, key in backward_gather.items():
        row = got[choice]
        assert_close(row["losses"], reference, REL)
        assert row["forward"] == {"all_gather over 4 ranks": row["forward"]["all_gather over 4 ranks"]}
        assert [k for k in row["backward"] if k.startswith("all_gather")] == ([key] if key else [])
        value = {"True": True, "2": 2, "False": False}[choice]
        plan = fsdp2.predicted_wire_bytes(model, replace(CFG4, options={"reshard_after_forward": value}), 4)
        measured: dict[str, int] = {}
        for phase in ("forward", "backward"):
            for k, wire in row[phase].items():
                measured[k.split(" over ")[0]] = measured.get(k.split(" over ")[0], 0) + wire
        assert measured == plan, choice
    # Keeping more of each block between forward and backward costs memory: 1/4, 1/2, then all of it.
    assert got["True"]["peak_mem_bytes"] < got["2"]["peak_mem_bytes"] < got["False"]["peak_mem_bytes"]
    assert "divides world_size=4" in got["3"]["refused"]


def test_separate_reduce_scatter_group(facts):
    got = facts["four"]["separate"]
    assert "refused" not in got, got.get("refused")
    assert got["groups"]["all_gather"] == [got["shard_group"]]
    assert len(got["groups"]["reduce_scatter"]) == 1 and got["groups"]["reduce_scatter"] != [
        got["shard_group"]
    ]
    assert got["group_ranks"]["reduce_scatter"] == [0, 1, 2, 3], "the same ranks, another communicator"
    assert got["comm"] == fsdp2.predicted_wire_bytes(build_model(CFG4.model), CFG4, 4)
    assert_close(got["losses"], reference_losses(CFG4), REL)


def _autocast_wire_bytes(model: nn.Module, n: int) -> dict[str, int]:
    """ZeRO-3 with fair knobs under `torch_autocast`: `nn.Linear` parameters travel in bf16, the rest in fp32;
    each gathered for forward and again for backward, reduce-scattered once."""
    linear = {id(p) for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
    gathered, reduced = 0, 0
    for p in model.parameters():
        payload = padded_flat_numel(p.numel(), n) * (2 if id(p) in linear else 4)
        gathered += 2 * collective_wire_bytes("all_gather", payload, n)
        reduced += collective_wire_bytes("reduce_scatter", payload, n)
    return {"all_gather": gathered, "reduce_scatter": reduced}


def test_deepspeed_torch_autocast_communicates_linear_weights_in_bf16(facts):
    got = facts["two"]["ds_autocast"]
    assert_close(got["losses"], single_run(replace(CFG2, dtype="bfloat16"))["losses"], BF16_REL)
    plan = _autocast_wire_bytes(build_model(CFG2.model), 2)
    assert got["comm"] == plan | {"all_reduce": 8}
    assert plan["all_gather"] < deepspeed.predicted_wire_bytes(build_model(CFG2.model), CFG2, 2)["all_gather"]


def test_deepspeed_bf16_master_weights(facts):
    got = facts["two"]["ds_bf16_master"]
    assert "refused" not in got, got.get("refused")  # DeepSpeed 0.19.8 runs it on CPU ranks
    assert got["master_dtype"] == "torch.bfloat16"
    moments = {k: v for k, v in got["optimizer_state_dtypes"].items() if k != "step"}
    assert moments == {"exp_avg": "torch.bfloat16", "exp_avg_sq": "torch.bfloat16"}
    bf16 = replace(CFG2, dtype="bfloat16")
    assert_close(got["losses"], single_run(bf16)["losses"], BF16_REL)
