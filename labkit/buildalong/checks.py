"""One live check per step of the build-along, on real ranks, against the single-process oracle.

Each `check_*` launches `world_size` ranks, runs the learner's pieces there under the lab's probes, and
prints one sentence: what was verified, with the measured figures, or the mistake it found. It returns
a `CheckResult` and never raises at the learner (a crash in their code is reported as a sentence). The
oracle is `single` (the same model, seed and global batch on one process, `labkit.engines.single`); the
bytes are the comm probe's, against `labkit.budget.collective_wire_bytes` of the padded sizes.
`run_checks` runs several (step, pieces) cases in one launch (the tests do). A step's check runs the checks of
the steps it builds on first (BUILDS_ON), so a wrong `shard` is said as "fix `shard` first", not as a later
piece's mistake. Gradients are judged before any optimizer step, against single's (`labkit.gradients`).
"""

from __future__ import annotations

import dataclasses
import os
import traceback
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

import labkit
from labkit.buildalong.gradient_verdicts import rows_expected
from labkit.buildalong.scaffold import Learner, Pieces, attach
from labkit.buildalong.verdicts import CheckResult, fix_first, launched, verdict
from labkit.engines import on_rank
from labkit.engines.base import RunConfig
from labkit.engines.single import SingleEngine
from labkit.errors import error_text
from labkit.layout import owned_rows
from labkit.model import build_model, loss_fn
from labkit.probes import Probes, state_bytes

TIMEOUT_S = 120.0
STEPS = ("shard", "gather", "forward", "backward", "reduce_scatter", "adamw")
NEEDS = {  # the pieces each step's check runs
    "shard": ("shard",),
    "gather": ("gather",),
    "forward": ("shard", "before_forward", "after_forward"),
    "backward": ("shard", "before_forward", "after_forward", "before_backward"),
    "reduce_scatter": ("shard", "before_forward", "after_forward", "before_backward", "after_grad"),
    "adamw": ("shard", "before_forward", "after_forward", "before_backward", "after_grad", "make_optimizer"),
}
BUILDS_ON = {  # the earlier steps whose pieces a step's check runs: their checks run first, in the same launch
    "shard": (),
    "gather": (),
    "forward": ("shard", "gather"),
    "backward": ("shard", "gather", "forward"),
    "reduce_scatter": ("shard", "gather", "forward", "backward"),
    "adamw": ("shard", "gather", "forward", "backward", "reduce_scatter"),
}


# ------------------------------------------------------------------------------------------------ public


def check_shard(shard: Callable, world_size: int = 3, model: str = "tiny_uneven") -> CheckResult:
    """Every rank shards every parameter of `model`: ceil(d0/n) rows, zero-padded, the full tensor's rows."""
    return _one("shard", Pieces(shard=shard), world_size, model)


def check_gather(gather: Callable, world_size: int = 3, model: str = "tiny_uneven") -> CheckResult:
    """Every rank gathers every parameter from correct shards: the full tensor, and (n-1)/n of its padded bytes."""
    return _one("gather", Pieces(gather=gather), world_size, model)


def check_forward(pieces: Pieces, world_size: int = 3, model: str = "tiny_uneven") -> CheckResult:
    """One forward: the loss is single's, each unit gathered only while it computes and freed after."""
    return _one("forward", pieces, world_size, model)


def check_backward(pieces: Pieces, world_size: int = 3, model: str = "tiny_uneven") -> CheckResult:
    """Forward and backward (full gradients kept): the mean gradient is single's, each unit gathered twice."""
    return _one("backward", pieces, world_size, model)


def check_reduce_scatter(pieces: Pieces, world_size: int = 3, model: str = "tiny_uneven") -> CheckResult:
    """After backward each shard's grad is its rows of single's gradient; the full grads and weights are gone."""
    return _one("reduce_scatter", pieces, world_size, model)


