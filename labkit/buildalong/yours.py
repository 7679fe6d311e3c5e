"""Your ZeRO-3 from notebook 02 in the later notebooks: read from 02's build cells, run beside the libraries.

`your_engine()` is `Learner(pieces)` of 02's build cells (filled in the instructor's copy, the learner's own in
the student copy), or None and the sentence naming the pieces still to write there: a later notebook never
falls back to labkit's engine in its place. `beside(records, name)` says, from one comparison's records,
whether your run computed what `single` computed and moved the bytes ZeRO-3's formula counts: two all-gathers
and one reduce-scatter of every (padded) parameter per step, (n-1)/n of each on the wire.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from labkit import budget
from labkit.buildalong.cells import pieces_from_notebook, unwritten_pieces
from labkit.buildalong.scaffold import Learner
from labkit.buildalong.verdicts import LOSS_RTOL
from labkit.engines.registry import ORACLE
from labkit.model import build_model
from labkit.names import ALL_GATHER, REDUCE_SCATTER
from labkit.tables import wire_bytes

NAME = "yours (02)"


def your_engine(notebook: Path | None = None, name: str = NAME) -> tuple[Learner | None, str]:
    """(your engine, "") from notebook 02's build cells; (None, what is still to write) while a piece is a stub."""
    pieces = pieces_from_notebook(notebook)
    waiting = unwritten_pieces(pieces)
    if waiting:
        return None, (
            f"Your 02 still has {', '.join(waiting)} to write (its build cells, then their checks): the table "
            "runs without your engine until they pass."
        )
    return Learner(pieces, name=name), ""


def formula_wire_bytes(model: str, world_size: int) -> dict[str, int]:
    """ZeRO-3's wire bytes per rank per step for `model` on `world_size` ranks, float32 and zero-padded shards:
    {"all_gather": 2 x (n-1)/n x padded bytes, "reduce_scatter": (n-1)/n x padded bytes}."""
    padded = 4 * sum(budget.padded_numel(tuple(p.shape), world_size) for p in build_model(model).parameters())
    return {
        ALL_GATHER: 2 * budget.collective_wire_bytes(ALL_GATHER, padded, world_size),
        REDUCE_SCATTER: budget.collective_wire_bytes(REDUCE_SCATTER, padded, world_size),
    }


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
