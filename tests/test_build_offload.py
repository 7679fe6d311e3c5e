"""Notebook 04's build cell (the offloaded optimizer step in the learner's engine from 02) and its check
(labkit.buildalong.offload_check): the filled cell passes every property on real ranks, and each planted mistake
fails the property it breaks with the sentence that names it (all of them trained in one launch); the student
release stubs the cell, shows none of its answer lines, and runs 04 on the stubs and on the learner's own pieces.
The tests that start ranks or write a release are marked slow by hand (tests/conftest.py lists whole modules)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
import torch
from release_helpers import answer_lines_shown, executed_text, learners_copy, type_in_the_filled_cells

from labkit.buildalong.cells import notebook_namespace
from labkit.buildalong.offload_check import check_offload, check_offloads, formula
from labkit.buildalong.stubs import NotWritten, write_this_piece
from labkit.course import course_path
from labkit.model import build_model

slow = pytest.mark.slow
NOTEBOOK = "notebooks/04_offload.ipynb"
NAMES = ["host_copy", "grads_down", "weights_up", "make_optimizer"]
SHARDS = len(list(build_model("tiny").parameters()))  # one shard per parameter, one host copy per shard


def _build_cell() -> nbformat.NotebookNode:
    cells = nbformat.read(course_path(NOTEBOOK), as_version=4).cells
    (cell,) = [c for c in cells if "build" in c.metadata.get("tags", [])]
    return cell


def _namespace(source: str) -> dict:
    """02's namespace (its filled build cells: `lab`, the pieces) with `source` run in it, as 04's kernel runs it."""
    ns = notebook_namespace()
    exec(compile(source, "04", "exec"), ns)  # noqa: S102 (the course's own cell)
    return ns


FILLED = _namespace(_build_cell().source)
HOST_COPY, GRADS_DOWN, WEIGHTS_UP = (FILLED[name] for name in NAMES[:3])


def _adamw(host):
    lab = FILLED["lab"]
    return torch.optim.AdamW(host, lr=lab.lr, betas=lab.betas, eps=lab.eps, weight_decay=lab.weight_decay)


def _with_hooks(before, after):
    """A make_optimizer over host copies with these step hooks (each called with (shards, host))."""

    def make_optimizer(shards):
        host = [HOST_COPY(s) for s in shards]
        adamw = _adamw(host)
        adamw.register_step_pre_hook(lambda *_: before(shards, host))
        adamw.register_step_post_hook(lambda *_: after(shards, host))
        return adamw

    return make_optimizer


# ------------------------------------------------------------------------------------------------ the cell


def test_the_build_cell_has_slides_an_id_and_a_stub_that_defines_its_names_and_says_write_this_piece():
    cell = _build_cell()
    assert cell.id == "offload-build" and cell.metadata["slideshow"] == {"slide_type": "-"}
    stub = _namespace(cell.metadata["labkit"]["stub"])
    assert [name for name in NAMES if callable(stub.get(name))] == NAMES
    for name in NAMES:
        with pytest.raises(NotWritten, match=f"^write this piece: {name} \\("):
            stub[name](*[None] * stub[name].__code__.co_argcount)


def test_a_stub_says_write_this_piece_without_starting_ranks():
    stub = {**FILLED, "write_this_piece": write_this_piece}
    exec(compile(_build_cell().metadata["labkit"]["stub"], "stub", "exec"), stub)
    result = check_offload(stub["make_optimizer"], quiet=True)
    assert not result.ok and result.sentence == (
        "write this piece: make_optimizer (AdamW over host copies, grads_down and weights_up as its step hooks), "
        "then run this check again"
    )
    # host_copy and make_optimizer written, grads_down still a stub: the check names the piece its hook calls
    filled = dict(zip(NAMES, _build_cell().source.split("\n\n\n"), strict=True))
    exec(compile(filled["host_copy"] + "\n" + filled["make_optimizer"], "04", "exec"), stub)  # noqa: S102
    result = check_offload(stub["make_optimizer"], quiet=True)
    assert not result.ok and result.sentence.startswith("write this piece: grads_down (")


def test_the_formula_is_the_budgets_offload_plan_on_the_engines_padded_shards():
    plan = formula("tiny", 2)
    assert plan["device_optimizer"] == 0
    assert (
        plan["down"] == plan["up"] == plan["host_grads"] == plan["host_moments"] // 2 == plan["host_io"] // 2
    )
    assert plan["host_io"] == 978_048 * 2  # 8 B per element of this rank's padded float32 shards


# ------------------------------------------------------------------------------------------------ on real ranks


@slow
@pytest.mark.parametrize(("world_size", "model"), [(2, "tiny"), (3, "tiny_uneven")])
def test_the_filled_cell_passes_every_property(world_size, model):
    result = check_offload(FILLED["make_optimizer"], world_size, model, quiet=True)
    assert result.ok, result.sentence
    f, want = result.figures, formula(model, world_size)
    assert f["loss_rel"] <= 1e-4
    assert set(f["down"]) == {want["down"]} and set(f["up"]) == {want["up"]}
    assert (f["device_optimizer"], f["host_moments"], f["host_grads"]) == (
        0,
        want["host_moments"],
        want["host_grads"],
    )


def _aliasing_copy(shards):
    """host_copy as t.to("cpu"): on CPU ranks the shard itself, so AdamW steps the device's tensors."""
    host = [s.to("cpu") for s in shards]
    adamw = _adamw(host)
    adamw.register_step_pre_hook(lambda *_: GRADS_DOWN(shards, host))
    adamw.register_step_post_hook(lambda *_: WEIGHTS_UP(shards, host))
    return adamw


