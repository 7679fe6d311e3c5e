"""The public checks: what `check()` can say where the grader's checks are not installed (a student release).

They hold no reference answers and none of the grade's cases: each one tests the student's answers against
what anyone may know: torch's and DeepSpeed's own results, invariants the exercise states (a shard has
ceil(d0/n) rows; the shard groups partition the ranks), the exercise's own example (its `parameters` cell),
and the fact-sheet figures the course prints. Passing them is no grade: the grader's hidden cases decide it.
A public check's probe returns its cases as [(passed, what was wrong)]; its judge only tallies them. The
capstone's are the grade's own seven (`labkit.grading.capstone`: references from `single`, formulas and sizes),
on the notebook's model instead of a hidden one.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from unittest import mock

from labkit.errors import error_text
from labkit.grading import capstone, diagnose
from labkit.grading.kit import RANK_ORDER, Check, Exercise, answer, tally, tensor_json, tensor_mismatch
from labkit.lessons import uneven
from labkit.names import ALL_GATHER, ALL_REDUCE, DATA_PARALLEL, HSDP, REDUCE_SCATTER, ZERO1, ZERO2, ZERO3

_LOCK = threading.Lock()
DEMO_RANKS = 3  # the exercises' demonstrations run on 3 ranks
LAUNCH_TIMEOUT_S = 120.0
FACT_PARAMS, FACT_RANKS, FACT_GROUP = 30e9, 256, 8  # the fact sheet's model and cluster


def _public(name: str, probe: Callable[[dict], list], answers: tuple[str, ...]) -> Check:
    return Check(name, 1, lambda ns, seed: probe(ns), lambda got, seed: tally(got), answers=answers)


# --------------------------------------------------------------------------------------- ex01_memory


def _fact_sheet_state(strategy: str, world_size: int = FACT_RANKS, group_size: int | None = None) -> float:
    """The fact sheet's state bytes per rank, as notebook 01 prints them (labkit.budget, on the notebooks' side)."""
    from labkit import budget

    extra = {"group_size": group_size} if group_size else {}
    return float(budget.plan(FACT_PARAMS, world_size, strategy, **extra)["state_bytes_per_rank"])


def _state_cases(ns: dict) -> list:
    fn = answer(ns, "state_bytes_per_rank")
    p, n = FACT_PARAMS, FACT_RANKS
    chain = [float(fn(p, n, s)) for s in (DATA_PARALLEL, ZERO1, ZERO2, ZERO3)]
    return [
        *(
            (
                math.isclose(got, want := _fact_sheet_state(s), abs_tol=16),
                f"{s}, 30e9 params on 256 ranks: {got:g} B, the fact sheet's {want:g} B",
            )
            for s, got in zip((DATA_PARALLEL, ZERO1, ZERO2, ZERO3), chain, strict=True)
        ),
        (chain == sorted(chain, reverse=True), f"ddp >= zero1 >= zero2 >= zero3 on 256 ranks: {chain}"),
        (
            float(fn(p, 8, DATA_PARALLEL)) == chain[0],
            "ddp replicates everything: its bytes do not depend on the world size",
        ),
    ]


def _fit_cases(ns: dict) -> list:
    """The fewest ranks must fit by the student's own state function, and one rank fewer must not."""
    fit, state = answer(ns, "min_ranks_to_fit"), answer(ns, "state_bytes_per_rank")
    cases = []
    for p, gpu, s in ((7e9, 80e9, ZERO3), (30e9, 80e9, ZERO2)):
        n = fit(p, gpu, s)
        ok = n is not None and state(p, n, s) <= gpu and (n == 1 or state(p, n - 1, s) > gpu)
        cases.append((ok, f"params={p:g}, {gpu:g} B, {s}: {n} ranks, not the fewest whose state fits"))
    return cases


# --------------------------------------------------------------------------------------- ex02_shard


