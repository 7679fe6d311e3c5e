"""The grading kit: what a check is (`Check`, `Exercise`), how checks are found, probed and judged, and the
helpers every exercise's checks (`labkit/grading/checks/<exercise id>.py`) build their cases with.

A check is two halves that never run in the same process during grading:
    probe(namespace, seed)      runs beside the student's code (the fresh answers process, or the kernel for
                                check()): calls the answers on inputs drawn from `seed` and returns plain
                                JSON data (numbers, lists, strings). It decides nothing.
    judge(observation, seed)    runs in the grader, which never executes student code: rebuilds the same
                                inputs from `seed`, computes the reference with the pristine labkit, and
                                returns (fraction of the points earned in [0, 1], feedback sentence).
Whatever the student's code does to its own process can only change the observation, and an observation
earns points only if it matches a reference the student's process never saw.

A check names the answers it calls (`answers`, for the integrity rule: see `labkit.grading.integrity`), its
time limit (`limit_s`: the grader runs each probe in a process of its own and stops it there) and, when
several probes share one expensive run (a launch of ranks), a `group`: a group's probes run one after the
other in one process, under the largest of their limits. Judges put the edge cases an exercise is about
first, then cases drawn from the seed, so that a common wrong answer never passes by luck.

Every seed's cases exercise the same conditions (rows not a multiple of the ranks, one rank short of rows,
an exact multiple, one rank, a world size that does not divide, ...): a drawn case is drawn within the
condition of its place in the list (`draw_where`), only its sizes and values differ. So a mistake that shows
under one condition costs every student the same points, whichever cases their seed drew.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import math
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labkit.grading import integrity

_ID = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
CHECKS_PACKAGE = "labkit.grading.checks"  # one module per exercise id, each defining EXERCISE
CHECK_MODULES = "ex*.py"  # the grader's check modules in that package (the student release leaves them out)
DEFAULT_LIMIT_S = 30.0  # a probe that calls plain functions; one that launches ranks says more
ERROR_CHARS = 600  # of a probe's error, in the feedback
_LAUNCH_MARGIN_S = (
    10.0  # a launch inside a probe stops this long before its limit (its ranks take seconds to stop)
)
_deadline: list[
    float
] = []  # monotonic time by which the running probe must finish (set by the answers process)


class MissingAnswer(LookupError):
    """A name the answer cells should define is not there (the cell raised, or defines another name)."""


class Diagnosis(Exception):
    """A probe's failure already said in the student's terms: the feedback shows the message alone."""


class TimedOut(Diagnosis):
    """A probe's own run (a launch of ranks) ran past its time limit: the report counts it as a limit hit."""


@dataclass(frozen=True)
class Check:
    """One graded question: `points` earned in proportion to the fraction `judge` returns.

    `answers`: the names the probe calls; `limit_s`: seconds its probe may run (wall clock); `group`: checks
    of one group share one process and one run (see the module docstring)."""

    name: str
    points: int
    probe: Callable[[dict, int], Any]
    judge: Callable[[Any, int], tuple[float, str]]
    answers: tuple[str, ...] = ()
    limit_s: float = DEFAULT_LIMIT_S
    group: str = ""


@dataclass(frozen=True)
class Exercise:
    """An exercise's checks. `id` is the notebooks' `metadata.labkit.exercise`.

    `forbidden`: dotted prefixes of the labkit code that implements what the answers must write (an answer
    cell that uses one earns nothing for the checks of the names it defines); `allowed`: exact dotted names
    under those prefixes the exercise hands the student (e.g. a helper its set-up cell imports for them)."""

    id: str
    title: str
    checks: tuple[Check, ...]

    @property
    def forbidden(self) -> tuple[str, ...]:
        return integrity.RULES.get(self.id, ((), ()))[0]

    @property
    def allowed(self) -> tuple[str, ...]:
        return integrity.RULES.get(self.id, ((), ()))[1]

    @property
    def max_score(self) -> int:
        return sum(c.points for c in self.checks)

    def groups(self) -> list[tuple[Check, ...]]:
        """The checks as the answers process runs them: one process per group (an ungrouped check alone)."""
        order: dict[str, list[Check]] = {}
        for i, check in enumerate(self.checks):
            order.setdefault(check.group or f"#{i}", []).append(check)
        return [tuple(checks) for checks in order.values()]


def group_limit_s(checks: Sequence[Check], override_s: float | None = None) -> float:
    """Seconds one group's process may run: the largest of its checks' limits, or `override_s` when given."""
    return float(override_s) if override_s is not None else max(c.limit_s for c in checks)


