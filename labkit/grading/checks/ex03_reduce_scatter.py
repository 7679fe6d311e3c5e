"""Exercise 03: the scratch engine's gradient reduce-scatter: a flat buffer, then a unit's packed buffer.

References: the mean gradient is what an all-reduce of the ranks' gradients divided by n gives (computed
here as the sum it is), and the packed layout is `ShardedUnit.start_reduce_scatter`'s: rank-major, each
parameter padded on dim 0 so that rank r's rows of every parameter are one contiguous chunk.
"""

from __future__ import annotations

from labkit.grading import ranks
from labkit.grading.kit import (
    Check,
    Diagnosis,
    Exercise,
    SharedLaunch,
    answer,
    draw_where,
    launch_timeout,
    one_rank_short,
    probe_error,
    rng,
    tally,
    tensor_json,
    tensor_mismatch,
)
from labkit.names import ALL_REDUCE, REDUCE_SCATTER

RANKS = 3
LAUNCH_TIMEOUT_S = 60.0
RANKS_LIMIT_S = 75.0  # the three checks that share one launch
BOTH = ("reduce_scatter_mean", "pack_grads")
ATOL = 1e-5


def _uneven(rows: int) -> bool:
    """Exactly one rank short of rows (or elements) on RANKS ranks: its shard is padded, no rank is empty."""
    return one_rank_short(rows, RANKS)


def _flat_numels(seed: int) -> list[int]:
    """Uneven (10), an exact multiple of the ranks (9), fewer elements than ranks (2), then one drawn uneven."""
    r = rng(seed, "flat")
    return [10, 9, 2, draw_where(r, lambda r: r.randrange(4, 15), _uneven)]


def _shapes(seed: int) -> list[list[tuple[int, ...]]]:
    """Uneven and fewer rows than ranks; exact multiples; then a drawn pair, both uneven (a 2-D and a 1-D)."""
    r = rng(seed, "pack")
    fixed = [[(5, 3), (7,), (2, 4)], [(6, 2), (3,)]]
    rows = [draw_where(r, lambda r: r.randrange(4, 9), _uneven) for _ in range(2)]
    return [*fixed, [(rows[0], r.randrange(2, 4)), (rows[1],)]]


def _grad(seed: int, rank: int, key: int, shape: tuple[int, ...]):
    import torch

    return torch.randn(shape, generator=torch.Generator().manual_seed(seed * 7919 + rank * 1000 + key))


def _mean(seed: int, key: int, shape: tuple[int, ...]):
    return sum(_grad(seed, r, key, shape) for r in range(RANKS)) / RANKS


def _reference_pack(grads: list, n: int):
    """The send buffer `ShardedUnit.start_reduce_scatter` builds: (n, chunk) flattened."""
    import torch

    from labkit.zero.sharding import dim0_rows

    columns = []
    for g in grads:
        _, padded_rows = dim0_rows(g.shape[0], n)
        padded = g.new_zeros((padded_rows, *g.shape[1:]))
        padded[: g.shape[0]] = g
        columns.append(padded.reshape(n, -1))
    return torch.cat(columns, dim=1).flatten()


