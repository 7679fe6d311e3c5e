"""Exercise 06: an HSDP mesh (shard groups x replicate groups) and its traffic, against `labkit.budget`."""

from __future__ import annotations

from labkit import budget
from labkit.grading.kit import Check, Exercise, answer, close, draw_where, rng, tally
from labkit.grading.public import bytes_said, hsdp_traffic_by_collective
from labkit.names import HSDP, STEP_KINDS


def _oblong(case: tuple[float, int, int]) -> bool:
    """Several shard groups, and not as many as a group's ranks: the two axes of the mesh differ in size."""
    _, n, g = case
    return g < n and n != g * g


def _cases(seed: int) -> list[tuple[float, int, int]]:
    """(params, world_size, group_size) with group_size dividing world_size: the fact sheet's, then two drawn
    `_oblong` meshes."""
    r = rng(seed, "mesh")

    def draw(r) -> tuple[float, int, int]:
        return float(r.randrange(1, 100) * 1e9), r.choice([4, 16, 64, 256]), r.choice([2, 4, 8])

    return [(30e9, 512, 8), *(draw_where(r, draw, _oblong) for _ in range(2))]


def reference_groups(world_size: int, group_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Rows and columns of a (world_size / group_size, group_size) mesh of ranks, as DeviceMesh lays it out."""
    rows = [list(range(i, i + group_size)) for i in range(0, world_size, group_size)]
    return rows, [list(column) for column in zip(*rows, strict=True)]


def _groups_probe(ns: dict, seed: int) -> list:
    fn = answer(ns, "hsdp_groups")
    out = []
    for _, n, g in _cases(seed):
        shard, replicate = fn(n, g)
        out.append(
            [
                [sorted(int(r) for r in grp) for grp in shard],
                [sorted(int(r) for r in grp) for grp in replicate],
            ]
        )
    return out


def _groups_judge(got: list, seed: int) -> tuple[float, str]:
    cases = []
    for (_, n, g), (shard, replicate) in zip(_cases(seed), got, strict=True):
        want_shard, want_replicate = reference_groups(n, g)
        for kind, seen, want in (("shard", shard, want_shard), ("replicate", replicate, want_replicate)):
            ok = sorted(seen) == sorted(want)
            cases.append(
                (ok, f"world_size={n}, group_size={g}: {kind} groups start {seen[:2]}, want {want[:2]}...")
            )
    return tally(cases)


def _traffic_probe(ns: dict, seed: int) -> list:
    fn = answer(ns, "hsdp_traffic")
    out = []
    for p, n, g in _cases(seed):
        traffic = fn(p, n, g)
        out.append({k: float(traffic[k]) for k in STEP_KINDS})
    return out


def _traffic_judge(got: list, seed: int) -> tuple[float, str]:
    cases = []
    for (p, n, g), seen in zip(_cases(seed), got, strict=True):
        for key, want in hsdp_traffic_by_collective(p, n, g).items():
            value = seen.get(key)
            # budget pads the flat buffer to a multiple of the group: a few bytes per collective at most.
            cases.append(
                (
                    close(value, want, abs_tol=64),
                    f"params={p:g}, n={n}, g={g}, {key}: {bytes_said(value, want)}, want {want:,} B",
                )
            )
    return tally(cases)


def _crosses_probe(ns: dict, seed: int) -> list:
    return sorted(str(c) for c in answer(ns, "crosses_groups"))


def _crosses_judge(got: list, seed: int) -> tuple[float, str]:
    p, n, g = _cases(seed)[0]
    terms = budget.plan(p, n, HSDP, group_size=g)["traffic_terms"]
    want = sorted({t["collective"] for t in terms if t["group_size"] != g})
    if got == want:
        return 1.0, f"only {want[0]} rings join ranks of different shard groups (one rank per group)"
    return 0.0, f"{got}; the collectives whose ring leaves a shard group are {want}"


def _state_probe(ns: dict, seed: int) -> list:
    fn = answer(ns, "hsdp_state_bytes_per_rank")
    return [float(fn(p, n, g)) for p, n, g in _cases(seed)]


def _state_judge(got: list, seed: int) -> tuple[float, str]:
    cases = []
    for (p, n, g), value in zip(_cases(seed), got, strict=True):
        want = budget.plan(p, n, HSDP, group_size=g)["state_bytes_per_rank"]
        cases.append(
            (close(value, want, abs_tol=16), f"params={p:g}, n={n}, g={g}: {value:g} B, want {want:g} B")
        )
    return tally(cases)


EXERCISE = Exercise(
    "ex06_hsdp",
    "An HSDP mesh and its traffic",
    (
        Check(
            "shard groups and replicate groups of the mesh",
            2,
            _groups_probe,
            _groups_judge,
            answers=("hsdp_groups",),
        ),
        Check(
            "wire bytes per rank per step, per collective (vs labkit.budget)",
            3,
            _traffic_probe,
            _traffic_judge,
            answers=("hsdp_traffic",),
        ),
        Check(
            "which collectives cross shard groups",
            1,
            _crosses_probe,
            _crosses_judge,
            answers=("crosses_groups",),
        ),
        Check(
            "state bytes per rank",
            1,
            _state_probe,
            _state_judge,
            answers=("hsdp_state_bytes_per_rank",),
        ),
    ),
)
