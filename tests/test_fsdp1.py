"""The fsdp1 engine (FSDP1's `FullyShardedDataParallel`) against the single-process oracle, on gloo CPU ranks.

Every run goes through the loop's own `train_rank` (the probes of `labkit compare`), and the checks are
grouped into one launch per world size: starting ranks costs seconds on this machine.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from engine_helpers import assert_close, reference_losses
from fsdp1_checks import assert_measured_is_planned, assert_prefetch

import labkit
from labkit import cli
from labkit.budget import padded_flat_numel
from labkit.engines import ENGINES, fsdp1, loop, on_rank, validation
from labkit.engines.base import RankInfo, RunConfig
from labkit.layout import flat_layout
from labkit.lessons import engine_inspect
from labkit.model import build_model, count_params

BF16_REL = 1e-2  # bf16 compute vs the float32 oracle over 3 steps (measured 7e-5)
TIMEOUT_S = 300


def _runs_then_layout(runs: list[tuple[str, RunConfig]], layout_cfg: RunConfig) -> tuple[list, list]:
    """Rank side: `train_rank` for each run (a barrier after each), then `inspect_flat(layout_cfg)`."""
    records = []
    for engine, cfg in runs:
        records.append(on_rank.train_rank(engine, cfg))
        dist.barrier()
    return records, engine_inspect.inspect_flat(layout_cfg)


def _launch(n: int, cases: dict[str, RunConfig], layout_cfg: RunConfig) -> tuple[dict, list[list]]:
    """{case: merged record} and every rank's `inspect_flat`, from one launch of `n` ranks."""
    runs = [("fsdp1", cfg) for cfg in cases.values()]
    per_rank = labkit.launch(_runs_then_layout, n, runs, layout_cfg, timeout=TIMEOUT_S)
    records = {
        name: loop.merge_ranks([r[0][i] for r in per_rank], cfg.steps)
        for i, (name, cfg) in enumerate(cases.items())
    }
    return records, [r[1] for r in per_rank]


def assert_layout(layouts: list[list[dict]], cfg: RunConfig, n: int) -> None:
    """Each rank's real FlatParameters: one per unit, padded to a multiple of n, sliced as `flat_layout`."""
    model = build_model(cfg.model)
    for rank, units in enumerate(layouts):
        assert [u["unit"] for u in units] == ["root"] + [f"blocks.{i}" for i in range(len(model.blocks))]
        assert all(u["is_flat_parameter"] and u["type"] == "Parameter" for u in units)
        for unit, numel in zip(units, fsdp1.unit_numels(model), strict=True):
            assert unit["flat_numel"] == numel
            assert unit["padded_numel"] == padded_flat_numel(numel, n) == n * unit["shard_numel"]
            held = sum(stop - start for _, start, stop in unit["segments"])
            assert held + unit["shard_padding"] == unit["shard_numel"]
        for i, block in enumerate(model.blocks):
            unit = units[i + 1]
            assert unit["params"] == [
                (f"blocks.{i}.{k}", tuple(p.shape)) for k, p in block.named_parameters()
            ]
            want = [
                (f"blocks.{i}.{s.param}", s.start, s.stop)
                for s in flat_layout(block, n)
                if s.rank == rank and not s.padding
            ]
            assert unit["segments"] == want, (rank, i)
    # The padding sits at the end of the buffer: on the last ranks only.
    assert sum(u["shard_padding"] for u in layouts[0]) == 0 or n == 1


def test_fsdp1_at_two_ranks_with_each_option_and_its_flat_parameters():
    base = RunConfig(world_size=2, steps=3)
    cases = {
        "default": replace(base, steps=10),
        "no_prefetch": replace(base, prefetch=False),
        "shard_grad_op": replace(base, reshard_after_forward=False),
        "bf16": replace(base, dtype="bfloat16"),
    }
    records, layouts = _launch(2, cases, base)
    for name, cfg in cases.items():
        record = records[name]
        reference = reference_losses(replace(cfg, dtype="float32"))
        assert_close(record["losses"], reference, BF16_REL if cfg.dtype == "bfloat16" else 1e-4)
        assert_measured_is_planned(record, cfg, 2)
        assert_prefetch(record, cfg, len(build_model(cfg.model).blocks))
    # bf16 gathers half the bytes and reduce-scatters the same fp32 gradients; the master shard stays fp32.
    fp32, bf16 = records["no_prefetch"]["comm"], records["bf16"]["comm"]
    assert 2 * bf16["all_gather"]["wire_bytes"] == fp32["all_gather"]["wire_bytes"]
    assert bf16["reduce_scatter"] == fp32["reduce_scatter"]
    assert records["bf16"]["state_bytes"] == records["default"]["state_bytes"]
    assert_layout(layouts, base, 2)


