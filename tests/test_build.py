"""The build-along (labkit.buildalong): the scaffold's units and moments, notebook 02's filled pieces against `single`,
and each step's check catching a planted mistake with the sentence that names it. Few launches: each rank
function below runs several cases."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import nbformat
import planted
import pytest
import torch
import torch.distributed as dist
from planted import FILLED

import labkit
from labkit.buildalong import Learner, Pieces, attach, checks
from labkit.buildalong.cells import build_cells, pieces_from_notebook
from labkit.buildalong.stubs import NotWritten, write_this_piece
from labkit.engines import on_rank, validation
from labkit.engines.base import RunConfig
from labkit.engines.single import SingleEngine
from labkit.model import batch, build_model

MODEL = "tiny_uneven"
NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "02_zero3_from_scratch.ipynb"
PIECES = pieces_from_notebook()


def _tagged(tag: str) -> list:
    return [c for c in nbformat.read(NOTEBOOK, as_version=4).cells if tag in c.metadata.get("tags", [])]


def _train_both(pieces: Pieces, steps: int = 3) -> dict:
    """On this rank: the learner's engine and `single` (global batch) for `steps` steps; both loss lists,
    one step's trace and the units' layout."""
    cfg = RunConfig(model=MODEL, world_size=dist.get_world_size(), steps=steps)
    info = on_rank.rank_info()
    eng = Learner(pieces).build(cfg, build_model(MODEL), info)
    oracle = SingleEngine(build_model(MODEL), cfg, info.device)
    n, rank = dist.get_world_size(), dist.get_rank()
    losses, single = [], []
    for step in range(steps):
        if step == steps - 1:
            eng.trace.clear()
        loss, _ = on_rank.timed_step(eng, step, batch(step, MODEL, 0, n, rank))
        dist.all_reduce(loss)
        losses.append(loss.item() / n)
        single.append(on_rank.timed_step(oracle, step, batch(step, MODEL, 0, 1, 0))[0].item())
    units = [
        (u.name, u.d0, [tuple(s.shape) for s in u.shards], u.prev and u.prev.name, u.next and u.next.name)
        for u in eng.units
    ]
    held = sum(p.untyped_storage().nbytes() for u in eng.units for p in u.params)
    return {"losses": losses, "single": single, "trace": list(eng.trace), "units": units, "held": held}


@pytest.fixture(scope="module")
def reference_runs():
    pieces = PIECES
    return {n: labkit.launch(_train_both, n, pieces)[0] for n in (2, 3)}


def test_each_build_cell_has_a_stub_that_defines_its_names_and_says_write_this_piece():
    cells = _tagged("build")
    given = [c.id for c in _tagged("build-given")]
    assert len(cells) == 6 and sorted(build_cells()) == sorted(given + [c.id for c in cells])
    lines = sum(len([x for x in c.source.splitlines() if x.strip()]) for c in cells)
    assert 25 <= lines <= 80, lines
    assert not [c for c in _tagged("notebook-only") if c.source.startswith("mine = False")]
    for cell in cells:
        filled, stub = {}, {"write_this_piece": write_this_piece, **FILLED}
        exec(compile(cell.source, "filled", "exec"), {**FILLED}, filled)
        exec(compile(cell.metadata["labkit"]["stub"], "stub", "exec"), stub)
        names = [name for name in filled if callable(filled[name])]
        assert names and all(stub[name] is not FILLED.get(name) for name in names), cell.id
        for name in names:
            with pytest.raises(NotWritten, match=f"^write this piece: {name} \\("):
                stub[name](*[None] * stub[name].__code__.co_argcount)
    assert len(_tagged("predict")) >= 2


@pytest.mark.parametrize("n", [2, 3])
def test_notebook_pieces_train_like_single(reference_runs, n):
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
    validation.validate([Learner(PIECES)], RunConfig(model=MODEL, world_size=3))
    with pytest.raises(ValueError, match="build"):
        validation.validate([object()], RunConfig(model=MODEL, world_size=3))


# ------------------------------------------------------------------------------------------------ checks


def _swap_free(unit):  # frees by giving each parameter a new empty tensor
    for p in unit.params:
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def _gather_into_new_tensor(unit):
    for p, s, d0 in zip(unit.params, unit.shards, unit.d0, strict=True):
        p.data = FILLED["gather"](s, d0, unit.group)


def _lab_adamw(params):
    lab = RunConfig()
    return torch.optim.AdamW(params, lr=lab.lr, betas=lab.betas, eps=lab.eps, weight_decay=lab.weight_decay)


def _stub_shard(full, rank, n):
    write_this_piece("shard", "the idea")


P = PIECES
PLANTED = {  # name: (step, pieces, words the sentence must contain)
    "no padding": (
        "shard",
        dataclasses.replace(P, shard=lambda full, r, n: full.tensor_split(n)[r].clone()),
        ["rank 2 of 3 has 33 rows of the 101-row tok.weight", "ceil(101/3) = 34", "zero-padded"],
    ),
    "stub": (
        "shard",
        dataclasses.replace(P, shard=_stub_shard),
        ["write this piece: shard (the idea), then run this check again"],
    ),
    "gather keeps padding": (
        "gather",
        dataclasses.replace(
            P,
            gather=lambda s, d0, group=None: FILLED["gather"](
                s, s.shape[0] * dist.get_world_size(group), group
            ),
        ),
        ["102 rows of tok.weight", "first d0 = 101"],
    ),
    "missing free": (
        "forward",
        dataclasses.replace(P, after_forward=lambda unit: None),
        ["after forward root, blocks.0, blocks.1 and blocks.2 still hold", "free them in after_forward"],
    ),
    "free by .data": (
        "forward",
        dataclasses.replace(P, after_forward=_swap_free),
        ["autograd still holds the full weights of blocks.0", "replacing p.data", "resize_(0)"],
    ),
    "hooks swapped": (
        "forward",
        dataclasses.replace(P, before_forward=P.after_forward, after_forward=P.before_forward),
        ["the forward of root found no weights", "before_forward must gather"],
    ),
    "no backward gather": (
        "backward",
        dataclasses.replace(P, before_backward=lambda unit: None),
        ["the backward of root found its weights freed", "gather them again in before_backward"],
    ),
    "backward gather into a new tensor": (
        "backward",
        dataclasses.replace(P, before_backward=_gather_into_new_tensor),
        ["before_backward gave root's parameters new tensors", "into the same storage"],
    ),
    "mean instead of a sum": (
        "reduce_scatter",
        dataclasses.replace(P, after_grad=planted.after_grad(dist.ReduceOp.AVG)),
        ["every gradient is 0.33 x single's: the mean was taken twice"],
    ),
    "not divided by n": (
        "reduce_scatter",
        dataclasses.replace(P, after_grad=planted.after_grad(divide=False)),
        ["every gradient is 3.00 x single's: after_grad did not divide by n", "divide that sum by n = 3"],
    ),
    "full grads kept": (
        "reduce_scatter",
        dataclasses.replace(P, after_grad=planted.after_grad(drop_grad=False)),
        ["full gradients are still there", "p.grad = None"],
    ),
    "weights kept after grad": (
        "reduce_scatter",
        dataclasses.replace(P, after_grad=planted.after_grad(free=False)),
        ["still hold full weights", "free them in after_grad"],
    ),
    "AdamW on copies": (
        "adamw",
        dataclasses.replace(
            P, make_optimizer=lambda shards: _lab_adamw([s.detach().clone() for s in shards])
        ),
        ["41 tensors that are not this rank's shards"],
    ),
    "AdamW defaults": (
        "adamw",
        dataclasses.replace(P, make_optimizer=lambda shards: torch.optim.AdamW(shards)),
        ["betas=(0.9, 0.999), weight_decay=0.01", "not the lab's betas=(0.9, 0.95), weight_decay=0.1"],
    ),
    "SGD": (
        "adamw",
        dataclasses.replace(P, make_optimizer=lambda shards: torch.optim.SGD(shards, lr=1e-3)),
        ["the optimizer is SGD, not AdamW"],
    ),
}


@pytest.fixture(scope="module")
def checked():
    """Every step's check on the reference pieces, then every planted mistake: one launch of 3 ranks."""
    cases = [(step, PIECES) for step in checks.STEPS] + [(step, p) for step, p, _ in PLANTED.values()]
    results = checks.run_checks(cases, world_size=3, model=MODEL, quiet=True)
    good = dict(zip(checks.STEPS, results[: len(checks.STEPS)], strict=True))
    return good, dict(zip(PLANTED, results[len(checks.STEPS) :], strict=True))