def check_adamw(
    pieces: Pieces, world_size: int = 3, model: str = "tiny_uneven", steps: int = 3
) -> CheckResult:
    """`steps` training steps: the losses are single's, and AdamW holds only this rank's shards."""
    return _one("adamw", pieces, world_size, model, steps)


def run_checks(
    cases: Sequence[tuple[str, Pieces]],
    world_size: int = 3,
    model: str = "tiny_uneven",
    steps: int = 3,
    quiet: bool = False,
) -> list[CheckResult]:
    """Several (step, pieces) checks in ONE launch, in order; each result printed unless `quiet`.

    A step's check first runs the checks of the steps it builds on (BUILDS_ON: `gather` only when the pieces
    hold one) with the same pieces; when one of those fails, the step says "fix `<piece>` first" with that
    check's sentence, and the ranks skip it when the failure would derail them (a mis-sized shard)."""
    results: list[CheckResult | None] = [None] * len(cases)
    plan: dict[tuple, tuple[str, Pieces, tuple[tuple, ...]]] = {}  # key -> (step, pieces, keys it builds on)
    for i, (step, pieces) in enumerate(cases):
        if step not in STEPS:
            raise ValueError(f"unknown build step {step!r}; choose one of {', '.join(STEPS)}")
        missing = [name for name in NEEDS[step] if getattr(pieces, name) is None]
        if missing:
            results[i] = CheckResult(
                step,
                False,
                f"{' and '.join(missing)} not written yet (None): write "
                f"{'it' if len(missing) == 1 else 'them'}, then run this check again",
            )
            continue
        before: list[tuple] = []
        for earlier in (*_builds_on(step, pieces), step):
            key = _key(earlier, pieces)
            plan.setdefault(key, (earlier, pieces, tuple(before)))
            before.append(key)
    if plan:
        keys = list(plan)
        rank_cases = [(step, pieces, [keys.index(k) for k in after]) for step, pieces, after in plan.values()]
        ranks, sentence = launched(_rank_cases, world_size, rank_cases, model, steps, timeout_s=TIMEOUT_S)
        found = {
            key: CheckResult(step, False, sentence)
            if ranks is None
            else verdict(step, [r[j] for r in ranks], model, world_size, steps)
            for j, (key, (step, _, _)) in enumerate(plan.items())
        }
        for i, (step, pieces) in enumerate(cases):
            if results[i] is None:
                results[i] = _after_earlier(step, pieces, found, launch_failed=ranks is None)
    if not quiet:
        for result in results:
            print(result)
    return results


def _builds_on(step: str, pieces: Pieces) -> list[str]:
    """The earlier steps whose checks `step`'s check stands on, for these pieces (`gather` only if given)."""
    return [s for s in BUILDS_ON[step] if all(getattr(pieces, name) is not None for name in NEEDS[s])]


def _key(step: str, pieces: Pieces) -> tuple:
    """One case per step and the pieces it and the steps it builds on run: checks that share them share a run."""
    names = {name for s in (*_builds_on(step, pieces), step) for name in NEEDS[s]}
    return (step, *(id(getattr(pieces, name)) if name in names else None for name in vars(pieces)))


def _after_earlier(step: str, pieces: Pieces, found: dict, launch_failed: bool) -> CheckResult:
    """The step's own result, or "fix `<piece>` first" with the sentence of the first earlier check that failed."""
    own = found[_key(step, pieces)]
    if launch_failed:
        return own
    for earlier in _builds_on(step, pieces):
        result = found[_key(earlier, pieces)]
        if not result.ok:
            return CheckResult(step, False, fix_first(earlier, result.sentence), {"blocked_by": earlier})
    return own


def _one(step: str, pieces: Pieces, world_size: int, model: str, steps: int = 3) -> CheckResult:
    return run_checks([(step, pieces)], world_size, model, steps)[0]


# ------------------------------------------------------------------------------------------------ ranks