def _grad_shared(shards, host):
    for s, h in zip(shards, host, strict=True):
        h.grad = s.grad  # not brought to the host: the device's own gradient


def _grad_rescaled(shards, host):
    for s, h in zip(shards, host, strict=True):
        h.grad = HOST_COPY(s.grad) / 2  # averaged again over the two ranks


def _weights_down_too(shards, host):
    GRADS_DOWN(shards, host)
    for s, h in zip(shards, host, strict=True):
        h.copy_(s)  # the weights read back from the device every step: bytes for nothing


def _nothing(shards, host):
    pass


def _both_before(shards, host):
    """Both copies in the pre-hook: the device gets the host's weights of the step before."""
    GRADS_DOWN(shards, host)
    WEIGHTS_UP(shards, host)


PLANTED = {
    "02's optimizer: state on the device": notebook_namespace()["make_optimizer"],
    "host copies that are the shards": _aliasing_copy,
    "gradient not brought to the host": _with_hooks(_grad_shared, WEIGHTS_UP),
    "gradient at the wrong scale": _with_hooks(_grad_rescaled, WEIGHTS_UP),
    "weights never copied back": _with_hooks(GRADS_DOWN, _nothing),
    "weights copied up before the step": _with_hooks(_both_before, _nothing),
    "weights copied down each step too": _with_hooks(_weights_down_too, WEIGHTS_UP),
}


@pytest.fixture(scope="module")
def planted() -> dict[str, list[str]]:
    """Each planted mistake's failing sentences, all trained in one launch."""
    results = check_offloads(list(PLANTED.values()))
    assert not any(r.ok for r in results)
    return {name: r.sentence.split("\n  ") for name, r in zip(PLANTED, results, strict=True)}


def _props(sentences: list[str]) -> list[str]:
    return [s.split(":", 1)[0] for s in sentences]


@slow
def test_state_left_on_the_device_fails_placement_memory_and_bytes(planted):
    said = planted["02's optimizer: state on the device"]
    assert _props(said) == ["placement", "memory", "bytes"], said
    assert said[0].startswith(f"placement: AdamW updates {SHARDS} of the device's own tensors")
    assert said[1].startswith("memory: the device keeps 1,956,096 B of optimizer state (the plan: 0 B)")
    assert said[2].startswith(
        "bytes: step 0 copied 0 B from device to host and 0 B back, the plan 978,048 B down"
    )
    assert _props(planted["host copies that are the shards"]) == ["placement", "memory", "bytes"]