def _shard_cases(ns: dict) -> list:
    import torch

    fn = answer(ns, "shard_rows")
    cases = []
    for shape, n in (((7, 4), 3), ((2, 3), 3), ((6, 2), 3)):  # the example, fewer rows than ranks, exact
        why = _shard_mistake(fn, torch.randn(shape), n)
        cases.append((not why, f"shape {list(shape)} on {n} ranks: {why}"))
    return cases


def _shard_mistake(shard_rows: Callable, full, n: int) -> str:
    """'' when `shard_rows` cuts `full` into n shards as the exercise states (ceil(d0/n) rows each, the rows
    in rank order, then zero rows); else the first thing that differs, with the shapes or rows."""
    import torch

    d0 = full.shape[0]
    k = -(-d0 // n)
    want = [k, *full.shape[1:]]
    shards = [shard_rows(full.clone(), r, n) for r in range(n)]
    for r, got in enumerate(shards):
        if not isinstance(got, torch.Tensor):
            return f"rank {r} got a {type(got).__name__}, want a tensor of shape {want}"
        if list(got.shape) != want:
            return (
                f"rank {r}'s shard has shape {list(got.shape)}, want {want}: ceil({d0}/{n}) = {k} rows on every "
                "rank, the last ones zero-padded"
            )
    rows = torch.cat(shards)
    wrong = [i for i in range(d0) if not torch.equal(rows[i], full[i])]
    if wrong:
        i = wrong[0]
        return (
            f"row {i} of the full tensor is not row {i % k} of rank {i // k}'s shard (rank r keeps rows "
            f"[r*{k}, (r+1)*{k}))"
        )
    padding = [i for i in range(d0, n * k) if rows[i].any()]
    if padding:
        i = padding[0]
        return (
            f"padding row {i % k} of rank {i // k}'s shard is not zero (all {n * k - d0} padding rows must be "
            "zeros)"
        )
    return ""


def _round_trip(gather_full: Callable, shards: list, d0: int, width: int) -> str:
    """On each rank: '' when `gather_full` rebuilds arange(1, d0*width+1) from this rank's shard of it."""
    import torch
    import torch.distributed as dist

    full = torch.arange(1, d0 * width + 1, dtype=torch.float32).reshape(d0, width)
    rebuilt = gather_full(shards[dist.get_rank()], d0, dist.get_world_size())
    return tensor_mismatch(tensor_json(rebuilt), full, order_hint=RANK_ORDER) or ""


def _gather_cases(ns: dict) -> list:
    """The round trip shard_rows -> gather_full on DEMO_RANKS ranks; a shard_rows that the shard check faults
    says "fix `shard_rows` first", not that gather_full is wrong."""
    import torch

    import labkit

    shard_rows, gather_full = answer(ns, "shard_rows"), answer(ns, "gather_full")
    cases = []
    for d0 in (7, 2):
        full = torch.arange(1, d0 * 4 + 1, dtype=torch.float32).reshape(d0, 4)
        where = f"d0={d0} on {DEMO_RANKS} ranks"
        if why := _shard_mistake(shard_rows, full, DEMO_RANKS):
            cases.append((False, f"{where}: fix `shard_rows` first ({why})"))
            continue
        shards = [shard_rows(full.clone(), r, DEMO_RANKS) for r in range(DEMO_RANKS)]
        said = labkit.launch(_round_trip, DEMO_RANKS, gather_full, shards, d0, 4, timeout=LAUNCH_TIMEOUT_S)
        wrong = [(r, why) for r, why in enumerate(said) if why]
        call = f"gather_full(shard_rows(full), {d0}, {DEMO_RANKS})"
        cases.append((not wrong, f"{where}: {call} on rank {wrong[0][0]}: {wrong[0][1]}" if wrong else ""))
    return cases


# ------------------------------------------------------------------------------- ex03_reduce_scatter


def _mean_rank(reduce_scatter_mean: Callable, numel: int) -> str | None:
    """On each rank: None when the answer's chunk is this rank's chunk of all_reduce's sum / n, else what
    differs (shape, or values with the usual mistake named)."""
    import torch
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    mine = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    mean = mine.clone()
    dist.all_reduce(mean)  # torch's own sum over ranks
    chunk = -(-numel // n)
    want = torch.cat([mean / n, mean.new_zeros(chunk * n - numel)])[rank * chunk : (rank + 1) * chunk]
    return tensor_mismatch(tensor_json(reduce_scatter_mean(mine, n)), want, 1e-6)


def _flat_cases(ns: dict) -> list:
    import labkit

    fn, cases = answer(ns, "reduce_scatter_mean"), []
    for numel in (10, 9):
        wrong = labkit.launch(_mean_rank, DEMO_RANKS, fn, numel, timeout=LAUNCH_TIMEOUT_S)
        why = next((f"rank {r}: {w}" for r, w in enumerate(wrong) if w), "")
        cases.append(
            (not why, f"{numel} elements on {DEMO_RANKS} ranks, against all_reduce's sum / n: {why}")
        )
    return cases


def rank_rows(grads: list, n: int):
    """What a reduce-scatter of the send buffer must leave each rank, rank after rank: rank r's ceil(d0/n)
    rows of every gradient in turn (zero rows where d0 runs out), as the exercise states the layout."""
    import torch

    chunks = []
    for r in range(n):
        for full in grads:
            per_rank = math.ceil(full.shape[0] / n)
            mine = full[r * per_rank : (r + 1) * per_rank].reshape(-1)
            chunks += [mine, mine.new_zeros(per_rank * (full.numel() // full.shape[0]) - mine.numel())]
    return torch.cat(chunks)


def _pack_cases(ns: dict) -> list:
    """The send buffer, laid out rank-major: row r of it viewed as (n, chunk) is what rank r's reduce-scatter
    receives, its rows of every gradient (uneven, fewer rows than ranks, exact)."""
    import torch

    fn, n, cases = answer(ns, "pack_grads"), DEMO_RANKS, []
    for shapes in (((7, 2), (5,)), ((2, 3), (6,))):
        grads = [torch.randn(shape) for shape in shapes]
        out = fn([g.clone() for g in grads], n)
        why = tensor_mismatch(tensor_json(out.reshape(-1)), rank_rows(grads, n), 1e-6)
        cases.append((why is None, f"shapes {[list(x) for x in shapes]} on {n} ranks: {why}"))
    return cases


# ------------------------------------------------------------------------------------ ex04_prefetch


def _units(n_blocks: int) -> list[str]:
    return ["root", *(f"blocks.{i}" for i in range(n_blocks))]


def _order_cases(ns: dict) -> list:
    fwd, bwd = answer(ns, "forward_order"), answer(ns, "backward_order")
    cases = []
    for n in (4, 1):
        f, b = list(fwd(n)), list(bwd(n))
        blocks_f = [u for u in f if u != "root"]
        blocks_b = [u for u in b if u != "root"]
        cases += [
            (
                sorted(f) == sorted(_units(n)) == sorted(b),
                f"{n} blocks: each order names 'root' and every block once",
            ),
            (
                blocks_f == _units(n)[1:] and blocks_b == blocks_f[::-1],
                f"{n} blocks: backward visits the blocks in reverse",
            ),
        ]
    return cases


def _schedule_cases(ns: dict) -> list:
    fn, fwd, bwd = answer(ns, "prefetch_schedule"), answer(ns, "forward_order"), answer(ns, "backward_order")
    n, cases = 4, []
    rows = [tuple(r) for r in fn(n)]
    for moment, order in (("before_forward", list(fwd(n))), ("before_backward", list(bwd(n)))):
        mine = [r for r in rows if r[0] == moment]
        cases.append(([r[1] for r in mine] == order, f"{moment}: the hooks fire in your own order"))
        later = all(r[2] is None or order.index(r[2]) > order.index(r[1]) for r in mine)
        cases.append(
            (
                later and bool(mine) and mine[-1][2] is None,
                f"{moment}: a hook prefetches a later unit, the last none",
            )
        )
    return cases


def _count_cases(ns: dict) -> list:
    fn, n = answer(ns, "all_gathers_per_step"), 4
    kept, resharded = int(fn(n, False)), int(fn(n, True))
    return [
        (kept >= n + 1, f"{n} blocks, weights kept: {kept} all-gathers, fewer than one per unit"),
        (
            resharded > kept,
            "resharding after forward gathers again in backward: more all-gathers, not as many",
        ),
    ]


# ----------------------------------------------------------------------------------- ex05_deepspeed


def parse(config: dict, world_size: int):
    """DeepSpeed's parsed config for `config` on `world_size` ranks; raises DeepSpeed's own error if invalid.

    Without a process group the parser assumes one rank, so its two questions to `deepspeed.comm` (this
    rank, how many ranks) are answered for the duration of the call."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.runtime import config as ds_config

    with (
        _LOCK,
        mock.patch.object(ds_config.dist, "get_rank", return_value=0),
        mock.patch.object(ds_config.dist, "get_world_size", return_value=world_size),
    ):
        return ds_config.DeepSpeedConfig(config)


def _config_cases(ns: dict) -> list:
    world_size, micro, gpn = (
        ns.get(k, d) for k, d in (("world_size", 4), ("micro_batch", 2), ("gpus_per_node", 8))
    )
    cases = []
    for name, config in (
        ("offload_config", answer(ns, "offload_config")(world_size, micro)),
        ("zeropp_config", answer(ns, "zeropp_config")(world_size, gpn, micro)),
    ):
        try:
            stage = int(parse(config, world_size).zero_config.stage)
            cases.append((stage == 3, f"{name}: DeepSpeed parses ZeRO stage {stage}, want 3"))
        except Exception as e:  # noqa: BLE001 (DeepSpeed raises assertion, pydantic and value errors)
            cases.append((False, f"{name}: DeepSpeed refuses it ({error_text(e)})"))
    return cases


# --------------------------------------------------------------------------------------- ex06_hsdp


def _group_cases(ns: dict) -> list:
    fn, cases = answer(ns, "hsdp_groups"), []
    for n, g in ((8, 4), (12, 3)):
        shard, replicate = fn(n, g)
        flat = sorted(r for group in shard for r in group)
        cases.append(
            (
                flat == list(range(n)) and all(len(s) == g for s in shard),
                f"{n} ranks, groups of {g}: shard groups of {g} that partition the ranks",
            )
        )
        one_each = all(
            len(rep) == n // g and all(len(set(rep) & set(s)) == 1 for s in shard) for rep in replicate
        )
        cases.append(
            (
                one_each and len(replicate) == g,
                f"{n} ranks, groups of {g}: each replicate group takes one rank of every shard group",
            )
        )
    return cases


def bytes_said(got: object, want: float) -> str:
    """`got` bytes as the feedback says them: with its factor of `want` when it is a number that differs."""
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        return f"{got!r} (not a number of bytes)"
    factor = f" ({got / want:.3g} x)" if want and not math.isclose(got, want, abs_tol=64) else ""
    return f"{got:,.0f} B{factor}"


def hsdp_traffic_by_collective(params: float, world_size: int, group_size: int) -> dict[str, int]:
    """Bytes one rank sends per step per collective of HSDP, as notebook 06 prints them (labkit.budget)."""
    from labkit import budget

    by = budget.plan(params, world_size, HSDP, group_size=group_size)["traffic_bytes_by_collective"]
    return {
        ALL_GATHER: by["all_gather_forward"] + by["all_gather_backward"],
        REDUCE_SCATTER: by[REDUCE_SCATTER],
        ALL_REDUCE: by[ALL_REDUCE],
    }


def _traffic_cases(ns: dict) -> list:
    """The notebook's case (the fact sheet's 30e9 on 512 ranks in groups of 8) against labkit.budget's
    figures, collective by collective, and one shard group alone, which all-reduces nothing."""
    fn = answer(ns, "hsdp_traffic")
    cases = []
    for n in (512, FACT_GROUP):
        mine = fn(FACT_PARAMS, n, FACT_GROUP)
        for kind, want in hsdp_traffic_by_collective(FACT_PARAMS, n, FACT_GROUP).items():
            got = mine.get(kind)
            ok = isinstance(got, (int, float)) and math.isclose(got, want, abs_tol=64)
            cases.append(
                (
                    ok,
                    f"30e9 params, {n} ranks in groups of {FACT_GROUP}, {kind}: {bytes_said(got, want)}, "
                    f"labkit.budget's {want:,} B",
                )
            )
    return cases


def _cross_cases(ns: dict) -> list:
    crosses = answer(ns, "crosses_groups")
    return [
        (
            set(crosses) < {ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE} and bool(crosses),
            "crosses_groups names some, not all, of all_gather, reduce_scatter, all_reduce",
        )
    ]


def _hsdp_state_cases(ns: dict) -> list:
    fn = answer(ns, "hsdp_state_bytes_per_rank")
    got, want = float(fn(FACT_PARAMS, 512, FACT_GROUP)), _fact_sheet_state(HSDP, 512, FACT_GROUP)
    return [
        (
            math.isclose(got, want, abs_tol=16),
            f"30e9 params, 512 ranks in groups of 8: {got:g} B, the fact sheet's {want:g} B (1/8 of the state)",
        )
    ]


# ------------------------------------------------------------------------------------ ex07_capstone


NOTEBOOK_RUN = capstone.Run(model="tiny", seed=0, ranks=DEMO_RANKS, steps=3)  # the notebook's demonstration


# ----------------------------------------------------------------------------- ex08_critical_batch

FACT_MACHINE = (989e12 * 0.4, 50e9, 2)  # the fact sheet's rank: FLOP/s at 40% MFU, NIC bytes/s, bf16 bytes


def _critical_cases(ns: dict) -> list:
    """The fact sheet's threshold as notebook 08 prints it (labkit.budget), and the formula's proportions."""
    from labkit import budget

    fn = answer(ns, "critical_tokens_per_rank")
    rate, link, weight = FACT_MACHINE
    mine = float(fn(rate, link, weight, FACT_RANKS))
    want = budget.critical_tokens(FACT_PARAMS, FACT_RANKS, link_gbytes=link / 1e9, peak_tflops=989, mfu=0.4)[
        "critical_tokens_per_rank"
    ]
    return [
        (
            math.isclose(mine, want, rel_tol=1e-9),
            f"the fact sheet's rank: {mine:g} tokens, notebook 08's {want:g}",
        ),
        (
            math.isclose(float(fn(rate, 2 * link, weight, FACT_RANKS)), mine / 2, rel_tol=1e-9),
            "a link twice as fast halves the threshold",
        ),
        (
            math.isclose(float(fn(2 * rate, link, weight, FACT_RANKS)), 2 * mine, rel_tol=1e-9),
            "a chip twice as fast doubles it",
        ),
    ]


def _useful_cases(ns: dict) -> list:
    """By the answer's own threshold: its world size clears it, one more node does not."""
    critical, useful = answer(ns, "critical_tokens_per_rank"), answer(ns, "largest_useful_world_size")
    out = []
    for tokens, per_node in ((4e6, FACT_GROUP), (1e6, 4)):
        n = useful(tokens, *FACT_MACHINE, per_node)
        if n is None or n % per_node:
            out.append((False, f"{tokens:g} tokens, {per_node} per node: {n}, not a whole number of nodes"))
            continue
        clears = tokens / n >= float(critical(*FACT_MACHINE, n))
        beyond = tokens / (n + per_node) < float(critical(*FACT_MACHINE, n + per_node))
        out.append(
            (
                clears and beyond,
                f"{tokens:g} tokens, {per_node} per node: {n} ranks; clears T* there: {clears}, "
                f"and {n + per_node} does not: {beyond}",
            )
        )
    return out


def _accumulation_cases(ns: dict) -> list:
    """The exercise's own demonstration (seed 0, 2 ranks, 2 micro-steps): one reduce-scatter per unit per
    optimizer step, the losses of `single` on the whole batch, and its gradient before the first AdamW step."""
    import labkit
    from labkit.engines.base import RunConfig
    from labkit.grading import gradients
    from labkit.lessons.production import single_run
    from labkit.model import build_model

    fn, k = answer(ns, "accumulate_gradients"), ns.get("micro_steps", 2)
    launched = labkit.launch(gradients.accumulation_rank, 2, fn, k, 0, 2, timeout=LAUNCH_TIMEOUT_S)
    steps = launched[0]["steps"]
    units = len(build_model("tiny").blocks) + 1
    cfg = RunConfig(model="tiny", world_size=2, steps=len(steps))
    want = single_run(cfg)["losses"]
    why = gradients.grads_mismatch(
        gradients.gathered_rows([r["grads"] for r in launched]),
        gradients.single_grads(cfg),
        "step 0, both ranks' rows before AdamW",
        gradients.accumulation_hint(k),
    )
    return (
        [(why is None, why or "")]
        + [
            (
                row[REDUCE_SCATTER]["calls"] == units,
                f"step {i}: {row[REDUCE_SCATTER]['calls']} reduce-scatters, one per unit is {units}",
            )
            for i, row in enumerate(steps)
        ]
        + [
            (
                math.isclose(row["loss"], w, rel_tol=1e-5),
                f"step {i}: loss {row['loss']:.6f}, single's {w:.6f}",
            )
            for i, (row, w) in enumerate(zip(steps, want, strict=True))
        ]
    )


PUBLIC = {
    "ex01_memory": (
        _public(
            "state bytes: the fact sheet's figures and their order", _state_cases, ("state_bytes_per_rank",)
        ),
        _public("fewest ranks: by your own state bytes", _fit_cases, ("min_ranks_to_fit",)),
    ),
    "ex02_shard": (
        _public("shard: ceil(d0/n) rows, in order, zero-padded", _shard_cases, ("shard_rows",)),
        _public(f"round trip on {DEMO_RANKS} ranks", _gather_cases, ("gather_full",)),
    ),
    "ex03_reduce_scatter": (
        _public("reduce_scatter_mean against torch's all_reduce", _flat_cases, ("reduce_scatter_mean",)),
        _public("pack_grads: rank r's rows of every gradient in row r", _pack_cases, ("pack_grads",)),
    ),
    "ex04_prefetch": (
        _public("hook orders", _order_cases, ("forward_order", "backward_order")),
        _public("schedule follows your orders", _schedule_cases, ("prefetch_schedule",)),
        _public("all-gather counts", _count_cases, ("all_gathers_per_step",)),
    ),
    "ex05_deepspeed": (
        _public("DeepSpeed parses both configs", _config_cases, ("offload_config", "zeropp_config")),
    ),
    "ex06_hsdp": (
        _public("mesh groups", _group_cases, ("hsdp_groups",)),
        _public("traffic: labkit.budget's bytes per collective", _traffic_cases, ("hsdp_traffic",)),
        _public("what crosses groups", _cross_cases, ("crosses_groups",)),
        _public("state: the fact sheet's figure", _hsdp_state_cases, ("hsdp_state_bytes_per_rank",)),
    ),
    "ex07_capstone": capstone.checks(lambda seed: NOTEBOOK_RUN),
    "ex08_critical_batch": (
        _public(
            "critical tokens: the fact sheet's and the formula's proportions",
            _critical_cases,
            ("critical_tokens_per_rank",),
        ),
        _public(
            "largest useful world size: by your own threshold", _useful_cases, ("largest_useful_world_size",)
        ),
        _public(
            "accumulation on 2 ranks: one reduce-scatter per unit, single's losses and gradients",
            _accumulation_cases,
            ("accumulate_gradients",),
        ),
    ),
    "ex09_diagnose": diagnose.checks(
        lambda seed: uneven.examples(), lambda seed: (list(uneven.EXAMPLE_ROWS), 0)
    ),
}


def load(exercise_id: str, title: str) -> Exercise:
    """The public checks of `exercise_id` as an Exercise titled `title`; LookupError when there are none."""
    if exercise_id not in PUBLIC:
        raise LookupError(f"no public checks for exercise {exercise_id!r}; known ids: {', '.join(PUBLIC)}")
    return Exercise(exercise_id, title, PUBLIC[exercise_id])
