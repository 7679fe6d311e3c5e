"""Measured live on a shared machine: 08's crossover, 03's floor and the calibrated prediction, quiet and
beside busy neighbours, side by side (issue 41).

    python benchmarks/shared_machine.py [--sweeps 3] [--settings quiet,nice19,normal] [--part all|prediction]
                                        [--out benchmarks/results.md]

For each setting (quiet; two spinning processes at nice 19; one at normal priority: `labkit.neighbours`):
1. notebook 08's measurement `--sweeps` times: R at the model's batch, the link that puts T* at 1152 tokens
   per rank, the sweep (widening itself where it misses), the measured crossover over the closed form's T*;
   PASS within 25% of its band, T* x (1 - f) (03's floor on the link alone) to T*.
2. notebook 03's: prefetch off, on and on with no link in interleaved rounds; rank 0's exposed time with
   prefetch against the unit plan's floor; PASS unless its whole interquartile range lies below the floor.
3. `labkit calibrate` on `small` at 2 and 4 ranks, then the median step of scratch, fsdp2 and ddp (runs
   interleaved, 2 launches) against `predicted_step_s`; PASS within 20%. Each setting's profile also prices
   every other setting's measured steps: a profile taken beside a neighbour predicts the quiet step.
The section "## Measured live on a shared machine" of `--out` is replaced; the others stay. `--part prediction`
measures 3. alone (a change to the time model) and replaces only its own section, "## Measured live on a
shared machine: the calibrated prediction".
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from calibrated import ENGINES, medians  # this folder's own scripts
from sections import write_section

from labkit import calibrate
from labkit.engines.base import RunConfig
from labkit.engines.scratch import exposed_floor
from labkit.lessons import overlap, roofline
from labkit.measured import beyond
from labkit.model import build_model, config
from labkit.neighbours import busy_neighbours

SETTINGS = {"quiet": (0, 0), "nice19": (2, 19), "normal": (1, 0)}  # name: (spinning processes, niceness)
LABEL = {"quiet": "quiet", "nice19": "2 x nice 19", "normal": "1 x nice 0"}
SWEEP = [8, 16, 24, 32, 48, 64, 96, 128]
CRITICAL_AT = 1152
WITHIN = {"predicted": 0.20}  # 08's crossover: `roofline.in_band`


def crossover_ratio() -> tuple[float | None, bool, str]:
    """08's measurement once: (measured crossover / T*, or None where the sweep missed; whether it lies within
    25% of the closed form's band, `roofline.in_band`; its verdict)."""
    model, n = "tiny", 2
    base = roofline.sweep(model, n, [config(model).global_batch], None)[0]
    link = roofline.link_for(n, CRITICAL_AT, roofline.rate(model, base["tokens_per_rank"], base["compute_s"]))
    rows = roofline.sweep_until_straddled(model, n, SWEEP, link, say=lambda _: None)
    closed = roofline.closed_form_crossover(rows, model, n, link)
    measured = roofline.measured_crossover(rows)
    lines = roofline.crossover_lines(measured, closed, roofline.missed_side(rows, model, n, link))
    if closed is None:
        return None, False, lines[-1]
    return (
        measured["tokens_per_rank"] / closed["tokens_per_rank"],
        roofline.in_band(measured, closed),
        lines[-1],
    )


def floor_row() -> str:
    """03's measurement: rank 0's exposed time with prefetch against the floor, and the verdict."""
    cfg = RunConfig(model="tiny", world_size=2, steps=4)
    base = medians([("scratch", cfg)], 1)[0]["step_s"]
    wire = sum(v["wire_bytes"] for v in medians([("scratch", cfg)], 1)[0]["records"][0]["comm"].values())
    cfg = replace(cfg, link_gbytes=wire / (0.5 * base) / 1e9)
    runs = overlap.interleaved_runs(cfg, 3)
    floor_s = exposed_floor(build_model("tiny"), cfg, 2)["floor_s"]
    on = runs[overlap.ON].exposed
    ok = beyond(on, floor_s) >= 0
    return f"{on.text()} against the floor {floor_s * 1e3:.1f} ms: {'PASS' if ok else 'FAIL'}"


def steps_and_profiles(reps: int) -> tuple[dict, dict]:
    """{(n, engine): measured median step s} and {n: profile}: each world size calibrated, then run."""
    measured, profiles = {}, {}
    for n in (2, 4):
        profiles[n] = calibrate.calibrate("small", (n,))
        runs = [(e, RunConfig(model="small", world_size=n, steps=5)) for e in ENGINES]
        for (engine, _), m in zip(runs, medians(runs, reps), strict=True):
            measured[n, engine] = m["step_s"]
    return measured, profiles