def test_fsdp1_at_three_ranks_even_and_uneven():
    cases = {
        "tiny": RunConfig(world_size=3, steps=10),
        "tiny_uneven": RunConfig(model="tiny_uneven", world_size=3, steps=10),
    }
    records, layouts = _launch(3, cases, cases["tiny_uneven"])
    for name, cfg in cases.items():
        assert_close(records[name]["losses"], reference_losses(cfg))
        assert_measured_is_planned(records[name], cfg, 3)
    # tiny_uneven's units do not divide by 3: each flat buffer is padded at its end, so the padding is in the
    # state counted (params, grads and both moments) beyond 16 B/param / n.
    model = build_model("tiny_uneven")
    padding = sum(padded_flat_numel(numel, 3) - numel for numel in fsdp1.unit_numels(model))
    assert padding > 0
    state = records["tiny_uneven"]["state_bytes"]
    units = len(fsdp1.unit_numels(model))
    assert sum(state.values()) == 16 * (count_params(model) + padding) // 3 + 4 * units
    assert_layout(layouts, cases["tiny_uneven"], 3)
    assert sum(u["shard_padding"] for u in layouts[-1]) == padding  # all of it on the last rank


def test_fsdp1_hybrid_shard_matches_single_and_its_plan():
    # hsdp_shard_size=2 on 4 ranks: flat buffers sharded over (0, 1) and (2, 3), gradient shards all-reduced
    # over (0, 2) and (1, 3).
    cfg = RunConfig(world_size=4, steps=3, options={"hsdp_shard_size": 2})
    record = loop.run("fsdp1", cfg, timeout_s=TIMEOUT_S)
    model = build_model(cfg.model)
    assert_close(record["losses"], reference_losses(cfg))
    wire = {kind: row["wire_bytes"] for kind, row in record["comm"].items()}
    assert wire == fsdp1.predicted_wire_bytes(model, cfg, 4)
    groups = {(c["kind"], tuple(c["group_ranks"])) for c in record["collective_calls"]}
    assert groups == {("all_gather", (0, 1)), ("reduce_scatter", (0, 1)), ("all_reduce", (0, 2))}
    assert record["state_bytes"] == fsdp1.state_bytes_accounting(model, cfg, 4)
    assert record["state_bytes"]["params"] == 4 * count_params(model) // 2


@pytest.mark.parametrize(
    "change, message",
    [
        ({"offload": "nvme"}, "DeepSpeed's ZeRO-Infinity"),
        ({"options": {"reshard_after_forward": 2}}, "partial resharding is FSDP2's"),
        ({"prefetch_depth": 2}, "FSDP1 prefetches one unit ahead"),
        ({"options": {"zero_hpz_partition_size": 2}}, "no such setting"),
        ({"options": {"hsdp_shard_size": 3}}, "hsdp_shard_size=3: pass a number of ranks that divides"),
        (
            {"options": {"hsdp_shard_size": 2}, "reshard_after_forward": False},
            "_HYBRID_SHARD_ZERO2",
        ),
    ],
)
def test_fsdp1_refuses_what_it_cannot_honour(change, message):
    # In the parent before any rank starts (validation.validate), in the plan, and in a rank's build.
    cfg = replace(RunConfig(world_size=4), **change)
    with pytest.raises(ValueError, match=message):
        validation.validate(["single", "fsdp1"], cfg)
    with pytest.raises(ValueError, match=message):
        fsdp1.predicted_wire_bytes(build_model(cfg.model), cfg, 4)
    with pytest.raises(ValueError, match=message):
        fsdp1.build(cfg, build_model(cfg.model), RankInfo(0, 4, 0, torch.device("cpu"), "gloo"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="FSDP1's CPUOffload runs on CUDA ranks")
def test_fsdp1_is_a_compare_engine_and_refuses_host_offload_on_cpu_ranks_in_one_line(capsys):
    assert "fsdp1" in ENGINES
    validation.validate(["single", "fsdp1"], RunConfig(world_size=4))
    with pytest.raises(ValueError, match="CPUOffload needs an accelerator"):
        validation.validate(["fsdp1"], RunConfig(offload="cpu"))
    with pytest.raises(ValueError, match="CPUOffload needs an accelerator"):
        fsdp1.wrap_kwargs(RunConfig(offload="cpu"), RankInfo(0, 2, 0, torch.device("cpu"), "gloo"))
    # The CLI contract: one line on stderr naming the setting, exit status 2, before any rank starts.
    assert cli.main(["compare", "--engines", "single,fsdp1", "--world-size", "4", "--hpz", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--hpz: the engines of this run" in err and "Traceback" not in err
