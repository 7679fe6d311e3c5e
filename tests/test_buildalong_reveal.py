"""Notebook 02's reveal after every check: each piece's common mistake, planted into the instructor's filled
pieces, fails its own check, makes every later check that builds on it say "fix `<piece>` first", and keeps
labkit's own code for that piece and for every piece built on it hidden (the notebook's reveal cells, run on
those results). The gradient checks judge each rank's shard against single's, naming a factor of n at world
sizes 2 and 4; exercise 02's round trip says the shapes. Few launches: each runs many cases."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import nbformat
import planted
import pytest
import torch
import torch.distributed as dist
from planted import FILLED

from labkit.buildalong import checks, reveal
from labkit.buildalong.cells import pieces_from_notebook

MODEL = "tiny_uneven"
NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "02_zero3_from_scratch.ipynb"
P = pieces_from_notebook()
# What each reveal shows (a line of its source) -> the steps whose checks must pass first: the piece's own and
# every piece it builds on.
REVEALS = {
    "def start_gather": ("shard", "gather", "forward"),
    "def start_reduce_scatter": ("shard", "gather", "forward", "backward", "reduce_scatter"),
    "def step": checks.STEPS,
}


def _no_padding(full, rank, n):
    return full.tensor_split(n)[rank].clone()


def _padding_not_zero(full, rank, n):
    shard = FILLED["shard"](full, rank, n)
    real = max(0, min(shard.shape[0], full.shape[0] - rank * shard.shape[0]))
    shard[real:] = 1.0
    return shard


def _rows_of_the_next_rank(full, rank, n):
    return FILLED["shard"](full, (rank + 1) % n, n)


def _gather_keeps_padding(shard, d0, group=None):
    return FILLED["gather"](shard, shard.shape[0] * dist.get_world_size(group), group)


PLANTED = {  # name: (the step whose piece is wrong, the pieces, words its own check's sentence holds)
    "shard without padding": (
        "shard",
        dataclasses.replace(P, shard=_no_padding),
        ["rank 2 of 3 has 33 rows of the 101-row tok.weight", "ceil(101/3) = 34"],
    ),
    "shard padded with ones": (
        "shard",
        dataclasses.replace(P, shard=_padding_not_zero),
        ["row 33 of rank 2's shard of tok.weight is not zero, but it is padding (3 x 34 rows hold 101"],
    ),
    "shard of the next rank's rows": (
        "shard",
        dataclasses.replace(P, shard=_rows_of_the_next_rank),
        ["row 0 of rank 0's shard of tok.weight is not row 0 of the full tensor"],
    ),
    "gather keeps the padding": (
        "gather",
        dataclasses.replace(P, gather=_gather_keeps_padding),
        ["gather returned 102 rows of tok.weight on rank 0 (shape (102, 50), want (101, 50))", "d0 = 101"],
    ),
    "after_forward does not free": (
        "forward",
        dataclasses.replace(P, after_forward=lambda unit: None),
        ["still hold their full weights (root: 44,200 B, want 0 B)", "free them in after_forward"],
    ),
    "no gather before backward": (
        "backward",
        dataclasses.replace(P, before_backward=lambda unit: None),
        ["the backward of root found its weights freed"],
    ),
    "after_grad does not divide by n": (
        "reduce_scatter",
        dataclasses.replace(P, after_grad=planted.after_grad(divide=False)),
        ["every gradient is 3.00 x single's: after_grad did not divide by n", "rank 0's shard grads"],
    ),
    "after_grad averages, then divides": (
        "reduce_scatter",
        dataclasses.replace(P, after_grad=planted.after_grad(op=dist.ReduceOp.AVG)),
        ["every gradient is 0.33 x single's: the mean was taken twice"],
    ),
    "AdamW with torch's defaults": (
        "adamw",
        dataclasses.replace(P, make_optimizer=lambda shards: torch.optim.AdamW(shards)),
        ["not the lab's betas=(0.9, 0.95), weight_decay=0.1"],
    ),
}


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, checks.CheckResult]]:
    """{"filled" or a planted name: {step: its check's result}}: every step of every case, as 02 runs them,
    in one launch of 3 ranks."""
    cases = {"filled": P, **{name: pieces for name, (_, pieces, _) in PLANTED.items()}}
    flat = [(step, pieces) for pieces in cases.values() for step in checks.STEPS]
    found = iter(checks.run_checks(flat, world_size=3, model=MODEL, quiet=True))
    return {name: {step: next(found) for step in checks.STEPS} for name in cases}


def _check_variables() -> dict[str, str]:
    """{variable: step} of the notebook's check cells (`shard_check = checks.check_shard(...)`)."""
    found = {}
    for cell in nbformat.read(NOTEBOOK, as_version=4).cells:
        for m in re.finditer(r"^(\w+) = checks\.check_(\w+)\(", cell.source, re.M):
            found[m.group(1)] = m.group(2)
    assert sorted(found.values()) == sorted(checks.STEPS), found
    return found


def _revealed(by_step: dict[str, checks.CheckResult], monkeypatch, capsys) -> tuple[list[str], int]:
    """Run the notebook's reveal cells on these check results: (the sources they displayed, how many said
    NOT_YET). `every_check` comes from its own line of the training cell, as the notebook writes it."""
    import IPython.display

    shown: list[str] = []
    monkeypatch.setattr(IPython.display, "display", lambda code: shown.append(code.data))
    ns = {var: by_step[step] for var, step in _check_variables().items()}
    cells = [c for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]
    for cell in cells:
        for node in ast.parse(cell.source).body:
            if isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == [
                "every_check"
            ]:
                exec(compile(ast.Module([node], []), "every_check", "exec"), ns)  # noqa: S102
    capsys.readouterr()
    for cell in cells:
        if "reveal.show(" in cell.source:
            exec(compile(cell.source, f"<02 cell {cell.id}>", "exec"), ns)  # noqa: S102 (the course's own)
    return shown, capsys.readouterr().out.count(reveal.NOT_YET)


def test_the_filled_pieces_pass_every_check_and_every_reveal_shows(results, monkeypatch, capsys):
    assert all(r.ok for r in results["filled"].values()), [str(r) for r in results["filled"].values()]
    shown, not_yet = _revealed(results["filled"], monkeypatch, capsys)
    assert not_yet == 0
    for line in REVEALS:
        assert any(line in source for source in shown), line


@pytest.mark.parametrize("name", list(PLANTED))
def test_a_planted_mistake_fails_its_check_blocks_the_later_ones_and_hides_their_reveals(
    results, name, monkeypatch, capsys
):
    step, _, words = PLANTED[name]
    found = results[name]
    own = found[step]
    assert not own.ok, own
    for w in words:
        assert w in own.sentence, own.sentence
    assert "\n" not in own.sentence and "fix `" not in own.sentence
    later = checks.STEPS[checks.STEPS.index(step) + 1 :]
    for after in later:  # each later check builds on this step (gather's own check does not build on shard)
        if step in checks.BUILDS_ON[after]:
            assert not found[after].ok and found[after].figures.get("blocked_by") == step, found[after]
            piece = {
                "forward": "before_forward",
                "backward": "before_backward",
                "reduce_scatter": "after_grad",
            }
            assert f"fix `{piece.get(step, step)}`" in found[after].sentence, found[after].sentence
            assert own.sentence in found[after].sentence
    shown, not_yet = _revealed(found, monkeypatch, capsys)
    for line, needs in REVEALS.items():
        revealed = any(line in source for source in shown)
        assert revealed == (step not in needs), (line, revealed)
    assert not_yet == sum(step in needs for needs in REVEALS.values())


@pytest.mark.parametrize("n", [2, 4])
def test_the_gradient_checks_name_the_factor_at_other_world_sizes(n):
    not_divided = dataclasses.replace(P, after_grad=planted.after_grad(divide=False))
    good, bad, blocked = checks.run_checks(
        [("reduce_scatter", P), ("reduce_scatter", not_divided), ("adamw", not_divided)],
        world_size=n,
        model=MODEL,
        quiet=True,
    )
    assert good.ok and good.figures["grad_rel"] <= 1e-4, good
    assert (
        not bad.ok and f"every gradient is {n:.2f} x single's: after_grad did not divide by n" in bad.sentence
    )
    assert not blocked.ok and blocked.sentence.startswith("fix `after_grad` first"), blocked


def test_the_backward_check_judges_the_mean_gradient_against_single_s():
    """A before_backward that gathers the weights doubled: the forward was right, the gradients are not."""

    def doubled(unit):
        for p, s, d0 in zip(unit.params, unit.shards, unit.d0, strict=True):
            FILLED["load"](p, 2 * FILLED["gather"](s, d0, unit.group))

    [result] = checks.run_checks(
        [("backward", dataclasses.replace(P, before_backward=doubled))], 3, MODEL, quiet=True
    )
    assert not result.ok
    assert "the mean of the 3 ranks' full gradients after backward: the gradient of" in result.sentence
    assert "differs from single's by up to" in result.sentence, result.sentence


def test_exercise_02_s_round_trip_says_the_shapes_when_the_padding_is_kept():
    from labkit.grading import public

    def gather_full(shard, d0, world_size):
        out = shard.new_empty((world_size * shard.shape[0], *shard.shape[1:]))
        dist.all_gather_single(out, shard.contiguous())
        return out  # the padding rows not dropped

    def floor_shard(full, rank, world_size):
        rows = full.shape[0] // world_size
        return full[rank * rows : (rank + 1) * rows].clone()

    kept = public._gather_cases({"shard_rows": FILLED["shard"], "gather_full": gather_full})
    assert [ok for ok, _ in kept] == [False, False]
    assert (
        "gather_full(shard_rows(full), 7, 3) on rank 0: shape [9, 4], want [7, 4]: 2 row(s) too many"
        in kept[0][1]
    )
    blamed = public._gather_cases({"shard_rows": floor_shard, "gather_full": gather_full})
    assert blamed[0][1].startswith(
        "d0=7 on 3 ranks: fix `shard_rows` first (rank 0's shard has shape [2, 4], want"
    )


def test_exercise_02_with_the_padding_kept_says_the_shapes_in_check_and_in_the_grade():
    """The solution's gather_full without `[:d0]`: both the grade and the student release's check() fail it,
    and both say the shapes."""
    from labkit.grading import public
    from labkit.grading.kit import judge_all, load, probe_all

    solution = Path(__file__).resolve().parents[1] / "solutions" / "02_shard_gather.ipynb"
    ns: dict = {}
    for cell in nbformat.read(solution, as_version=4).cells:
        if {"parameters", "setup", "answer"} & set(cell.metadata.get("tags", [])):
            exec(cell.source.replace("return out[:d0]", "return out"), ns)  # noqa: S102 (the course's own)
    for exercise in (public.load("ex02_shard", "ex02"), load("ex02_shard")):
        entries = judge_all(exercise, probe_all(exercise, ns, 3), 3)
        failed = [e for e in entries if not e["passed"]]
        assert failed and all("gather" in e["name"] or "round trip" in e["name"] for e in failed), entries
        assert re.search(
            r"shape \[\d+, \d+\], want \[\d+, \d+\]: \d row\(s\) too many", failed[0]["feedback"]
        )
