"""Notebook 05's build cell and its live check (labkit.buildalong.fsdp2_check): the filled answer passes every property,
each planted mistake fails with the sentence that names it, and the stub says "write this piece" — one launch, on
3 ranks of the uneven model (FSDP2 pads every shard there, and the byte plan must price the padding)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from torch.distributed.fsdp import fully_shard

from labkit.buildalong.fsdp2_check import PROPERTIES, run_fully_shard_checks

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "05_fsdp2_surface.ipynb"


def _build_cell() -> nbformat.NotebookNode:
    [cell] = [c for c in nbformat.read(NOTEBOOK, as_version=4).cells if "build" in c.metadata.get("tags", [])]
    return cell


def _defined(source: str):
    namespace: dict = {}
    exec(compile(source, "<notebook 05 build cell>", "exec"), namespace)
    return namespace["shard_with_fsdp2"]


def _blocks(model, mesh, mp_policy):
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)


def _prefetch_next(model):
    for block, following in zip(model.blocks[:-1], model.blocks[1:], strict=True):
        block.set_modules_to_forward_prefetch([following])


def root_not_wrapped(model, mesh, mp_policy):
    _blocks(model, mesh, mp_policy)
    _prefetch_next(model)


def no_prefetch(model, mesh, mp_policy):
    _blocks(model, mesh, mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def blocks_not_wrapped(model, mesh, mp_policy):
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def summed_gradients(model, mesh, mp_policy):
    """Every unit reduce-scatters the sum of the ranks' gradients: n x single's, which AdamW hides."""
    _blocks(model, mesh, mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    _prefetch_next(model)
    for unit in [*model.blocks, model]:
        unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM: SUM, then FSDP2's own division
        unit.set_gradient_divide_factor(1.0)  # ... by 1


@pytest.fixture(scope="module")
def results():
    cell = _build_cell()
    cases = {
        "filled": _defined(cell.source),
        "root_not_wrapped": root_not_wrapped,
        "no_prefetch": no_prefetch,
        "blocks_not_wrapped": blocks_not_wrapped,
        "summed_gradients": summed_gradients,
        "stub": _defined(cell.metadata["labkit"]["stub"]),
    }
    found = run_fully_shard_checks(list(cases.values()), world_size=3, model="tiny_uneven", quiet=True)
    return {name: {r.step: r for r in checked} for name, checked in zip(cases, found, strict=True)}


def test_the_filled_build_cell_passes_every_property(results):
    filled = results["filled"]
    assert list(filled) == list(PROPERTIES) and all(r.ok for r in filled.values()), filled
    assert filled["bytes"].figures["measured"] == filled["bytes"].figures["plan"]
    assert filled["losses"].figures["largest_rel_diff"] < 1e-4
    assert "equal single's on the global batch" in filled["gradients"].sentence
    assert filled["prefetch"].figures["lists"] == {
        "blocks.0": ["blocks.1"],
        "blocks.1": ["blocks.2"],
        "blocks.2": [],
    }


def test_each_planted_mistake_fails_with_its_sentence(results):
    root = results["root_not_wrapped"]
    assert not root["placements"].ok and "the root is not sharded" in root["placements"].sentence
    assert not any(r.ok for r in root.values())  # FSDP2 without a root unit does not even train here
    nothing = results["no_prefetch"]
    assert nothing["prefetch"].sentence.startswith("no forward prefetch") and not nothing["prefetch"].ok
    assert nothing["placements"].ok and nothing["losses"].ok and nothing["bytes"].ok
    assert nothing["prefetch"].figures["issued_before_previous_block"] == [False, False]  # the probe agrees
    whole = results["blocks_not_wrapped"]
    assert whole["placements"].sentence.startswith("one FSDP unit holds all") and not whole["placements"].ok
    assert not whole["prefetch"].ok and not whole["bytes"].ok
    assert whole["losses"].ok and whole["gradients"].ok  # right numbers, wrong memory and traffic
    summed = results["summed_gradients"]
    assert not summed["gradients"].ok and "3.00 x single's" in summed["gradients"].sentence
    assert "summed, not averaged" in summed["gradients"].sentence
    assert summed["placements"].ok and summed["bytes"].ok  # only the gradients can see it


def test_the_stub_says_write_this_piece(results):
    [stub] = results["stub"].values()
    assert not stub.ok and stub.sentence.startswith("write this piece: shard_with_fsdp2")
