"""Exercise 09's checks, the same for the grade and for the student release's check(): only the cases differ.

Part 1 reads the flight-recorder entries of a hung run (`labkit.lessons.uneven.Hang`): `diagnose(entries)`
names the culprit rank and the sequence number where the ranks part (aligned by sequence number: a recorder
is a ring, so the ranks' lists may start at different numbers), the collective its peers wait in, and the
cause. Part 2 runs `train_step` on FSDP2 ranks with uneven rows, one rank without any
(`labkit.lessons.uneven.run_uneven`): every rank must issue the same collectives in the same order, each unit's
reduce-scatter among them (the hang gone), and the losses and first-step gradients must be `single`'s on the
same rows (`uneven.single_uneven`): a wrong weighting of uneven rows shows in the gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from labkit.grading import gradients, ranks
from labkit.grading.kit import Check, SharedLaunch, answer, close, launch_timeout, tally
from labkit.lessons.uneven import Hang
from labkit.names import REDUCE_SCATTER

KEYS = ("rank", "seq", "waiting_in", "cause")
LAUNCH_TIMEOUT_S = 90.0
LOSS_REL = 1e-5  # float32 both sides: only the order of the sums differs

Hangs = Callable[[int], Sequence[Hang]]  # seed -> the hung runs to read
Splits = Callable[[int], tuple[list[list[int]], int]]  # seed -> (rows per step and rank, the model's seed)


def _said(hang: Hang) -> str:
    kept = f", each recorder keeps its last {hang.kept}" if hang.kept else ""
    return f"{hang.world_size} ranks, {len(hang.program)} collectives{kept}"


def _diagnose_probe(hangs: Hangs) -> Callable[[dict, int], list]:
    def probe(ns: dict, seed: int) -> list:
        fn = answer(ns, "diagnose")
        out = []
        for hang in hangs(seed):
            got = fn(hang.entries())
            got = got if isinstance(got, dict) else {}
            out.append({k: got.get(k) if isinstance(got.get(k), (int, str)) else None for k in KEYS})
        return out

    return probe


def _diagnose_judge(hangs: Hangs, keys: tuple[str, ...]) -> Callable[[list, int], tuple[float, str]]:
    def judge(got: list, seed: int) -> tuple[float, str]:
        cases = []
        for hang, said in zip(hangs(seed), got, strict=True):
            want = hang.diagnosis()
            cases.append(
                (
                    all(said.get(k) == want[k] for k in keys),
                    f"{_said(hang)}: {', '.join(f'{k} {said.get(k)!r}' for k in keys)}; want "
                    + ", ".join(f"{k} {want[k]!r}" for k in keys),
                )
            )
        return tally(cases)

    return judge


_shared = SharedLaunch()


def _launch(ns: dict, seed: int, splits: Splits) -> list[dict]:
    """One launch serves both part-2 checks: per rank, {"steps": [...], "grads": its first-step rows}."""
    fn = answer(ns, "train_step")
    rows, model_seed = splits(seed)
    return _shared.result(
        (fn, seed, model_seed),
        lambda: ranks.launch(
            gradients.uneven_rank,
            len(rows[0]),
            fn,
            rows,
            model_seed,
            timeout=launch_timeout(LAUNCH_TIMEOUT_S),
        ),
    )


def _collectives_judge(splits: Splits) -> Callable[[list, int], tuple[float, str]]:
    from labkit.model import build_model

    units = len(build_model("tiny").blocks) + 1  # each block, then the root

    def judge(got: list, seed: int) -> tuple[float, str]:
        rows, _ = splits(seed)
        cases = []
        for step, split in enumerate(rows):
            issued = [rank[step] for rank in got]
            same = all(i == issued[0] for i in issued)
            scatters = [sum(kind == REDUCE_SCATTER for kind, _ in i) for i in issued]
            cases.append(
                (
                    same and min(scatters) >= units,
                    f"step {step}, rows {split}: "
                    + (
                        "the same collectives on every rank"
                        if same
                        else "the ranks issued different collectives"
                    )
                    + f", reduce-scatters per rank {scatters} (each of the {units} units needs one on every rank)",
                )
            )
        return tally(cases)

    return judge


def _hint(n: int) -> Callable[[float], str]:
    def hint(ratio: float) -> str:
        if abs(ratio * n - 1) < 0.01:
            return f"every gradient is 1/{n} of single's: FSDP2's reduce-scatter averages over the {n} ranks"
        return ""

    return hint


def _loss_judge(splits: Splits) -> Callable[[dict, int], tuple[float, str]]:
    def judge(got: dict, seed: int) -> tuple[float, str]:
        from labkit.lessons.uneven import single_uneven

        rows, model_seed = splits(seed)
        want, grads = single_uneven(rows, model_seed)
        cases = [
            (
                close(value, want[step], rel_tol=LOSS_REL),
                f"rank {rank}, step {step}, rows {rows[step]}: loss {value}, single's {want[step]:.6f}",
            )
            for rank, losses in enumerate(got["losses"])
            for step, value in enumerate(losses)
        ]
        why = gradients.grads_mismatch(
            gradients.gathered_rows(got["grads"]),
            grads,
            f"step 0, rows {rows[0]}, every rank's rows before AdamW (the mean over all {sum(rows[0])} sequences)",
            _hint(len(rows[0])),
        )
        cases.append((why is None, why or ""))
        return tally(cases)

    return judge


def checks(hangs: Hangs, splits: Splits) -> tuple[Check, ...]:
    """Exercise 09's four checks on the hung runs `hangs(seed)` and the uneven rows `splits(seed)`."""

    def collectives_probe(ns: dict, seed: int) -> list:
        return [[step["collectives"] for step in rank["steps"]] for rank in _launch(ns, seed, splits)]

    def loss_probe(ns: dict, seed: int) -> dict[str, Any]:
        launched = _launch(ns, seed, splits)
        return {
            "losses": [[s["loss"] for s in r["steps"]] for r in launched],
            "grads": [r["grads"] for r in launched],
        }

    probe = _diagnose_probe(hangs)
    limit = LAUNCH_TIMEOUT_S + 15
    return (
        Check(
            "the culprit: its rank, and the sequence number where the ranks part",
            3,
            probe,
            _diagnose_judge(hangs, ("rank", "seq")),
            answers=("diagnose",),
        ),
        Check(
            "the cause, and the collective its peers wait in",
            2,
            probe,
            _diagnose_judge(hangs, ("cause", "waiting_in")),
            answers=("diagnose",),
        ),
        Check(
            "uneven rows: every rank issues the same collectives, each unit's reduce-scatter among them",
            2,
            collectives_probe,
            _collectives_judge(splits),
            answers=("train_step",),
            limit_s=limit,
            group="ranks",
        ),
        Check(
            "uneven rows: losses and first-step gradients equal single's on the same rows",
            3,
            loss_probe,
            _loss_judge(splits),
            answers=("train_step",),
            limit_s=limit,
            group="ranks",
        ),
    )
