"""A run that hangs on a short last batch, read from its flight recorder, and the step that fixes it.

The case (exercise 09): the last batch of an epoch is short, and one rank gets no rows. The step every rank
runs (`broken_step`) returns early on that rank, so it never joins FSDP2's all-gathers and reduce-scatters and
its peers wait for it; on the ranks that do train, each averages over its own rows, so uneven rows weigh
unevenly. `run_uneven` trains FSDP2 (the lab's `tiny`) on such splits with any step function and returns what
each rank issued; `single_uneven` is `single` on the same rows, the reference.

`Hang` builds what each rank's flight recorder holds when a run hangs (the same `labkit.flight.Entry` rows
`labkit.flight.entries` reads from real dumps), from the program every rank should issue and the one rank that
parts from it: it stops before a collective, issues another collective, or issues it with other sizes. Each
recorder is a ring: with `kept`, a rank holds only its last entries, so the ranks' lists may start at
different sequence numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from labkit.engines.base import RunConfig
from labkit.flight import Entry, Flight
from labkit.names import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER

MODEL = "tiny"
GROUP = "default_pg"  # the default process group's name in a dump
STOPPED, OTHER_COLLECTIVE, OTHER_SIZES = "stopped", "other collective", "other sizes"
CAUSES = (STOPPED, OTHER_COLLECTIVE, OTHER_SIZES)
HANG_ROWS = ((7, 5, 0),)  # the reported run: the last step, 12 rows over 3 ranks, the third gets none
EXAMPLE_ROWS = ((7, 5, 0), (3, 0, 2))  # exercise 09's own rows: one rank empty, then a short batch
HANG_TIMEOUT_S, HANG_DUMP_S = 10.0, 3.0  # the reported run's launch: stopped after, dumped every (seconds)

Call = tuple[str, tuple[tuple[int, ...], ...]]  # (collective, its input sizes)


@dataclass(frozen=True)
class Hang:
    """Every rank issues `program` (collective, sizes) in order, but `culprit` parts from it at sequence
    number `at` (1-based), by `cause`; the others wait in collective `at`. `kept`: entries each recorder keeps."""

    program: tuple[Call, ...]
    world_size: int
    culprit: int
    cause: str
    at: int
    kept: int | None = None

    def __post_init__(self):
        if self.world_size < 3 or not 0 <= self.culprit < self.world_size:
            raise ValueError(f"world_size={self.world_size}, culprit={self.culprit}: pass 3 or more ranks")
        if self.cause not in CAUSES or not 1 <= self.at <= len(self.program):
            raise ValueError(f"cause={self.cause!r}, at={self.at}: pass one of {CAUSES}, within the program")
        if self.cause == OTHER_COLLECTIVE and (
            self.at == len(self.program) or self.program[self.at][0] == self.program[self.at - 1][0]
        ):
            raise ValueError(f"at={self.at}: the collective after it must be another one, to skip to")

    def issued(self, rank: int) -> list[Call]:
        """What `rank` issued before the run hung, the collective it waits in last."""
        before = list(self.program[: self.at - 1])
        if rank != self.culprit:
            return [*before, self.program[self.at - 1]]
        if self.cause == STOPPED:
            return before
        if self.cause == OTHER_COLLECTIVE:
            return [*before, self.program[self.at]]
        op, sizes = self.program[self.at - 1]
        return [*before, (op, ((sizes[0][0] + self.world_size, *sizes[0][1:]), *sizes[1:]))]

    def entries(self) -> dict[int, list[Entry]]:
        """{rank: the entries its flight recorder holds}, as `labkit.flight.entries` reads them from dumps."""
        out = {}
        for rank in range(self.world_size):
            rows = [
                Entry(i + 1, GROUP, op, [list(s) for s in sizes])
                for i, (op, sizes) in enumerate(self.issued(rank))
            ]
            out[rank] = rows[-self.kept :] if self.kept else rows
        return out

    def diagnosis(self) -> dict:
        """What a reader of the entries should find: the culprit, the sequence number where the ranks part,
        the collective the others wait in, and the cause."""
        return {
            "rank": self.culprit,
            "seq": self.at,
            "waiting_in": self.program[self.at - 1][0],
            "cause": self.cause,
        }


# ------------------------------------------------------------------------------------ the run that hangs


def broken_step(model, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """The reported step: nothing to learn from on a rank without rows, so it returns at once; elsewhere the
    mean loss over this rank's rows, backward. (It hangs its peers, and weighs uneven rows unevenly.)"""
    from labkit.model import loss_fn

    if tokens.shape[0] == 0:
        return 0.0
    loss = loss_fn(model(tokens), targets)
    loss.backward()
    return loss.item()


