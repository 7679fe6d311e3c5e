"""What each exercise checks: one module per exercise id, each defining `EXERCISE`.

A check is two halves that never run in the same process during grading:
    probe(namespace, seed)      runs beside the student's code (the fresh answers process, or the kernel for
                                check()): calls the answers on inputs drawn from `seed` and returns plain
                                JSON data (numbers, lists, strings). It decides nothing.
    judge(observation, seed)    runs in the grader, which never executes student code: rebuilds the same
                                inputs from `seed`, computes the reference with the pristine labkit, and
                                returns (fraction of the points earned in [0, 1], feedback sentence).
Whatever the student's code does to its own process can only change the observation, and an observation
earns points only if it matches a reference the student's process never saw.
"""

from __future__ import annotations

import importlib
import json
import math
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_ID = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


class MissingAnswer(LookupError):
    """A name the answer cells should define is not there (the cell raised, or defines another name)."""


@dataclass(frozen=True)
class Check:
    """One graded question: `points` earned in proportion to the fraction `judge` returns."""

    name: str
    points: int
    probe: Callable[[dict, int], Any]
    judge: Callable[[Any, int], tuple[float, str]]


@dataclass(frozen=True)
class Exercise:
    """An exercise's checks. `id` is the notebooks' `metadata.labkit.exercise`."""

    id: str
    title: str
    checks: tuple[Check, ...]

    @property
    def max_score(self) -> int:
        return sum(c.points for c in self.checks)


def load(exercise_id: str) -> Exercise:
    """The `EXERCISE` of module `labkit.grading.checks.<exercise_id>`; LookupError when there is none."""
    if not isinstance(exercise_id, str) or not _ID.match(exercise_id):
        raise LookupError(f"{exercise_id!r} is not an exercise id (lower-case letters, digits and _)")
    try:
        module = importlib.import_module(f"{__name__}.{exercise_id}")
    except ModuleNotFoundError:
        raise LookupError(f"no checks for exercise {exercise_id!r} in labkit/grading/checks/") from None
    exercise = getattr(module, "EXERCISE", None)
    if not isinstance(exercise, Exercise) or exercise.id != exercise_id:
        raise LookupError(f"labkit/grading/checks/{exercise_id}.py defines no EXERCISE with that id")
    return exercise


def answer(namespace: dict, name: str) -> Any:
    """The object the answer cells define as `name`, or MissingAnswer saying it is not there."""
    if name not in namespace:
        raise MissingAnswer(f"`{name}` is not defined (its answer cell raised or did not define it)")
    return namespace[name]


def to_json(value: Any) -> Any:
    """`value` as it comes back from a JSON round trip: what the grader's judge will see."""
    return json.loads(json.dumps(value))


def probe_all(exercise: Exercise, namespace: dict, seed: int) -> dict[str, dict]:
    """Run every probe: {check name: {"value": observation} or {"error": "Type: message"}}."""
    observations = {}
    for check in exercise.checks:
        try:
            observations[check.name] = {"value": to_json(check.probe(namespace, seed))}
        except Exception as e:  # noqa: BLE001 (a wrong answer may fail in any way; it only loses its points)
            observations[check.name] = {"error": f"{type(e).__name__}: {e}".strip().splitlines()[0][:300]}
    return observations


def judge_all(
    exercise: Exercise, observations: dict, seed: int, cell_errors: Sequence[str] = ()
) -> list[dict]:
    """The report's check entries: each observation judged against its reference; points are rounded to 0.01.

    `cell_errors` (e.g. "cell answer-shard raised NotImplementedError") is added to the feedback of a
    check whose probe could not run, so the student sees why.
    """
    entries = []
    for check in exercise.checks:
        seen = observations.get(check.name) if isinstance(observations, dict) else None
        if isinstance(seen, dict) and "value" in seen:
            try:
                fraction, feedback = check.judge(seen["value"], seed)
                fraction = min(1.0, max(0.0, float(fraction)))
            except Exception as e:  # noqa: BLE001 (a malformed observation is a wrong answer)
                fraction, feedback = (
                    0.0,
                    f"your answer returned something unexpected ({type(e).__name__}: {e})",
                )
        else:
            error = seen.get("error") if isinstance(seen, dict) else None
            fraction = 0.0
            feedback = f"could not run your answer: {error or 'no result came back'}"
            if cell_errors:
                feedback += "; " + "; ".join(cell_errors)
        points = round(check.points * fraction, 2)
        entries.append(
            {
                "name": check.name,
                "points": points,
                "max_points": check.points,
                "passed": fraction == 1.0,
                "feedback": str(feedback),
            }
        )
    return entries


def tally(cases: Sequence[tuple[bool, str]]) -> tuple[float, str]:
    """(fraction right, feedback) for a check made of several cases, each (passed, what was wrong)."""
    if not cases:
        return 0.0, "no cases came back"
    wrong = [why for ok, why in cases if not ok]
    if not wrong:
        return 1.0, f"all {len(cases)} cases right"
    right = len(cases) - len(wrong)
    return right / len(cases), f"{right}/{len(cases)} cases right; for example {wrong[0]}"


def close(got: Any, want: float, abs_tol: float = 0.0, rel_tol: float = 1e-9) -> bool:
    """True when `got` is a real number within the tolerances of `want`."""
    if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isfinite(got):
        return False
    return math.isclose(got, want, rel_tol=rel_tol, abs_tol=abs_tol)


def rng(seed: int, salt: str) -> random.Random:
    """The random stream the probe and the judge both draw a check's inputs from."""
    return random.Random(f"{seed}:{salt}")


def tensor_json(t: Any) -> dict:
    """A tensor as JSON data: {"shape": [...], "values": [...]} (float values, row-major)."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    return {"shape": list(t.shape), "values": t.detach().cpu().double().flatten().tolist()}


def tensor_mismatch(seen: Any, want: Any, atol: float = 0.0) -> str | None:
    """None when the JSON tensor `seen` has `want`'s shape and values (within `atol`), else what differs."""
    import torch

    shape = list(want.shape)
    if not isinstance(seen, dict) or seen.get("shape") != shape:
        got = seen.get("shape") if isinstance(seen, dict) else type(seen).__name__
        return f"shape {got}, want {shape}"
    values = torch.tensor(seen["values"], dtype=torch.float64)
    if values.numel() != want.numel():
        return f"{values.numel()} values, want {want.numel()}"
    err = (values - want.detach().double().flatten()).abs().max().item() if want.numel() else 0.0
    return None if err <= atol else f"values differ by up to {err:.3g}"
