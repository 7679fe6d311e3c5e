"""The from-scratch ZeRO-3 against the single-process oracle: losses, layouts, hooks, state, checkpoints.

Every rank-side check at n ranks shares one launch (`zero_launch(n)`, jobs in `zero_jobs`); the 4-rank one
goes first, as it writes the checkpoint that the 2- and 3-rank ones resume from.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from engine_helpers import assert_close, reference_losses
from launches import Job, job, launch_jobs, train
from torch import nn

import labkit
from labkit import budget
from labkit.budget import collective_wire_bytes
from labkit.buildalong.gradient_verdicts import rows_expected
from labkit.cli import main
from labkit.collectives import Patch
from labkit.engines import scratch
from labkit.engines.base import RunConfig
from labkit.engines.on_rank import rank_info, train_steps
from labkit.engines.validation import validate
from labkit.layout import dim0_layout, dim0_rows, flat_layout, owned_rows, padding_elements
from labkit.model import batch, build_model, count_params, loss_fn
from labkit.probes import state_bytes
from labkit.zero import ShardedAdamW, ZeRO3, checkpoint
from labkit.zero.sharding import shard_dim0, unshard_dim0
from labkit.zero.unit import ShardedState, ShardedUnit

VARIANTS = [  # (prefetch, offload, reshard_after_forward)
    (True, "none", True),
    (False, "none", True),
    (True, "cpu", True),
    (False, "cpu", False),
]
MODELS = ["tiny", "tiny_uneven"]
BF16 = RunConfig(model="tiny", world_size=2, steps=6, dtype="bfloat16")
CHECKPOINT = RunConfig(model="tiny_uneven", world_size=4, steps=3)  # saved on 4 ranks, resumed on 4, 2, 3
TINY_CHECKPOINT = RunConfig(model="tiny", world_size=2, steps=1)  # what another model's load refuses
WIRE_CASES = [  # (model, n, dtype, reshard_after_forward, hsdp_shard_size, split_root)
    ("tiny_uneven", 3, "float32", True, None, True),
    ("tiny_uneven", 3, "float32", True, None, False),  # one root, gathered twice
    ("tiny", 4, "bfloat16", False, None, True),
    ("tiny_uneven", 2, "float32", True, None, True),
    ("tiny_uneven", 4, "float32", True, 2, True),  # HSDP: padding to 2 rows inside each shard group
    ("tiny", 2, "float32", False, 1, True),  # HSDP's limit: shard groups of 1 rank are DDP's all-reduce
]


def wire_cfg(model: str, n: int, dtype: str, reshard: bool, hsdp: int | None, split: bool) -> RunConfig:
    """The 2-step run of a WIRE_CASES row."""
    options = {"split_root": split} | ({} if hsdp is None else {"hsdp_shard_size": hsdp})
    return RunConfig(
        model=model, world_size=n, steps=2, dtype=dtype, reshard_after_forward=reshard, options=options
    )


# ------------------------------------------------------------------------------------------ sharding


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", [(7,), (10, 3), (101, 50), (12, 4, 2)])
def test_dim0_shards_pad_to_a_multiple_of_n_and_rebuild_the_tensor(n, shape):
    full = torch.randn(shape)
    shards = [shard_dim0(full, r, n) for r in range(n)]
    rows, padded = dim0_rows(shape[0], n)
    assert all(s.shape == (rows, *shape[1:]) for s in shards)
    assert padded % n == 0 and padded - shape[0] < n
    assert torch.equal(unshard_dim0(shards, shape[0]), full)
    assert torch.count_nonzero(torch.cat(shards)[shape[0] :]) == 0
    # what the build's judges hold a learner's shard to is the engine's shard, on every rank
    assert all(torch.equal(rows_expected(full, r, n), shards[r]) for r in range(n))
    assert torch.equal(torch.cat([owned_rows(full, r, n) for r in range(n)]), full)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_both_layouts_cover_every_element_once_and_pad_as_the_budget_says(n):
    block = build_model("tiny_uneven").blocks[0]
    numel = sum(p.numel() for p in block.parameters())
    per_param, flat = dim0_layout(block, n), flat_layout(block, n)
    for layout in (per_param, flat):
        real = {}
        for seg in layout:
            if not seg.padding:
                real[seg.param] = real.get(seg.param, 0) + seg.stop - seg.start
        assert real == {name: p.numel() for name, p in block.named_parameters()}
    expected_dim0 = sum(budget.padded_numel(tuple(p.shape), n) for p in block.parameters())
    assert padding_elements(per_param) == expected_dim0 - numel
    assert padding_elements(flat) == budget.padded_flat_numel(numel, n) - numel
    assert padding_elements(flat) < n and padding_elements(flat) <= padding_elements(per_param)


# ------------------------------------------------------------------------------------------ training


def _train_variants(cfg: RunConfig) -> list[list[float]]:
    out = []
    for prefetch, offload, raf in VARIANTS:
        run_cfg = replace(cfg, prefetch=prefetch, offload=offload, reshard_after_forward=raf)
        engine = scratch.build(run_cfg, build_model(cfg.model, cfg.seed), rank_info())
        out.append(train_steps(engine, run_cfg))
    return out


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_losses_match_single_with_prefetch_and_offload_on_and_off(model, n, zero_launch):
    cfg = RunConfig(model=model, world_size=n, steps=10)
    reference = reference_losses(cfg)
    for repeat in range(2):  # twice: a race would show up as a difference between runs
        variants = zero_launch(n)[f"losses {model} {repeat}"]
        for (prefetch, offload, raf), losses in zip(VARIANTS, variants, strict=True):
            rel = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
            assert rel < 1e-4, (prefetch, offload, raf, rel)


def _bf16_losses(cfg: RunConfig) -> list[float]:
    return train_steps(scratch.build(cfg, build_model(cfg.model, cfg.seed), rank_info()), cfg)


def test_bfloat16_compute_stays_within_two_percent_of_float32(zero_launch):
    cfg = BF16
    losses = zero_launch(2)["bf16"]
    reference = reference_losses(cfg)
    assert max(abs(a - b) / b for a, b in zip(losses, reference, strict=True)) < 2e-2
    assert losses[-1] < losses[0]


# ------------------------------------------------------------------------------------------ hooks


def _hook_trace(prefetch: bool):
    trace = []
    model = build_model("tiny")
    zero = ZeRO3(model, prefetch=prefetch, trace=trace)
    opt = ShardedAdamW(zero.shards())
    gathers = []

    def spy(name, original):
        def spied(out, inp, group=None, async_op=False):
            gathers.append(async_op)
            return original(out, inp, group=group, async_op=async_op)

        return spied

    with Patch(["all_gather_single"], spy):
        for step in range(2):
            tokens, targets = batch(step, "tiny", world_size=2, rank=dist.get_rank())
            loss_fn(model(tokens), targets).backward()
            zero.finish_backward()
            opt.step()
    return trace, gathers


@pytest.mark.parametrize("prefetch", [True, False])
def test_hooks_fire_in_order_and_prefetch_makes_gathers_async(prefetch, zero_launch):
    trace, gathers = zero_launch(2)[f"hooks, prefetch={prefetch}"]
    step = trace[: len(trace) // 2]
    units = ["root"] + [f"blocks.{i}" for i in range(4)]
    assert [u for m, u in step if m == "before_forward"] == units
    assert [u for m, u in step if m == "before_backward"] == ["root", *reversed(units[1:])]
    assert [u for m, u in step if m == "after_grad"] == [*reversed(units[1:]), "root"]
    for i in range(4):
        b = f"blocks.{i}"
        assert step.index(("before_forward", b)) < step.index(("after_forward", b))
        assert step.index(("after_forward", b)) < step.index(("before_backward", b))
        assert step.index(("before_backward", b)) < step.index(("after_grad", b))
    per_step = len(gathers) // 2
    assert per_step == 2 * len(units)  # every unit gathered before forward and again before backward
    second = gathers[per_step:]
    # step 1 knows the order: every gather but the root's first one is a prefetch (async) iff enabled
    assert sum(second) == (2 * len(units) - 2 if prefetch else 0)


def _unit_transitions() -> dict:
    block = build_model("tiny_uneven").blocks[0]
    weights = {name: p.detach().clone() for name, p in block.named_parameters()}
    unit = ShardedUnit("blocks.0", block, list(block.named_parameters()), None, torch.float32)
    gathers, states, errors = [], [unit.state], {}

    def attempt(label: str, action) -> None:
        try:
            action()
        except RuntimeError as e:
            errors[label] = str(e)

    def count(name, original):
        def counted(*args, **kwargs):
            gathers.append(name)
            return original(*args, **kwargs)

        return counted

    with Patch(["all_gather_single"], count):
        attempt("finish_gather while sharded", unit.finish_gather)
        unit.start_gather(async_op=True)
        unit.start_gather(async_op=True)  # a prefetch got there first: no second all-gather
        states.append(unit.state)
        attempt("free while gathering", unit.free)
        unit.finish_gather()
        unit.finish_gather()  # already unsharded: nothing to do
        unit.start_gather(async_op=False)  # the weights were kept: nothing to do
        states.append(unit.state)
        gathered = all(torch.equal(p, weights[name]) for name, p in block.named_parameters())
        unit.free()
        unit.free()
        states.append(unit.state)
    attempt("finish_reduce_scatter before start", unit.finish_reduce_scatter)
    unit.start_reduce_scatter(async_op=True)
    attempt("start_reduce_scatter twice", lambda: unit.start_reduce_scatter(async_op=True))
    unit.finish_reduce_scatter()
    return {
        "states": states,
        "gathers": len(gathers),
        "gathered": gathered,
        "errors": errors,
        "storage": [sp.full.untyped_storage().nbytes() for sp in unit.params],
    }


def test_a_unit_moves_sharded_gathering_unsharded_and_an_illegal_transition_raises_a_sentence(zero_launch):
    for r in zero_launch(2)["unit transitions"]:
        assert r["states"] == [
            ShardedState.SHARDED,
            ShardedState.GATHERING,
            ShardedState.UNSHARDED,
            ShardedState.SHARDED,
        ]
        assert r["gathers"] == 1 and r["gathered"]
        assert r["storage"] == [0] * len(r["storage"])  # freed: the full buffers hold no bytes
        errors = r["errors"]
        assert set(errors) == {
            "finish_gather while sharded",
            "free while gathering",
            "finish_reduce_scatter before start",
            "start_reduce_scatter twice",
        }
        assert errors["finish_gather while sharded"] == (
            "finish_gather() needs unit blocks.0 gathering, but it is sharded; call start_gather() first"
        )
        assert errors["free while gathering"] == (
            "free() needs unit blocks.0 unsharded or sharded, but it is gathering; call finish_gather() first"
        )
        assert "call start_reduce_scatter() first" in errors["finish_reduce_scatter before start"]
        assert "call finish_reduce_scatter() first" in errors["start_reduce_scatter twice"]
        assert all(e.count(";") == 1 and "\n" not in e for e in errors.values())  # one sentence each


# ------------------------------------------------------------------------------------------ state


def _state_bytes(cfg: RunConfig) -> dict[str, int]:
    engine = scratch.build(cfg, build_model(cfg.model), rank_info())
    train_steps(engine, cfg)
    return state_bytes(engine.state_tensors())


@pytest.mark.parametrize("n", [2, 3])
def test_state_bytes_per_rank_are_16_bytes_per_param_over_n_plus_padding(n, zero_launch):
    states = zero_launch(n)["state bytes"]
    padded = sum(budget.padded_numel(tuple(p.shape), n) for p in build_model("tiny_uneven").parameters())
    for state in states:
        assert state["params"] == state["grads"] == 4 * padded // n
        assert state["optimizer"] == 8 * padded // n
    assert 16 * count_params(build_model("tiny_uneven")) / n < sum(states[0].values())


# ------------------------------------------------------------------------------------------ checkpoints


def _train_save_resume(cfg: RunConfig, path: str, mode: str) -> list[float]:
    engine = scratch.build(cfg, build_model(cfg.model), rank_info())
    if mode == "save":
        train_steps(engine, cfg)
        checkpoint.save(path, engine.zero, engine.optimizer)
    else:
        checkpoint.load(path, engine.zero, engine.optimizer)
    return train_steps(engine, cfg, first_step=cfg.steps)


@pytest.mark.parametrize("resume_on", [4, 2, 3])
def test_a_checkpoint_of_4_ranks_resumes_on_any_world_size(resume_on, zero_launch):
    # Saved once, by the 4-rank launch; each launch loads it into an engine built afresh (4 ranks: after
    # the save, in the same ranks), then trains the same steps as the saving run did after its save.
    uninterrupted = zero_launch(4)["checkpoint saved"]
    resumed = zero_launch(resume_on)["checkpoint resumed"]
    if resume_on == 4:
        assert resumed == uninterrupted  # bit for bit
    else:
        assert max(abs(a - b) / b for a, b in zip(resumed, uninterrupted, strict=True)) < 1e-5


def _load_into(path: str, model_name: str):
    cfg = RunConfig(model=model_name, world_size=2)
    engine = scratch.build(cfg, build_model(model_name), rank_info())
    checkpoint.load(path, engine.zero, engine.optimizer)


def test_a_checkpoint_of_another_model_or_no_checkpoint_is_refused_in_one_sentence(zero_launch, zero_dir):
    zero_launch(2)  # saved tiny's checkpoint (TINY_CHECKPOINT) under zero_dir
    with pytest.raises(labkit.LaunchError, match="is of another model"):
        labkit.launch(_load_into, 2, str(zero_dir / "tiny"), "tiny_uneven")
    with pytest.raises(labkit.LaunchError, match="holds no labkit checkpoint"):
        labkit.launch(_load_into, 2, str(zero_dir / "nothing"), "tiny")


# ------------------------------------------------------------------------------------------ bad input


def _shard(module):
    ZeRO3(module)


def test_a_module_without_blocks_is_refused_and_one_rank_is_a_valid_degenerate_zero3():
    with pytest.raises(labkit.LaunchError, match="has no `blocks` ModuleList to shard"):
        labkit.launch(_shard, 2, nn.Linear(4, 4))
    cfg = RunConfig(model="tiny", world_size=1, steps=4)
    losses = labkit.launch(_bf16_losses, 1, cfg)[0]
    assert max(abs(a - b) / b for a, b in zip(losses, reference_losses(cfg), strict=True)) < 1e-4


# ------------------------------------------------------------------------------------------ bytes


@pytest.mark.parametrize("model,n,dtype,reshard,hsdp,split", WIRE_CASES)
def test_measured_wire_bytes_are_the_formula_for_the_padded_model(
    model, n, dtype, reshard, hsdp, split, zero_launch
):
    cfg = wire_cfg(model, n, dtype, reshard, hsdp, split)
    record = zero_launch(n)[f"wire {(model, n, dtype, reshard, hsdp, split)}"]
    comm = record["comm"]
    predicted = scratch.predicted_wire_bytes(build_model(model), cfg, n)
    assert {k: v["wire_bytes"] for k, v in comm.items()} == predicted
    units = (2 if split else 1) + len(build_model(model).blocks)  # input and output units, or the root
    kept = 1 if split else 0  # the output unit is never gathered twice
    assert comm["all_gather"]["calls"] == (2 * units - kept if reshard else units)
    assert comm["reduce_scatter"]["calls"] == units
    if hsdp is not None:  # gathers and reduce-scatters in rank 0's shard group, all-reduces across groups
        assert comm["all_reduce"]["calls"] == units
        groups = {c["kind"]: c["group_ranks"] for c in record["collective_calls"]}
        assert groups == {
            "all_gather": list(range(hsdp)),
            "reduce_scatter": list(range(hsdp)),
            "all_reduce": list(range(0, n, hsdp)),
        }
    elif (
        reshard and dtype == "float32"
    ):  # AG = (n-1)/n x (2 x padded bytes - the kept output unit's), RS = 1 x
        net = build_model(model)
        padded_bytes = 4 * sum(budget.padded_numel(tuple(p.shape), n) for p in net.parameters())
        output_bytes = 4 * sum(
            budget.padded_numel(tuple(p.shape), n) for p in (*net.ln_f.parameters(), net.head.weight)
        )
        assert comm["all_gather"]["wire_bytes"] == (n - 1) * (2 * padded_bytes - split * output_bytes) // n
        assert comm["reduce_scatter"]["wire_bytes"] == (n - 1) * padded_bytes // n


# ------------------------------------------------------------------------------------------ HSDP


def test_scratch_hsdp_in_labkit_compare_matches_fsdp2_single_and_the_budget(tmp_path, capsys):
    out = tmp_path / "hsdp.json"
    argv = [
        "compare",
        "--engines",
        "single,scratch,fsdp2",
        "--hsdp",
        "2",
        "--world-size",
        "4",
        "--steps",
        "3",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    capsys.readouterr()
    engines = json.loads(out.read_text())["engines"]
    ours, theirs = engines["scratch"], engines["fsdp2"]
    assert_close(ours["losses"], engines["single"]["losses"], rel=1e-4)
    assert_close(ours["losses"], theirs["losses"], rel=1e-5)
    model = build_model("tiny")
    n_params = count_params(model)
    # State per rank: 16 B/param / 2 (the shard group), not / 4; FSDP2's AdamW adds a 4-byte step per tensor.
    plan = budget.plan(n_params, 4, "hsdp", group_size=2, precision="fp32")
    assert sum(ours["state_bytes"].values()) == plan["state_bytes_per_rank"] == 16 * n_params // 2
    assert ours["state_bytes"] == theirs["state_bytes"] | {
        "optimizer": theirs["state_bytes"]["optimizer"] - 4 * len(list(model.parameters()))
    }
    wire = {
        engine: {k: row["wire_bytes"] for k, row in rec["comm"].items()} for engine, rec in engines.items()
    }
    traffic = plan["traffic_bytes_by_collective"]
    # the plan gathers every weight twice; the scratch engine's output unit (ln_f, head) is kept across the turn
    output_bytes = 4 * sum(p.numel() for p in (*model.ln_f.parameters(), model.head.weight))
    assert wire["scratch"] == {
        "all_gather": traffic["all_gather_forward"]
        + traffic["all_gather_backward"]
        - collective_wire_bytes("all_gather", output_bytes, 2),
        "reduce_scatter": traffic["reduce_scatter"],
        "all_reduce": traffic["all_reduce"],
    }
    # The one documented difference: FSDP2 keeps its whole root gathered from forward to backward; the
    # scratch engine keeps its output unit and gathers its input unit (the embeddings) again for backward.
    input_bytes = 4 * sum(p.numel() for p in (model.tok.weight, model.pos.weight))
    assert wire["scratch"] == wire["fsdp2"] | {
        "all_gather": wire["fsdp2"]["all_gather"] + collective_wire_bytes("all_gather", input_bytes, 2)
    }
    # In that order, as FSDP2 does: a unit's gradients are reduce-scattered inside its shard group of 2, then
    # its shard is all-reduced across the 2 replicas; the k-th all-reduce follows the k-th reduce-scatter.
    reductions = [(c["kind"], c["group_size"]) for c in ours["collective_calls"] if c["kind"] != "all_gather"]
    units = len(model.blocks) + 2  # the blocks, the input unit and the output unit
    assert sorted(set(reductions)) == [("all_reduce", 2), ("reduce_scatter", 2)], reductions
    kinds = [kind for kind, _ in reductions]
    assert kinds.count("reduce_scatter") == kinds.count("all_reduce") == units, kinds
    assert all(
        kinds[:i].count("reduce_scatter") > kinds[:i].count("all_reduce")
        for i, k in enumerate(kinds)
        if k == "all_reduce"
    ), kinds


def test_options_the_scratch_engine_does_not_implement_are_refused_in_one_sentence(capsys, monkeypatch):
    monkeypatch.setattr("labkit.cluster.max_ranks", lambda device_type=None: 8)
    validate(["scratch"], RunConfig(world_size=4, options={"hsdp_shard_size": 2}))  # implemented: accepted
    assert main(["compare", "--engines", "single,scratch", "--world-size", "4", "--hpz", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "labkit compare: --hpz: the engines of this run (single, scratch) have no such setting, so it would be "
        "ignored; --hpz is deepspeed's"
    )
    with pytest.raises(ValueError, match="hsdp_shard_size=3: pass a number of ranks that divides"):
        validate(["scratch"], RunConfig(world_size=4, options={"hsdp_shard_size": 3}))
    validate(["scratch"], RunConfig(world_size=2, prefetch_depth=0))  # no prefetch, as prefetch=False
    with pytest.raises(ValueError, match="prefetch_depth=-1: pass a whole number of units, 0 or more"):
        validate(["scratch"], RunConfig(world_size=2, prefetch_depth=-1))


# ------------------------------------------------------------------------------------------ the split root


def _split_trace_and_losses(depth: int, steps: int = 3, split: bool = True) -> tuple[list, list[float]]:
    trace = []
    model = build_model("tiny_uneven")
    zero = ZeRO3(model, trace=trace, split_root=split, prefetch_depth=depth)
    opt = ShardedAdamW(zero.shards(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    losses = []
    for step in range(steps):
        tokens, targets = batch(step, "tiny_uneven", world_size=3, rank=dist.get_rank())
        loss = loss_fn(model(tokens), targets)
        loss.backward()
        zero.finish_backward()
        opt.step()
        losses.append(loss.detach())
    for loss in losses:
        dist.all_reduce(loss)
    return trace, [loss.item() / 3 for loss in losses]


@pytest.mark.parametrize("depth", [1, 2])
def test_the_split_root_runs_input_blocks_output_keeps_the_output_across_the_turn_and_matches_single(
    depth, zero_launch
):
    trace, losses = zero_launch(3)[f"split root, depth {depth}"]
    step = trace[: len(trace) // 3]
    units = ["input", "blocks.0", "blocks.1", "blocks.2", "output"]
    assert [u for m, u in step if m == "before_forward"] == units
    assert [u for m, u in step if m == "before_backward"] == units[::-1]
    assert [u for m, u in step if m == "after_grad"] == units[::-1]
    # the input unit's forward ends as the first block's begins; the output's as the model returns
    assert step.index(("after_forward", "input")) < step.index(("before_forward", "blocks.0"))
    assert step[step.index(("after_forward", "output")) + 1] == ("before_backward", "output")
    cfg = RunConfig(model="tiny_uneven", world_size=3, steps=3)
    assert_close(losses, reference_losses(cfg), rel=1e-4)


def test_the_floor_of_the_split_plan_is_the_input_unit_and_block_0s_forward_gather_and_reduce_scatter():
    model, cfg = build_model("tiny"), RunConfig(model="tiny", world_size=2)
    floor = scratch.exposed_floor(model, cfg, 2)
    assert floor["exposed"] == [
        ("input", "forward all-gather"),
        ("blocks.0", "forward all-gather"),
        ("blocks.0", "reduce-scatter"),
        ("input", "reduce-scatter"),
    ]
    costs = {u.name: u for u in scratch.unit_costs(model, cfg, 2)}
    assert floor["floor_wire_bytes"] == sum(
        costs[u].gather_wire_bytes + costs[u].reduce_wire_bytes for u in ("input", "blocks.0")
    )
    assert floor["comm_wire_bytes"] == sum(scratch.predicted_wire_bytes(model, cfg, 2).values())
    # on a 1 GB/s link with no backend cost of its own, the seconds are the bytes / 1e9
    timed = scratch.exposed_floor(model, replace(cfg, link_gbytes=1.0), 2)
    assert timed["floor_s"] == pytest.approx(floor["floor_wire_bytes"] / 1e9)
    assert timed["comm_s"] == pytest.approx(floor["comm_wire_bytes"] / 1e9)


def test_the_floor_of_one_root_is_its_gathers_and_reduce_scatter_and_block_0s_as_the_root_is_scheduled(
    zero_launch,
):
    """A root kept whole (the learner's scaffold, a model with named units) is gathered before the forward with
    only its embedding lookups before block 0, gathered again first in the backward, and reduced last: the
    floor holds both its gathers, its reduce-scatter and block 0's forward gather and reduce-scatter."""
    model, cfg = build_model("tiny"), RunConfig(model="tiny", world_size=2, options={"split_root": False})
    floor = scratch.exposed_floor(model, cfg, 2)
    assert floor["exposed"] == [
        ("root", "forward all-gather"),
        ("blocks.0", "forward all-gather"),
        ("root", "backward all-gather"),
        ("blocks.0", "reduce-scatter"),
        ("root", "reduce-scatter"),
    ]
    costs = {u.name: u for u in scratch.unit_costs(model, cfg, 2)}
    root, block = costs["root"], costs["blocks.0"]
    assert floor["floor_wire_bytes"] == 2 * root.gather_wire_bytes + root.reduce_wire_bytes + (
        block.gather_wire_bytes + block.reduce_wire_bytes
    )
    assert floor["comm_wire_bytes"] == sum(scratch.predicted_wire_bytes(model, cfg, 2).values())
    # the schedule this weighs, as labkit's engine runs one root: first gathered in each pass, last reduced
    trace, _ = zero_launch(3)["one root"]
    assert [u for m, u in trace if m == "before_forward"][:2] == ["root", "blocks.0"]
    assert [u for m, u in trace if m == "before_backward"][0] == "root"
    assert [u for m, u in trace if m == "after_grad"][-1] == "root"


# ------------------------------------------------------------------------------------------ the launches


def zero_jobs(n: int, path: str) -> dict[str, Job]:
    """Every rank-side job of this file at `n` ranks, in launch order (`path`: the checkpoints' folder)."""
    jobs = {
        f"losses {model} {repeat}": job(_train_variants, RunConfig(model=model, world_size=n, steps=10))
        for model in MODELS
        for repeat in range(2)
    }
    for case in WIRE_CASES:
        if case[1] == n:
            jobs[f"wire {case}"] = train("scratch", wire_cfg(*case))
    if n in (2, 3):
        cfg = RunConfig(model="tiny_uneven", world_size=n, steps=1)
        jobs["state bytes"] = job(_state_bytes, cfg, per_rank=True)
    if n == 2:
        jobs["bf16"] = job(_bf16_losses, BF16)
        for prefetch in (True, False):
            jobs[f"hooks, prefetch={prefetch}"] = job(_hook_trace, prefetch)
        jobs["unit transitions"] = job(_unit_transitions, per_rank=True)
        jobs["tiny checkpoint"] = job(_train_save_resume, TINY_CHECKPOINT, f"{path}/tiny", "save")
    if n == 3:
        for depth in (1, 2):
            jobs[f"split root, depth {depth}"] = job(_split_trace_and_losses, depth)
        jobs["one root"] = job(_split_trace_and_losses, 1, 1, False)
    if n == 4:
        jobs["checkpoint saved"] = job(_train_save_resume, CHECKPOINT, f"{path}/4", "save")
    jobs["checkpoint resumed"] = job(_train_save_resume, CHECKPOINT, f"{path}/4", "load")
    return jobs


@pytest.fixture(scope="module")
def zero_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("zero")


@pytest.fixture(scope="module")
def zero_launch(zero_dir):
    """`get(n)`: {job name: rank 0's result (every rank's for a per-rank job)} of `zero_jobs(n)`, launched the
    first time a test asks for `n`; 4 ranks first, whose checkpoint the others resume."""
    launched: dict[int, dict] = {}

    def get(n: int) -> dict:
        if n != 4:
            get(4)
        if n not in launched:
            launched[n] = launch_jobs(n, zero_jobs(n, str(zero_dir)))
        return launched[n]

    return get