@pytest.mark.parametrize("step", checks.STEPS)
def test_each_check_passes_the_reference_with_its_figures(checked, step):
    result = checked[0][step]
    assert result.ok, result.sentence
    if step in ("gather", "forward", "backward", "reduce_scatter"):
        assert "to the byte" in result.sentence
        assert result.figures["wire_bytes"] == result.figures["formula_bytes"] > 0
    if step == "adamw":
        assert result.figures["loss_rel"] < 1e-4 and "over 3 steps" in result.sentence
        ratio = result.figures["single_state_bytes"] / result.figures["state_bytes"]
        assert 2.5 < ratio < 3  # 1/n of single's, plus the padding


@pytest.mark.parametrize("name", list(PLANTED))
def test_a_planted_mistake_is_named_by_its_steps_check(checked, name):
    step, _, words = PLANTED[name]
    result = checked[1][name]
    assert not result.ok and result.step == step
    for w in words:
        assert w in result.sentence, result.sentence
    assert "\n" not in result.sentence  # one sentence, not a traceback


def test_a_step_not_written_yet_says_so_without_a_launch(capsys):
    result = checks.check_backward(dataclasses.replace(PIECES, before_backward=None))
    assert not result.ok and "before_backward not written yet" in result.sentence
    assert capsys.readouterr().out.strip() == str(result)
    with pytest.raises(ValueError, match="unknown build step"):
        checks.run_checks([("sharding", PIECES)])


def test_every_check_passes_the_filled_pieces_on_one_rank():
    """A 1-GPU hub runs the build-along at world size 1: one shard per parameter, nothing padded."""
    results = checks.run_checks([(step, PIECES) for step in checks.STEPS], 1, MODEL, quiet=True)
    assert [r.ok for r in results] == [True] * len(checks.STEPS), [str(r) for r in results]
    assert "cut into 1 shard of ceil(d0/1) rows" in str(
        results[0]
    ) and "and 0 of padding over all ranks" in str(results[0])
