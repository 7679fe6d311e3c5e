"""The learner's engine, as the course runs it after 02: their pieces for a run, whether they can run it, the engine.

A run reads the build cells of the notebooks its settings need (`written_notebooks`): 02's pieces, then 03's two
gathering moments when it prefetches and 04's optimizer when it offloads to the CPU. Before any run,
`refusal(cfg, consequence)` says in one sentence why it cannot: a setting their engine does not do (bf16, no
reshard, prefetch deeper than one unit, HSDP, activation checkpointing, a split root, NVMe), a build cell still a
stub, or a piece that fails its notebook's check (02's checks in one launch of 3 ranks; 03's prefetch check and
04's offload check in one launch of 2 ranks each; seconds, and run once per version of those cells).

Two callers, one rule: the student copy's `scratch` engine, which is the learner's (`build`), and "yours" in the
later notebooks of either copy (`labkit.buildalong.yours`). Neither falls back to labkit's engine.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from labkit.buildalong.cells import (
    NOTEBOOK,
    OFFLOAD_NOTEBOOK,
    PREFETCH_NOTEBOOK,
    build_cells,
    namespace_of,
    stubbed,
)
from labkit.buildalong.scaffold import Learner, Pieces
from labkit.buildalong.verdicts import PIECES_OF
from labkit.course import course_path
from labkit.engines.base import RankInfo, RunConfig
from labkit.units import UnitSpec

NAME = "yours"  # what both copies print for the learner's engine (the student copy's scratch)
# cfg.options the learner's engine takes, with the one value it does them at
OPTIONS = {"split_root": False}
SCRATCH = "the scratch engine of this copy (yours) cannot run"  # what a refusal means for `scratch`
# the check of each later notebook's build cell: its step and the pieces it writes again
LATER_CHECKS = {
    PREFETCH_NOTEBOOK: ("prefetch", ("before_forward", "before_backward")),
    OFFLOAD_NOTEBOOK: ("offload", ("make_optimizer",)),
}


def written_notebooks(cfg: RunConfig) -> tuple[str, ...]:
    """The notebooks whose build cells make the engine `cfg` asks for: 02, then 03 (prefetch), 04 (offload)."""
    return (
        NOTEBOOK,
        *((PREFETCH_NOTEBOOK,) if cfg.prefetch_depth else ()),
        *((OFFLOAD_NOTEBOOK,) if cfg.offload == "cpu" else ()),
    )


def notebook_paths(cfg: RunConfig, notebook_02: Path | None = None) -> list[Path]:
    """`written_notebooks(cfg)` in this copy (02 read from `notebook_02` instead, if given)."""
    paths = [course_path(nb) for nb in written_notebooks(cfg)]
    return [notebook_02 or paths[0], *paths[1:]]


def learner_pieces(cfg: RunConfig, notebook_02: Path | None = None) -> Pieces:
    """The learner's `Pieces` for a run of `cfg`: 02's build cells, then 03's and 04's run after them where the
    run prefetches or offloads (their `before_forward`, `before_backward`, `make_optimizer` replace 02's)."""
    return _pieces(namespace_of(*notebook_paths(cfg, notebook_02)))


def _pieces(ns: dict) -> Pieces:
    return Pieces(**{f.name: ns.get(f.name) for f in fields(Pieces)})


def unsupported(cfg: RunConfig) -> str:
    """The first setting of `cfg` the learner's engine does not do, as a phrase; "" when none."""
    for key, value in cfg.options.items():
        if OPTIONS.get(key, object()) != value:
            return f"{key} = {value!r}"
    checks = (
        (cfg.dtype != "float32", f"dtype {cfg.dtype!r} (yours computes in float32)"),
        (
            not cfg.reshard_after_forward,
            "reshard_after_forward=False (yours frees every unit after its forward)",
        ),
        (cfg.prefetch_depth > 1, f"prefetch_depth {cfg.prefetch_depth} (your 03 gathers one unit ahead)"),
        (cfg.offload not in ("none", "cpu"), f"offload {cfg.offload!r} (your 04 offloads to the CPU)"),
    )
    return next((said for bad, said in checks if bad), "")


def refusal(cfg: RunConfig, consequence: str = SCRATCH, notebook_02: Path | None = None) -> str:
    """Why the learner's engine cannot run `cfg`, in one sentence saying `consequence` and what to do; "" when
    it can. `consequence`: what the refusal means where it is said, e.g. "the table runs without your engine"."""
    setting = unsupported(cfg)
    if setting:
        return f"Your engine does not do {setting}, so {consequence}: leave that setting out."
    paths = notebook_paths(cfg, notebook_02)
    for i, path in enumerate(paths):  # each notebook's pieces as its own cells leave them
        waiting = stubbed(path, namespace_of(*paths[: i + 1]))
        if waiting:
            return (
                f"Your {path.name[:2]} still has {', '.join(waiting)} to write (its build cells, then their "
                f"checks), so {consequence}."
            )
    first = (str(paths[0]), repr(build_cells(paths[0])))
    for notebook, path in zip(written_notebooks(cfg), paths, strict=True):
        failed = _failing(notebook, first, (str(path), repr(build_cells(path))))
        if failed:
            return _fails(*failed, consequence)
    return ""


@functools.lru_cache(maxsize=16)
def _failing(notebook: str, first: tuple[str, str], this: tuple[str, str]) -> tuple[str, str, str] | None:
    """(notebook, step, what its check saw) when `notebook`'s check fails on its build cells, run with 02's
    pieces; None when it passes. `this` and `first`: the path and the cells' text of `notebook` and of 02, the
    cache's key (each check runs once per version of the cells it runs)."""
    from labkit.buildalong.offload_check import check_offload
    from labkit.buildalong.prefetch_check import check_prefetch

    plain = _pieces(namespace_of(Path(first[0])))
    if notebook == NOTEBOOK:
        failed = _failing_02([plain])[0]
        return ("02", *failed) if failed else None
    ns, (step, _) = namespace_of(Path(first[0]), Path(this[0])), LATER_CHECKS[notebook]
    if step == "prefetch":
        result = check_prefetch(ns["before_forward"], ns["before_backward"], yours=plain, quiet=True)
    else:
        result = check_offload(ns["make_optimizer"], yours=plain, quiet=True)
    if result.ok:
        return None
    said, *more = result.sentence.strip().splitlines()  # one line per property that fails
    return Path(this[0]).name[:2], step, said.strip() + (f" (and {len(more)} more)" if more else "")


def failing_pieces(candidates: Sequence[Pieces], consequence: str = SCRATCH) -> list[str]:
    """For each of `candidates`, every check of 02 on it (all of them in one launch): "" when they all pass,
    else one sentence naming the first step whose check fails, that step's pieces and what the check saw."""
    return [_fails("02", *failed, consequence) if failed else "" for failed in _failing_02(candidates)]


def _failing_02(candidates: Sequence[Pieces]) -> list[tuple[str, str] | None]:
    """For each of `candidates`: (the first step of 02 whose check fails, what it saw), or None."""
    from labkit.buildalong.checks import STEPS, run_checks

    results = run_checks([(step, pieces) for pieces in candidates for step in STEPS], quiet=True)
    out = []
    for i in range(len(candidates)):
        mine = results[i * len(STEPS) : (i + 1) * len(STEPS)]
        failed = next((r for r in mine if not r.ok), None)
        if failed is None:
            out.append(None)
        elif all(not r.ok and r.sentence == failed.sentence for r in mine):  # the launch itself failed
            out.append(("", failed.sentence))
        else:
            out.append((failed.step, failed.sentence))
    return out


def _fails(notebook: str, step: str, sentence: str, consequence: str) -> str:
    """The sentence for `step`'s check of `notebook` failing with `sentence` ("" step: it could not run)."""
    if not step:
        return f"{notebook}'s checks could not run on your pieces, so {consequence}: {sentence}"
    pieces = PIECES_OF.get(step) or next(p for s, p in LATER_CHECKS.values() if s == step)
    named = " and ".join(f"`{piece}`" for piece in pieces)
    one = len(pieces) == 1
    return (
        f"Your {named} {'fails' if one else 'fail'} {notebook}'s `{step}` check, so {consequence}: "
        f"{sentence.rstrip('.')}; fix {'it' if one else 'them'} in {notebook} and run that check cell again."
    )


def build(cfg: RunConfig, model, info: RankInfo, units: UnitSpec = None):
    """On each rank: the learner's engine for `cfg` (`learner_pieces`), as the lab's loop runs any engine."""
    return Learner(learner_pieces(cfg), name=NAME, units=units).build(cfg, model, info)
