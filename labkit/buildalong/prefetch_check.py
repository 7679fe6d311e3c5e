"""Notebook 03's build check: your 02 engine with your prefetch, on real ranks, judged from what it recorded.

`check_prefetch(before_forward, before_backward)` trains your 02 pieces (`cells.pieces_from_notebook`) with these
two moments in place of 02's, under the probes, and says one sentence per property that fails: "losses:" they are
`single`'s (float32, LOSS_RTOL); "bytes:" the wire bytes per step are ZeRO-3's formula (`verdicts.formula_wire_bytes`),
as prefetch moves bytes earlier, never more of them; "order:" in each pass, the gather of the unit that computes
next was issued before this unit began computing and waited for only after that. The order is a log each rank
keeps: when a moment starts, when it returns (the unit's compute begins), and when each all-gather is issued and
waited for, charged to the unit whose shards it carries. A stub gets its "write this piece"; nothing raises.
04's check (`offload_check`) shares its first and last steps: `your_02`, `stub_sentence`, `single_losses`,
`train_steps`, `worst_rel`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from labkit.budget import collective_wire_bytes
from labkit.buildalong.cells import pieces_from_notebook, unwritten_pieces
from labkit.buildalong.checks import _learner, _LearnerError
from labkit.buildalong.scaffold import Learner, Pieces
from labkit.buildalong.stubs import NotWritten, unwritten
from labkit.buildalong.verdicts import (
    LOSS_RTOL,
    CheckResult,
    error_sentence,
    formula_wire_bytes,
    launched,
    names_of,
)
from labkit.collectives import COLLECTIVES, Patch
from labkit.engines import on_rank
from labkit.engines.base import RunConfig
from labkit.engines.single import SingleEngine
from labkit.model import build_model
from labkit.names import ALL_GATHER, REDUCE_SCATTER
from labkit.probes import Probes

STEP = "prefetch"
TIMEOUT_S = 120.0
GATHERS = tuple(name for name, c in COLLECTIVES.items() if c.kind == ALL_GATHER and c.counted)
UNKNOWN = "?"  # the unit of an all-gather whose input is none of the units' shards
NEXT = {"forward": "unit.next", "backward": "unit.backward_next"}  # what the scaffold names the coming unit


def check_prefetch(
    before_forward: Callable,
    before_backward: Callable,
    world_size: int = 2,
    model: str = "tiny",
    steps: int = 3,
    link_gbytes: float | None = None,
    yours: Pieces | None = None,
    quiet: bool = False,
) -> CheckResult:
    """Your 02 engine (`yours`, default: notebook 02's build cells) with these two moments, `steps` steps on
    `world_size` ranks (over an emulated link of `link_gbytes` GB/s, if given): the result, printed unless
    `quiet`. Its figures hold the losses, the bytes and the last step's timeline of every rank."""
    result = _check(before_forward, before_backward, world_size, model, steps, link_gbytes, yours)
    if not quiet:
        print(result)
    return result


def _check(before_forward, before_backward, world_size, model, steps, link_gbytes, yours) -> CheckResult:
    if (stub := stub_sentence(before_forward, before_backward)) is not None:
        return CheckResult(STEP, False, stub)
    plain, waiting = your_02(yours, "these two moments in place of 02's")
    if plain is None:
        return CheckResult(STEP, False, waiting)
    pieces = dataclasses.replace(plain, before_forward=before_forward, before_backward=before_backward)
    ranks, sentence = launched(
        _rank_prefetch,
        world_size,
        pieces,
        plain,
        model,
        steps,
        link_gbytes,
        timeout_s=TIMEOUT_S,
        question="does every rank issue the same gathers in the same order, and wait for each one?",
    )
    if ranks is None:
        return CheckResult(STEP, False, sentence)
    failed = next(((rank, r) for rank, r in enumerate(ranks) if "error" in r), None)
    if failed is not None:
        return CheckResult(STEP, False, error_sentence(*failed), failed[1])
    return verdict(ranks, model, world_size)


def your_02(yours: Pieces | None, what: str) -> tuple[Pieces | None, str]:
    """(the learner's 02 pieces, "") from `yours` or notebook 02's build cells; (None, the sentence naming the
    pieces still to write there) while one is a stub. `what`: what the later check puts in place of 02's."""
    plain = yours if yours is not None else pieces_from_notebook()
    waiting = unwritten_pieces(plain)
    if not waiting:
        return plain, ""
    return None, (
        f"your 02 still has {', '.join(waiting)} to write: this check runs your 02 engine with {what}; write "
        "them there (and pass their checks) first"
    )


def stub_sentence(*pieces: Callable) -> str | None:
    """The first stub's own "write this piece" sentence among `pieces` and the functions of the learner's cells
    they call by name (a stub calls write_this_piece), depth first; None when none is a stub."""
    seen: set[int] = set()
    for piece in pieces:
        if (said := _stub_in(piece, seen)) is not None:
            return said
    return None


def _stub_in(fn: Callable, seen: set[int]) -> str | None:
    code = getattr(fn, "__code__", None)
    if code is None or id(fn) in seen:
        return None
    seen.add(id(fn))
    if "write_this_piece" in code.co_names:
        try:
            fn(*[None] * code.co_argcount)
        except NotWritten as e:
            return unwritten(e)
        except Exception:  # noqa: BLE001 - a written piece that also names write_this_piece: the ranks run it
            return None
        return None
    named = getattr(fn, "__globals__", {})
    called = [named[name] for name in _names(code) if inspect.isfunction(named.get(name))]
    return next(filter(None, (_stub_in(f, seen) for f in called)), None)


def _names(code) -> list[str]:
    """The global names `code` and the functions and lambdas inside it use, in order."""
    inner = [name for c in code.co_consts if inspect.iscode(c) for name in _names(c)]
    return [*code.co_names, *inner]


# ------------------------------------------------------------------------------------------------ ranks


class _Log:
    """One rank's record of a run, in the order things happened: ("step", s); ("begin", pass, unit) when a
    moment starts and ("compute", pass, unit) when it returns; ("issue", unit, wire bytes) and ("wait", unit)
    for each all-gather (a synchronous one is waited for as it is issued)."""

    def __init__(self, calls: list):
        self.events: list[tuple] = []
        self.units: list = []
        self.calls = calls  # the comm probe's calls: the bytes of each all-gather are the probe's

    def moment(self, pass_: str, learner: Callable) -> Callable:
        def logged(unit) -> None:
            self.events.append(("begin", pass_, unit.name))
            learner(unit)
            self.events.append(("compute", pass_, unit.name))

        return logged

    def wrap(self, name: str, current: Callable) -> Callable:
        """The logged version of all-gather function `name` (a `labkit.collectives.Patch` wrap)."""
        signature = inspect.signature(current)

        def logged(*args, **kwargs):
            given = signature.bind_partial(*args, **kwargs).arguments
            unit = self.unit_of(
                given.get("input_tensor", given.get("tensor", given.get("input_tensor_list")))
            )
            before = len(self.calls)
            out = current(*args, **kwargs)
            self.events.append(("issue", unit, sum(c.wire_bytes for c in self.calls[before:])))
            if not given.get("async_op") or out is None:
                self.events.append(("wait", unit))
                return out
            return _LoggedWork(out, lambda: self.events.append(("wait", unit)))

        return logged

    def unit_of(self, tensor: Any) -> str:
        """The unit whose shards `tensor` carries: one of them (its storage, else its values), or all of them
        concatenated in order; UNKNOWN when none."""
        if isinstance(tensor, (list, tuple)):
            tensor = tensor[0] if tensor else None
        if not isinstance(tensor, torch.Tensor):
            return UNKNOWN
        address = tensor.untyped_storage().data_ptr()
        for unit in self.units:
            if any(s.untyped_storage().data_ptr() == address for s in unit.shards):
                return unit.name
        flat = tensor.detach().reshape(-1).float()
        for unit in self.units:
            candidates = [*unit.shards, torch.cat([s.detach().reshape(-1) for s in unit.shards])]
            if any(c.numel() == flat.numel() and torch.equal(c.reshape(-1), flat) for c in candidates):
                return unit.name
        return UNKNOWN


class _LoggedWork(distributed_c10d.Work):
    """An async all-gather's Work that notes when it is waited for; everything else is the real Work's (a
    `Work` subclass, as the comm probe's is, for callers that test isinstance)."""

    def __init__(self, inner, on_wait: Callable[[], None]):
        super().__init__()
        self._inner = inner
        self._on_wait = on_wait

    def __getattribute__(self, name: str):
        if name.startswith("_") or name == "wait":
            return object.__getattribute__(self, name)
        return getattr(object.__getattribute__(self, "_inner"), name)

    def wait(self, timeout=None) -> bool:
        self._on_wait()
        return self._inner.wait() if timeout is None else self._inner.wait(timeout)


def _rank_prefetch(pieces: Pieces, plain: Pieces, model: str, steps: int, link_gbytes: float | None) -> dict:
    """Rank side: `steps` steps of `pieces` under the probes and the log; their losses and single's, and, when
    they part, the losses of `plain` (02's moments) too."""
    torch.set_num_threads(1)  # as the loop: one core per rank, and no OpenMP pool in a forked rank
    info = on_rank.rank_info()
    n = info.world_size
    cfg = RunConfig(model=model, world_size=n, steps=steps)
    probes = Probes(info.rank, info.device)
    log = _Log(probes.comm.calls)
    logged = dataclasses.replace(
        pieces,
        before_forward=log.moment("forward", pieces.before_forward),
        before_backward=log.moment("backward", pieces.before_backward),
    )
    try:
        with probes:
            eng = _learner("attach and make_optimizer", Learner(logged).build, cfg, build_model(model), info)
            log.units = eng.units
            probes.timeline.watch_blocks(eng.model)
            dist.barrier()
            probes.comm.emulate_link(link_gbytes)
            probes.timeline.reset_clock()
            with Patch(GATHERS, log.wrap, outermost=True):
                losses = train_steps(eng, model, steps, probes, log)
        oracle = single_losses(cfg, info.device)
        parted = torch.tensor([float(worst_rel(losses, oracle) > LOSS_RTOL)], device=info.device)
        dist.all_reduce(parted, op=dist.ReduceOp.MAX)  # every rank runs 02's moments alike, or none does
        plain_losses = None
        if parted.item():
            again = _learner("your 02 engine", Learner(plain).build, cfg, build_model(model), info)
            plain_losses = train_steps(again, model, steps)
    except _LearnerError as e:
        return {"error": e.text, "where": e.where, "line": e.line}
    return {
        "losses": losses,
        "oracle": oracle,
        "plain_losses": plain_losses,
        "events": log.events,
        "comm": [probes.comm.summary(s) for s in range(steps)],
        "unit_wire_bytes": {u.name: _unit_wire_bytes(u) for u in eng.units},
        "timeline": [e for e in probes.timeline.events if e["step"] == steps - 1],
    }


def single_losses(cfg: RunConfig, device: torch.device) -> list[float]:
    """`single`'s loss at each of `cfg.steps` steps on the global batch: the oracle, computed on this rank."""
    single = SingleEngine(build_model(cfg.model), cfg, device)
    batches = (on_rank.rank_batch(s, cfg.model, 0, 1, 0, device) for s in range(cfg.steps))
    return [on_rank.timed_step(single, s, data)[0].item() for s, data in enumerate(batches)]


def train_steps(
    eng, model: str, steps: int, probes: Probes | None = None, log: _Log | None = None
) -> list[float]:
    """`steps` steps of `eng` on this rank's slices; the global mean loss of each (the mean outside the step)."""
    info = on_rank.rank_info()
    losses = []
    for step in range(steps):
        if log is not None:
            log.events.append(("step", step))
        data = on_rank.rank_batch(step, model, 0, info.world_size, info.rank, info.device)
        loss, _ = _learner(
            f"training step {step}", on_rank.timed_step, eng, step, data, probes, trace=eng.trace
        )
        dist.all_reduce(loss)
        losses.append(loss.item() / info.world_size)
    return losses


def _unit_wire_bytes(unit) -> int:
    """What one step's all-gathers of `unit` send per rank: twice (n-1)/n of its padded shards' bytes."""
    return 2 * sum(
        collective_wire_bytes(ALL_GATHER, s.numel() * s.element_size() * unit.n, unit.n) for s in unit.shards
    )


def worst_rel(got: list[float], want: list[float]) -> float:
    """The largest relative difference of `got` to `want`, step by step."""
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


# ------------------------------------------------------------------------------------------------ verdict


def verdict(ranks: list[dict], model: str, n: int) -> CheckResult:
    """The result, from every rank's record (rank order): one sentence per failing property, else what held."""
    r0 = ranks[0]
    formula = formula_wire_bytes(model, n)
    steps = _steps(r0["events"])
    figures = {
        "losses": r0["losses"],
        "oracle": r0["oracle"],
        "loss_rel": worst_rel(r0["losses"], r0["oracle"]),
        "wire_bytes": {k: r0["comm"][0].get(k, {}).get("wire_bytes", 0) for k in formula},
        "formula_bytes": formula,
        "timeline": [e for r in ranks for e in r["timeline"]],
    }
    said = [
        _losses_said(r0),
        _bytes_said(r0, steps, formula),
        next(filter(None, (_order_said(_steps(r["events"])) for r in ranks)), None),
    ]
    failing = [s for s in said if s]
    if failing:
        return CheckResult(STEP, False, "\n  ".join(failing), figures)
    flying = [len(_pairs(steps[0], p)) for p in ("forward", "backward")]
    return CheckResult(
        STEP,
        True,
        f"losses equal to single's over {len(steps)} steps (largest relative difference {figures['loss_rel']:.1e}); "
        f"the bytes of ZeRO-3 without prefetch, to the byte (all-gather {formula[ALL_GATHER]:,} B, reduce-scatter "
        f"{formula[REDUCE_SCATTER]:,} B per rank per step); and in every step each unit's gather but the first of "
        f"each pass ({flying[0]} in forward, {flying[1]} in backward) was issued before the unit ahead of it began "
        "computing and waited for only when its own unit began: in flight while that unit computed",
        figures,
    )


def _steps(events: list[tuple]) -> list[list[tuple]]:
    """The log cut at each ("step", s) marker: one list of events per step."""
    steps: list[list[tuple]] = []
    for event in events:
        if event[0] == "step":
            steps.append([])
        elif steps:
            steps[-1].append(event)
    return steps


def _losses_said(r: dict) -> str | None:
    """The losses against single's; which moment the step that parted points to."""
    diffs = [abs(a - b) / abs(b) for a, b in zip(r["losses"], r["oracle"], strict=True)]
    if max(diffs) <= LOSS_RTOL:
        return None
    k = next(i for i, d in enumerate(diffs) if d > LOSS_RTOL)
    plain = r["plain_losses"]
    if plain is not None and worst_rel(plain, r["oracle"]) > LOSS_RTOL:
        return (
            f"losses: your 02 engine parts from single's losses without prefetch too (step {k}): run 02's "
            "checks again, they name the piece"
        )
    hint = (
        "before_forward let a unit compute with weights that are not its own: wait for the unit's gather, then "
        "load each full weight into its parameter, before the unit computes"
        if k == 0
        else "the forward of step 0 was right, so a later one, or a backward, computed with weights that are not "
        "the unit's current ones: before_backward must load the unit's own gather, and no gather may stay "
        "pending from one step to the next (the optimizer changes the shards)"
    )
    return (
        f"losses: with your prefetch the loss at step {k} is {r['losses'][k]:.6f}, single's {r['oracle'][k]:.6f} "
        f"(relative {diffs[k]:.1e}, float32 allows {LOSS_RTOL:.0e}), and with 02's moments it is single's: {hint}"
    )


def _bytes_said(r: dict, steps: list[list[tuple]], formula: dict[str, int]) -> str | None:
    """The bytes: each step's wire bytes against the formula; for the all-gathers, the first unit gathered more or
    less than its share, and the moments that issued its gathers."""
    for s, (comm, events) in enumerate(zip(r["comm"], steps, strict=True)):
        got = {k: comm.get(k, {}).get("wire_bytes", 0) for k in formula}
        if got[ALL_GATHER] != formula[ALL_GATHER]:
            sent, by = _gathers_by_unit(events)
            unit = next((u for u, want in r["unit_wire_bytes"].items() if sent.get(u, 0) != want), None)
            which = (
                f": {unit}'s gathers sent {sent.get(unit, 0):,} B, its share {r['unit_wire_bytes'][unit]:,} B, "
                f"issued in {names_of(by.get(unit, ['no moment']))}"
                if unit is not None
                else ""
            )
            return (
                f"bytes: in step {s} your engine sent {got[ALL_GATHER]:,} B of all-gather per rank, the formula "
                f"{formula[ALL_GATHER]:,} B (each unit once for its forward, once for its backward){which}: "
                + (
                    "a prefetched gather its unit does not use, or a unit gathered again in its own moment, is sent "
                    "all the same"
                    if got[ALL_GATHER] > formula[ALL_GATHER]
                    else "a unit loaded a gather it had loaded before (empty unit.pending once its weights are "
                    "loaded), whose weights may be an earlier step's"
                )
            )
        if got[REDUCE_SCATTER] != formula[REDUCE_SCATTER]:
            return (
                f"bytes: in step {s} your engine sent {got[REDUCE_SCATTER]:,} B of reduce-scatter per rank, the "
                f"formula {formula[REDUCE_SCATTER]:,} B: prefetch changes no reduce-scatter; run 02's "
                "reduce-scatter check again"
            )
    return None


def _gathers_by_unit(events: list[tuple]) -> tuple[dict[str, int], dict[str, list[str]]]:
    """Per unit: the wire bytes of its gathers in one step, and the moments that issued them ("before_forward
    (root)"; "outside a moment" for one issued elsewhere), each named once, in order."""
    sent: dict[str, int] = {}
    by: dict[str, list[str]] = {}
    moment = "outside a moment"
    for event in events:
        if event[0] == "begin":
            moment = f"before_{event[1]}({event[2]})"
        elif event[0] == "compute":
            moment = "outside a moment"
        elif event[0] == "issue":
            unit = event[1]
            sent[unit] = sent.get(unit, 0) + event[2]
            if moment not in by.setdefault(unit, []):
                by[unit].append(moment)
    return sent, by


def _pairs(events: list[tuple], pass_: str) -> list[tuple[str, str]]:
    """(unit, the unit that computes after it) in one pass of one step, in the order their moments fired."""
    order = [e[2] for e in events if e[0] == "begin" and e[1] == pass_]
    return list(zip(order, order[1:], strict=False))


def _order_said(steps: list[list[tuple]]) -> str | None:
    """The order: in each pass of each step, the next unit's gather issued before this unit computed and waited for
    after; the first place it was not, as a sentence naming the moment."""
    if any(e[0] == "issue" and e[1] == UNKNOWN for events in steps for e in events):
        return (
            "order: an all-gather carried none of your units' shards as they are (neither one shard nor a unit's "
            "shards concatenated in order), so the check cannot tell which unit it was for: gather the shards "
            "themselves"
        )
    for s, events in enumerate(steps):
        at = {(e[0], e[1], e[2]): i for i, e in enumerate(events) if e[0] in ("begin", "compute")}
        for pass_ in ("forward", "backward"):
            for unit, after in _pairs(events, pass_):
                said = _pair_said(events, at, pass_, unit, after, s)
                if said:
                    return f"order: {said}"
    return None


def _pair_said(events: list[tuple], at: dict, pass_: str, unit: str, after: str, s: int) -> str | None:
    """The sentence when `after`'s gather (those since `after` last computed, up to its compute in this pass)
    was not issued before `unit` computed, or was waited for before that; None when it flew under `unit`."""
    moment = f"before_{pass_}"
    computes = at[("compute", pass_, unit)]
    since = at.get(("compute", "forward", after), -1) if pass_ == "backward" else -1
    until = at[("compute", pass_, after)]
    mine = [
        (i, e[0]) for i, e in enumerate(events[since + 1 : until], since + 1) if e[0] in ("issue", "wait")
    ]
    mine = [(i, kind) for i, kind in mine if events[i][1] == after]
    issued = [i for i, kind in mine if kind == "issue"]
    waited = [i for i, kind in mine if kind == "wait"]
    where = f"in step {s}'s {pass_}"
    if issued and all(i > computes for i in issued):
        return (
            f"{after}'s gather was issued only when {after} began, after {unit} had begun computing {where}: nothing "
            f"was in flight while {unit} computed; {moment}({unit}) must issue it ({NEXT[pass_]}), without waiting"
        )
    if any(i > computes for i in issued):
        return (
            f"{after} was gathered before {unit} computed and again when it began {where}: {moment}({after}) "
            "must use the gather in flight (unit.pending), not issue another"
        )
    early = [i for i in waited if i < computes]
    if early:
        return (
            f"{moment}({unit}) waited for {after}'s gather before {unit} computed {where} (issued and waited for at "
            f"once): nothing was in flight while {unit} computed; leave it pending and wait for it in "
            f"{moment}({after})"
        )
    if issued and not waited:
        return (
            f"{after}'s gather was never waited for before {after} computed {where}: {moment}({after}) must wait for "
            "it before loading the weights"
        )
    return None
