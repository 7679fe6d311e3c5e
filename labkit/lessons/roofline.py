"""FSDP's roofline measured on CPU ranks: exposed communication against tokens per rank, over an emulated link.

`sweep` trains the scratch engine at several global batches of one model ("tiny@B", `model.with_batch`),
each twice on the same ranks: once with no emulated link (its compute: the step less what it waited for)
and once over a link of `link_gbytes`, with prefetch (its exposed communication: what rank by rank it sat
blocked on collectives). The runs repeat in interleaved rounds (`labkit.measured.interleaved`) and every
figure is a `Measured` over the steps after the first of each, on the rank's clock; `sweep_until_straddled`
widens a sweep that misses the closed form's crossover instead of failing, and `crossover_lines` and
`rate_trend` say what the sweep shows only as far as its spreads allow.

`closed_form_crossover` is `labkit.budget.roofline`'s T* = (b/2)(n-1)/n R/B with this machine's R, and the band
below it that 03's floor opens: T* counts every byte as one the compute can hide, while the floor's collectives
(the first gather, the last reduce-scatter) can cross the link with nothing beside them, leaving the compute only
the rest to cover, so the knee lies from T* x (1 - `floor_share`) to T* (a fifth below T* on the 4-block `tiny`,
a few percent on a model of dozens of layers). A CPU step has a fixed cost (Python, op launches), so the rate at
which a rank computes rises with its tokens, and the formula holds with the rate at the crossover.
`measured_crossover` fits the sweep with the shape the prefetch model predicts (exposed = floor + slope x
max(0, T_x - T): falling while the link outruns the compute, flat once the compute hides it) and returns T_x.
`link_for` picks the link that puts T* at a chosen number of tokens.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace
from itertools import pairwise
from typing import Any

import torch.distributed as dist

import labkit
from labkit.budget import closed_form_critical_tokens
from labkit.engines import scratch
from labkit.engines.base import RunConfig
from labkit.engines.on_rank import options_for, train_rank
from labkit.engines.registry import SCRATCH
from labkit.measured import ADVICE, Measured, compare, interleaved
from labkit.model import build_model, config, count_params, with_batch
from labkit.probes import exposed_comm_s

ENGINE = SCRATCH


def tokens_per_rank(model: str, world_size: int) -> int:
    """Tokens one of `world_size` ranks trains on per step: its sequences times their length."""
    cfg = config(model)
    return cfg.global_batch // world_size * cfg.seq_len


def link_seconds(cfg: RunConfig) -> float:
    """The emulated link's seconds for one step's wire bytes (the scratch engine's formula, one rank)."""
    wire = sum(scratch.predicted_wire_bytes(build_model(cfg.model), cfg, cfg.world_size).values())
    return wire / (cfg.link_gbytes * 1e9)


ROUNDS = 3  # interleaved rounds of the whole sweep: each batch's figures are medians over them
WIDENINGS = 2  # at most this many extensions of a sweep that misses the closed form's crossover
LAUNCH_TIMEOUT_S = 600.0  # one launch of a sweep: a busy 2-core machine takes a few minutes


def _rank_runs(cfgs: Sequence[RunConfig], rounds: int) -> list[list[list[tuple[float, float]]]]:
    """Rank side of `sweep`: `rounds` interleaved rounds of every run of `cfgs` (`measured.interleaved`:
    forwards, then backwards). For each run, each round, each step: (step seconds, seconds blocked on
    collectives), on the rank's clock."""
    out: list[list[list[tuple[float, float]]]] = [[] for _ in cfgs]
    for k in interleaved(range(len(cfgs)), rounds):
        rec = train_rank(ENGINE, cfgs[k], peak=False)
        dist.barrier()
        out[k].append(
            [
                (s, exposed_comm_s([e for e in rec["timeline"] if e["step"] == i]))
                for i, s in enumerate(rec["step_time_s"])
            ]
        )
    return out


def _figures(per_rank: list[list[list[tuple[float, float]]]]) -> dict[str, Any]:
    """One run's figures from every rank's (step, blocked) seconds per round and step, the first step of each
    round left out: "compute" (the slowest rank's step less what it was blocked), "exposed" (the ranks' mean
    blocked time) and "step" (the slowest rank's), each a `Measured` over every round's steps and a list of
    each round's median ("by_round")."""
    rounds = len(per_rank[0])
    samples: dict[str, list[list[float]]] = {"compute": [], "exposed": [], "step": []}
    for r in range(rounds):
        steps = [
            list(zip(*(rank[r][i] for rank in per_rank), strict=True)) for i in range(1, len(per_rank[0][r]))
        ]
        samples["compute"].append([max(s - b for s, b in zip(*st, strict=True)) for st in steps])
        samples["exposed"].append([statistics.fmean(st[1]) for st in steps])
        samples["step"].append([max(st[0]) for st in steps])
    return {
        name: Measured.of(v for by_round in values for v in by_round) for name, values in samples.items()
    } | {
        "by_round": [
            {f"{name}_s": statistics.median(values[r]) for name, values in samples.items()}
            for r in range(rounds)
        ]
    }


def sweep(
    model: str,
    world_size: int,
    sequences: Sequence[int],
    link_gbytes: float | None,
    steps: int = 4,
    rounds: int = ROUNDS,
) -> list[dict[str, Any]]:
    """One launch of `world_size` ranks: every global batch of `sequences`, without a link and then over it
    (interleaved, `rounds` times: `_rank_runs`).

    Returns one row per batch, by tokens: sequences, tokens_per_rank, "compute" (a `Measured` of the steps
    with no link, less what they waited for), and over the link with prefetch (None when `link_gbytes` is
    None): "exposed" and "step" (`Measured`), link_s (the link's time for the step's wire bytes). Seconds
    per step on the rank's clock; compute_s, exposed_s and step_s are the medians, and "by_round" holds each
    round's medians (the spread of what is fitted to them). The first step of each run is left out.
    """
    if steps < 2 or rounds < 1:
        raise ValueError(f"steps={steps!r}, rounds={rounds!r}: pass 2 or more steps and 1 or more rounds")
    sequences = sorted(set(sequences))
    plain = [RunConfig(model=with_batch(model, g), world_size=world_size, steps=steps) for g in sequences]
    linked = [] if link_gbytes is None else [replace(cfg, link_gbytes=link_gbytes) for cfg in plain]
    runs = [
        c for pair in zip(plain, linked or [None] * len(plain), strict=True) for c in pair if c is not None
    ]
    per_rank = labkit.launch(_rank_runs, world_size, runs, rounds, timeout=LAUNCH_TIMEOUT_S)
    per_run = [_figures([rank[k] for rank in per_rank]) for k in range(len(runs))]
    rows = []
    for k, cfg in enumerate(plain):
        bare = per_run[k * (2 if linked else 1)]
        over = per_run[2 * k + 1] if linked else None
        by_round = [{"compute_s": b["compute_s"]} for b in bare["by_round"]]
        if over:
            by_round = [
                {**b, "exposed_s": o["exposed_s"]} for b, o in zip(by_round, over["by_round"], strict=True)
            ]
        rows.append(
            {
                "sequences": sequences[k],
                "tokens_per_rank": tokens_per_rank(cfg.model, world_size),
                "compute": bare["compute"],
                "compute_s": bare["compute"].median,
                "exposed": over and over["exposed"],
                "exposed_s": over and over["exposed"].median,
                "step": over and over["step"],
                "step_s": over and over["step"].median,
                "link_s": link_seconds(linked[k]) if linked else None,
                "by_round": by_round,
            }
        )
    return rows


def rate(model: str, tokens: float, compute_s: float) -> float:
    """FLOP/s one rank computed at: 6 x parameters x `tokens` over `compute_s` seconds."""
    return 6 * count_params(build_model(model)) * tokens / compute_s


def link_for(world_size: int, critical_tokens: float, flops_per_s: float, weight_bytes: int = 4) -> float:
    """The link (GB/s) that puts T* (no floor taken off) at `critical_tokens` for a rank computing `flops_per_s`
    (T* is inversely proportional to the link: its value on a 1 B/s link over the one wanted)."""
    return closed_form_critical_tokens(flops_per_s, 1.0, weight_bytes, world_size) / critical_tokens / 1e9


def floor_share(model: str, world_size: int) -> float:
    """The share of a step's wire bytes that no prefetch can hide (03's floor: `scratch.exposed_floor` of the
    sweep's engine at prefetch depth 1). Where the link carries them while nothing computes, the compute has only
    the rest of the link's time to cover. The same at every batch (wire bytes follow the parameters)."""
    cfg = options_for(ENGINE, RunConfig(model=model, world_size=world_size))
    return scratch.exposed_floor(build_model(model), cfg, world_size)["floor_share"]


def closed_form_crossover(
    rows: Sequence[dict], model: str, world_size: int, link_gbytes: float, weight_bytes: int = 4
) -> dict[str, Any] | None:
    """T* = (b/2)(n-1)/n R/B with R this machine's rate at T*: the tokens where each row's own T* (at its
    measured rate) crosses its tokens, interpolated between the two rows around it, from the rows' medians.
    T* takes every byte as one the compute can hide; 03's floor can cross the link with nothing beside it, and
    then the compute has only the rest to cover: "low_tokens_per_rank" is the same crossing of T* x (1 -
    `floor_share`), the band's other end. Returns {"tokens_per_rank", "flops_per_s" (R there), "floor_share",
    "low_tokens_per_rank", "by_round" (a `Measured` of T*'s crossing from each round's medians, where that
    round straddles it)}; None when the sweep does not straddle T* (`missed_side` says which way it lies)."""
    points = [(r["tokens_per_rank"], r["compute_s"]) for r in rows]
    at = _closed_form(points, model, world_size, link_gbytes, 0.0, weight_bytes)
    if at is None:
        return None
    share = floor_share(model, world_size)
    low = _closed_form(points, model, world_size, link_gbytes, share, weight_bytes)
    rounds = [
        _closed_form(
            [(r["tokens_per_rank"], r["by_round"][k]["compute_s"]) for r in rows],
            model,
            world_size,
            link_gbytes,
            0.0,
            weight_bytes,
        )
        for k in range(len(rows[0]["by_round"]))
    ]
    per_flop = closed_form_critical_tokens(1.0, link_gbytes * 1e9, weight_bytes, world_size)
    # T* is proportional to the rate: the rate whose T* is t is t over T* at 1 FLOP/s.
    return {
        "tokens_per_rank": at,
        "flops_per_s": at / per_flop,
        "floor_share": share,
        # below the sweep's smallest batch: T* x (1 - f) at the rate of T*'s crossing
        "low_tokens_per_rank": low if low is not None else at * (1 - share),
        "by_round": Measured.of(t for t in rounds if t is not None) if any(rounds) else None,
    }


def _closed_form(
    points: Sequence[tuple[float, float]],
    model: str,
    world_size: int,
    link_gbytes: float,
    share: float,
    weight_bytes: int = 4,
) -> float | None:
    """The tokens where T* x (1 - `share`) at the rate of (tokens, compute seconds) crosses the tokens; None if
    it does not."""

    def gap(tokens: float, compute_s: float) -> float:
        own = closed_form_critical_tokens(
            rate(model, tokens, compute_s), link_gbytes * 1e9, weight_bytes, world_size
        )
        return own * (1 - share) - tokens

    gaps = [(t, gap(t, c)) for t, c in points]
    for (t0, g0), (t1, g1) in pairwise(gaps):
        if g0 >= 0 >= g1:
            return t0 + (t1 - t0) * g0 / (g0 - g1) if g0 != g1 else t0
    return None


def measured_crossover(rows: Sequence[dict]) -> dict[str, Any]:
    """The least-squares fit of exposed_s = floor_s + slope x max(0, T_x - T) over the rows' medians (T in
    tokens per rank), T_x searched on a fine grid between the smallest and the largest T. Returns
    {"tokens_per_rank": T_x, "floor_s", "slope_s_per_token", "rms_s", "at_edge" (T_x at either end of the
    sweep: the fall or the floor is not in it), "by_round" (a `Measured` of T_x fitted to each round)}."""
    ts = [row["tokens_per_rank"] for row in rows]
    fit = _fit_knee(ts, [row["exposed_s"] for row in rows])
    rounds = [
        _fit_knee(ts, [row["by_round"][k]["exposed_s"] for row in rows])
        for k in range(len(rows[0]["by_round"]))
    ]
    lo, hi = min(ts), max(ts)
    return {
        **fit,
        "at_edge": not lo * KNEE_MARGIN < fit["tokens_per_rank"] < hi / KNEE_MARGIN,
        "by_round": Measured.of(f["tokens_per_rank"] for f in rounds),
    }


KNEE_MARGIN = 1.02  # a knee within 2% of the sweep's smallest or largest tokens is at its edge


def _fit_knee(ts: list[float], ys: list[float]) -> dict[str, float]:
    """exposed = floor + slope x max(0, T_x - T), least squares, T_x on a log grid over [min(ts), max(ts)]."""
    best = None
    lo, hi = min(ts), max(ts)
    for i in range(401):
        tx = lo * (hi / lo) ** (i / 400)
        xs = [max(0.0, tx - t) for t in ts]
        fit = _line(xs, ys)
        if fit and (best is None or fit[2] < best[2]):
            best = (*fit, tx)
    floor_s, slope, sse, tx = best
    return {
        "tokens_per_rank": tx,
        "floor_s": floor_s,
        "slope_s_per_token": slope,
        "rms_s": (sse / len(ys)) ** 0.5,
    }


def _line(xs: list[float], ys: list[float]) -> tuple[float, float, float] | None:
    """Least squares y = a + b x with b >= 0: (a, b, sum of squared residuals); None if every x is equal."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    b = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx)
    a = my - b * mx
    return a, b, sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True))


# ------------------------------------------------------------------------------ a sweep that finds its crossover


def missed_side(rows: Sequence[dict], model: str, world_size: int, link_gbytes: float) -> str | None:
    """None when the sweep straddles the closed form's crossover; else "larger" (it lies above the largest
    batch: compute never caught up with the link) or "smaller" (below the smallest)."""
    points = [(r["tokens_per_rank"], r["compute_s"]) for r in rows]
    if _closed_form(points, model, world_size, link_gbytes, 0.0) is not None:
        return None
    link_s = link_seconds(RunConfig(model=model, world_size=world_size, link_gbytes=link_gbytes))
    return "larger" if rows[-1]["compute_s"] < link_s else "smaller"


def widened(sequences: Sequence[int], side: str, world_size: int) -> list[int]:
    """Two more global batches beyond the sweep on `side`: 1.5x and 2x its largest ("larger"), or half and a
    quarter of its smallest ("smaller", at least one sequence per rank); whole sequences per rank."""
    if side == "larger":
        top = max(sequences)
        wanted = [top * 3 // 2, top * 2]
    else:
        low = min(sequences)
        wanted = [low // 2, low // 4]
    out = {max(world_size, g // world_size * world_size) for g in wanted}
    return sorted(out - set(sequences))


def sweep_until_straddled(
    model: str,
    world_size: int,
    sequences: Sequence[int],
    link_gbytes: float,
    steps: int = 4,
    rounds: int = ROUNDS,
    widenings: int = WIDENINGS,
    say=print,
) -> list[dict[str, Any]]:
    """`sweep`, widened up to `widenings` times (`widened`, one more launch each) while the closed form's
    crossover lies outside it (`missed_side`); each widening is said with `say`. Returns
    every row, by tokens; the caller reads `missed_side` to know whether it was found."""
    rows = sweep(model, world_size, sequences, link_gbytes, steps, rounds)
    for _ in range(widenings):
        side = missed_side(rows, model, world_size, link_gbytes)
        more = widened([r["sequences"] for r in rows], side, world_size) if side else []
        if not more:
            break
        say(
            f"the crossover lies beyond the {'largest' if side == 'larger' else 'smallest'} batch swept; "
            f"widening the sweep to {', '.join(map(str, more))} sequences"
        )
        rows = sorted(
            rows + sweep(model, world_size, more, link_gbytes, steps, rounds),
            key=lambda r: r["tokens_per_rank"],
        )
    return rows


# ------------------------------------------------------------------------------------------ what it says

CLOSE_ENOUGH = 0.25  # the closed form holds where the measured crossover is within 25% of its band


def in_band(measured: dict, closed: dict) -> bool:
    """Whether the measured crossover lies within CLOSE_ENOUGH of the closed form's band: from T* x (1 - f)
    (03's floor on the link alone) less 25% to T* (every byte hidden) plus 25%."""
    t = measured["tokens_per_rank"]
    return (
        (1 - CLOSE_ENOUGH) * closed["low_tokens_per_rank"]
        <= t
        <= (1 + CLOSE_ENOUGH) * closed["tokens_per_rank"]
    )


def crossover_lines(measured: dict, closed: dict | None, side: str | None) -> list[str]:
    """What the sweep found, in sentences that its figures support: the crossover line (measured, closed
    form, R there, their ratio) and a verdict that states agreement or disagreement only beyond both
    figures' spreads over the rounds; where the sweep missed the crossover (`side`, from `missed_side`),
    that instead of a ratio."""
    if closed is None or side is not None:
        where = "above its largest batch" if side == "larger" else "below its smallest batch"
        return [
            f"The crossover lies {where} of the sweep (widened as far as it goes), so this run gives no ratio: the link "
            f"(chosen from R at the model's batch) and the compute did not meet inside the batches swept; "
            "run the cells from the rate measurement again, or with fewer kernels running on this machine."
        ]
    ratio = measured["tokens_per_rank"] / closed["tokens_per_rank"]
    head = [
        f"crossover: measured {measured['tokens_per_rank']:,.0f} tokens per rank (the fit's floor "
        f"{measured['floor_s'] * 1e3:.1f} ms, rms {measured['rms_s'] * 1e3:.1f} ms), closed form "
        f"{closed['tokens_per_rank']:,.0f} at R = {closed['flops_per_s'] / 1e9:.1f} GFLOP/s (down to "
        f"{closed['low_tokens_per_rank']:,.0f} with 03's floor, {closed['floor_share']:.0%} of the bytes, on the link "
        f"alone): ratio {ratio:.2f}"
    ]
    if measured["at_edge"]:
        return [
            *head,
            f"This machine was too busy to resolve the crossover: the exposed time did not settle on a floor "
            f"inside the sweep (the fit's knee sits at its edge, {measured['tokens_per_rank']:,.0f} tokens per "
            "rank), so this run cannot place the crossover and the ratio above does not test the closed form; "
            f"{ADVICE}.",
        ]
    lines = head
    m_rounds, c_rounds = measured["by_round"], closed["by_round"]
    spreads = (
        f"the measured crossover {_tokens(m_rounds)} and the closed form {_tokens(c_rounds)} over the rounds"
        if c_rounds is not None
        else f"the measured crossover {_tokens(m_rounds)} over the rounds"
    )
    apart = c_rounds is not None and compare(m_rounds, c_rounds) != 0
    if in_band(measured, closed):
        lines.append(
            f"The closed form, with R taken where compute meets the link, is within {CLOSE_ENOUGH:.0%} of where "
            f"prefetch stopped losing to the link, the floor on the link alone or not ({spreads})."
        )
    elif apart:
        lines.append(
            f"The measured crossover is {ratio:.2f}x the closed form, beyond both spreads ({spreads}): this run "
            "had costs the formula does not count (gloo's work and other processes on the ranks' cores); "
            "run it again with fewer kernels on this machine to see the formula hold."
        )
    else:
        lines.append(
            f"This machine was too busy to resolve the crossover: {spreads} overlap, and their medians are "
            f"{ratio:.2f}x apart; {ADVICE}."
        )
    return lines


def _tokens(m: Measured) -> str:
    if m.n == 1:
        return f"{m.median:,.0f} (one round)"
    return f"{m.median:,.0f} (IQR {m.q1:,.0f} to {m.q3:,.0f} tokens per rank over {m.n})"


def rate_trend(rows: Sequence[dict], model: str) -> str:
    """One sentence on how R (FLOP/s per rank) moved from the smallest batch swept to the largest: that it
    rose or fell only where the two figures' interquartile ranges do not overlap."""
    first, last = rows[0], rows[-1]

    def r(row: dict) -> Measured:
        return Measured.of(rate(model, row["tokens_per_rank"], c) / 1e9 for c in row["compute"].values)

    a, b = r(first), r(last)
    span = (
        f"R = {a.text('GFLOP/s', 1)} at {first['tokens_per_rank']:,} tokens per rank and "
        f"{b.text('GFLOP/s', 1)} at {last['tokens_per_rank']:,}"
    )
    verdict = compare(b, a)
    if verdict > 0:
        return f"R rose across the sweep: {span}."
    if verdict < 0:
        return f"R fell across the sweep, which a fixed cost per step cannot explain: {span}; {ADVICE}."
    return f"This machine was too busy to resolve how R moved across the sweep: {span}; {ADVICE}."
