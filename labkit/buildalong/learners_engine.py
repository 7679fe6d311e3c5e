"""The scratch engine of the student copy: the learner's own ZeRO-3, read from their build cells.

The student release ships no ZeRO-3 of labkit's (`labkit/zero/` stays in the instructor's copy), so there the
`scratch` engine that the notebooks and `labkit compare` run is the learner's: 02's pieces, with 03's two
gathering moments when a run prefetches and 04's optimizer when it offloads to the CPU. Before any run,
`refusal(cfg)` says in one sentence why it cannot run: a setting their engine does not do (bf16, no reshard,
prefetch deeper than one unit, HSDP, activation checkpointing, a split root, NVMe), a build cell still a stub,
or a piece that fails 02's checks (run once per version of 02's cells: one launch of 3 ranks, seconds).
"""

from __future__ import annotations

import functools
from dataclasses import fields

from labkit.buildalong.cells import (
    NOTEBOOK,
    OFFLOAD_NOTEBOOK,
    PREFETCH_NOTEBOOK,
    build_cells,
    namespace_of,
    stubbed,
)
from labkit.buildalong.scaffold import Learner, Pieces
from labkit.course import course_path
from labkit.engines.base import RankInfo, RunConfig
from labkit.units import UnitSpec

NAME = "yours"  # what the student copy prints for its scratch engine's runs
# cfg.options the learner's engine takes, with the one value it does them at
OPTIONS = {"split_root": False}


def written_notebooks(cfg: RunConfig) -> tuple[str, ...]:
    """The notebooks whose build cells make the engine `cfg` asks for: 02, then 03 (prefetch), 04 (offload)."""
    return (
        NOTEBOOK,
        *((PREFETCH_NOTEBOOK,) if cfg.prefetch_depth else ()),
        *((OFFLOAD_NOTEBOOK,) if cfg.offload == "cpu" else ()),
    )


def learner_pieces(cfg: RunConfig) -> Pieces:
    """The learner's `Pieces` for a run of `cfg`: 02's build cells, then 03's and 04's run after them where the
    run prefetches or offloads (their `before_forward`, `before_backward`, `make_optimizer` replace 02's)."""
    ns = namespace_of(*(course_path(nb) for nb in written_notebooks(cfg)))
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


def refusal(cfg: RunConfig) -> str:
    """Why the learner's engine cannot run `cfg`, in one sentence naming what to do; "" when it can."""
    setting = unsupported(cfg)
    if setting:
        return f"The scratch engine of this copy is yours, and it does not do {setting}: run it without that setting."
    paths = [course_path(nb) for nb in written_notebooks(cfg)]
    for i, path in enumerate(paths):  # each notebook's pieces as its own cells leave them
        waiting = stubbed(path, namespace_of(*paths[: i + 1]))
        if waiting:
            return (
                f"The scratch engine of this copy is yours: your {path.name[:2]} still has {', '.join(waiting)} to "
                "write (its build cells, then their checks)."
            )
    return _failing(repr(build_cells(paths[0])))


@functools.lru_cache(maxsize=8)
def _failing(cells_02: str) -> str:
    """02's checks on the learner's pieces, once per version of 02's cells (`cells_02`): "" or the sentence."""
    from labkit.buildalong.yours import failing_pieces

    said = failing_pieces([learner_pieces(RunConfig(prefetch=False))])[0]
    return said.replace(
        "the table runs without your engine", "the scratch engine of this copy (yours) cannot run"
    )


def build(cfg: RunConfig, model, info: RankInfo, units: UnitSpec = None):
    """On each rank: the learner's engine for `cfg` (`learner_pieces`), as the lab's loop runs any engine."""
    return Learner(learner_pieces(cfg), name=NAME, units=units).build(cfg, model, info)
