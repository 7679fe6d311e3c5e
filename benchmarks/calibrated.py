"""The calibrated time model against the measured step, and prefetch against the unit plan's floor.

    python benchmarks/calibrated.py [--reps 2] [--steps 5] [--out benchmarks/results-calibrated.md]

1. `labkit.calibrate.calibrate` profiles this machine at each world size just before that world size's runs
   and just after them (a VM under sustained load slows; a machine shared with other work changes under
   the benchmark); `predicted_step_s` prices one step of scratch, fsdp2 and ddp on `small` at 2 and 4
   ranks with the mean of the two profiles, with no emulated link and with one set (from the first
   profile) so that the scratch engine's wire bytes take 0.5 x the plan's compute; each beside the
   measured median step (PASS within 20%).
2. The scratch engine on `small` and `tiny_deep` at 2 ranks under that link: prefetch (depth 1 and 2, the
   root split; depth 1 with one root) over no prefetch, beside the floor's ideal: the no-prefetch run's
   compute (its waits cut out) plus the floor, the collectives with no compute beside them
   (`labkit.engines.scratch.exposed_floor` priced on the calibrated machine: each collective the longer of
   the link's time and gloo's own), over the no-prefetch step; PASS at
   <= 0.70 on `small` and <= 0.65 on `tiny_deep`, with the wire bytes equal to `predicted_wire_bytes` and
   the losses to `single`'s; a target below the floor's ideal is marked unreachable. Figures are medians
   over repetitions that alternate the runs; a loaded machine moves them.
3. What gloo's collectives cost the CPU, on one block of `small` (`gloo_cpu.py`): why the compute that
   prefetch hides a collective behind runs slower.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace

import gloo_cpu  # this folder's own scripts (a script's own folder is on sys.path)
from sections import write_report

from labkit import budget, calibrate
from labkit.engines import scratch
from labkit.engines.base import RunConfig
from labkit.engines.loop import run, run_many
from labkit.model import build_model, count_params
from labkit.probes import timeline
from labkit.tables import median_step_s
from labkit.units import unit_plan

WITHIN = 0.20  # the calibrated prediction's allowed distance from the measured step
PREFETCH_TARGETS = {"small": 0.70, "tiny_deep": 0.65}  # prefetch / no-prefetch step, 2 ranks
ENGINES = ("scratch", "fsdp2", "ddp")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def half_compute_link(cfg: RunConfig, profile: dict) -> float:
    """GB/s at which the scratch engine's wire bytes per step take 0.5 x the calibrated plan's compute."""
    n, strategy, options = calibrate.plan_options("scratch", cfg, profile)
    compute_s = budget.plan(count_params(build_model(cfg.model)), n, strategy, **options)["compute_time_s"]
    wire = sum(scratch.predicted_wire_bytes(build_model(cfg.model), cfg, cfg.world_size).values())
    return wire / (0.5 * compute_s) / 1e9


def medians(runs: list[tuple[str, RunConfig]], reps: int) -> list[dict]:
    """Each run's records over `reps` launches (the runs alternate inside each); its median step in "step_s"."""
    records = [run_many(runs) for _ in range(reps)]
    out = []
    for i in range(len(runs)):
        recs = [r[i] for r in records]
        out.append({"records": recs, "step_s": statistics.median(median_step_s(r) for r in recs)})
    return out


def mean_profile(before: dict, after: dict) -> dict:
    """The machine profile whose every figure is the mean of `before`'s and `after`'s (same keys)."""
    if isinstance(before, dict):
        return {k: mean_profile(v, after[k]) for k, v in before.items()}
    if isinstance(before, float):
        return (before + after) / 2
    return before


