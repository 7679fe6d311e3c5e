"""FSDP2 and DeepSpeed ZeRO-3 at matched granularity: the same collectives per step, then the step times.

Claim 21 says neither is faster at equal tuning. Equal tuning means equal units: with the fair knobs
DeepSpeed gathers every sub-module by itself (64 all-gathers a step on tiny against FSDP2's 9), and on gloo
each call costs milliseconds whatever its size. `ds_config.matched_to_fsdp2` makes each block a DeepSpeed
leaf module and sizes its reduce bucket; `Fsdp2ModuleUnits` gives FSDP2 DeepSpeed's remaining units (the
root's four modules each a unit). `run_parity` trains FSDP2 at its own per-block units once, then the matched
pair several times on the same ranks, interleaved, and sets their calls, bytes and step times side by side;
`decide` turns the pairs' step-time ratios into a verdict that a noisy machine cannot flip.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch import nn
from torch.distributed.fsdp import fully_shard

from labkit import measured
from labkit.engines import fsdp2
from labkit.engines.base import RankInfo, RunConfig, adamw
from labkit.engines.ds_config import matched_to_fsdp2
from labkit.engines.loop import run_many
from labkit.engines.registry import DEEPSPEED, FSDP2
from labkit.names import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER

FSDP2_BLOCKS = "fsdp2, per-block units"
FSDP2_MODULES = "fsdp2, module units"
DEEPSPEED_MATCHED = "deepspeed, matched"


class Fsdp2ModuleUnits:
    """The fsdp2 engine with every module that holds parameters a unit: `fully_shard` on each block and on
    each of the root's modules (tok, pos, ln_f, head), then on the (now parameter-free) root."""

    name = FSDP2

    def build(self, cfg: RunConfig, model: nn.Module, rank_info: RankInfo) -> fsdp2.Fsdp2Engine:
        n = rank_info.world_size
        mesh = fsdp2.device_mesh(rank_info.device.type, n)
        common = fsdp2.shard_kwargs(cfg, mesh)
        reshard = fsdp2.block_reshard(cfg, n)
        for module in model.children():
            if module is model.blocks:
                for block in module:
                    fully_shard(block, reshard_after_forward=reshard, **common)
            elif any(True for _ in module.parameters()):
                fully_shard(module, reshard_after_forward=reshard, **common)
        fully_shard(model, **common)
        if cfg.prefetch:
            fsdp2.set_explicit_prefetch(model, cfg.prefetch_depth)
        fsdp2.assert_sharded(model, mesh)
        return fsdp2.Fsdp2Engine(model, adamw(model.parameters(), cfg), rank_info.device)


def matched_runs(cfg: RunConfig) -> dict[str, tuple[Any, RunConfig]]:
    """{label: (engine, cfg)}: FSDP2 at its per-block units, FSDP2 at module units, DeepSpeed matched to it.

    Neither side prefetches: DeepSpeed's fair knobs keep one parameter live, which stops its prefetch, so
    FSDP2 runs with `prefetch=False` too (it keeps its implicit one-block backward prefetch, which has no
    switch, and which on gloo issues the same blocking gather a little earlier).
    """
    cfg = replace(cfg, prefetch=False)
    # DeepSpeed reads no prefetch setting (validation.check_settings would refuse it): its knobs are what stop it.
    ds_cfg = replace(cfg, prefetch=True, options={**cfg.options, **matched_to_fsdp2(cfg.model)})
    return {
        FSDP2_BLOCKS: (FSDP2, cfg),
        FSDP2_MODULES: (Fsdp2ModuleUnits(), cfg),
        DEEPSPEED_MATCHED: (DEEPSPEED, ds_cfg),
    }


def interleaved(repeats: int) -> list[str]:
    """The order `run_parity` trains in: FSDP2 at per-block units once, then `repeats` matched pairs, each pair
    starting with the engine the previous one ended with (FSDP2, DeepSpeed, DeepSpeed, FSDP2, ...)."""
    return [FSDP2_BLOCKS, *measured.interleaved((FSDP2_MODULES, DEEPSPEED_MATCHED), repeats)]


