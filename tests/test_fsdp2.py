"""The fsdp2 engine and its features against the single-process AdamW oracle, on gloo CPU ranks.

Checks are grouped into one launch per world size (starting ranks costs seconds on this machine).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from engine_helpers import assert_close, reference_losses, train

import labkit
from labkit.budget import padded_numel
from labkit.engines import fsdp2, fsdp2_features, loop
from labkit.engines.base import RunConfig
from labkit.model import build_model, count_params

BF16_REL = 1e-2  # bf16 compute vs the float32 oracle over 3 steps (measured below 1e-3)
TIMEOUT_S = 300


def _variants(cases: list[tuple[str, RunConfig]]) -> dict:
    """Rank side: build and train each case on fresh weights; losses, placements and local state bytes."""
    out = {}
    for name, cfg in cases:
        engine = fsdp2.build(cfg, build_model(cfg.model, cfg.seed), loop.rank_info())
        placements = set(fsdp2.placements(engine.model).values())
        losses = train(engine, cfg)
        state = {k: sum(t.numel() * t.element_size() for t in ts) for k, ts in engine.state_tensors().items()}
        out[name] = {"losses": losses, "placements": placements, "state": state}
    return out


CASES = {
    2: {
        "default": {},
        "no_prefetch": {"prefetch": False},
        "keep_gathered": {"reshard_after_forward": False},
        "bf16": {"dtype": "bfloat16"},
        "offload": {"offload": "cpu"},
    },
    3: {"default": {}, "uneven": {"model": "tiny_uneven"}},
    4: {
        "default": {},
        "reshard_to_2": {"options": {"reshard_after_forward": 2}},
        "prefetch_2": {"options": {"prefetch_depth": 2}},
    },
}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_fsdp2_matches_single_with_every_option(n):
    # The defaults over 5 steps, each option over 3 (starting ranks is cheap, stepping them is not).
    cases = [
        (name, replace(RunConfig(world_size=n, steps=5 if name == "default" else 3), **kw))
        for name, kw in CASES[n].items()
    ]
    results = labkit.launch(_variants, n, cases, timeout=TIMEOUT_S)
    for name, cfg in cases:
        got = results[0][name]
        reference = reference_losses(replace(cfg, dtype="float32"))
        assert_close(got["losses"], reference, BF16_REL if cfg.dtype == "bfloat16" else 1e-4)
        assert got["placements"] == {"(Shard(dim=0),)"}, name
        assert all(r[name]["losses"] == got["losses"] for r in results), "ranks disagree on the global loss"
        if cfg.model == "tiny" and cfg.dtype == "float32":
            # 16 B/param / n: param, grad, two moments (the tiny model divides by 2, 3 and 4: no padding),
            # plus AdamW's 4-byte step counter per parameter tensor.
            n_params = count_params(build_model(cfg.model))
            n_tensors = len(list(build_model(cfg.model).parameters()))
            assert got["state"] == {
                "params": 4 * n_params // n,
                "grads": 4 * n_params // n,
                "optimizer": 8 * n_params // n + 4 * n_tensors,
            }


@pytest.mark.parametrize("n, model", [(2, "tiny"), (3, "tiny_uneven")])
def test_fsdp2_bytes_through_the_loop_match_the_wrap_plan(n, model):
    cfg = RunConfig(model=model, world_size=n, steps=2)
    record = loop.run("fsdp2", cfg)
    unsharded = build_model(model)
    assert_close(record["losses"], reference_losses(cfg))
    predicted = fsdp2.predicted_wire_bytes(unsharded, cfg, n)
    comm = record["comm"]
    assert comm["all_gather"]["wire_bytes"] == predicted["all_gather"]
    assert comm["reduce_scatter"]["wire_bytes"] == predicted["reduce_scatter"]
    # Against the formula: reduce-scatter (n-1)/n x padded parameter bytes; all-gather between 1x and 2x
    # (the root group stays gathered from forward to backward, so it is gathered once, the blocks twice).
    padded_bytes = 4 * sum(padded_numel(p.shape, n) for p in unsharded.parameters())
    assert comm["reduce_scatter"]["wire_bytes"] == (n - 1) * padded_bytes // n
    assert 1 < comm["all_gather"]["wire_bytes"] / comm["reduce_scatter"]["wire_bytes"] < 2
    assert set(comm) == {"all_gather", "reduce_scatter"}
    # Storages counted by the probe: the padded parameter and gradient shards, unpadded AdamW moments.
    assert record["state_bytes"]["params"] == padded_bytes // n


def test_hsdp_option_of_the_engine_matches_single_and_its_plan():
    # hsdp_shard_size=2 on 4 ranks: shard groups (0, 1), (2, 3); gradient shards all-reduced over (0, 2).
    cfg = RunConfig(world_size=4, steps=2, options={"hsdp_shard_size": 2})
    record = loop.run("fsdp2", cfg)
    assert_close(record["losses"], reference_losses(cfg))
    wire = {k: v["wire_bytes"] for k, v in record["comm"].items()}
    assert wire == fsdp2.predicted_wire_bytes(build_model(cfg.model), cfg, 4)
    groups = {(c["kind"], tuple(c["group_ranks"])) for c in record["collective_calls"]}
    assert groups == {("all_gather", (0, 1)), ("reduce_scatter", (0, 1)), ("all_reduce", (0, 2))}
    # One machine is one node: nothing crosses a node boundary.
    assert record["nodes"] == [0, 0, 0, 0]
    assert all(row["inter_node_bytes"] == 0 for row in record["comm_by_link"].values())
    with pytest.raises(ValueError, match="hsdp_shard_size=3: pass a number of ranks that divides"):
        fsdp2.predicted_wire_bytes(build_model(cfg.model), RunConfig(options={"hsdp_shard_size": 3}), 4)


def _features(cfg: RunConfig) -> dict:
    return {
        "hsdp": fsdp2_features.hsdp(cfg),
        "tp": fsdp2_features.tp_fsdp(cfg),
        "ignored": fsdp2_features.ignored_params(cfg),
        "ignored_synced": fsdp2_features.ignored_params(cfg, sync=True),
        "counts": fsdp2_features.comm_debug_counts(cfg),
    }


def test_hsdp_tp_ignored_params_and_comm_debug_mode_on_four_ranks():
    cfg = RunConfig(world_size=4, steps=3)
    facts = labkit.launch(_features, 4, cfg, timeout=TIMEOUT_S)[0]
    reference = reference_losses(cfg)

    hsdp = facts["hsdp"]
    assert hsdp["mesh_dim_names"] == ("replicate", "shard")
    assert hsdp["placements"] == "(Replicate(), Shard(dim=0))"
    assert hsdp["shard_group_ranks"] == [0, 1] and hsdp["replicate_group_ranks"] == [0, 2]
    assert hsdp["local_shape"][0] * 2 == hsdp["full_shape"][0]
    assert_close(hsdp["losses"], reference)

    tp = facts["tp"]
    assert tp["mesh_dim_names"] == ("dp", "tp")
    assert tp["placements"]["out.weight"][1] == "(Shard(dim=0), Shard(dim=1))"
    assert tp["placements"]["qkv.weight"] == ("('dp',)", "(Shard(dim=0),)")
    assert tp["fc_local_shape"][0] * 4 == tp["fc_full_shape"][0]
    assert_close(tp["losses"], reference)

    ignored, synced = facts["ignored"], facts["ignored_synced"]
    assert ignored["is_dtensor"] == {"pos.weight": False} and ignored["shape"] == (48, 96)
    assert ignored["max_abs_diff_between_ranks"] > 0, "an ignored parameter is not reduced: replicas drift"
    with pytest.raises(AssertionError):
        assert_close(ignored["losses"], reference)
    assert synced["max_abs_diff_between_ranks"] == 0
    assert_close(synced["losses"], reference)

    # One step: 4 blocks + root all-gathered in forward, the 4 blocks again in backward; 5 reduce-scatters.
    assert facts["counts"] == {"_allgather_base_": 9, "_reduce_scatter_base_": 5}


def test_dcp_saved_on_four_ranks_loads_on_two_bit_identical_and_resumes(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = labkit.launch(fsdp2_features.dcp_save, 4, RunConfig(world_size=4, steps=2), path, 2)[0]
    on_two = labkit.launch(fsdp2_features.dcp_load, 2, RunConfig(world_size=2), path, 2, 2)[0]
    on_four = labkit.launch(fsdp2_features.dcp_load, 4, RunConfig(world_size=4), path, 2, 2)[0]
    assert saved["files"] == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    for part in ("model", "optimizer"):
        want, got = saved["state"][part], on_two["state"][part]
        assert sorted(want) == sorted(got)
        assert all(torch.equal(want[k], got[k]) for k in want), part
    assert on_four["losses"] == saved["continued_losses"], "same world size: the resumed run is exact"
    assert_close(saved["losses"] + on_two["losses"], reference_losses(RunConfig(steps=4)))


@pytest.mark.skipif(
    not os.environ.get("LABKIT_SLOW_TESTS"), reason="compiles for ~45 s; set LABKIT_SLOW_TESTS=1 to run"
)
def test_compile_of_the_sharded_model_matches_eager():
    cfg = RunConfig(world_size=2, steps=3)
    facts = labkit.launch(fsdp2_features.compile_sharded, 2, cfg, timeout=TIMEOUT_S)[0]
    if "skipped" in facts:
        pytest.skip(facts["skipped"])
    assert_close(facts["losses"], reference_losses(cfg))
    assert facts["first_step_s"] > facts["later_step_s"]