def prediction_rows(steps: int, reps: int) -> tuple[list[str], dict]:
    """The predicted/measured table, and the profile of 2 ranks (calibrated just before their runs).

    This machine (a VM) slows under sustained load, so each world size is calibrated just before its runs
    (which sets the link) and again just after; the prediction uses the mean of the two profiles, and the
    table says how far the compute rate moved between them.
    """
    profiles, rows = (
        {},
        [
            "| ranks | link | engine | measured s | predicted s | predicted/measured | within 20% |",
            "|---|---|---|---|---|---|---|",
        ],
    )
    for n in (2, 4):
        before = profiles[n] = calibrate.calibrate("small", (n,))
        print(calibrate.profile_table(before), flush=True)
        base = RunConfig(model="small", world_size=n, steps=steps)
        link = half_compute_link(base, before)
        configs = [("none", base), (f"{link:.3f} GB/s (0.5 x compute)", replace(base, link_gbytes=link))]
        runs = [(e, cfg) for _, cfg in configs for e in ENGINES]
        measured = medians(runs, reps)
        after = calibrate.calibrate("small", (n,))
        profile = mean_profile(before, after)
        drift = after["compute_flops_per_s"] / before["compute_flops_per_s"] - 1
        rows.append(
            f"| {n} | compute rate before / after the runs: {before['compute_flops_per_s'] / 1e9:.1f} / "
            f"{after['compute_flops_per_s'] / 1e9:.1f} GFLOP/s ({drift:+.0%}); predicted with their mean "
            "| | | | | |"
        )
        for (engine, cfg), m in zip(runs, measured, strict=True):
            label = next(lbl for lbl, c in configs if c == cfg)
            predicted = calibrate.predicted_step_s(engine, cfg, profile)
            ratio = predicted / m["step_s"]
            rows.append(
                f"| {n} | {label} | {engine} | {m['step_s']:.3f} | {predicted:.3f} | {ratio:.2f} | "
                f"{verdict(abs(ratio - 1) <= WITHIN)} |"
            )
            print(rows[-1], flush=True)
    tables = [f"{n} ranks:\n{calibrate.profile_table(p)}" for n, p in profiles.items()]
    return rows, {"profile": profiles[2], "tables": tables}


PREFETCH_VARIANTS = {  # label -> the RunConfig settings it changes
    "no prefetch": {"prefetch": False},
    "prefetch, depth 1": {},
    "prefetch, depth 2": {"prefetch_depth": 2},
    "prefetch, depth 1, one root": {"options": {"split_root": False}},
}


def unit_bytes(model: str, cfg: RunConfig) -> list[int]:
    """Gathered bytes of each unit of the scratch engine's plan at 2 ranks, in forward order (fp32)."""
    plan = unit_plan(build_model(model), None, scratch.split_root(cfg))
    return [4 * sum(budget.padded_numel(tuple(p.shape), 2) for _, p in params) for _, _, params in plan]


def busy_and_waiting_s(records: list[dict]) -> tuple[float, float]:
    """Median seconds per step that a rank's compute thread computed and that it waited on collectives,
    over every rank and kept step of `records` (`labkit.probes.timeline`)."""
    busy, waiting = [], []
    for rec in records:
        for step in sorted({e["step"] for e in rec["timeline"]}):
            events = [e for e in rec["timeline"] if e["step"] == step]
            for rank in range(len(rec["peak_mem_bytes"])):
                busy.append(timeline.busy_s(events, rank))
                waiting.append(timeline.exposed_comm_s(events, rank))
    return statistics.median(busy), statistics.median(waiting)