def predicted_over_measured(measured: dict, profiles: dict) -> dict:
    """{(n, engine): predicted / measured} with `profiles[n]` pricing `measured[n, engine]`."""
    return {
        (n, e): calibrate.predicted_step_s(e, RunConfig(model="small", world_size=n, steps=5), profiles[n])
        / s
        for (n, e), s in measured.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweeps", type=int, default=3, help="08 measurements per setting")
    parser.add_argument("--reps", type=int, default=2, help="launches per step-time measurement")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="of " + ", ".join(SETTINGS))
    parser.add_argument("--part", choices=("all", "prediction"), default="all", help="prediction: 3. alone")
    parser.add_argument("--out", default="benchmarks/results.md")
    args = parser.parse_args(argv)
    settings = args.settings.split(",")
    if not set(settings) <= set(SETTINGS) or args.sweeps < 1:
        print(f"--settings: pick from {', '.join(SETTINGS)}; --sweeps: 1 or more", file=sys.stderr)
        return 2
    start = time.perf_counter()
    got: dict[str, dict] = {}
    for name in settings:
        count, nice = SETTINGS[name]
        whole = args.part == "all"
        with busy_neighbours(count, nice):
            sweeps = [crossover_ratio() for _ in range(args.sweeps)] if whole else []
            floor = floor_row() if whole else ""
            measured, profiles = steps_and_profiles(args.reps)
        got[name] = {"sweeps": sweeps, "floor": floor, "measured": measured, "profiles": profiles}
        print(name, got[name]["sweeps"], floor, measured, flush=True)
    header = "## Measured live on a shared machine" + (
        "" if args.part == "all" else ": the calibrated prediction"
    )
    write_section(args.out, header, [header, "", *report(got, time.perf_counter() - start)])
    return 0


def _crossover_cell(ratio: float | None, in_band: bool) -> str:
    if ratio is None:
        return "missed"
    return f"{ratio:.2f} {'PASS' if in_band else 'FAIL'}"


def report(got: dict, wall_s: float) -> list[str]:
    names = list(got)
    head = "| | " + " | ".join(LABEL[n] for n in names) + " |"
    rule = "|---|" + "---|" * len(names)
    lines = [
        f"Beside spinning processes (`labkit.neighbours`) on this machine's cores; `benchmarks/shared_machine.py`, "
        f"{time.strftime('%Y-%m-%d')}, wall {wall_s:.0f} s. Times on the rank's clock (`labkit.probes.clock`).",
        "",
    ]
    runs = max(len(got[n]["sweeps"]) for n in names)
    if not runs:
        lines += [
            "The time model as it is now (the drift read per step, `calibrate.drift_per_wait_s`): these rows "
            "supersede the prediction rows of the section above where they differ.",
            "",
        ]
    if runs:
        lines += [
            "08: measured crossover / T*, one row per run (PASS within 25% of the band T* x (1 - f) to T*); "
            "03: rank 0's exposed time with prefetch against the floor (FAIL only when its whole IQR lies below it).",
            "",
            head,
            rule,
        ]
    for i in range(runs):
        cells = [
            _crossover_cell(*got[n]["sweeps"][i][:2]) if i < len(got[n]["sweeps"]) else "" for n in names
        ]
        lines.append(f"| 08 crossover, run {i + 1} | " + " | ".join(cells) + " |")
    if runs:
        lines += ["| 03 exposed with prefetch | " + " | ".join(got[n]["floor"] for n in names) + " |", ""]
    lines += ["Calibrated prediction / measured median step, `small` (PASS within 20%):", "", head, rule]
    for key in got[names[0]]["measured"]:
        cells = []
        for n in names:
            ratio = predicted_over_measured(got[n]["measured"], got[n]["profiles"])[key]
            cells.append(f"{ratio:.2f} {'PASS' if abs(ratio - 1) <= WITHIN['predicted'] else 'FAIL'}")
        lines.append(f"| {key[1]} at {key[0]} ranks | " + " | ".join(cells) + " |")
    drift = [
        " / ".join(f"{got[n]['profiles'][w]['sync_s'][str(w)] * 1e3:.1f}" for w in (2, 4)) + " ms"
        for n in names
    ]
    lines.append("| calibrate's drift per wait, 2 / 4 ranks | " + " | ".join(drift) + " |")
    lines += [
        "",
        "A profile from one setting pricing another setting's measured steps (rows: the profile's):",
        "",
    ]
    lines += [head, rule]
    for p in names:
        cells = []
        for n in names:
            ratios = predicted_over_measured(got[n]["measured"], got[p]["profiles"]).values()
            cells.append(f"{min(ratios):.2f} to {max(ratios):.2f}")
        lines.append(f"| profile taken {LABEL[p]} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
