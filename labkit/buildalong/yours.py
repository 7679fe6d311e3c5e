"""Your ZeRO-3 in the later notebooks: read from your build cells (02, 03, 04), run beside the libraries.

`your_engine(cfg)` is `Learner(pieces)` of the build cells a run of `cfg` needs (02's, 03's prefetch, 04's
offload: filled in the instructor's copy, the learner's own in the student copy), or None and one sentence: a
setting it does not do, the pieces still to write, or, before any run, the piece whose check fails and the check
cell to run again (`learners_engine.refusal`). A later notebook never falls back to labkit's engine in its place.
`beside(records, name)` says, from one comparison's records, whether your run computed what `single` computed
and moved the bytes ZeRO-3's formula counts: two all-gathers and one reduce-scatter of every (padded) parameter
per step, (n-1)/n of each on the wire.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from labkit.buildalong.learners_engine import NAME, learner_pieces, refusal
from labkit.buildalong.scaffold import Learner
from labkit.buildalong.verdicts import LOSS_RTOL, formula_wire_bytes
from labkit.engines.base import RunConfig
from labkit.engines.registry import ORACLE
from labkit.tables import wire_bytes

TABLE = "the table runs without your engine"  # what a refusal means in a later notebook


def your_engine(cfg: RunConfig, name: str = NAME, notebook: Path | None = None) -> tuple[Learner | None, str]:
    """(your engine for runs of `cfg`, "") from your build cells (02's, with 03's when `cfg` prefetches and 04's
    when it offloads; 02 read from `notebook` if given) once their checks pass on them (seconds); (None, the one
    sentence that says why not) while a setting of `cfg` is one your engine does not do, a piece is a stub or
    fails its check (`learners_engine.refusal`)."""
    said = refusal(cfg, TABLE, notebook)
    return (None, said) if said else (Learner(learner_pieces(cfg, notebook), name=name), "")


def beside(
    records: dict[str, dict[str, Any]], name: str, model: str, world_size: int, oracle: str = ORACLE
) -> str:
    """One sentence on `records[name]`: its losses against `records[oracle]`'s (float32: within LOSS_RTOL) and
    its wire bytes per collective against `formula_wire_bytes`."""
    rec, want = records[name], records[oracle]["losses"]
    diffs = [abs(a - b) / abs(b) for a, b in zip(rec["losses"], want, strict=True)]
    formula = formula_wire_bytes(model, world_size)
    got = {kind: wire_bytes(rec, kind) for kind in formula}
    said_bytes = ", ".join(f"{kind} {got[kind]:,} B (formula {formula[kind]:,} B)" for kind in formula)
    if max(diffs) > LOSS_RTOL:
        first = next(i for i, d in enumerate(diffs) if d > LOSS_RTOL)
        return (
            f"Your engine's losses part from {oracle}'s at step {first} (relative difference {diffs[first]:.1e}, "
            f"float32 allows {LOSS_RTOL:.0e}): run 02's checks again, they name the piece."
        )
    if got != formula:
        return (
            f"Your engine trained to {oracle}'s losses, but its wire bytes per step are {said_bytes}: a unit "
            "gathered more or less often than once for forward and once for backward; 02's forward and backward "
            "checks name which."
        )
    return (
        f"Your engine trained to {oracle}'s losses (largest relative difference {max(diffs):.1e}) and sent, per "
        f"rank and step, {said_bytes}: the algorithm of the libraries beside it, in your own code."
    )
