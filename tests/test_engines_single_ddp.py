"""The `single` oracle and the `ddp` engine through the shared loop: losses, state bytes, comm, timeline.

One launch per rank count (`loop.run_many`): both `single` runs in one, every ddp run at n ranks in another.
DDP leaves nothing alive in its ranks (`run_many`), so a run after another is measured as one alone.
"""

from __future__ import annotations

import pytest
from engine_helpers import assert_close, reference_losses

from labkit.budget import collective_wire_bytes
from labkit.engines import loop
from labkit.engines.base import RunConfig
from labkit.model import build_model
from labkit.probes.memory import STEP_SCALAR_BYTES

STEPS = 10
F32 = 4
BF16 = RunConfig(world_size=4, steps=STEPS, dtype="bfloat16")


def ddp_runs(n: int) -> dict[str, RunConfig]:
    """The ddp runs at `n` ranks, in launch order: the two repeats first, then the timeline's or bf16's."""
    runs = {
        "repeat 0": RunConfig(world_size=n, steps=STEPS),
        "repeat 1": RunConfig(world_size=n, steps=STEPS),
    }
    if n == 2:
        runs["timeline"] = RunConfig(world_size=n, steps=3)
    if n == 4:
        runs["bf16"] = BF16
    return runs


@pytest.fixture(scope="module")
def singles() -> dict[str, dict]:
    """`single` in float32 (first in its launch: its peak is its own) and under bf16 autocast."""
    fp32, bf16 = loop.run_many([("single", RunConfig(world_size=4, steps=STEPS)), ("single", BF16)])
    return {"fp32": fp32, "bf16": bf16}


@pytest.fixture(scope="module")
def single_record(singles) -> dict:
    return singles["fp32"]


@pytest.fixture(scope="module")
def ddp_records():
    """`get(n)`: {run name: record} of `ddp_runs(n)`, launched the first time a test asks for `n`."""
    launched: dict[int, dict[str, dict]] = {}

    def get(n: int) -> dict[str, dict]:
        if n not in launched:
            runs = ddp_runs(n)
            records = loop.run_many([("ddp", cfg) for cfg in runs.values()])
            launched[n] = dict(zip(runs, records, strict=True))
        return launched[n]

    return get


def test_single_is_plain_adamw_on_the_global_batch(single_record):
    assert_close(single_record["losses"], reference_losses(RunConfig(steps=STEPS)), rel=1e-6)
    assert single_record["comm"] == {}
    assert len(single_record["peak_mem_bytes"]) == 1


@pytest.mark.parametrize("repeat", [0, 1])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ddp_matches_single_and_pays_one_all_reduce_of_the_gradients(n, repeat, single_record, ddp_records):
    records = ddp_records(n)
    record = records[f"repeat {repeat}"]
    assert_close(record["losses"], single_record["losses"], rel=1e-4)

    params = list(build_model().parameters())
    n_params, n_tensors = sum(p.numel() for p in params), len(params)
    # fp32 AdamW: param + grad + exp_avg + exp_avg_sq = 16 B/param, plus AdamW's step scalars: one 4-byte
    # `step` per tensor it updates (on the CPU: not `capturable`, not `fused`)
    assert record["state_bytes"] == {
        "params": F32 * n_params,
        "grads": F32 * n_params,
        "optimizer": 2 * F32 * n_params + STEP_SCALAR_BYTES * n_tensors,
    }
    grad_bytes = F32 * n_params
    assert set(record["comm"]) == {"all_reduce"}
    assert record["comm"]["all_reduce"]["payload_bytes"] == grad_bytes
    assert record["comm"]["all_reduce"]["wire_bytes"] == sum(
        collective_wire_bytes("all_reduce", c["payload_bytes"], n) for c in record["collective_calls"]
    )
    assert abs(record["comm"]["all_reduce"]["wire_bytes"] - 2 * (n - 1) / n * grad_bytes) <= n_tensors

    # each rank holds 1/n of the activations of the single process (same weights, same state); the second
    # repeat shares the first's ranks, where nothing of the first's engine is alive: what was live before it
    # began is what was live before the first (the forked ranks' copy of this test process's own tensors,
    # and a stray collective buffer of tens of bytes at most), so its figures are those of a run alone
    first = records["repeat 0"]["mem_prior_bytes"]
    assert all(
        abs(a - b) < F32 * n_params // 100 for a, b in zip(record["mem_prior_bytes"], first, strict=True)
    )
    assert len(record["peak_mem_bytes"]) == n
    assert max(record["peak_mem_bytes"]) < single_record["peak_mem_bytes"][0]


def test_ddp_timeline_has_phases_blocks_and_comm_on_every_rank_for_the_last_steps(ddp_records):
    n = 2
    record = ddp_records(n)["timeline"]
    events = record["timeline"]
    assert {e["step"] for e in events} == {1, 2}
    for rank in range(n):
        mine = [e for e in events if e["rank"] == rank]
        names = {(e["kind"], e["name"]) for e in mine}
        phases = {("compute", p) for p in ("forward", "backward", "optimizer")}
        blocks = {("compute", f"blocks.{i}.forward") for i in range(len(build_model().blocks))}
        assert phases | blocks | {("comm", "all_reduce")} <= names
        assert all(0 <= e["start_s"] <= e["end_s"] for e in mine)
        (fwd,) = [e for e in mine if e["name"] == "forward" and e["step"] == 2]
        block0 = next(e for e in mine if e["name"] == "blocks.0.forward" and e["step"] == 2)
        assert fwd["start_s"] <= block0["start_s"] <= block0["end_s"] <= fwd["end_s"]


def test_bfloat16_autocast_stays_within_the_stated_tolerances(singles, ddp_records):
    single_bf16 = singles["bf16"]["losses"]
    assert_close(ddp_records(4)["bf16"]["losses"], single_bf16, rel=1e-3)
    assert_close(single_bf16, singles["fp32"]["losses"], rel=1e-2)
    assert single_bf16 != singles["fp32"]["losses"]  # autocast did change the arithmetic
