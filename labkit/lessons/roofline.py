"""FSDP's roofline measured on CPU ranks: exposed communication against tokens per rank, over an emulated link.

`sweep` trains the scratch engine at several global batches of one model ("tiny@B", `model.with_batch`),
each twice on the same ranks: once with no emulated link (its compute: the step less what it waited for)
and once over a link of `link_gbytes`, with prefetch (its exposed communication: what rank by rank it sat
blocked on collectives). Every figure is a median over the steps after the first.

`closed_form_crossover` is `labkit.budget.roofline`'s T* = (b/2)(n-1)/n R/B with this machine's R: a CPU
step has a fixed cost (Python, op launches), so the rate at which a rank computes rises with its tokens, and
the formula holds with the rate at the crossover, where the step's compute equals its link time.
`measured_crossover` fits the sweep with the shape the prefetch model predicts (exposed = floor +
slope x max(0, T_x - T): falling while the link outruns the compute, flat once the compute hides it) and
returns T_x. `link_for` picks the link that puts the closed form's crossover at a chosen number of tokens.
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
from labkit.engines.loop import train_rank
from labkit.engines.registry import SCRATCH
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


def _rank_steps(cfgs: Sequence[RunConfig]) -> list[list[tuple[float, float]]]:
    """Rank side of `sweep`: for each run, (step seconds, seconds blocked on collectives) of each step."""
    out = []
    for cfg in cfgs:
        rec = train_rank(ENGINE, cfg)
        dist.barrier()
        out.append(
            [
                (s, exposed_comm_s([e for e in rec["timeline"] if e["step"] == i]))
                for i, s in enumerate(rec["step_time_s"])
            ]
        )
    return out


def _medians(per_rank: list[list[tuple[float, float]]]) -> tuple[float, float]:
    """(median over the steps after the first of the slowest rank's step, of the ranks' mean exposed), s."""
    steps = range(1, len(per_rank[0]))
    step_s = statistics.median(max(r[i][0] for r in per_rank) for i in steps)
    exposed_s = statistics.median(statistics.mean(r[i][1] for r in per_rank) for i in steps)
    return step_s, exposed_s


def sweep(
    model: str, world_size: int, sequences: Sequence[int], link_gbytes: float | None, steps: int = 5
) -> list[dict[str, Any]]:
    """One launch of `world_size` ranks: each global batch of `sequences`, without a link, then over it.

    Returns one row per batch: sequences, tokens_per_rank, compute_s (the step with no link, less what it
    waited for), and over the link with prefetch (None when `link_gbytes` is None): step_s, exposed_s, and
    link_s (the link's time for the step's wire bytes). Seconds per step, medians over the steps after the
    first.
    """
    plain = [RunConfig(model=with_batch(model, g), world_size=world_size, steps=steps) for g in sequences]
    linked = [] if link_gbytes is None else [replace(cfg, link_gbytes=link_gbytes) for cfg in plain]
    per_rank = labkit.launch(_rank_steps, world_size, plain + linked)
    rows = []
    for k, cfg in enumerate(plain):
        step_s, exposed_s = _medians([r[k] for r in per_rank])
        row = {
            "sequences": sequences[k],
            "tokens_per_rank": tokens_per_rank(cfg.model, world_size),
            "compute_s": step_s - exposed_s,
            "step_s": None,
            "exposed_s": None,
            "link_s": None,
        }
        if linked:
            row["step_s"], row["exposed_s"] = _medians([r[len(plain) + k] for r in per_rank])
            row["link_s"] = link_seconds(linked[k])
        rows.append(row)
    return rows


def rate(model: str, tokens: float, compute_s: float) -> float:
    """FLOP/s one rank computed at: 6 x parameters x `tokens` over `compute_s` seconds."""
    return 6 * count_params(build_model(model)) * tokens / compute_s


def link_for(world_size: int, critical_tokens: float, flops_per_s: float, weight_bytes: int = 4) -> float:
    """The link (GB/s) that puts the closed form's T* at `critical_tokens` for a rank computing `flops_per_s`
    (T* is inversely proportional to the link: its value on a 1 B/s link over the one wanted)."""
    return closed_form_critical_tokens(flops_per_s, 1.0, weight_bytes, world_size) / critical_tokens / 1e9


def closed_form_crossover(
    rows: Sequence[dict], model: str, world_size: int, link_gbytes: float, weight_bytes: int = 4
) -> dict[str, float]:
    """T* = (b/2)(n-1)/n R/B with R this machine's rate at T*: the tokens where each row's own T* (at its
    measured rate) crosses its tokens, interpolated between the two rows around it. Returns
    {"tokens_per_rank", "flops_per_s" (R there)}; ValueError when the sweep does not straddle it."""

    def own(row: dict) -> float:
        r = rate(model, row["tokens_per_rank"], row["compute_s"])
        return closed_form_critical_tokens(r, link_gbytes * 1e9, weight_bytes, world_size)

    gaps = [(row["tokens_per_rank"], own(row) - row["tokens_per_rank"]) for row in rows]
    for (t0, g0), (t1, g1) in pairwise(gaps):
        if g0 >= 0 >= g1:
            t = t0 + (t1 - t0) * g0 / (g0 - g1) if g0 != g1 else t0
            # T* is proportional to the rate: the rate whose T* is t is t over T* at 1 FLOP/s.
            per_flop = closed_form_critical_tokens(1.0, link_gbytes * 1e9, weight_bytes, world_size)
            return {"tokens_per_rank": t, "flops_per_s": t / per_flop}
    raise ValueError(
        "the sweep does not straddle the closed form's crossover; sweep smaller and larger batches"
    )


def measured_crossover(rows: Sequence[dict]) -> dict[str, float]:
    """The least-squares fit of exposed_s = floor_s + slope x max(0, T_x - T) over the rows (T in tokens per
    rank), T_x searched on a fine grid between the smallest and the largest T. Returns {"tokens_per_rank":
    T_x, "floor_s", "slope_s_per_token", "rms_s"}."""
    ts = [row["tokens_per_rank"] for row in rows]
    ys = [row["exposed_s"] for row in rows]
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
