"""Exercise 01: model-state bytes per rank for DDP and ZeRO-1/2/3, against `labkit.budget.plan`."""

from __future__ import annotations

from fractions import Fraction

from labkit import budget
from labkit.grading.kit import Check, Exercise, answer, close, draw_where, rng, tally
from labkit.names import DATA_PARALLEL, ZERO1, ZERO2, ZERO3

STRATEGIES = (DATA_PARALLEL, ZERO1, ZERO2, ZERO3)  # the four the fact sheet prices
# bf16 mixed precision: bytes per parameter of the replicated and of the sharded part, per strategy.
_SPLIT = {DATA_PARALLEL: (16, 0), ZERO1: (4, 12), ZERO2: (2, 14), ZERO3: (0, 16)}
_MAX_RANKS = 2**24
# The drawn state cases' world sizes, one each: one rank (nothing sharded), a few, many, not a power of two.
STATE_RANKS = (1, 8, 64, 1000)


def _state_cases(seed: int, strategy: str) -> list[tuple[float, int]]:
    """The fact sheet's case, then drawn parameter counts on each of STATE_RANKS."""
    r = rng(seed, f"state-{strategy}")
    return [(30e9, 256), *((float(r.randrange(1, 2000) * 10 ** r.randrange(6, 9)), n) for n in STATE_RANKS)]


def _state_check(strategy: str) -> Check:
    def probe(ns: dict, seed: int) -> list[float]:
        fn = answer(ns, "state_bytes_per_rank")
        return [float(fn(p, n, strategy)) for p, n in _state_cases(seed, strategy)]

    def judge(got: list, seed: int) -> tuple[float, str]:
        cases = []
        for (p, n), value in zip(_state_cases(seed, strategy), got, strict=True):
            want = budget.plan(p, n, strategy)["state_bytes_per_rank"]
            # plan pads each sharded term to a multiple of n elements: at most 16 B more than P x B / n.
            cases.append(
                (
                    close(value, want, abs_tol=16),
                    f"params={p:g}, world_size={n}: {value:g} B, want {want:g} B",
                )
            )
        return tally(cases)

    return Check(f"state bytes per rank: {strategy}", 1, probe, judge, answers=("state_bytes_per_rank",))


def _needs_several_ranks(case: tuple[float, float, str]) -> bool:
    """The state fits, on more than one rank (the answer is a world size, not 1 nor None)."""
    fewest = _fewest_ranks_exact(*case)
    return fewest is not None and fewest > 1 and _fewest_ranks_plan(*case) is not None


def _fit_cases(seed: int) -> list[tuple[float, float, str]]:
    """Fixed: fits on one rank, never fits, needs several; then a ZeRO-3 and a ZeRO-1 case drawn that need
    several ranks."""
    r = rng(seed, "fit")
    fixed = [(7e9, 80e9, ZERO3), (7e9, 80e9, DATA_PARALLEL), (1e9, 80e9, DATA_PARALLEL), (30e9, 80e9, ZERO2)]
    drawn = [
        draw_where(
            r,
            lambda r: (float(r.randrange(1, 200) * 1e9), float(r.choice([24, 40, 80, 141]) * 1e9), ZERO3),
            _needs_several_ranks,
        ),
        draw_where(r, lambda r: (float(r.randrange(1, 100) * 1e9), 80e9, ZERO1), _needs_several_ranks),
    ]
    return fixed + drawn


def _fewest_ranks_plan(params: float, gpu_bytes: float, strategy: str) -> int | None:
    """Smallest world size whose `plan` state fits in `gpu_bytes`, or None when none up to 2**24 does."""

    def fits(n: int) -> bool:
        return budget.plan(params, n, strategy)["state_bytes_per_rank"] <= gpu_bytes

    if not fits(_MAX_RANKS):
        return None
    lo, hi = 1, _MAX_RANKS
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return lo


def _fewest_ranks_exact(params: float, gpu_bytes: float, strategy: str) -> int | None:
    """The same without padding: replicated + sharded / n <= gpu_bytes, in exact arithmetic."""
    replicated, sharded = (Fraction(b) * Fraction(params) for b in _SPLIT[strategy])
    room = Fraction(gpu_bytes) - replicated
    if room < 0 or (room == 0 and sharded > 0):
        return None
    return max(1, -(-sharded // room)) if sharded else 1


def _fit_probe(ns: dict, seed: int) -> list:
    fn = answer(ns, "min_ranks_to_fit")
    out = []
    for case in _fit_cases(seed):
        value = fn(*case)
        out.append(None if value is None else int(value))
    return out


def _fit_judge(got: list, seed: int) -> tuple[float, str]:
    cases = []
    for (p, gpu, s), value in zip(_fit_cases(seed), got, strict=True):
        accepted = {_fewest_ranks_plan(p, gpu, s), _fewest_ranks_exact(p, gpu, s)}
        want = " or ".join(sorted(str(a) for a in accepted))
        cases.append((value in accepted, f"params={p:g}, {gpu:g} B per GPU, {s}: {value}, want {want}"))
    return tally(cases)


EXERCISE = Exercise(
    "ex01_memory",
    "Memory arithmetic per strategy",
    (
        *(_state_check(s) for s in STRATEGIES),
        Check("fewest ranks to fit the state", 2, _fit_probe, _fit_judge, answers=("min_ranks_to_fit",)),
    ),
)
