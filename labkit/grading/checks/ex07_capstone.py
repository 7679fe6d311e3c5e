"""Exercise 07, the capstone: the student's whole ZeRO-3, with prefetch, trained on 3 ranks by the lab's loop.

The checks are `labkit.grading.capstone`'s (the same seven the public `check()` runs on the notebook's
`tiny`); the grade runs them on a model the notebook never shows (`ex07_capstone_model`: its widths and
sequence length come from the seed, uneven against 3 ranks), with the reference pieces
(`ex07_capstone_reference`) standing in for one of the student's that raises, so that it costs only the
checks of its own properties.
"""

from __future__ import annotations

from labkit.grading import capstone
from labkit.grading.checks import ex07_capstone_reference
from labkit.grading.checks.ex07_capstone_model import RANKS, STEPS, hidden_run, model_config
from labkit.grading.kit import Exercise

LAUNCH_TIMEOUT_S = capstone.LAUNCH_TIMEOUT_S
RANKS_LIMIT_S = capstone.RANKS_LIMIT_S
__all__ = ["EXERCISE", "LAUNCH_TIMEOUT_S", "RANKS", "RANKS_LIMIT_S", "STEPS", "hidden_run", "model_config"]

EXERCISE = Exercise(
    "ex07_capstone",
    "Capstone: your own ZeRO-3, with prefetch",
    capstone.checks(hidden_run, ex07_capstone_reference.pieces()),
)