def submission_seed(class_seed: int, exercise_id: str, student: str) -> int:
    """The seed of one submission's cases: a hash of the class seed, the exercise and the student (31 bits).

    The same three always give the same cases, so a re-grade reproduces the grade; two students get
    different random cases (the fixed edge cases are everyone's)."""
    digest = hashlib.sha256(f"{int(class_seed)}:{exercise_id}:{student}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def set_deadline(seconds: float | None) -> None:
    """Start (or clear) the running probe's time limit: `launch_timeout` keeps launches inside it."""
    _deadline[:] = [] if seconds is None else [time.monotonic() + seconds]


def launch_timeout(default_s: float) -> float:
    """The `timeout` for a `labkit.launch` inside a probe: `default_s`, or less, so that the launch's own
    account of what each rank was doing arrives before the probe's process is stopped."""
    if not _deadline:
        return default_s
    return max(1.0, min(default_s, _deadline[0] - time.monotonic() - _LAUNCH_MARGIN_S))


class SharedLaunch:
    """One launch of ranks that several probes of a group read: run again only for other answers (compared
    by identity) or another seed (by value); a failure is kept too, so every probe that shares it reports
    the same."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._outcome: Any = None

    def result(self, key: tuple, launch: Callable[[], Any]) -> Any:
        """`launch()`'s result for `key` (the answers and the seed), launched at most once per key."""
        if not self._holds(key):
            try:
                self._outcome = launch()
            except Exception as e:  # noqa: BLE001 (kept, so the other probes report the same failure)
                self._outcome = e
            self._key = key
        if isinstance(self._outcome, Exception):
            raise self._outcome
        return self._outcome

    def _holds(self, key: tuple) -> bool:
        """Whether the kept outcome is `key`'s: the same answers (the same objects) and equal other values."""
        if self._key is None or len(self._key) != len(key):
            return False
        return all(a is b or (not callable(a) and a == b) for a, b in zip(self._key, key, strict=True))


STAND_IN_MODULE = "labkit_reference_stand_ins"  # the stand-ins' __name__: not labkit's
_ABSENT = object()


def stand_ins(path: str | Path, names: Sequence[str]) -> dict[str, Callable]:
    """{name: function} of the grader's reference file `path`, compiled again under `STAND_IN_MODULE` and a
    file name outside labkit: what a probe puts in place of an answer that raised, so that the answers built
    on it are still judged. The integrity watch counts labkit code an answer cell calls as that answer's use;
    an answer that calls a stand-in in place of its own crashed helper has used no grader code. Such a file
    calls no labkit function an exercise forbids."""
    namespace: dict = {"__name__": STAND_IN_MODULE}
    source = Path(path).read_text(encoding="utf-8")
    code = compile(source, f"<reference {Path(path).stem}>", "exec")
    exec(code, namespace)  # noqa: S102 (the grader's own file)
    return {name: namespace[name] for name in names}


@contextlib.contextmanager
def standing_in(fns: Iterable[Callable], replacements: Mapping[str, Callable]) -> Iterator[None]:
    """While entered, each name of `replacements` is bound to its stand-in in the globals of `fns` (answers,
    which call one another by name; ranks forked inside see it too); restored on exit."""
    spaces = {id(g): g for g in (getattr(fn, "__globals__", None) for fn in fns) if isinstance(g, dict)}
    saved = [(space, name, space.get(name, _ABSENT)) for space in spaces.values() for name in replacements]
    try:
        for space, name, _ in saved:
            space[name] = replacements[name]
        yield
    finally:
        for space, name, value in saved:
            if value is _ABSENT:
                space.pop(name, None)
            else:
                space[name] = value


def crashed_answers(namespace: dict, calls: Mapping[str, Callable[[Callable], Any]]) -> dict[str, str]:
    """{name: what it raised} for each answer of `calls` ({name: how to call it on a plain case}) that is
    missing or raises when so called: the helpers a probe stands a reference in for."""
    crashed = {}
    for name, call in calls.items():
        try:
            call(answer(namespace, name))
        except Exception as e:  # noqa: BLE001 (the student's answer: any failure is its own)
            crashed[name] = probe_error(e)
    return crashed


def stood_in(feedback: str, crashed: Iterable[str], why: str = "this answer is judged on its own") -> str:
    """`feedback` with the note that the reference of each `crashed` answer stood in for it (`why` that is
    fair); `feedback` alone when none did."""
    names = ", ".join(crashed)
    if not names:
        return feedback
    return f"{feedback} (judged with the reference {names} in place of yours, which could not run: {why})"


def probe_beside(
    name: str,
    helpers: Mapping[str, Callable[[Callable], Any]],
    reference: Mapping[str, Callable],
    probe: Callable[[Callable, int], Any],
) -> Callable[[dict, int], dict]:
    """A probe of the answer `name` built on the helper answers of `helpers` ({helper: how to call it on a
    plain case}): `probe(answer, seed)`, with `reference`'s stand-in for each helper that raises or is
    missing, as {"value": ..., "stand_ins": {helper: what it raised}} (`judge_beside` reads it). A crash in
    a helper then costs the helper's own check, not this one."""

    def probed(namespace: dict, seed: int) -> dict:
        fn = answer(namespace, name)
        crashed = crashed_answers(namespace, helpers)
        with standing_in([fn], {helper: reference[helper] for helper in crashed}):
            return {"value": probe(fn, seed), "stand_ins": crashed}

    return probed


def judge_beside(judge: Callable[[Any, int], tuple[float, str]]) -> Callable[[Any, int], tuple[float, str]]:
    """`judge` of a `probe_beside` observation, its feedback saying which references stood in."""

    def judged(seen: dict, seed: int) -> tuple[float, str]:
        fraction, feedback = judge(seen["value"], seed)
        return fraction, stood_in(feedback, seen["stand_ins"])

    return judged


def has_grader_checks() -> bool:
    """Whether this labkit holds the grader's checks (CHECK_MODULES of CHECKS_PACKAGE); the student release
    does not."""
    checks = importlib.import_module(CHECKS_PACKAGE)
    return any(Path(checks.__file__).parent.glob(CHECK_MODULES))


def load(exercise_id: str) -> Exercise:
    """The `EXERCISE` of module `labkit.grading.checks.<exercise_id>`; LookupError when there is none."""
    if not isinstance(exercise_id, str) or not _ID.match(exercise_id):
        raise LookupError(f"{exercise_id!r} is not an exercise id (lower-case letters, digits and _)")
    try:
        module = importlib.import_module(f"{CHECKS_PACKAGE}.{exercise_id}")
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


def probe_error(e: BaseException) -> str:
    """What a probe's exception says in the feedback: its first line, with its type unless it is a Diagnosis;
    a first line that ends in a colon keeps the lines it introduces (a timeout's rank by rank), joined."""
    text = str(e).strip()
    if not isinstance(e, Diagnosis):
        text = f"{type(e).__name__}: {text}".strip().rstrip(":")
    lines = [line.strip() for line in text.splitlines() if line.strip()] or [type(e).__name__]
    first = lines[0]
    if first.endswith(":") and len(lines) > 1:
        first = f"{first} {'; '.join(lines[1:])}"
    return first[:ERROR_CHARS]


def probe_one(check: Check, namespace: dict, seed: int) -> dict:
    """{"value": observation} or {"error": what went wrong}, for one check's probe."""
    try:
        return {"value": to_json(check.probe(namespace, seed))}
    except Exception as e:  # noqa: BLE001 (a wrong answer may fail in any way; it only loses its points)
        return {"error": probe_error(e), **({"limit": "time"} if isinstance(e, TimedOut) else {})}


def probe_all(exercise: Exercise, namespace: dict, seed: int) -> dict[str, dict]:
    """Run every probe here, one after the other: {check name: {"value": ...} or {"error": "..."}}."""
    return {check.name: probe_one(check, namespace, seed) for check in exercise.checks}


def judge_all(
    exercise: Exercise,
    observations: dict,
    seed: int,
    cell_errors: Sequence[str] = (),
    flags: dict[str, str] | None = None,
) -> list[dict]:
    """The report's check entries: each observation judged against its reference; points are rounded to 0.01.

    `cell_errors` (e.g. "cell answer-shard raised NotImplementedError") is added to the feedback of a
    check whose probe could not run, so the student sees why. `flags` ({check name: sentence}) are checks
    that earn nothing whatever their observation (the integrity rule); the sentence is their feedback.
    """
    entries = []
    for check in exercise.checks:
        seen = observations.get(check.name) if isinstance(observations, dict) else None
        if flags and check.name in flags:
            fraction, feedback = 0.0, flags[check.name]
        elif isinstance(seen, dict) and "value" in seen:
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


def draw_where(
    r: random.Random, draw: Callable[[random.Random], Any], condition: Callable[[Any], bool]
) -> Any:
    """A case `draw(r)` that meets `condition`: the condition a place in a check's list of cases exercises is
    fixed, only the case is drawn (drawn again until it meets it; ValueError when 10,000 draws never do)."""
    for _ in range(10_000):
        case = draw(r)
        if condition(case):
            return case
    raise ValueError("no drawn case meets the condition: widen the draw")


def one_rank_short(d0: int, n: int) -> bool:
    """Sharding `d0` rows on `n` ranks (ceil(d0/n) each) leaves exactly one rank short of rows: every rank
    holds real rows, the last fewer than the others (where padding at the wrong end, or none, shows)."""
    rows = -(-d0 // n)
    return (n - 1) * rows < d0 and d0 % rows != 0


def tensor_json(t: Any) -> dict:
    """A tensor as JSON data: {"shape": [...], "values": [...]} (float values, row-major)."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    return {"shape": list(t.shape), "values": t.detach().cpu().double().flatten().tolist()}


# What the right values in another order usually mean, in each exercise's words (`tensor_mismatch`).
PACKING_ORDER = (
    "the right values in the wrong order (packed parameter by parameter where rank by rank is wanted, or the "
    "chunks of the wrong ranks?)"
)
PADDING_ORDER = (
    "the right rows in the wrong order (the zero padding rows go at the end of the shard, after this rank's "
    "real rows, which keep their order)"
)
RANK_ORDER = "the right rows in the wrong order (the shards concatenated in rank order, rank 0's rows first)"


def tensor_mismatch(seen: Any, want: Any, atol: float = 0.0, order_hint: str = PACKING_ORDER) -> str | None:
    """None when the JSON tensor `seen` has `want`'s shape and values (within `atol`), else what differs.

    `order_hint`: what the right values in another order (not a transpose) usually mean in this exercise."""
    import torch

    shape = list(want.shape)
    if not isinstance(seen, dict) or seen.get("shape") != shape:
        got = seen.get("shape") if isinstance(seen, dict) else type(seen).__name__
        return f"shape {got}, want {shape}{_rows_hint(got, shape)}"
    values = torch.tensor(seen["values"], dtype=torch.float64)
    if values.numel() != want.numel():
        return f"{values.numel()} values, want {want.numel()}"
    expected = want.detach().double().flatten()
    err = (values - expected).abs().max().item() if want.numel() else 0.0
    return (
        None
        if err <= atol
        else f"values differ by up to {err:.3g}{_values_hint(values, expected, shape, atol, order_hint)}"
    )


def _rows_hint(got: Any, want: list[int]) -> str:
    """What a dim-0 difference of one tensor's shape usually means in sharding (padding rows)."""
    if not (isinstance(got, list) and len(got) == len(want) >= 1 and got[1:] == want[1:]):
        return ""
    extra = got[0] - want[0]
    if extra > 0:
        return f": {extra} row(s) too many (drop the padding rows after gathering, or shard with ceil(d0 / n) rows)"
    return f": {-extra} row(s) too few (pad dim 0 to a multiple of n: each shard has ceil(d0 / n) rows)"


def _values_hint(values: Any, expected: Any, shape: list[int], atol: float, order_hint: str) -> str:
    """The usual mistakes behind wrong values of the right shape: a constant factor (a mean taken twice or
    not at all), the right values in another order (a transposed or parameter-major layout)."""
    import torch

    tol = max(atol, 1e-6 * expected.abs().max().item())
    if expected.abs().max() > 0:
        ratio = (values @ expected / (expected @ expected)).item()
        if abs(ratio - 1) > 1e-3 and torch.allclose(values, ratio * expected, atol=tol, rtol=1e-4):
            k = ratio if ratio >= 1 else 1 / ratio
            size = "large" if ratio > 1 else "small"
            factor = f"{round(k)} times" if abs(k - round(k)) < 1e-3 else f"{k:.3g} times"
            return (
                f": every value is {factor} too {size} (a factor of the ranks: the sum where the mean is "
                "wanted, or a division by n twice?)"
            )
    if torch.allclose(values.sort().values, expected.sort().values, atol=tol, rtol=1e-6):
        if len(shape) == 2 and torch.allclose(
            values.view(shape[1], shape[0]).T.flatten(), expected, atol=tol
        ):
            return ": the right values, transposed"
        return f": {order_hint}"
    return ""