def prefetch_rows(profile: dict, steps: int, reps: int) -> list[str]:
    rows = [
        "2 ranks: the machine profile of the 2-rank runs above sets the link.",
        "",
        "| model | link GB/s | variant | step s | / no prefetch | floor's ideal | floor ms (plan) "
        "| busy / waiting ms | bytes = formula | losses = single | peak MB - no prefetch's "
        "| gathered peak MB - no prefetch's (budget) | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, target in PREFETCH_TARGETS.items():
        base = RunConfig(model=model, world_size=2, steps=steps)
        link = half_compute_link(base, profile)
        cfgs = {k: replace(base, link_gbytes=link, **change) for k, change in PREFETCH_VARIANTS.items()}
        results = dict(zip(cfgs, medians([("scratch", c) for c in cfgs.values()], reps), strict=True))
        single = run("single", replace(base, steps=steps))["losses"]
        off = results["no prefetch"]["step_s"]
        timing = {label: busy_and_waiting_s(r["records"]) for label, r in results.items()}
        off_busy_s, _ = timing["no prefetch"]
        off_peak = max(results["no prefetch"]["records"][-1]["peak_mem_bytes"])
        off_gathered = budget.gathered_peak_bytes(unit_bytes(model, base), prefetch=False)
        for label, cfg in cfgs.items():
            rec = results[label]["records"][-1]
            wire = {k: v["wire_bytes"] for k, v in rec["comm"].items()}
            bytes_ok = wire == scratch.predicted_wire_bytes(build_model(model), cfg, 2)
            losses_ok = all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(rec["losses"], single, strict=True))
            floor = scratch.exposed_floor(build_model(model), cfg, 2, machine=profile)
            ideal = (off_busy_s + floor["floor_s"]) / off
            ratio = results[label]["step_s"] / off
            check = ""
            if label == "prefetch, depth 1":
                check = verdict(ratio <= target and bytes_ok and losses_ok) + f" (<= {target}"
                check += f"; unreachable: below the floor's ideal {ideal:.2f})" if ideal > target else ")"
            peak = max(rec["peak_mem_bytes"]) - off_peak
            busy_s, waiting_s = timing[label]
            gathered = budget.gathered_peak_bytes(unit_bytes(model, cfg), cfg.prefetch_depth) - off_gathered
            rows.append(
                f"| {model} | {link:.4f} | {label} | {results[label]['step_s']:.3f} | {ratio:.2f} | "
                f"{ideal:.2f} | {floor['floor_s'] * 1e3:.1f} | "
                f"{busy_s * 1e3:.0f} / {waiting_s * 1e3:.0f} | {bytes_ok} | {losses_ok} | "
                f"{peak / 1e6:+.2f} | {gathered / 1e6:+.2f} | {check} |"
            )
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2, help="launches per configuration (runs alternate)")
    parser.add_argument("--steps", type=int, default=5, help="steps per run (the first is dropped)")
    parser.add_argument("--out", default="benchmarks/results-calibrated.md")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    predicted, calibration = prediction_rows(args.steps, args.reps)
    lines = [
        f"# The calibrated time model and prefetch to the floor ({time.strftime('%Y-%m-%d')}, "
        f"{os.cpu_count()} CPUs, CPU gloo)",
        "",
        "## The machine (`labkit calibrate`)",
        "",
        "```",
        *calibration["tables"],
        "```",
        "",
        "## Predicted (calibrated `labkit.budget`) against measured median step, `small`",
        "",
        *predicted,
        "",
        "## Prefetch against the floor, scratch, 2 ranks, emulated link at 0.5 x compute",
        "",
        "busy / waiting: per step, what a rank's compute thread spent computing and blocked on collectives "
        "(`labkit.probes.timeline`, medians over ranks and steps). floor: the collectives with no compute "
        "beside them (`labkit.budget.exposed_floor`), each priced on the calibrated machine as the longer of "
        "the link's time and gloo's own. floor's ideal: the no-prefetch run's busy time plus the floor, over "
        "its step: every other collective hidden, the compute unchanged. On CPU the compute does change: "
        "gloo's own work runs on the cores beside the compute that hides it (its reduce-scatter is an "
        "all-reduce inside, the costliest; last section), and busy time grows.",
        "",
        *prefetch_rows(calibration["profile"], args.steps, args.reps),
        "",
        *gloo_cpu.section_lines(gloo_cpu.measure("small")),
        "",
    ]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines.append(
        f"Load average as it ended (1, 5, 15 min): {load}; wall {time.perf_counter() - start:.0f} s."
    )
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
