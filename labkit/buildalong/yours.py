"""Your ZeRO-3 from notebook 02 in the later notebooks: read from 02's build cells, run beside the libraries.

`your_engine()` is `Learner(pieces)` of 02's build cells (filled in the instructor's copy, the learner's own in
the student copy), or None and one sentence: the pieces still to write there, or, before any run, the piece
whose 02 check fails and the check cell to run again. A later notebook never falls back to labkit's engine in
its place. `beside(records, name)` says, from one comparison's records,
whether your run computed what `single` computed and moved the bytes ZeRO-3's formula counts: two all-gathers
and one reduce-scatter of every (padded) parameter per step, (n-1)/n of each on the wire.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from labkit import budget
from labkit.buildalong.cells import pieces_from_notebook, unwritten_pieces
from labkit.buildalong.scaffold import Learner, Pieces
from labkit.buildalong.verdicts import LOSS_RTOL, PIECES_OF
from labkit.engines.registry import ORACLE
from labkit.model import build_model
from labkit.names import ALL_GATHER, REDUCE_SCATTER
from labkit.tables import wire_bytes

NAME = "yours (02)"


def your_engine(notebook: Path | None = None, name: str = NAME) -> tuple[Learner | None, str]:
    """(your engine, "") from notebook 02's build cells once 02's checks pass on them (one launch of 3 ranks,
    seconds); (None, the one sentence that says why not) while a piece is a stub or fails its check."""
    pieces = pieces_from_notebook(notebook)
    waiting = unwritten_pieces(pieces)
    if waiting:
        return None, (
            f"Your 02 still has {', '.join(waiting)} to write (its build cells, then their checks): the table "
            "runs without your engine until they pass."
        )
    failing = failing_pieces([pieces])[0]
    return (None, failing) if failing else (Learner(pieces, name=name), "")


def failing_pieces(candidates: Sequence[Pieces]) -> list[str]:
    """For each of `candidates`, every check of 02 on it (all of them in one launch): "" when they all pass,
    else one sentence naming the first step whose check fails, that step's pieces and what the check saw."""
    from labkit.buildalong.checks import STEPS, run_checks

    results = run_checks([(step, pieces) for pieces in candidates for step in STEPS], quiet=True)
    said = []
    for i in range(len(candidates)):
        mine = results[i * len(STEPS) : (i + 1) * len(STEPS)]
        failed = next((r for r in mine if not r.ok), None)
        if failed is None:
            said.append("")
        elif all(not r.ok and r.sentence == failed.sentence for r in mine):  # the launch itself failed
            said.append(
                f"02's checks could not run on your pieces, so the table runs without your engine: {failed.sentence}"
            )
        else:
            said.append(_fails(failed.step, failed.sentence))
    return said


def _fails(step: str, sentence: str) -> str:
    pieces = PIECES_OF[step]
    named = " and ".join(f"`{piece}`" for piece in pieces)
    return (
        f"Your {named} {'fails' if len(pieces) == 1 else 'fail'} 02's `{step}` check, so the table runs without "
        f"your engine: {sentence.rstrip('.')}; fix {'it' if len(pieces) == 1 else 'them'} in 02 and run that "
        "check cell again."
    )


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
