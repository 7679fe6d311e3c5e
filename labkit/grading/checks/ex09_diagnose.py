"""Exercise 09: read a hung run's flight-recorder entries, and fix the step that hung it.

The checks are `labkit.grading.diagnose`'s (the student release's check() runs the same on the notebook's
cases); here are the hidden cases. Hung runs, the edge cases first: a rank that stopped while every recorder
kept only its last entries (the ranks' lists start at different sequence numbers: read by position, the lists
part at once), a rank that skipped to the next collective, one that issued other sizes, a rank that issued
nothing at all; then two drawn on 4 to 8 ranks (another collective past what the recorders keep, their last
6; other sizes). Uneven rows on 3 ranks: step 0 with one rank empty (which one drawn), step 1 a short batch
of drawn rows.
"""

from __future__ import annotations

import random

from labkit.grading import diagnose
from labkit.grading.kit import Exercise, rng
from labkit.lessons.uneven import OTHER_COLLECTIVE, OTHER_SIZES, STOPPED, Call, Hang
from labkit.model import config
from labkit.names import ALL_GATHER, ALL_REDUCE, BROADCAST, REDUCE_SCATTER

RANKS = 3
KINDS = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, BROADCAST)


def _program(r: random.Random, length: int) -> tuple[Call, ...]:
    """`length` collectives, no two in a row of the same kind (so a skip always issues another one)."""
    out: list[Call] = []
    for _ in range(length):
        kind = r.choice([k for k in KINDS if not out or k != out[-1][0]])
        out.append((kind, ((r.randrange(1, 64) * 64,),)))
    return tuple(out)


def hangs(seed: int) -> list[Hang]:
    """The hung runs a seed reads: four edge cases, then two drawn on more ranks, each place with its own
    cause and ring (so a mistake costs every seed the same cases)."""
    r = rng(seed, "hangs")
    n = r.randrange(3, 6)
    cases = [
        Hang(_program(r, 30), n, r.randrange(n), STOPPED, r.randrange(20, 29), kept=8),
        Hang(_program(r, 12), n, r.randrange(1, n - 1), OTHER_COLLECTIVE, r.randrange(2, 11)),
        Hang(_program(r, 12), n, r.randrange(n), OTHER_SIZES, r.randrange(2, 12)),
        Hang(_program(r, 6), n, r.randrange(n), STOPPED, 1),
    ]
    for cause, kept in ((OTHER_COLLECTIVE, 6), (OTHER_SIZES, None)):
        world, length = r.randrange(4, 9), r.randrange(10, 40)
        at = r.randrange(kept + 2 if kept else 2, length)  # with a ring: past what it keeps
        cases.append(Hang(_program(r, length), world, r.randrange(world), cause, at, kept))
    return cases


def splits(seed: int) -> tuple[list[list[int]], int]:
    """(rows per step and rank, the model's seed): step 0 the whole batch with one rank empty, step 1 a short
    batch; both uneven."""
    r = rng(seed, "rows")
    batch = config("tiny").global_batch
    empty = r.randrange(RANKS)
    first = r.randrange(1, batch)
    step0 = [0] * RANKS
    others = [k for k in range(RANKS) if k != empty]
    step0[others[0]], step0[others[1]] = first, batch - first
    step1 = [r.randrange(0, batch // RANKS + 1) for _ in range(RANKS)]
    step1[r.randrange(RANKS)] += 1  # at least one row
    return [step0, step1], r.randrange(1000)


EXERCISE = Exercise(
    "ex09_diagnose", "A hung run: read its flight recorder, fix its step", diagnose.checks(hangs, splits)
)
