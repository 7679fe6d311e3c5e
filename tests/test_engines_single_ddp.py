"""The `single` oracle and the `ddp` engine through the shared loop: losses, state bytes, comm, timeline."""

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


@pytest.fixture(scope="module")
def single_record() -> dict:
    return loop.run("single", RunConfig(world_size=4, steps=STEPS))


def test_single_is_plain_adamw_on_the_global_batch(single_record):
    assert_close(single_record["losses"], reference_losses(RunConfig(steps=STEPS)), rel=1e-6)
    assert single_record["comm"] == {}
    assert len(single_record["peak_mem_bytes"]) == 1


@pytest.mark.parametrize("repeat", [0, 1])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ddp_matches_single_and_pays_one_all_reduce_of_the_gradients(n, repeat, single_record):
    record = loop.run("ddp", RunConfig(world_size=n, steps=STEPS))
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

    # each rank holds 1/n of the activations of the single process (same weights, same state)
    assert len(record["peak_mem_bytes"]) == n
    assert max(record["peak_mem_bytes"]) < single_record["peak_mem_bytes"][0]


def test_ddp_timeline_has_phases_blocks_and_comm_on_every_rank_for_the_last_steps():
    n = 2
    record = loop.run("ddp", RunConfig(world_size=n, steps=3))
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


def test_bfloat16_autocast_stays_within_the_stated_tolerances(single_record):
    cfg = RunConfig(world_size=4, steps=STEPS, dtype="bfloat16")
    single_bf16 = loop.run("single", cfg)["losses"]
    assert_close(loop.run("ddp", cfg)["losses"], single_bf16, rel=1e-3)
    assert_close(single_bf16, single_record["losses"], rel=1e-2)
    assert single_bf16 != single_record["losses"]  # autocast did change the arithmetic
