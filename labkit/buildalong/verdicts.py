"""The sentences of the build-along's checks: from what every rank measured to one verdict per step.

Parent side of `labkit.buildalong.checks`. Each step has a `_mistake_<step>` that returns the sentence naming the
first mistake it finds (checked in the order a learner would make them), or None; then the sentence of
what was verified, with the measured figures. Bytes are compared with `labkit.budget`'s ring formula on
the padded sizes, exactly; losses with single's, to the engines' float32 tolerance, and gradients (before any
optimizer step) with single's by `labkit.gradients`, which names a factor of n.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from labkit.budget import collective_wire_bytes, padded_numel
from labkit.buildalong.gradient_verdicts import (
    grads_said,
    mean_over_ranks,
    rows_expected,
    single_gradients,
    worst_rel,
)
from labkit.buildalong.stubs import unwritten
from labkit.model import build_model
from labkit.names import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER

LOSS_RTOL = 1e-4  # float32: the engines' contract with single


@dataclass
class CheckResult:
    """What one check found: `ok`, the sentence it printed, and the measured figures behind it."""

    step: str
    ok: bool
    sentence: str
    figures: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{'✓' if self.ok else '✗'} {self.step}: {self.sentence}"

    def _ipython_display_(self) -> None:
        pass  # printed when it was made; as a cell's last value it is not shown twice


class ModelFacts:
    """The parent's view of the model the ranks ran: names, shapes, padded bytes, the byte formulas."""

    def __init__(self, name: str, n: int):
        self.name = name
        self.n = n
        self.shapes = {k: tuple(p.shape) for k, p in build_model(name).named_parameters()}
        self.padded_bytes = {k: padded_numel(s, n) * 4 for k, s in self.shapes.items()}  # float32
        self.gather_bytes = self._wire(ALL_GATHER)  # each parameter gathered once
        self.scatter_bytes = self._wire(REDUCE_SCATTER)  # each gradient reduced once

    def _wire(self, kind: str) -> int:
        return sum(collective_wire_bytes(kind, b, self.n) for b in self.padded_bytes.values())

    def rows(self, name: str) -> tuple[int, int]:
        """(d0, ceil(d0/n)) of parameter `name`."""
        d0 = self.shapes[name][0]
        return d0, -(-d0 // self.n)


def launched(
    fn: Callable, world_size: int, *args, timeout_s: float, question: str = ""
) -> tuple[list | None, str]:
    """Every rank's result of `labkit.launch(fn, world_size, *args)`, or None and the one sentence a check says
    instead: a stub's "write this piece", what each rank was doing when the launch ran past `timeout_s`
    (with `question`, what the learner should ask of their code), or the first line of the launch's failure."""
    import labkit

    try:
        return labkit.launch(fn, world_size, *args, timeout=timeout_s), ""
    except labkit.LaunchTimeout as e:
        doing = "; ".join(f"rank {r}: {d}" for r, d in sorted(e.doing.items()))
        return None, (
            f"the ranks did not finish in {timeout_s:.0f} s ({doing}): a collective that not every rank calls, "
            "or calls with other sizes, waits forever" + (f" ({question})" if question else "")
        )
    except labkit.LaunchError as e:
        return None, unwritten(e) or f"the ranks failed before reporting ({str(e).splitlines()[0]})"


def verdict(step: str, ranks: list[dict], model: str, n: int, steps: int) -> CheckResult:
    """The result of one case, from every rank's measurements (rank order)."""
    if any("skipped" in r for r in ranks):  # run_checks says which earlier check failed instead
        return CheckResult(step, False, "not run: an earlier check of these pieces failed", {"skipped": True})
    failed = next(((rank, r) for rank, r in enumerate(ranks) if "error" in r), None)
    if failed is not None:
        return CheckResult(step, False, error_sentence(*failed), failed[1])
    figures_of, mistake_of, ok_of = _STEPS[step]
    m = ModelFacts(model, n)
    figures = figures_of(ranks, m, steps)
    mistake = mistake_of(ranks, m, figures)
    if mistake is not None:
        return CheckResult(step, False, mistake, figures)
    return CheckResult(step, True, ok_of(ranks, m, figures), figures)


def error_sentence(rank: int, r: dict) -> str:
    """The sentence for code that raised: where, what, and (for the model's own ops) which weight was absent."""
    where, text = r["where"], r["error"]
    if (stub := unwritten(text)) is not None:
        return stub
    unit = where.rsplit("(", 1)[-1].rstrip(")") if "after " in where else "a unit"
    if not r.get("line"):  # raised in the model's ops, not in the learner's code: its weights were absent
        if where.startswith("backward") and r.get("held", {}).get(unit):
            return (
                f"before_backward gave {unit}'s parameters new tensors, but its backward reads the views "
                f"autograd saved in forward, whose storage after_forward freed ({text}): gather back into "
                "the same storage (resize it, then copy, as load does)"
            )
        if where.startswith("backward"):
            return f"the backward of {unit} found its weights freed ({text}): gather them again in before_backward"
        if where.startswith("forward"):
            return (
                f"the forward of {unit} found no weights ({text}): before_forward must gather each of the "
                "unit's weights into its parameter (p in unit.params) before the unit computes"
            )
    line = f" ({r['line']})" if r.get("line") else ""
    return f"your code raised {text} in {where} on rank {rank}{line}"


PIECES_OF = {  # the pieces each step adds to the build: what "fix ... first" names
    "shard": ("shard",),
    "gather": ("gather",),
    "forward": ("before_forward", "after_forward"),
    "backward": ("before_backward",),
    "reduce_scatter": ("after_grad",),
    "adamw": ("make_optimizer",),
}


def fix_first(earlier: str, sentence: str) -> str:
    """What a check says when the check of an `earlier` step, which it builds on, failed with `sentence`: fix
    that piece first (a piece still to write is said as its own sentence)."""
    if sentence.startswith("write this piece") or "not written yet" in sentence:
        return sentence
    pieces = " and ".join(f"`{name}`" for name in PIECES_OF[earlier])
    return f"fix {pieces} first, this check runs on {'it' if len(PIECES_OF[earlier]) == 1 else 'them'}: {sentence}"


def _tol(x: float) -> str:
    return "exactly" if x == 0 else f"to {x:.0e}"


def _wire(comm: dict, kind: str) -> int:
    return comm.get(kind, {}).get("wire_bytes", 0)


def names_of(units: Sequence[str]) -> str:
    """'a', 'a and b', 'a, b and c'; past four names, 'a, b, c and 5 more'."""
    units = list(units)
    if len(units) > 4:
        return f"{', '.join(units[:3])} and {len(units) - 3} more"
    return " and ".join(filter(None, [", ".join(units[:-1]), units[-1]]))


# ------------------------------------------------------------------------------------------------ shard


def _shard_figures(ranks: list[dict], m: ModelFacts, steps: int) -> dict:
    rows = {k: [r["params"][i].get("shape", (0,))[0] for r in ranks] for i, k in enumerate(m.shapes)}
    pad = sum(b // 4 - math.prod(m.shapes[k]) for k, b in m.padded_bytes.items())
    return {"params": len(m.shapes), "padding_elements": pad, "rows": rows}


def _shard_mistake(ranks: list[dict], m: ModelFacts, figures: dict) -> str | None:
    n = m.n
    for i, name in enumerate(m.shapes):
        d0, k = m.rows(name)
        for rank, row in enumerate(r["params"][i] for r in ranks):
            if "shape" not in row:
                return (
                    f"shard returned a {row['type']} for {name} on rank {rank}; return a tensor of shape "
                    f"{(k, *m.shapes[name][1:])}"
                )
            if row["shape"][:1] != (k,):
                got = row["shape"][0] if row["shape"] else 0
                return (
                    f"rank {rank} of {n} has {got} rows of the {d0}-row {name}; every rank needs "
                    f"ceil({d0}/{n}) = {k}, zero-padded, or the gather's buffers do not line up"
                )
            if row["shape"][1:] != row["want"][1:]:
                return (
                    f"rank {rank}'s shard of {name} has shape {row['shape']}, not {row['want']}: cut on dim 0 "
                    "only, keep the other dims"
                )
            if row["dtype"] != "torch.float32":
                return (
                    f"rank {rank}'s shard of {name} is {row['dtype']}: the shards are the float32 master copy "
                    "the optimizer updates"
                )
            if not row["rows_equal"]:
                i = row["first_wrong_row"]
                return (
                    f"row {i} of rank {rank}'s shard of {name} is not row {rank * k + i} of the full tensor (its "
                    f"rows [{rank * k}, {min(d0, (rank + 1) * k)}) should be): rank r keeps rows [r*k, (r+1)*k), "
                    f"k = {k}"
                )
            if not row["padding_zero"]:
                real = max(0, min(k, d0 - rank * k))
                return (
                    f"row {row['first_nonzero_padding']} of rank {rank}'s shard of {name} is not zero, but it is "
                    f"padding ({n} x {k} rows hold {d0}: rank {rank}'s last {k - real} are padding): pad with "
                    "zeros, so padding never counts"
                )
            if row["view"]:
                return (
                    f"rank {rank}'s shard of {name} is a view of the full tensor (it shares its storage): "
                    "freeing the full weight would free nothing; return a copy"
                )
    return None


def _shard_ok(ranks: list[dict], m: ModelFacts, figures: dict) -> str:
    # an example with padding when n leaves rows over in some parameter (never at n = 1: one shard, whole)
    example = next((k for k in m.shapes if m.rows(k)[0] % m.n), next(iter(m.shapes)))
    d0, k = m.rows(example)
    per_rank = sum(b // 4 for b in m.padded_bytes.values()) // m.n
    return (
        f"each of the {len(m.shapes)} parameters cut into {m.n} shard{'s' * (m.n > 1)} of ceil(d0/{m.n}) rows, "
        f"each the full tensor's rows, zero-padded: {per_rank:,} elements per rank, and "
        f"{figures['padding_elements']:,} of padding over all ranks, at the end of the last ranks' shards "
        f"({example}: {m.n} x {k} rows for {d0})"
    )


# ------------------------------------------------------------------------------------------------ gather


def _gather_figures(ranks: list[dict], m: ModelFacts, steps: int) -> dict:
    return {"wire_bytes": _wire(ranks[0]["comm"], ALL_GATHER), "formula_bytes": m.gather_bytes}


def _gather_mistake(ranks: list[dict], m: ModelFacts, figures: dict) -> str | None:
    for rank, r in enumerate(ranks):
        for row in r["params"]:
            name = row["name"]
            d0, k = m.rows(name)
            if row["shape"] is None:
                return (
                    f"gather returned a {row['type']} for {name} on rank {rank}: return the full tensor, of "
                    f"shape {row['want']}"
                )
            if row["shape"] != row["want"]:
                hint = (
                    f"keep the first d0 = {d0} (the rest is padding)"
                    if row["shape"][0] == k * m.n
                    else f"the full tensor has shape {row['want']}"
                )
                return (
                    f"gather returned {row['shape'][0]} rows of {name} on rank {rank} (shape {row['shape']}, want "
                    f"{row['want']}); {hint}"
                )
            if not row["equal"]:
                i = row["first_wrong_row"]
                return (
                    f"row {i} of the gathered {name} on rank {rank} is not the full tensor's row {i} (row {i % k} "
                    f"of rank {i // k}'s shard): rank r's shard goes to rows [r*k, (r+1)*k) (k = {k}), in rank order"
                )
    if ALL_REDUCE in ranks[0]["comm"]:
        return (
            f"gather used an all-reduce ({_wire(ranks[0]['comm'], ALL_REDUCE):,} B on the wire, an all-gather's "
            f"is {m.gather_bytes:,} B): it works on zero-padded buffers but sends 2(n-1)/n of the bytes, twice "
            "an all-gather's (n-1)/n"
        )
    if figures["wire_bytes"] != m.gather_bytes:
        return (
            f"all-gather wire bytes {figures['wire_bytes']:,} B, but (n-1)/n x padded bytes = "
            f"{m.gather_bytes:,} B: gather each parameter once, from its padded shard"
        )
    return None


def _gather_ok(ranks: list[dict], m: ModelFacts, figures: dict) -> str:
    return (
        f"every parameter gathered back exactly on every rank; all-gather wire bytes {figures['wire_bytes']:,} B "
        "= (n-1)/n x padded bytes, to the byte"
    )


# ------------------------------------------------------------------------------------------------ forward


def _forward_figures(ranks: list[dict], m: ModelFacts, steps: int) -> dict:
    return {
        "loss_rel": max(abs(r["loss"] - r["oracle"]) / abs(r["oracle"]) for r in ranks),
        "wire_bytes": _wire(ranks[0]["comm"], ALL_GATHER),
        "formula_bytes": m.gather_bytes,
        "trace": ranks[0]["trace"],
    }


def _forward_mistake(ranks: list[dict], m: ModelFacts, figures: dict) -> str | None:
    r0 = ranks[0]
    if figures["loss_rel"] > LOSS_RTOL:
        return (
            f"loss {r0['loss']:.6f} differs from single's {r0['oracle']:.6f} on the same slice (relative "
            f"{figures['loss_rel']:.1e}): each parameter must hold exactly gather(shard, d0) while its unit computes"
        )
    held = {u: b for u, b in r0["held"].items() if b}
    if held:
        first = next(iter(held))
        return (
            f"after forward {names_of(held)} still hold{'s its' if len(held) == 1 else ' their'} full weights "
            f"({first}: {held[first]:,} B, want 0 B): free them in after_forward"
        )
    if r0["pinned"]:
        first = next(iter(r0["pinned"]))
        return (
            f"after forward autograd still holds the full weights of {names_of(r0['pinned'])} ({first}: "
            f"{r0['pinned'][first]:,} B, want 0 B) in the tensors it saved for backward: replacing p.data leaves the "
            "gathered tensor alive there; free its storage (p.untyped_storage().resize_(0)) and gather back into it"
        )
    early = {u: o for u, o in r0["others_held"].items() if o}
    if early:
        unit, others = next(iter(early.items()))
        return (
            f"while {unit} computed, {names_of(others)} already held full weights ({sum(others.values()):,} B, "
            "want 0 B): gather each unit in its own before_forward, or the peak is the whole model"
        )
    if figures["wire_bytes"] != m.gather_bytes:
        return (
            f"forward all-gather wire bytes {figures['wire_bytes']:,} B, but (n-1)/n x padded bytes = "
            f"{m.gather_bytes:,} B: gather each unit's weights once, in its before_forward"
        )
    return None


def _forward_ok(ranks: list[dict], m: ModelFacts, figures: dict) -> str:
    return (
        f"loss equal to single's {_tol(figures['loss_rel'])} on every rank's slice; only the root and the "
        "computing block held full weights, and after its forward every unit held 0 B; all-gather wire bytes "
        f"{figures['wire_bytes']:,} B = (n-1)/n x padded bytes, to the byte"
    )


# ------------------------------------------------------------------------------------------------ backward


def _backward_figures(ranks: list[dict], m: ModelFacts, steps: int) -> dict:
    want = single_gradients(m.name)
    mean = {name: mean_over_ranks([r["grads"].get(name) for r in ranks]) for name in want}
    return {
        "grad_rel": worst_rel(mean, want),
        "mistake": grads_said(
            mean, want, f"the mean of the {m.n} ranks' full gradients after backward", m.n, after_grad=False
        ),
        "wire_bytes": _wire(ranks[0]["comm"], ALL_GATHER),
        "formula_bytes": 2 * m.gather_bytes,
        "trace": ranks[0]["trace"],
    }


def _wrong_shape(ranks: list[dict], key: str, shapes_of, noun: str, sentence: str) -> str | None:
    """`sentence` (fields rank, name, shape, said) of the first tensor under `key` whose shape is not
    `shapes_of(rank's record)[name]`, `said` being "no {noun}" or "a {noun} of shape ..."; None when all fit."""
    for rank, r in enumerate(ranks):
        for name, shape in shapes_of(r).items():
            got = r[key].get(name)
            if got is None or tuple(got.shape) != shape:
                said = f"no {noun}" if got is None else f"a {noun} of shape {tuple(got.shape)}"
                return sentence.format(rank=rank, name=name, shape=shape, said=said)
    return None


def _backward_mistake(ranks: list[dict], m: ModelFacts, figures: dict) -> str | None:
    wrong = _wrong_shape(
        ranks,
        "grads",
        lambda r: m.shapes,
        "gradient",
        "after backward {name} has {said} on rank {rank}, want its full shape {shape}: the backward needs the "
        "full weights, gathered in before_backward",
    )
    if wrong:
        return wrong
    if figures["mistake"]:
        return f"{figures['mistake']}: backward must see the same full weights as forward"
    if figures["wire_bytes"] != figures["formula_bytes"]:
        return (
            f"all-gather wire bytes {figures['wire_bytes']:,} B in forward and backward, but 2 x (n-1)/n x padded "
            f"bytes = {figures['formula_bytes']:,} B: each unit is gathered once before its forward and once "
            "before its backward"
        )
    return None


def _backward_ok(ranks: list[dict], m: ModelFacts, figures: dict) -> str:
    return (
        f"gradients (mean over ranks) equal single's {_tol(figures['grad_rel'])}; all-gather wire bytes "
        f"{figures['wire_bytes']:,} B = 2 x (n-1)/n x padded bytes, to the byte: each unit gathered for its "
        "forward and again for its backward"
    )


# ------------------------------------------------------------------------------------------------ reduce-scatter


def _scatter_figures(ranks: list[dict], m: ModelFacts, steps: int) -> dict:
    want = single_gradients(m.name)
    rows = [{name: rows_expected(w, rank, m.n) for name, w in want.items()} for rank in range(m.n)]
    said = (
        grads_said(r["shard_grads"], rows[rank], f"after backward, rank {rank}'s shard grads", m.n)
        for rank, r in enumerate(ranks)
    )
    return {
        "grad_rel": max(worst_rel(r["shard_grads"], rows[rank]) for rank, r in enumerate(ranks)),
        "mistake": next((x for x in said if x), None),
        "wire_bytes": _wire(ranks[0]["comm"], REDUCE_SCATTER),
        "formula_bytes": m.scatter_bytes,
        "trace": ranks[0]["trace"],
    }


def _scatter_mistake(ranks: list[dict], m: ModelFacts, figures: dict) -> str | None:
    r0 = ranks[0]
    wrong = _wrong_shape(
        ranks,
        "shard_grads",
        lambda r: r["shard_shapes"],
        ".grad",
        "after backward rank {rank}'s shard of {name} has {said}, want its shard's shape {shape}: after_grad must "
        "set each shard's .grad to its rows of the mean gradient",
    )
    if wrong:
        return wrong
    if figures["mistake"] and " x single's: " in figures["mistake"]:
        return figures["mistake"]
    if figures["mistake"]:
        return (
            f"{figures['mistake']}: rank r's .grad must be rows [r*k, (r+1)*k) of the zero-padded full gradient, "
            "summed over ranks and divided by n"
        )
    full = max(r["full_grad_bytes"] for r in ranks)
    if full:
        return (
            f"after backward the full gradients are still there ({full:,} B per rank, want 0 B): set p.grad = None "
            "once it is reduce-scattered"
        )
    held = {u: b for u, b in r0["held"].items() if b}
    if held:
        first = next(iter(held))
        return (
            f"after backward {names_of(held)} still hold full weights ({first}: {held[first]:,} B, want 0 B): free "
            "them in after_grad"
        )
    if ALL_REDUCE in r0["comm"] and not figures["wire_bytes"]:
        return (
            f"after_grad used an all-reduce ({_wire(r0['comm'], ALL_REDUCE):,} B on the wire, a reduce-scatter's "
            f"is {m.scatter_bytes:,} B): every rank receives the whole gradient (2(n-1)/n of its bytes) to keep "
            "1/n of it; a reduce-scatter sends half"
        )
    if figures["wire_bytes"] != m.scatter_bytes:
        return (
            f"reduce-scatter wire bytes {figures['wire_bytes']:,} B, but (n-1)/n x padded float32 bytes = "
            f"{m.scatter_bytes:,} B: reduce each gradient once, padded"
        )
    return None


def _scatter_ok(ranks: list[dict], m: ModelFacts, figures: dict) -> str:
    return (
        f"each shard's grad equals its rows of single's gradient {_tol(figures['grad_rel'])} (summed over ranks, "
        f"divided by {m.n}); full grads and weights dropped (0 B held); reduce-scatter wire bytes "
        f"{figures['wire_bytes']:,} B = (n-1)/n x padded float32 bytes, to the byte"
    )


# ------------------------------------------------------------------------------------------------ AdamW


def _adamw_figures(ranks: list[dict], m: ModelFacts, steps: int) -> dict:
    r0 = ranks[0]
    pairs = list(zip(r0["losses"], r0["oracle"], strict=True))
    return {
        "loss_rel": max(abs(a - b) / abs(b) for a, b in pairs),
        "losses": r0["losses"],
        "single": r0["oracle"],
        "state_bytes": r0["state_bytes"],
        "single_state_bytes": r0["oracle_state_bytes"],
        "steps": steps,
    }


def _adamw_mistake(ranks: list[dict], m: ModelFacts, figures: dict) -> str | None:
    r0 = ranks[0]
    if not r0["is_adamw"]:
        return f"the optimizer is {r0['optimizer']}, not AdamW: single trains with torch.optim.AdamW"
    if r0["not_shards"]:
        return (
            f"the optimizer updates {r0['not_shards']} tensors that are not this rank's shards ({r0['n_held']} "
            f"tensors, want exactly its {r0['n_shards']} shards): give it `shards` themselves (the tensors "
            "after_grad fills), or the weights the units gather never change"
        )
    want = r0["want_hyper"]
    differ = [k for k, v in r0["hyper"].items() if _plain(v) != _plain(want[k])]
    if differ:
        got = ", ".join(f"{k}={r0['hyper'][k]}" for k in differ)
        lab = ", ".join(f"{k}={want[k]}" for k in differ)
        verb = "is" if len(differ) == 1 else "are"
        return f"AdamW's {got} {verb} not the lab's {lab}: take them from RunConfig, as single does"
    if not figures["loss_rel"] <= LOSS_RTOL:
        at = max(range(len(r0["losses"])), key=lambda i: abs(r0["losses"][i] - r0["oracle"][i]))
        return (
            f"the loss at step {at} is {r0['losses'][at]:.6f}, single's {r0['oracle'][at]:.6f} (relative "
            f"{figures['loss_rel']:.1e}, float32 allows {LOSS_RTOL:.0e}): AdamW must update each shard with "
            "single's settings"
        )
    return None


def _adamw_ok(ranks: list[dict], m: ModelFacts, figures: dict) -> str:
    state, single = figures["state_bytes"], figures["single_state_bytes"]
    return (
        f"loss equal to single's {_tol(figures['loss_rel'])} over {figures['steps']} steps; AdamW holds only this "
        f"rank's {ranks[0]['n_shards']} shards: its state is {state:,} B per rank, 1/{single / state:.2f} "
        f"of single's {single:,} B"
    )


def _plain(v):
    return list(v) if isinstance(v, (tuple, list)) else v


Verdict = tuple[Callable[..., dict], Callable[..., str | None], Callable[..., str]]
_STEPS: dict[str, Verdict] = {
    "shard": (_shard_figures, _shard_mistake, _shard_ok),
    "gather": (_gather_figures, _gather_mistake, _gather_ok),
    "forward": (_forward_figures, _forward_mistake, _forward_ok),
    "backward": (_backward_figures, _backward_mistake, _backward_ok),
    "reduce_scatter": (_scatter_figures, _scatter_mistake, _scatter_ok),
    "adamw": (_adamw_figures, _adamw_mistake, _adamw_ok),
}


def formula_wire_bytes(model: str, world_size: int) -> dict[str, int]:
    """ZeRO-3's wire bytes per rank per step for `model` on `world_size` ranks, float32 and zero-padded shards:
    {"all_gather": 2 x (n-1)/n x padded bytes, "reduce_scatter": (n-1)/n x padded bytes} (`ModelFacts`'
    per-parameter sums: every gather twice, every gradient reduced once)."""
    facts = ModelFacts(model, world_size)
    return {ALL_GATHER: 2 * facts.gather_bytes, REDUCE_SCATTER: facts.scatter_bytes}