@slow
def test_a_gradient_left_on_the_device_or_rescaled_is_named(planted):
    shared = planted["gradient not brought to the host"]
    assert _props(shared) == ["placement", "memory", "bytes"], shared
    assert "host copies take as .grad the device's own gradient" in shared[0]
    assert shared[2].startswith("bytes: step 0 copied 0 B from device to host and 978,048 B back")
    (rescaled,) = planted["gradient at the wrong scale"]  # AdamW hardly sees a scale: only this check does
    assert rescaled.startswith(
        f"gradient: at step 0's AdamW {SHARDS} host copies' gradients differ from their shards' "
    )
    assert "(the first: 0.5 times the device's)" in rescaled


@slow
def test_weights_not_copied_back_after_the_step_are_named(planted):
    never = planted["weights never copied back"]
    assert _props(never) == ["weights", "bytes", "losses"], never
    assert never[0].startswith(
        f"weights: after step 0's AdamW, {SHARDS} device shards differ from their host copies"
    )
    assert "978,048 B from device to host and 0 B back" in never[1]
    early = planted["weights copied up before the step"]
    assert _props(early) == ["weights", "losses"], early
    assert early[1].startswith("losses: at step 1 your engine's loss is ")


@slow
def test_bytes_moved_for_nothing_fail_the_bytes_alone(planted):
    (said,) = planted["weights copied down each step too"]
    assert said.startswith(
        "bytes: step 0 copied 1,956,096 B from device to host and 978,048 B back, the plan "
    )


# ------------------------------------------------------------------------------------------------ the release


@slow
def test_the_release_stubs_the_cell_and_shows_none_of_its_answer_lines(student_release: Path):
    answer, shown = answer_lines_shown(student_release, NOTEBOOK, _build_cell())
    assert len(answer) >= 6, answer
    assert shown == []


@slow
def test_the_student_04_runs_on_its_stubs_and_measures_the_learners_own_engine(
    student_release: Path, tmp_path: Path, monkeypatch, executed
):
    from labkit.buildalong.cells import NOTEBOOK as NOTEBOOK_02
    from labkit.buildalong.cells import PREFETCH_NOTEBOOK

    release = learners_copy(student_release, tmp_path)
    stubbed = executed_text(release, release / NOTEBOOK, monkeypatch)
    assert "✗ offload: write this piece: make_optimizer (" in stubbed
    assert "Not yet: your engine joins the table once the check above passes." in stubbed
    assert "scratch, offload" not in stubbed  # the student copy has no engine of labkit's: its own comes
    assert (
        "Not yet: the prediction is answered by your engine's rows, once they run (what they wait for is said above)."
        in stubbed
    )
    assert "deepspeed, optimizer" in stubbed  # the libraries' measurement goes on
    for notebook in (NOTEBOOK_02, PREFETCH_NOTEBOOK, NOTEBOOK):  # their 02, 03 (its prefetch), then their 04
        type_in_the_filled_cells(release, notebook)
    written = executed_text(release, release / NOTEBOOK, monkeypatch)
    assert "✓ offload: AdamW's weights, m and v on the host" in written, written
    assert "Not yet" not in written
    assert "yours, offload" in written and "optimizer column 0 B" in written
    # the same engine state as the instructor's copy measures for the filled cells, to the byte
    instructor = "\n".join(
        "".join(o.get("text", "") for o in c.get("outputs", [])) for c in executed(Path(NOTEBOOK).name).cells
    )
    assert _yours_line(written) == _yours_line(instructor), (_yours_line(written), _yours_line(instructor))


def _yours_line(text: str) -> str:
    """The offload-yours cell's sentence, up to its loss figure (whose reference run differs between copies)."""
    line = next(line for line in text.splitlines() if line.startswith("yours: engine state "))
    return line.split("; largest relative loss difference")[0]