def _reference_shard(full, rank: int, n: int):
    import torch

    chunk = -(-full.numel() // n)
    padded = torch.zeros(chunk * n, dtype=full.dtype)
    padded[: full.numel()] = full.flatten()
    return padded[rank * chunk : (rank + 1) * chunk]


def _packed_buffers(pack_grads, seed: int) -> list | str:
    """On each rank: its send buffer of every packed case, or what `pack_grads` raised (on this rank or
    another: the ranks agree by an all-reduce, so that all of them skip the packed reduce-scatters together
    and a crash in `pack_grads` costs only the checks that need it)."""
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    try:
        buffers, why = [], ""
        for s, shapes in enumerate(_shapes(seed)):
            grads = [_grad(seed, rank, 100 + 10 * s + k, shape) for k, shape in enumerate(shapes)]
            buffers.append(pack_grads(grads, n))
    except Exception as e:  # noqa: BLE001 (the student's pack_grads: any failure is its own)
        buffers, why = [], probe_error(e)
    failed = torch.tensor([1 if why else 0])
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    return (why or "pack_grads raised on another rank") if failed.item() else buffers


def _rank(reduce_scatter_mean, pack_grads, seed: int) -> dict:
    """On each rank: the packed buffers, then the flat cases (recording which collectives the answer calls),
    then the packed ones (or, when pack_grads raised, what it raised)."""
    import torch.distributed as dist

    from labkit.collectives import COLLECTIVES, Patch

    rank, n = dist.get_rank(), dist.get_world_size()
    buffers = _packed_buffers(pack_grads, seed)
    calls: list[str] = []

    def watch(name, fn):
        def watched(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return watched

    with Patch(COLLECTIVES, watch, outermost=True):  # each call the answer makes, once
        flat = [
            tensor_json(reduce_scatter_mean(_grad(seed, rank, k, (m,)), n))
            for k, m in enumerate(_flat_numels(seed))
        ]
    packed = (
        buffers if isinstance(buffers, str) else [tensor_json(reduce_scatter_mean(b, n)) for b in buffers]
    )
    return {"flat": flat, "calls": calls, "packed": packed}


_shared = SharedLaunch()


def _launch(ns: dict, seed: int) -> list[dict]:
    """One launch serves the three probes that need ranks: the result (or failure) is kept for the same answers."""
    fns = answer(ns, "reduce_scatter_mean"), answer(ns, "pack_grads")
    return _shared.result(
        (*fns, seed), lambda: ranks.launch(_rank, RANKS, *fns, seed, timeout=launch_timeout(LAUNCH_TIMEOUT_S))
    )


def _flat_probe(ns: dict, seed: int) -> list:
    return [rank["flat"] for rank in _launch(ns, seed)]


def _flat_judge(got: list, seed: int) -> tuple[float, str]:
    cases = []
    for k, m in enumerate(_flat_numels(seed)):
        mean = _mean(seed, k, (m,))
        problems = [
            f"rank {r}: {why}"
            for r in range(RANKS)
            if (why := tensor_mismatch(got[r][k], _reference_shard(mean, r, RANKS), ATOL))
        ]
        cases.append((not problems, f"{m} elements on {RANKS} ranks, {problems[0] if problems else ''}"))
    return tally(cases)


def _calls_probe(ns: dict, seed: int) -> list:
    return [rank["calls"] for rank in _launch(ns, seed)]


def _calls_judge(got: list, seed: int) -> tuple[float, str]:
    from labkit.collectives import COLLECTIVES

    calls = [str(c) for c in got[0]]
    kinds = [COLLECTIVES[c].kind if c in COLLECTIVES else c for c in calls]
    scatters = [c for c, kind in zip(calls, kinds, strict=True) if kind == REDUCE_SCATTER]
    if len(scatters) == len(_flat_numels(seed)) and ALL_REDUCE not in kinds:
        return 1.0, f"one {scatters[0]} per buffer and no all-reduce: (n-1)/n of the buffer on the wire"
    return 0.0, (
        f"saw {calls or 'no torch.distributed collective'}; want one dist.reduce_scatter_single per buffer "
        "(an all-reduce moves twice the bytes and leaves every rank the whole sum)"
    )


def _pack_probe(ns: dict, seed: int) -> list:
    fn = answer(ns, "pack_grads")
    out = []
    for s, shapes in enumerate(_shapes(seed)):
        grads = [_grad(seed, 0, 100 + 10 * s + k, shape) for k, shape in enumerate(shapes)]
        out.append(tensor_json(fn(grads, RANKS).reshape(-1)))
    return out


def _pack_judge(got: list, seed: int) -> tuple[float, str]:
    cases = []
    for s, shapes in enumerate(_shapes(seed)):
        grads = [_grad(seed, 0, 100 + 10 * s + k, shape) for k, shape in enumerate(shapes)]
        why = tensor_mismatch(got[s], _reference_pack(grads, RANKS))
        cases.append((why is None, f"shapes {[list(x) for x in shapes]}: {why}"))
    return tally(cases)


def _packed_probe(ns: dict, seed: int) -> list:
    packed = [rank["packed"] for rank in _launch(ns, seed)]
    raised = next((p for p in packed if isinstance(p, str)), None)
    if raised is not None:
        raise Diagnosis(f"your pack_grads raised {raised} (the flat-buffer checks were judged without it)")
    return packed


def _packed_judge(got: list, seed: int) -> tuple[float, str]:
    import torch

    from labkit.zero.sharding import shard_dim0

    cases = []
    for s, shapes in enumerate(_shapes(seed)):
        means = [_mean(seed, 100 + 10 * s + k, shape) for k, shape in enumerate(shapes)]
        problems = []
        for r in range(RANKS):
            want = torch.cat([shard_dim0(m, r, RANKS).flatten() for m in means])
            if why := tensor_mismatch(got[r][s], want, ATOL):
                problems.append(f"rank {r}: {why}")
        cases.append((not problems, f"shapes {[list(x) for x in shapes]}, {problems[0] if problems else ''}"))
    return tally(cases)


EXERCISE = Exercise(
    "ex03_reduce_scatter",
    "The gradient reduce-scatter hook",
    (
        Check(
            "flat buffer: this rank's shard of the mean gradient (vs an all-reduce)",
            3,
            _flat_probe,
            _flat_judge,
            answers=BOTH,
            limit_s=RANKS_LIMIT_S,
            group="ranks",
        ),
        Check(
            "flat buffer: one reduce-scatter per buffer, no all-reduce",
            1,
            _calls_probe,
            _calls_judge,
            answers=BOTH,
            limit_s=RANKS_LIMIT_S,
            group="ranks",
        ),
        Check(
            "pack: the send buffer laid out as ShardedUnit packs it",
            2,
            _pack_probe,
            _pack_judge,
            answers=("pack_grads",),
        ),
        Check(
            "pack + reduce-scatter: each rank gets its rows of every parameter",
            2,
            _packed_probe,
            _packed_judge,
            answers=BOTH,
            limit_s=RANKS_LIMIT_S,
            group="ranks",
        ),
    ),
)
