"""The capstone's checks (exercise 07), on any run: the student's whole ZeRO-3, with prefetch, trained on 3 ranks
by the lab's loop. The grade gives them a model the notebook never shows (`checks/ex07_capstone_model`, drawn
from the seed); the public `check()` of the student release gives them the notebook's own (`tiny`, seed 0).

The probe plugs the answers into the build-along's scaffold (`labkit.buildalong.Pieces`, `Learner`) and trains
them with `labkit.engines.on_rank.train_rank`, under the lab's probes. It returns what the probes measured (each
rank's losses, bytes per collective, state bytes, the order of its all-gathers and block computes) and each
rank's gradient shards after the first backward. The judges compute every reference themselves: `single`
trained in this process (losses, gradients), the ring formula and fp32 byte table of `labkit.budget` over the
padded parameters (bytes, state), and each unit's padded size (what must be gathered before a block computes).
No answer is here: every reference is `single`'s, a formula's, or a size.

What makes it ZeRO-3 is measured too, not only what it computes (`labkit.grading.capstone_memory`): around
each moment the probe weighs the full weights a unit holds and its full gradients. A unit whose
`after_forward` frees nothing trains to the same losses over the same bytes, yet holds the whole model from
its forward to its backward; that costs it the memory check.

Why the gradients and not only the losses: AdamW's update is invariant to a constant scale of the gradient
(but for eps), so a reduce-scatter that forgets to divide by n trains to the same losses (docs/measured.md).
Its gradient shards are n x the mean.

The points follow the properties: freed weights and sharded gradients, what makes it ZeRO-3, weigh most
(`CHECKS`). A piece that raises (or is not defined) costs only the checks of the properties it touches
(`CHECKS`' pieces): given `reference` pieces (the grade's `checks/ex07_capstone_reference`), the probe trains
again with the reference piece in its place, and the other checks judge that run, saying so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

from labkit.grading import ranks
from labkit.grading.capstone_memory import Watch, freed_judge, sharded_grads_judge
from labkit.grading.capstone_run import Run, single_reference
from labkit.grading.gradients import GRAD_REL_TOL, mean_hint
from labkit.grading.kit import (
    Check,
    MissingAnswer,
    SharedLaunch,
    TimedOut,
    answer,
    launch_timeout,
    probe_error,
    standing_in,
    stood_in,
    tally,
    tensor_json,
)
from labkit.names import ALL_GATHER, REDUCE_SCATTER

LAUNCH_TIMEOUT_S = 120.0
RANKS_LIMIT_S = 150.0  # the seven checks share one training run (and its reruns with a stand-in)
# float32 puts a right answer within 1e-7 of single's loss; full gradients kept past their reduce-scatter
# (autograd adds the next step's to them) moved the third loss by 6.8e-5 to 1.6e-3 over 12 hidden models
LOSS_REL_TOL = 1e-5
PIECES = (
    "shard",
    "gather",
    "before_forward",
    "after_forward",
    "before_backward",
    "after_grad",
    "make_optimizer",
)
FIRST_STEP_HINT = (
    "the weights your gathers loaded are not the model's: is the receive buffer read rank-major, "
    "parameter p's rows at recv.view(n, chunk)[:, offset : offset + shard numel]?"
)


# --------------------------------------------------------------------------------------------- the probe


class _FirstGrads:
    """The student's after_grad, recording each unit's gradient shards the first time it returns."""

    def __init__(self, after_grad):
        self.after_grad = after_grad
        self.grads: dict[str, dict] = {}

    def __call__(self, unit) -> None:
        self.after_grad(unit)
        if unit.name in self.grads:
            return
        prefix = "" if unit.name == "root" else f"{unit.name}."
        names = {id(p): prefix + n for n, p in unit.module.named_parameters()}
        self.grads[unit.name] = {
            names[id(p)]: None if s.grad is None else tensor_json(s.grad)
            for p, s in zip(unit.params, unit.shards, strict=True)
        }


def _rank(pieces, run: Run, own: dict[str, Any], crashes: str) -> dict:
    """On each rank: train the student's pieces with the lab's loop and keep what the judges need. A piece of
    `own` (the student's, by name) that raises is written to the folder `crashes` (`_note_crash`)."""
    from labkit.buildalong.scaffold import Learner
    from labkit.engines import on_rank

    recorder = _FirstGrads(pieces.after_grad)
    watch = Watch(dataclasses.replace(pieces, after_grad=recorder))
    try:
        out = on_rank.train_rank(Learner(watch.wrapped()), run.config())
    except Exception as e:
        _note_crash(crashes, own, e)
        raise
    last = run.steps - 1
    order = [
        [e["kind"], e["name"], e["start_s"]]
        for e in out["timeline"]
        if e["step"] == last
        and (
            (e["kind"] == "comm" and e["name"] == ALL_GATHER)
            or (e["kind"] == "compute" and e["name"].endswith(".forward"))
        )
    ]
    return {
        "losses": out["losses"],
        "grads": {name: g for unit in recorder.grads.values() for name, g in unit.items()},
        "comm": out["comm"][last],
        "state_bytes": out["state_bytes"],
        "gathers": [
            [c["payload_bytes"], c["async_op"]] for c in out["collective_calls"] if c["kind"] == ALL_GATHER
        ],
        "order": order,
        "memory": {"after_forward": watch.after_forward, "after_grad": watch.after_grad, "peak": watch.peak},
    }


def _crashed_in(e: BaseException, own: Mapping[str, Any]) -> str | None:
    """The piece of `own` ({name: the student's function}) whose code raised `e`: the innermost of their
    frames in its traceback (a hook that calls the student's `gather` which raises: `gather`), or None."""
    codes = {getattr(fn, "__code__", None): name for name, fn in own.items()}
    found, tb = None, e.__traceback__
    while tb is not None:
        found = codes.get(tb.tb_frame.f_code, found)
        tb = tb.tb_next
    return found


def _note_crash(crashes: str, own: Mapping[str, Any], e: BaseException) -> None:
    """Write which of the student's pieces raised `e` on this rank, and when, to the folder `crashes`."""
    import torch.distributed as dist

    piece = _crashed_in(e, own)
    if piece is not None:
        note = {"piece": piece, "time": time.time(), "error": probe_error(e)}
        with open(os.path.join(crashes, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump(note, f)


def _first_crash(crashes: str) -> dict | None:
    """The earliest piece any rank wrote to `crashes` (the others' are mostly its consequences), or None."""
    notes = []
    for name in os.listdir(crashes):
        try:
            with open(os.path.join(crashes, name)) as f:
                notes.append(json.load(f))
        except (OSError, ValueError):
            continue
    return min(notes, key=lambda note: float(note.get("time", 0)), default=None)


_shared = SharedLaunch()


def _launch(ns: dict, run: Run, reference: Mapping[str, Callable] | None) -> dict:
    """One training run serves the checks: {"ranks": what each rank measured, "stand_ins": {piece: why it
    could not run}}; the result (or failure) is kept for the same answers."""
    fns, missing = [], {}
    for name in PIECES:
        try:
            fns.append(answer(ns, name))
        except MissingAnswer as e:
            if not reference:
                raise
            fns.append(None)
            missing[name] = str(e)
    return _shared.result(
        (*fns, run), lambda: _train(dict(zip(PIECES, fns, strict=True)), missing, run, reference)
    )


class _PieceRaised(Exception):
    """The student's `piece` raised `raised` when called here, before any rank started."""

    def __init__(self, piece: str, raised: Exception):
        super().__init__(piece)
        self.piece, self.raised = piece, raised


def _raise_quick_crash(own: dict[str, Any], run: Run) -> None:
    """Call `shard` and `make_optimizer` on a small tensor here, before any rank starts (a stub raises here,
    with its own message): `_PieceRaised` when one raises."""
    import torch

    calls = {
        "shard": lambda fn: fn(torch.zeros(4, 2), 0, run.ranks),
        "make_optimizer": lambda fn: fn([torch.zeros(2, requires_grad=True)]),
    }
    for name, call in calls.items():
        if name in own:
            try:
                call(own[name])
            except Exception as e:
                raise _PieceRaised(name, e) from e


def _train(
    fns: dict[str, Any], missing: dict[str, str], run: Run, reference: Mapping[str, Callable] | None
) -> dict:
    """Train the pieces `fns`; while one raises and `reference` holds its stand-in (and a check is left that
    does not touch any stood-in piece), train again with the reference piece in its place. When none can
    stand in, the first failure is raised (a stub's own message, say)."""
    stand_ins = dict(missing)
    own = {name: fn for name, fn in fns.items() if name not in stand_ins}
    if stand_ins and not _can_stand_in(reference, set(stand_ins)):
        raise MissingAnswer(next(iter(stand_ins.values())))
    first: Exception | None = None
    while True:
        try:
            _raise_quick_crash(own, run)
            return {"ranks": _train_once(fns, own, run, reference, stand_ins), "stand_ins": stand_ins}
        except _PieceRaised as e:
            raised, note = e.raised, {"piece": e.piece, "error": probe_error(e.raised)}
        except Exception as e:
            raised, note = e, None if isinstance(e, TimedOut) else getattr(e, "crash", None)
        first = first or raised
        if not note or not _can_stand_in(reference, set(stand_ins) | {note["piece"]}):
            raise first
        stand_ins[note["piece"]] = str(note.get("error", ""))
        own.pop(note["piece"])


def _can_stand_in(reference: Mapping[str, Callable] | None, pieces: set[str]) -> bool:
    """Whether training again with `reference`'s stand-ins for `pieces` leaves a check to judge."""
    return bool(reference) and pieces <= set(reference) and judged_beside(pieces)


def _train_once(
    fns: dict[str, Any],
    own: dict[str, Any],
    run: Run,
    reference: Mapping[str, Callable] | None,
    stand_ins: Mapping[str, str],
) -> list[dict]:
    """One launch of the student's pieces, the stood-in ones replaced by `reference`'s, also in the globals
    the student's code reads them from (their hooks call `gather` by name); a failure carries `.crash`, the
    first piece of `own` that raised (`_first_crash`)."""
    from labkit.buildalong.scaffold import Pieces

    used = {name: reference[name] if name in stand_ins else fn for name, fn in fns.items()}
    crashes = tempfile.mkdtemp(prefix="labkit-crashes-")
    try:
        with standing_in(own.values(), {name: used[name] for name in stand_ins}):
            return ranks.launch(
                _rank, run.ranks, Pieces(**used), run, own, crashes, timeout=launch_timeout(LAUNCH_TIMEOUT_S)
            )
    except Exception as e:
        e.crash = _first_crash(crashes)
        raise
    finally:
        shutil.rmtree(crashes, ignore_errors=True)


def _probe(view: Callable[[dict], Any]) -> Callable:
    """A check's probe: `view` of each rank's measurements of the shared run, beside its stand-ins."""

    def probe(ns: dict, run: Run, reference: Mapping[str, Callable] | None) -> dict:
        launched = _launch(ns, run, reference)
        return {"ranks": [view(r) for r in launched["ranks"]], "stand_ins": launched["stand_ins"]}

    return probe


_training_probe = _probe(lambda r: {"losses": r["losses"], "grads": r["grads"]})
_bytes_probe = _probe(lambda r: r["comm"])
_state_probe = _probe(lambda r: r["state_bytes"])
_memory_probe = _probe(lambda r: r["memory"])
_prefetch_probe = _probe(lambda r: {"gathers": r["gathers"], "order": r["order"]})


# -------------------------------------------------------------------------------------------- the judges


def _grad_case(seen: dict, grads: dict, rank: int, n: int) -> tuple[bool, str]:
    """Rank `rank`'s gradient shards against its rows of single's gradient; the usual mistake named."""
    import torch

    from labkit.buildalong.gradient_verdicts import rows_expected

    dot = norm = 0.0
    problem = None
    for name, full in grads.items():
        want = rows_expected(full, rank, n).double()
        got = seen.get(name) if isinstance(seen, dict) else None
        if got is None:
            return False, f"rank {rank}: the shard of {name} had no .grad when after_grad returned"
        if not isinstance(got, dict) or got.get("shape") != list(want.shape):
            shape = got.get("shape") if isinstance(got, dict) else type(got).__name__
            return (
                False,
                f"rank {rank}: the gradient shard of {name} has shape {shape}, want {list(want.shape)}",
            )
        values = torch.tensor(got["values"], dtype=torch.float64).view_as(want)
        dot += float((values * want).sum())
        norm += float((want * want).sum())
        err = float((values - want).abs().max()) if want.numel() else 0.0
        scale = float(full.abs().max())
        if problem is None and not err <= GRAD_REL_TOL * scale + 1e-9:
            problem = (
                f"rank {rank}: the gradient shard of {name} differs from single's rows by up to {err:.3g} "
                f"(of {scale:.3g})"
            )
    if problem is None:
        return True, ""
    ratio = dot / norm if norm else math.nan
    hint = mean_hint(n, f"the sum over the {n} ranks", f"divide the reduce-scatter's sum by n = {n}")(ratio)
    return False, problem + (f" ({hint})" if hint else "")


def _gradients_judge(got: list, run: Run) -> tuple[float, str]:
    """Each rank's first-step gradient shards against its rows of single's gradient (the mean over ranks)."""
    _, grads = single_reference(run)
    fraction, feedback = tally(
        [_grad_case(got[rank]["grads"], grads, rank, run.ranks) for rank in range(run.ranks)]
    )
    return fraction, f"each rank's first-step gradient shards: {feedback}"


def _losses_judge(got: list, run: Run) -> tuple[float, str]:
    """The global loss of every step against single's: the weights gathered right, and AdamW's updates."""
    losses, _ = single_reference(run)
    cases = []
    for step, want in enumerate(losses):
        seen = sum(float(r["losses"][step]) for r in got) / run.ranks
        rel = abs(seen - want) / abs(want)
        why = f"step {step}: loss {seen:.6f}, single's {want:.6f} (relative {rel:.1e} > {LOSS_REL_TOL:g})"
        if step == 0:
            why += f"; step 0 comes before any update, so {FIRST_STEP_HINT}"
        cases.append((rel <= LOSS_REL_TOL, why))
    fraction, feedback = tally(cases)
    return fraction, f"losses of {run.steps} steps: {feedback}"


def expected_wire_bytes(run: Run) -> dict[str, int]:
    """Per rank per step: 2 all-gathers (forward, backward) and 1 reduce-scatter of the padded fp32 weights."""
    from labkit.budget import collective_wire_bytes

    payload = run.padded_elements() * 4
    return {
        ALL_GATHER: 2 * collective_wire_bytes(ALL_GATHER, payload, run.ranks),
        REDUCE_SCATTER: collective_wire_bytes(REDUCE_SCATTER, payload, run.ranks),
    }


def expected_calls(run: Run) -> dict[str, int]:
    """Per rank per step: one packed all-gather per unit in forward and one in backward, one reduce-scatter."""
    units = len(run.unit_shapes())
    return {ALL_GATHER: 2 * units, REDUCE_SCATTER: units}


def _bytes_judge(got: list, run: Run) -> tuple[float, str]:
    want = expected_wire_bytes(run)
    payload = run.padded_elements() * 4
    formula = {
        ALL_GATHER: f"2 x (n-1)/n x {payload:,} B of padded weights = {want[ALL_GATHER]:,} B",
        REDUCE_SCATTER: f"(n-1)/n x {payload:,} B of padded gradients = {want[REDUCE_SCATTER]:,} B",
    }
    cases = []
    for rank, comm in enumerate(got):
        for kind, bytes_ in want.items():
            seen = comm.get(kind, {}).get("wire_bytes", 0)
            cases.append(
                (
                    seen == bytes_,
                    f"rank {rank}: {kind} sent {seen:,} B in a step, the formula {formula[kind]}",
                )
            )
        for kind, calls in expected_calls(run).items():
            seen = comm.get(kind, {}).get("calls", 0)
            cases.append(
                (
                    seen == calls,
                    f"rank {rank}: {seen} {kind} calls in a step, want {calls}: one per unit "
                    f"{'in forward and one in backward' if kind == ALL_GATHER else 'after its backward'}, "
                    "every parameter of the unit packed into it",
                )
            )
        others = sorted(set(comm) - set(want))  # a failing case each, said first: nothing else earns anything
        cases[:0] = [
            (
                False,
                f"rank {rank} also ran {other}: ZeRO-3 needs only all-gathers and reduce-scatters (a "
                "reduce-scatter leaves each rank only its rows of the sum, at half an all-reduce's bytes)",
            )
            for other in others
        ]
    return tally(cases)


def expected_state_bytes(run: Run) -> dict[str, int]:
    """Per rank: 4 B/param of fp32 shards, 4 of gradient shards, 8 of AdamW's m and v, over padded sizes."""
    from labkit.budget import PRECISIONS

    per_param = PRECISIONS["fp32"]
    elements = run.padded_elements() // run.ranks
    return {
        "params": int(per_param["weights"] * elements),
        "grads": int(per_param["grads"] * elements),
        "optimizer": int((per_param["master"] + per_param["adam_m"] + per_param["adam_v"]) * elements),
    }


def _state_judge(got: list, run: Run) -> tuple[float, str]:
    want = expected_state_bytes(run)
    n_tensors = sum(len(params) for params in run.unit_shapes().values())
    step_counters = 4 * n_tensors  # torch.optim.AdamW keeps a 4-byte step per tensor
    cases = []
    for rank, state in enumerate(got):
        for key, bytes_ in want.items():
            seen = state.get(key)
            allowed = (bytes_, bytes_ + step_counters) if key == "optimizer" else (bytes_,)
            hint = {
                "params": "the shards only: free every full weight after its unit's gradients are reduced",
                "grads": "the gradient shards only: set each full p.grad to None after the reduce-scatter",
                "optimizer": "AdamW's m and v over the shards, not over the full parameters",
            }[key]
            cases.append(
                (seen in allowed, f"rank {rank}: {key} {seen} B after a step, want {bytes_:,} B ({hint})")
            )
    return tally(cases)


def _prefetch_case(seen: dict, run: Run, rank: int, block: int) -> tuple[bool, str]:
    """Before blocks.{block} computes: the gathers issued cover the root and blocks 0..block+1, the last async."""
    root = run.padded_elements("root") * 4
    per_block = run.padded_elements("blocks.0") * 4
    events = sorted(seen["order"], key=lambda e: float(e[2]))
    start = next(
        (float(e[2]) for e in events if e[0] == "compute" and e[1] == f"blocks.{block}.forward"), None
    )
    if start is None:
        return False, f"rank {rank}: blocks.{block} never computed in the last step"
    issued = sum(1 for e in events if e[0] == "comm" and float(e[2]) < start)
    gathers = seen["gathers"][:issued]
    covered = sum(int(g[0]) for g in gathers)
    nxt = f"blocks.{block + 1}"
    where = f"rank {rank}: when blocks.{block} started computing"
    if covered < root + (block + 2) * per_block:
        units = max(0, (covered - root) // per_block) if covered >= root else 0
        return False, (
            f"{where}, all-gathers had been issued for the root and {units} block(s), not yet for {nxt}: "
            f"issue {nxt}'s gather in blocks.{block}'s before_forward (unit.next), before it computes"
        )
    if not gathers or gathers[-1][1] is not True:
        return (
            False,
            f"{where}, {nxt}'s all-gather was synchronous: pass async_op=True and wait in its own before_forward",
        )
    return True, ""


def _prefetch_judge(got: list, run: Run) -> tuple[float, str]:
    n_blocks = run.n_layers
    cases = [
        _prefetch_case(seen, run, rank, block)
        for rank, seen in enumerate(got)
        for block in range(n_blocks - 1)
    ]
    return tally(cases)


RANKS_GROUP = "ranks"  # one training run serves every check
MOVES = ("shard", "gather", "before_forward", "before_backward", "after_grad")  # what the collectives carry
# (name, points, probe, judge, the pieces whose property it is) of each check, as the grade scores them: the
# two that make it ZeRO-3 (nothing whole between a unit's forward and backward, gradients left as shards)
# weigh most. A check whose pieces include one that could not run earns nothing; the others judge the run
# with the reference piece in its place.
CHECKS = (
    (
        "full weights freed after each unit's forward: only the shards between forward and backward",
        5,
        _memory_probe,
        freed_judge,
        ("before_forward", "after_forward"),
    ),
    (
        "gradients end sharded: no full gradient or weight left after a unit's reduce-scatter",
        4,
        _memory_probe,
        sharded_grads_judge,
        ("after_grad",),
    ),
    (
        "gradients: each rank's first-step gradient shards are its rows of single's (the mean over ranks)",
        3,
        _training_probe,
        _gradients_judge,
        MOVES,
    ),
    (  # freeing changes no loss: weights never freed train to the same losses
        "losses: every step's loss against single's",
        2,
        _training_probe,
        _losses_judge,
        (*MOVES, "make_optimizer"),
    ),
    (
        "state bytes per rank: 16 B/param/n over the padded shards",
        2,
        _state_probe,
        _state_judge,
        ("shard", "after_grad", "make_optimizer"),
    ),
    (
        "wire bytes and calls per collective: a packed reduce-scatter, against the ring formula",
        2,
        _bytes_probe,
        _bytes_judge,
        MOVES,
    ),
    (
        "prefetch: the next unit's all-gather issued, async, before this unit computes",
        2,
        _prefetch_probe,
        _prefetch_judge,
        ("before_forward",),  # its gather of unit.next, async: the one-tensor `gather` is synchronous
    ),
)


def judged_beside(stand_ins: set[str]) -> bool:
    """Whether a check is left whose pieces include none of `stand_ins` (else there is nothing to judge)."""
    return any(not stand_ins & set(pieces) for *_, pieces in CHECKS)


def _isolated(judge: Callable, pieces: tuple[str, ...]) -> Callable:
    """`judge` on a probe's {"ranks", "stand_ins"}: nothing when a piece of its property could not run, else
    the run's ranks judged, the feedback saying which of the student's pieces a reference stood in for."""

    def judged(seen: dict, run: Run) -> tuple[float, str]:
        stand_ins = seen["stand_ins"]
        lost = [piece for piece in pieces if piece in stand_ins]
        if lost:
            return 0.0, f"could not run your {lost[0]}: {stand_ins[lost[0]]}"
        fraction, feedback = judge(seen["ranks"], run)
        return fraction, stood_in(feedback, stand_ins, "this property does not depend on it")

    return judged


def checks(
    run_of: Callable[[int], Run], reference: Mapping[str, Callable] | None = None
) -> tuple[Check, ...]:
    """The checks, each probing and judging the run `run_of(seed)`: one training run serves them all.
    `reference`: {piece: stand-in}, trained in place of a piece that raises or is missing (None: such a
    piece costs every check)."""

    def bound_probe(probe: Callable) -> Callable:
        return lambda ns, seed: probe(ns, run_of(seed), reference)

    def bound_judge(judge: Callable, pieces: tuple[str, ...]) -> Callable:
        return lambda seen, seed: _isolated(judge, pieces)(seen, run_of(seed))

    return tuple(
        Check(
            name,
            points,
            bound_probe(probe),
            bound_judge(judge, pieces),
            answers=PIECES,
            limit_s=RANKS_LIMIT_S,
            group=RANKS_GROUP,
        )
        for name, points, probe, judge, pieces in CHECKS
    )