def run_parity(cfg: RunConfig, repeats: int = 4, timeout_s: float = 600.0) -> dict[str, Any]:
    """FSDP2 at per-block units once, then `repeats` pairs of the matched two, in one launch; per label a summary.

    The pairs are interleaved and alternate which engine goes first (`interleaved`), so a machine that slows or
    speeds up during the launch weighs on both alike. Per label: "calls"
    and "wire_bytes" per step by collective (rank 0, last step), "median_step_s" per repetition
    (`tables.median_step_s`: steps after the first), "step_s" (the median of those), "spread" (max / min of
    them), "phase_s" (rank 0's forward, backward and optimizer spans, s per step, the median over repetitions)
    and "losses" (the first repetition's). "ratio": DeepSpeed matched / FSDP2 at module units, each pair's
    ("per_repeat") and their median; `decide` reads them.
    """
    from labkit.tables import median_step_s, phase_s

    if repeats < 1:
        raise ValueError(f"repeats={repeats}: pass 1 or more repetitions")
    runs = matched_runs(cfg)
    order = interleaved(repeats)
    records = run_many([runs[label] for label in order], timeout_s=timeout_s)
    out: dict[str, Any] = {}
    for label in runs:
        mine = [r for lab, r in zip(order, records, strict=True) if lab == label]
        medians = [median_step_s(r) for r in mine]
        out[label] = {
            "calls": {k: row["calls"] for k, row in mine[-1]["comm"].items()},
            "wire_bytes": {k: row["wire_bytes"] for k, row in mine[-1]["comm"].items()},
            "median_step_s": medians,
            "step_s": statistics.median(medians),
            "spread": max(medians) / min(medians),
            "phase_s": {
                phase: statistics.median(phase_s(r, phase) for r in mine)
                for phase in ("forward", "backward", "optimizer")
            },
            "losses": mine[0]["losses"],
        }
    pairs = decide(out[FSDP2_MODULES]["median_step_s"], out[DEEPSPEED_MATCHED]["median_step_s"])
    return {
        "config": cfg.to_dict(),
        "engines": out,
        "ratio": {"per_repeat": list(pairs.ratios), "median": pairs.median},
    }


# A gap under this is not called one: the fact sheet puts what prefetch and bucket settings alone move at 5-10%.
PARITY_MARGIN = 0.10


@dataclass(frozen=True)
class ParityVerdict:
    """What interleaved pairs of step times say: DeepSpeed / FSDP2 per pair, and the verdict read off them.

    The interval is the pairs' range [low, high]: it holds the median ratio with probability `coverage`
    (1 - 2 x 0.5^pairs, the sign test's, whatever the noise's shape). `outcome`: "deepspeed slower" or
    "fsdp2 slower" when the whole interval lies beyond 1 +- `margin`; "parity" when it lies inside; "noise"
    when it straddles the margin, so one noisy pair moves the verdict only between neighbouring sentences.
    """

    ratios: tuple[float, ...]
    margin: float = PARITY_MARGIN

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def low(self) -> float:
        return min(self.ratios)

    @property
    def high(self) -> float:
        return max(self.ratios)

    @property
    def coverage(self) -> float:
        return 1 - 2 * 0.5 ** len(self.ratios)

    @property
    def outcome(self) -> str:
        above, below = 1 + self.margin, 1 / (1 + self.margin)
        if self.low > above:
            return "deepspeed slower"
        if self.high < below:
            return "fsdp2 slower"
        if below <= self.low and self.high <= above:
            return "parity"
        return "noise"

    def sentence(self) -> str:
        """The verdict in one sentence, with the interval it rests on."""
        pairs = (
            f"DeepSpeed / FSDP2 {self.median:.2f}x (median of {len(self.ratios)} interleaved pairs; the pairs "
            f"run from {self.low:.2f}x to {self.high:.2f}x, a range that holds the median with "
            f"{self.coverage:.0%} confidence)"
        )
        if self.outcome == "parity":
            return f"{pairs}: every pair within {self.margin:.0%}, so parity holds on this machine to within that."
        if self.outcome == "noise":
            return (
                f"{pairs}: within the noise of this machine, the pairs agreeing neither on a gap beyond "
                f"{self.margin:.0%} nor on one inside it."
            )
        slower = "DeepSpeed's" if self.outcome == "deepspeed slower" else "FSDP2's"
        return (
            f"{pairs}: {slower} step was longer in every pair, by more than the {self.margin:.0%} this lab calls "
            "a difference, so at matched bytes parity does NOT hold on this machine."
        )


