"""Notebook 06's build cells (the learner's DeepSpeed config and step) and their live check, in ONE launch.

The filled cells of the instructor's copy pass every property; mistakes planted into copies of them fail with
the sentence that names them; the stubs (what the student release holds) give their "write this piece"
sentence. Every case that reaches the ranks starts DeepSpeed twice (thresholds 0 and 1000), so all share one
launch; a config mistake is named in the parent, before any rank starts.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from labkit.buildalong.deepspeed_check import PROPERTIES, run_deepspeed_checks
from labkit.buildalong.stubs import write_this_piece
from labkit.model import build_model, loss_fn
from labkit.release import normalised_lines, telling

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "06_deepspeed_surface.ipynb"


def _build_cells() -> list[nbformat.NotebookNode]:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    return [c for c in nb.cells if "build" in c.metadata.get("tags", [])]


def _define(sources: list[str]) -> dict:
    """The names the cells define, run in the namespace 06's set-up cells give them (loss_fn, write_this_piece)."""
    ns = {"loss_fn": loss_fn, "write_this_piece": write_this_piece}
    for source in sources:
        exec(compile(source, "<06 build cell>", "exec"), ns)  # noqa: S102 (the course's own cells)
    return ns


def _planted(source: str, line: str, instead: str | None) -> str:
    """`source` with the line holding `line` replaced by `instead` (same indent), or dropped."""
    out = []
    for kept in source.splitlines():
        if line in kept:
            if instead is not None:
                out.append(kept[: len(kept) - len(kept.lstrip())] + instead)
            continue
        out.append(kept)
    return "\n".join(out)


@pytest.fixture(scope="module")
def results() -> dict[str, list]:
    filled = {c.id: c.source for c in _build_cells()}
    config_src, step_src = filled.values()
    ok = _define([config_src, step_src])
    stubs = _define([c.metadata["labkit"]["stub"] for c in _build_cells()])
    config, step = ok["zero3_config"], ok["train_step"]

    def stage_2(*args):
        out = config(*args)
        out["zero_optimization"]["stage"] = 2
        return out

    def threshold_left_out(*args):
        out = config(*args)
        del out["zero_optimization"]["stage3_param_persistence_threshold"]
        return out

    cases = {
        "filled": (config, step),
        "stage 2": (stage_2, step),
        "threshold left out": (threshold_left_out, step),
        "no engine.step": (config, _define([_planted(step_src, "engine.step()", None)])["train_step"]),
        "loss.backward": (
            config,
            _define([_planted(step_src, "engine.backward(loss)", "loss.backward()")])["train_step"],
        ),
        "mean taken twice": (
            config,
            _define([_planted(step_src, "engine.backward(loss)", "engine.backward(loss / 2)")])["train_step"],
        ),
        "config stub": (stubs["zero3_config"], step),
        "step stub": (config, stubs["train_step"]),
    }
    got = run_deepspeed_checks(list(cases.values()), world_size=2, model="tiny", threshold=1000, quiet=True)
    return dict(zip(cases, got, strict=True))


def _said(results: list) -> dict[str, tuple[bool, str]]:
    return {r.step: (r.ok, r.sentence) for r in results}


def test_the_filled_cells_pass_every_property(results):
    said = _said(results["filled"])
    assert list(said) == list(PROPERTIES) and all(ok for ok, _ in said.values()), said
    n_params = len(list(build_model("tiny").parameters()))
    assert f"at 0 all {n_params} parameters are partitioned" in said["threshold"][1]
    assert "the deepspeed engine's plan exactly" in said["bytes"][1]


def test_planted_mistakes_fail_with_the_sentence_that_names_them(results):
    stage = _said(results["stage 2"])
    assert list(stage) == ["config"] and not stage["config"][0]  # named in the parent, no rank started
    assert stage["config"][1].startswith("stage 2 partitions gradients and AdamW's state, but every rank")
    left_out = _said(results["threshold left out"])
    assert not left_out["threshold"][0] and not left_out["bytes"][0]
    assert (
        "all 53 parameters stayed whole on every rank, so ZeRO-3 partitioned none" in left_out["threshold"][1]
    )
    assert "(DeepSpeed's default: the key is missing" in left_out["threshold"][1]
    no_step = _said(results["no engine.step"])
    assert not no_step["losses"][0] and no_step["losses"][1].startswith("engine.step() was never called")
    # DeepSpeed 0.19.8 hooks a plain loss.backward(): the same losses and bytes, and the check says why.
    torch_style = _said(results["loss.backward"])
    assert all(ok for ok, _ in torch_style.values()), torch_style
    assert "you called loss.backward(): DeepSpeed 0.19.8 hooks it" in torch_style["losses"][1]
    # Half the gradient trains to single's losses under AdamW: only the gradients see it.
    halved = _said(results["mean taken twice"])
    assert (
        not halved["gradients"][0] and "0.50 x single's: the mean was taken twice" in halved["gradients"][1]
    )
    assert halved["losses"][0] and halved["bytes"][0], halved


def test_the_stubs_say_write_this_piece(results):
    [config] = results["config stub"]
    assert (config.step, config.ok) == ("config", False)
    assert config.sentence.startswith("write this piece: zero3_config (")
    assert config.sentence.endswith(", then run this check again")
    said = _said(results["step stub"])
    assert said["config"][0] and said["train_step"] == (
        False,
        "write this piece: train_step (forward and loss, the engine's backward, the engine's step), then run "
        "this check again",
    )


def test_the_filled_cells_copy_no_line_of_the_deepspeed_engine():
    engine_lines = set()
    for name in ("ds_config.py", "deepspeed.py"):
        engine_lines |= set(normalised_lines((ROOT / "labkit" / "engines" / name).read_text()))
    copied = [
        line
        for cell in _build_cells()
        for line in normalised_lines(cell.source)
        if telling(line) and line in engine_lines
    ]
    assert not copied
