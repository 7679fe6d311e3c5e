"""Exercise 02: shard a parameter on dim 0 (uneven sizes, zero padding) and rebuild it with an all-gather.

Every grade includes the three edge cases of sharding (fewer rows than ranks, rows not a multiple of the
ranks, rows an exact multiple: where `d0 // n + 1` and `d0 // n` part from `ceil(d0 / n)`), then cases
drawn from the seed, each within a fixed condition (`_DRAWN`): every student's cases exercise the same
conditions, so a mistake costs everyone the same points."""

from __future__ import annotations

from labkit.grading import ranks
from labkit.grading.kit import (
    PADDING_ORDER,
    RANK_ORDER,
    Check,
    Exercise,
    answer,
    draw_where,
    launch_timeout,
    one_rank_short,
    rng,
    tally,
    tensor_json,
    tensor_mismatch,
)

GATHER_RANKS = 3
LAUNCH_TIMEOUT_S = 60.0
GATHER_LIMIT_S = 75.0


def _exact(d0: int, n: int) -> bool:
    return d0 % n == 0


# The drawn cases, in order: (dims, condition on (d0, n), which of the check's world sizes).
_DRAWN = ((2, one_rank_short, -1), (2, _exact, 1), (3, one_rank_short, 0))


def _cases(seed: int, salt: str, world_sizes: tuple[int, ...]) -> list[tuple[tuple[int, ...], int]]:
    """(shape, world_size) pairs: the edge cases first (d0 % n != 0, d0 < n, d0 = n * k, 1-D), then one drawn
    case per condition of `_DRAWN` (its sizes from the seed)."""
    r = rng(seed, salt)
    n0 = world_sizes[0]
    fixed = [((7, 4), n0), ((2, 3), n0), ((2 * n0, 2), n0), ((5,), n0)]
    if 4 in world_sizes:
        fixed += [((8,), 4), ((1, 2), 4)]
    drawn = []
    for dims, condition, which in _DRAWN:
        n = world_sizes[which % len(world_sizes)]
        d0 = draw_where(r, lambda r: r.randrange(1, 14), lambda d0, n=n, c=condition: c(d0, n))
        drawn.append(((d0, *(r.randrange(2, 6) for _ in range(dims - 1))), n))
    return fixed + drawn


def _full(seed: int, i: int, shape: tuple[int, ...]):
    import torch

    return torch.randn(shape, generator=torch.Generator().manual_seed(seed * 1009 + i))


def _shard_probe(ns: dict, seed: int) -> list:
    fn = answer(ns, "shard_rows")
    out = []
    for i, (shape, n) in enumerate(_cases(seed, "shard", (3, 2, 4))):
        full = _full(seed, i, shape)
        out.append([tensor_json(fn(full.clone(), r, n)) for r in range(n)])
    return out


def _shard_judge(got: list, seed: int) -> tuple[float, str]:
    from labkit.zero.sharding import shard_dim0

    cases = []
    for i, ((shape, n), shards) in enumerate(zip(_cases(seed, "shard", (3, 2, 4)), got, strict=True)):
        full = _full(seed, i, shape)
        problems = [
            f"rank {r}: {why}"
            for r in range(n)
            if (
                why := tensor_mismatch(
                    shards[r] if r < len(shards) else None, shard_dim0(full, r, n), order_hint=PADDING_ORDER
                )
            )
        ]
        cases.append((not problems, f"shape {list(shape)} on {n} ranks, {problems[0] if problems else ''}"))
    return tally(cases)


def _gather_rank(gather, cases: list, seed: int) -> list:
    """On each rank: take labkit's own shard of every case, rebuild it with the student's gather."""
    import torch.distributed as dist

    from labkit.zero.sharding import shard_dim0

    rank, n = dist.get_rank(), dist.get_world_size()
    out = []
    for i, (shape, _) in enumerate(cases):
        shard = shard_dim0(_full(seed, i, shape), rank, n)
        out.append(tensor_json(gather(shard, shape[0], n)))
    return out


def _gather_probe(ns: dict, seed: int) -> list:
    gather = answer(ns, "gather_full")
    cases = _cases(seed, "gather", (GATHER_RANKS,))
    return ranks.launch(
        _gather_rank, GATHER_RANKS, gather, cases, seed, timeout=launch_timeout(LAUNCH_TIMEOUT_S)
    )


def _gather_judge(got: list, seed: int) -> tuple[float, str]:
    cases = []
    for i, (shape, _) in enumerate(_cases(seed, "gather", (GATHER_RANKS,))):
        full = _full(seed, i, shape)
        problems = [
            f"rank {r}: {why}"
            for r in range(GATHER_RANKS)
            if (why := tensor_mismatch(got[r][i], full, order_hint=RANK_ORDER))
        ]
        cases.append((not problems, f"shape {list(shape)}, {problems[0] if problems else ''}"))
    return tally(cases)


EXERCISE = Exercise(
    "ex02_shard",
    "Shard a parameter on dim 0 and all-gather it back",
    (
        Check(
            "shard: this rank's rows, zero-padded to ceil(d0/n)",
            3,
            _shard_probe,
            _shard_judge,
            answers=("shard_rows",),
        ),
        Check(
            f"gather: the all-gather rebuilds the parameter on {GATHER_RANKS} ranks",
            3,
            _gather_probe,
            _gather_judge,
            answers=("gather_full",),
            limit_s=GATHER_LIMIT_S,
        ),
    ),
)