def run_uneven(step_fn: Callable[..., float], rows: Sequence[Sequence[int]], seed: int = 0) -> list[dict]:
    """Rank side: one FSDP2 step (the lab's `tiny`, seed `seed`) per entry of `rows`, where rank r gets
    `rows[s][r]` sequences of step s's global batch (its first sum(rows[s]), in rank order): `step_fn(model,
    tokens, targets)`, then AdamW. Per step: "loss" (what `step_fn` returned here) and "collectives" (what this
    rank issued during `step_fn`, in order: [kind, payload bytes])."""
    from labkit.engines.on_rank import rank_info
    from labkit.lessons.fsdp2_features import build_engine
    from labkit.model import batch
    from labkit.probes import Probes

    info = rank_info()
    cfg = RunConfig(model=MODEL, world_size=info.world_size, steps=len(rows), seed=seed)
    engine = build_engine(cfg)
    out = []
    with Probes(info.rank, info.device) as probes:
        for step, split in enumerate(rows):
            tokens, targets = batch(step, MODEL, seed)
            start = sum(split[: info.rank])
            mine = slice(start, start + split[info.rank])
            first = len(probes.comm.calls)
            loss = step_fn(engine.model, tokens[mine].to(info.device), targets[mine].to(info.device))
            issued = [[c.kind, c.payload_bytes] for c in probes.comm.calls[first:]]
            engine.optimizer_step()
            out.append({"loss": float(loss), "collectives": issued})
    return out


def single_uneven(
    rows: Sequence[Sequence[int]], seed: int = 0
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """`single` on the same rows: the loss of each step over all sum(rows[s]) sequences, and the first
    step's full gradients (the mean over those sequences), by parameter name."""
    from labkit.gradients import single_steps
    from labkit.model import batch

    cfg = RunConfig(model=MODEL, world_size=1, steps=len(rows), seed=seed)
    return single_steps(
        cfg, ([t[: sum(split)] for t in batch(step, MODEL, seed)] for step, split in enumerate(rows))
    )


def hang_run(dump_dir: str | Path, rows: Sequence[Sequence[int]] = HANG_ROWS) -> Flight:
    """The reported run under torch's flight recorder: `broken_step` on len(rows[0]) ranks, dumped per rank
    in `dump_dir` (`labkit.flight.record`); the launch's error, not an exception, when it hangs or dies."""
    from labkit import flight

    return flight.record(
        run_uneven,
        len(rows[0]),
        broken_step,
        rows,
        dump_dir=dump_dir,
        dump_after_s=HANG_DUMP_S,
        timeout=HANG_TIMEOUT_S,
    )


def examples() -> list[Hang]:
    """Exercise 09's own hung runs (its notebook and its check() read them): one of each cause on 3 or 4
    ranks, the last with recorders that keep only their last 4 entries."""
    step = (
        (ALL_GATHER, ((1024,),)),
        (ALL_GATHER, ((4096,),)),
        (REDUCE_SCATTER, ((4096,),)),
        (ALL_REDUCE, ((1,),)),
    )
    program = step * 3
    return [
        Hang(program, 3, 1, OTHER_COLLECTIVE, 6),
        Hang(program, 4, 3, OTHER_SIZES, 2),
        Hang(program, 3, 0, STOPPED, 10, kept=4),
    ]