def _rank_cases(cases, model: str, steps: int) -> list[dict]:
    """Rank side of `run_checks`: each case's measurements on this rank (or the error the learner's code
    raised). A case whose earlier cases failed for sure on some rank is skipped on every rank."""
    out: list[dict] = []
    failed: list[bool] = []
    device = on_rank.rank_info().device
    for step, pieces, after in cases:
        if any(failed[j] for j in after):
            out.append({"skipped": True})
            failed.append(True)
            continue
        try:
            out.append(_RANK[step](pieces, model, steps))
        except _LearnerError as e:
            out.append({"error": e.text, "where": e.where, "line": e.line, "held": e.held})
        flag = torch.tensor([float(_surely_wrong(step, out[-1]))], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the check's own collective: every rank skips alike
        failed.append(bool(flag.item()))
    return out


def _surely_wrong(step: str, r: dict) -> bool:
    """This rank alone sees the case fail: the learner's code raised, or a shard or gather is wrong (the
    later steps would gather mis-sized shards, which derails the ranks' collectives)."""
    if "error" in r:
        return True
    if step == "shard":
        return not all(row.get("right") for row in r["params"])
    if step == "gather":
        return not all(row["equal"] for row in r["params"])
    return False


class _LearnerError(Exception):
    def __init__(self, where: str, exc: BaseException, trace: list | None = None):
        super().__init__(where)
        self.where = where
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_learners(f.filename)]
        self.line = f"line {frames[-1].lineno}: {frames[-1].line}" if frames else ""
        self.text = error_text(exc)  # torch's own words, its first whole sentence
        self.held: dict[str, int] = {}  # bytes of full weights each unit held when it was raised
        if trace:
            self.where = f"{where}, after {trace[-1][0]}({trace[-1][1]})"


def _is_learners(filename: str) -> bool:
    """A frame of the learner's code: not torch's, not labkit's."""
    theirs = not filename.startswith(_LIBRARY_DIRS)
    return theirs and not filename.startswith("<frozen")


_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) for m in (torch, labkit))