def decide(
    fsdp2_step_s: Sequence[float], deepspeed_step_s: Sequence[float], margin: float = PARITY_MARGIN
) -> ParityVerdict:
    """The verdict on step times (s) measured in interleaved pairs: the i-th of each list ran side by side."""
    if not fsdp2_step_s or len(fsdp2_step_s) != len(deepspeed_step_s):
        raise ValueError(
            f"{len(fsdp2_step_s)} FSDP2 and {len(deepspeed_step_s)} DeepSpeed step times: pass one of each per pair"
        )
    return ParityVerdict(tuple(d / f for f, d in zip(fsdp2_step_s, deepspeed_step_s, strict=True)), margin)


def faster(step_s: dict[str, measured.Measured], margin: float = PARITY_MARGIN) -> str | None:
    """Of two runs, {label: its steps' seconds}, the one whose step is shorter beyond both spreads (the
    interquartile ranges do not overlap, `measured.compare`) and by more than `margin` at the medians; None
    when neither is (even, or this run cannot tell them apart)."""
    (a, a_s), (b, b_s) = step_s.items()
    order = measured.compare(a_s, b_s)
    if order < 0 and a_s.median * (1 + margin) < b_s.median:
        return a
    if order > 0 and b_s.median * (1 + margin) < a_s.median:
        return b
    return None


def steps_measured(record: dict[str, Any]) -> measured.Measured:
    """A record's step times after step 0 (the warm-up) as one `Measured` (seconds; the slowest rank's)."""
    times = record["step_time_s"]
    return measured.Measured.of(times[1:] if len(times) > 1 else times)


def parity_verdict(result: dict[str, Any], margin: float = PARITY_MARGIN) -> ParityVerdict:
    """The verdict on `run_parity`'s pairs (DeepSpeed matched / FSDP2 at module units), at `margin`."""
    return ParityVerdict(tuple(result["ratio"]["per_repeat"]), margin)


def parity_table(result: dict[str, Any]) -> str:
    """`run_parity`'s result as a fixed-width table: calls and wire bytes by collective, step and phase times."""
    lines = [
        f"{'engine':<24} {'all-gathers':>11} {'reduce-scatters':>15} {'all-reduces':>11} {'wire MB':>8} "
        f"{'step ms':>8} {'spread':>6} {'fwd ms':>7} {'bwd ms':>7} {'opt ms':>7}"
    ]
    for label, row in result["engines"].items():
        calls, phases = row["calls"], row["phase_s"]
        lines.append(
            f"{label:<24} {calls.get(ALL_GATHER, 0):>11} {calls.get(REDUCE_SCATTER, 0):>15} "
            f"{calls.get(ALL_REDUCE, 0):>11} {sum(row['wire_bytes'].values()) / 1e6:>8.3f} "
            f"{row['step_s'] * 1e3:>8.1f} {row['spread']:>6.2f} {phases['forward'] * 1e3:>7.1f} "
            f"{phases['backward'] * 1e3:>7.1f} {phases['optimizer'] * 1e3:>7.1f}"
        )
    ratios = result["ratio"]["per_repeat"]
    lines.append(
        f"deepspeed matched / fsdp2 module units: {result['ratio']['median']:.2f} (median of {len(ratios)} pairs, "
        f"from {min(ratios):.2f} to {max(ratios):.2f})"
    )
    return "\n".join(lines)
