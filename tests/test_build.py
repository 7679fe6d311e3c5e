"""The build-along (labkit.build): the scaffold's units and moments, the reference pieces against `single`,
and each step's check catching a planted mistake with the sentence that names it. Few launches: each rank
function below runs several cases."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import labkit
from labkit.build import Learner, Pieces, attach
from labkit.build.reference import PIECES
from labkit.engines import loop
from labkit.engines.base import RunConfig
from labkit.engines.single import SingleEngine
from labkit.model import batch, build_model

MODEL = "tiny_uneven"


def _train_both(pieces: Pieces, steps: int = 3) -> dict:
    """On this rank: the learner's engine and `single` (global batch) for `steps` steps; both loss lists,
    one step's trace and the units' layout."""
    cfg = RunConfig(model=MODEL, world_size=dist.get_world_size(), steps=steps)
    info = loop.rank_info()
    eng = Learner(pieces).build(cfg, build_model(MODEL), info)
    oracle = SingleEngine(build_model(MODEL), cfg, info.device)
    n, rank = dist.get_world_size(), dist.get_rank()
    losses, single = [], []
    for step in range(steps):
        if step == steps - 1:
            eng.trace.clear()
        loss, _ = loop.timed_step(eng, step, batch(step, MODEL, 0, n, rank))
        dist.all_reduce(loss)
        losses.append(loss.item() / n)
        single.append(loop.timed_step(oracle, step, batch(step, MODEL, 0, 1, 0))[0].item())
    units = [
        (u.name, u.d0, [tuple(s.shape) for s in u.shards], u.prev and u.prev.name, u.next and u.next.name)
        for u in eng.units
    ]
    held = sum(p.untyped_storage().nbytes() for u in eng.units for p in u.params)
    return {"losses": losses, "single": single, "trace": list(eng.trace), "units": units, "held": held}


@pytest.fixture(scope="module")
def reference_runs():
    return {n: labkit.launch(_train_both, n, PIECES)[0] for n in (2, 3)}


@pytest.mark.parametrize("n", [2, 3])
def test_reference_pieces_train_like_single(reference_runs, n):
    run = reference_runs[n]
    worst = max(abs(a - b) / b for a, b in zip(run["losses"], run["single"], strict=True))
    assert worst < 1e-4, run
    assert run["held"] == 0  # every full weight freed after the step


def test_units_root_first_then_blocks_with_padded_shards(reference_runs):
    model = build_model(MODEL)
    units = reference_runs[3]["units"]
    assert [u[0] for u in units] == ["root", *(f"blocks.{i}" for i in range(len(model.blocks)))]
    assert [u[3] for u in units] == [None, "root", "blocks.0", "blocks.1"]
    assert [u[4] for u in units] == ["blocks.0", "blocks.1", "blocks.2", None]
    root_shapes = [tuple(p.shape) for p in (model.tok.weight, model.pos.weight, model.ln_f.weight)]
    assert units[0][1][:3] == [s[0] for s in root_shapes]
    assert units[0][2][0] == (-(-101 // 3), 50)  # tok.weight: 101 rows -> 34 per rank, the last padded


def test_moments_fire_in_order(reference_runs):
    trace = reference_runs[3]["trace"]
    blocks = [f"blocks.{i}" for i in range(3)]
    forward = [("before_forward", "root")]
    for b in blocks:
        forward += [("before_forward", b), ("after_forward", b)]
    forward.append(("after_forward", "root"))
    assert trace[: len(forward)] == forward
    backward = trace[len(forward) :]
    assert [u for m, u in backward if m == "before_backward"] == ["root", *reversed(blocks)]
    assert [u for m, u in backward if m == "after_grad"] == [*reversed(blocks), "root"]
    for b in blocks:  # a block's gradients are reduced after its backward gather, before the next one's
        assert backward.index(("before_backward", b)) < backward.index(("after_grad", b))


def test_attach_needs_shard_and_the_loop_takes_a_learner_object():
    with pytest.raises(ValueError, match="write shard"):
        attach(build_model(MODEL), Pieces())
    loop.validate([Learner(PIECES)], RunConfig(model=MODEL, world_size=3))
    with pytest.raises(ValueError, match="build"):
        loop.validate([object()], RunConfig(model=MODEL, world_size=3))