def _learner(where: str, fn: Callable, *args, trace: list | None = None):
    """Call the learner's code; an exception becomes a _LearnerError saying where it happened."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - any mistake of theirs is reported, not raised
        raise _LearnerError(where, e, trace) from e


def _setup(model: str):
    info = on_rank.rank_info()
    return info, dist.get_rank(), dist.get_world_size(), on_rank.rank_model(model, 0, info.device)


def _rank_shard(pieces: Pieces, model: str, steps: int) -> dict:
    info, rank, n, net = _setup(model)
    rows = []
    for name, p in net.named_parameters():
        full = p.detach().clone()
        s = _learner(f"shard({name})", pieces.shard, full, rank, n)
        if not isinstance(s, torch.Tensor):
            rows.append({"name": name, "type": type(s).__name__})
            continue
        want = rows_expected(full.float(), rank, n)
        real = owned_rows(full, rank, n).shape[0]
        same_shape = tuple(s.shape) == tuple(want.shape)
        wrong = _rows_where(s[:real].float() != want[:real]) if same_shape else []
        nonzero = [real + i for i in _rows_where(s[real:] != 0)] if same_shape else []
        view = s.untyped_storage().data_ptr() == full.untyped_storage().data_ptr() and s.numel() > 0
        row = {
            "name": name,
            "shape": tuple(s.shape),
            "want": tuple(want.shape),
            "dtype": str(s.dtype),
            "view": view,
            "rows_equal": same_shape and not wrong,
            "first_wrong_row": wrong[0] if wrong else None,
            "padding_zero": same_shape and not nonzero,
            "first_nonzero_padding": nonzero[0] if nonzero else None,
        }
        row["right"] = row["rows_equal"] and row["padding_zero"] and s.dtype == torch.float32 and not view
        rows.append(row)
    return {"params": rows}


def _rank_gather(pieces: Pieces, model: str, steps: int) -> dict:
    info, rank, n, net = _setup(model)
    rows = []
    with Probes(rank, info.device) as probes, probes.step(0):
        for name, p in net.named_parameters():
            full = p.detach().float()
            out = _learner(
                f"gather({name})", pieces.gather, rows_expected(full, rank, n), full.shape[0], None
            )
            ok_shape = isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(full.shape)
            wrong = _rows_where(out.float() != full) if ok_shape else []
            rows.append(
                {
                    "name": name,
                    "type": type(out).__name__,
                    "shape": tuple(out.shape) if isinstance(out, torch.Tensor) else None,
                    "want": tuple(full.shape),
                    "equal": ok_shape and not wrong,
                    "first_wrong_row": wrong[0] if wrong else None,
                }
            )
    return {"params": rows, "comm": probes.comm.summary(0)}


def _rows_where(differs: torch.Tensor) -> list[int]:
    """The dim-0 indices of the rows where `differs` (a boolean tensor) holds anywhere."""
    if not differs.numel():
        return []
    return differs.reshape(differs.shape[0], -1).any(dim=1).nonzero().flatten().tolist()


def _held_bytes(unit) -> int:
    """Bytes of full weights a unit holds now (a freed parameter's storage has 0 bytes)."""
    return sum(p.untyped_storage().nbytes() for p in unit.params)


def _rank_forward(pieces: Pieces, model: str, steps: int) -> dict:
    info, rank, n, net = _setup(model)
    oracle = on_rank.rank_model(model, 0, info.device)
    tokens, targets = on_rank.rank_batch(0, model, 0, n, rank, info.device)
    trace: list = []
    units = _learner("attach (your shard)", attach, net, pieces, None, trace)
    others_held: dict[str, dict[str, int]] = {}
    computing: dict[int, str] = {}  # storage address of a weight whose unit computes now -> the unit

    def at_compute(unit):
        others_held[unit.name] = {
            u.name: _held_bytes(u) for u in units if u is not unit and u.name != "root" and _held_bytes(u)
        }
        computing.update({p.untyped_storage().data_ptr(): unit.name for p in unit.params if p.numel()})

    def computed(unit):
        for address in [a for a, u in computing.items() if u == unit.name]:
            del computing[address]

    for unit in units:  # registered after attach's: they run once the learner's moment is done
        unit.module.register_forward_pre_hook(lambda _m, _a, unit=unit: at_compute(unit))
        unit.module.register_forward_hook(lambda _m, _a, _o, unit=unit: computed(unit))
    saved: list[tuple[weakref.ref, str]] = []  # what autograd saved from a computing unit's weights

    def pack(t):
        unit = computing.get(t.untyped_storage().data_ptr()) if t.numel() else None
        if unit is not None:
            saved.append((weakref.ref(t), unit))
        return t

    with Probes(rank, info.device) as probes, probes.step(0):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = _learner("forward", lambda: loss_fn(net(tokens), targets), trace=trace)
    pinned: dict[str, int] = {}  # bytes of those still alive after forward (the same storage once)
    seen = set()
    for ref, unit in saved:
        t = ref()
        if t is not None and t.untyped_storage().nbytes() and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            pinned[unit] = pinned.get(unit, 0) + t.untyped_storage().nbytes()
    return {
        "loss": loss.item(),
        "oracle": loss_fn(oracle(tokens), targets).item(),
        "trace": trace,
        "held": {u.name: _held_bytes(u) for u in units},
        "others_held": others_held,
        "pinned": pinned,
        "comm": probes.comm.summary(0),
    }


def _forward_backward(pieces: Pieces, model: str):
    info, rank, n, net = _setup(model)
    tokens, targets = on_rank.rank_batch(0, model, 0, n, rank, info.device)
    trace: list = []
    units = _learner("attach (your shard)", attach, net, pieces, None, trace)
    with Probes(rank, info.device) as probes, probes.step(0):
        loss = _learner("forward", lambda: loss_fn(net(tokens), targets), trace=trace)
        try:
            _learner("backward", loss.backward, trace=trace)
        except _LearnerError as e:
            e.held = {u.name: _held_bytes(u) for u in units}
            raise
    names = {id(p): name for name, p in net.named_parameters()}
    return info, rank, n, net, units, names, trace, probes.comm.summary(0)


def _rank_backward(pieces: Pieces, model: str, steps: int) -> dict:
    """Forward and backward with no after_grad: this rank's full gradients (of its slice), for the parent to
    average over ranks and hold against single's."""
    pieces = dataclasses.replace(pieces, after_grad=None)  # the full gradients stay, to compare with single's
    info, rank, n, net, units, names, trace, comm = _forward_backward(pieces, model)
    return {"grads": _cpu_grads(net.named_parameters()), "trace": trace, "comm": comm}


def _rank_reduce_scatter(pieces: Pieces, model: str, steps: int) -> dict:
    """Forward and backward with the learner's after_grad: each shard's .grad (what the optimizer would
    read), the full gradients and weights still held, and the step's collectives."""
    info, rank, n, net, units, names, trace, comm = _forward_backward(pieces, model)
    pairs = [(names[id(p)], s) for unit in units for p, s in zip(unit.params, unit.shards, strict=True)]
    full_grads = sum(p.grad.numel() * p.grad.element_size() for p in net.parameters() if p.grad is not None)
    return {
        "shard_grads": _cpu_grads(pairs),
        "shard_shapes": {name: tuple(s.shape) for name, s in pairs},
        "full_grad_bytes": full_grads,
        "held": {u.name: _held_bytes(u) for u in units},
        "trace": trace,
        "comm": comm,
    }


def _cpu_grads(named) -> dict[str, torch.Tensor | None]:
    """{name: a CPU copy of its .grad, or None}: what a rank sends back to be judged."""
    return {name: None if t.grad is None else t.grad.detach().float().cpu().clone() for name, t in named}


def _rank_adamw(pieces: Pieces, model: str, steps: int) -> dict:
    info = on_rank.rank_info()
    rank, n = dist.get_rank(), dist.get_world_size()
    cfg = RunConfig(model=model, world_size=n, steps=steps)
    eng = _learner("attach and make_optimizer", Learner(pieces).build, cfg, build_model(model), info)
    oracle = SingleEngine(build_model(model), cfg, info.device)
    opt = eng.optimizer
    group = opt.param_groups[0] if isinstance(opt, torch.optim.Optimizer) and opt.param_groups else {}
    shard_ids = {id(s) for s in eng.shards}
    held = [t for g in getattr(opt, "param_groups", []) for t in g["params"]]
    losses, single = [], []
    for step in range(steps):
        data = on_rank.rank_batch(step, model, 0, n, rank, info.device)
        loss, _ = _learner(f"training step {step}", on_rank.timed_step, eng, step, data, trace=eng.trace)
        dist.all_reduce(loss)
        losses.append(loss.item() / n)
        data = on_rank.rank_batch(step, model, 0, 1, 0, info.device)
        single.append(on_rank.timed_step(oracle, step, data)[0].item())
    return {
        "optimizer": type(opt).__name__,
        "is_adamw": isinstance(opt, torch.optim.AdamW),
        "hyper": {k: group.get(k) for k in ("lr", "betas", "eps", "weight_decay")},
        "want_hyper": {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay},
        "not_shards": sum(id(t) not in shard_ids for t in held),
        "n_held": len(held),
        "n_shards": len(shard_ids),
        "state_bytes": state_bytes(eng.state_tensors())["optimizer"],
        "oracle_state_bytes": state_bytes(oracle.state_tensors())["optimizer"],
        "losses": losses,
        "oracle": single,
    }


_RANK = {
    "shard": _rank_shard,
    "gather": _rank_gather,
    "forward": _rank_forward,
    "backward": _rank_backward,
    "reduce_scatter": _rank_reduce_scatter,
    "adamw": _rank_adamw,
}
