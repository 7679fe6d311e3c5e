"""Side-by-side benchmarks of the engines: medians and ratios from one run, engines interleaved A B A B.

    python benchmarks/run_all.py [--quick] [--no-course | --course-only] [--out benchmarks/results.md]

(`benchmarks/cpu_adam.py` and `benchmarks/slides.py` measure their one section alone and write it into the
same file.)

Every figure is a median over repetitions that alternate between the engines (after one warm-up step per
run, which is dropped), so a machine that slows down during the run slows every engine alike. Absolute
times depend on the machine; the ratios are what the targets of the performance issue are about.
"""

from __future__ import annotations

import argparse
import glob
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import torch
from sections import write_report  # benchmarks/sections.py (a script's own folder is on sys.path)

import labkit
from labkit import budget
from labkit.engines import fsdp1, fsdp2, scratch
from labkit.engines.base import RunConfig
from labkit.engines.loop import run, run_many
from labkit.engines.on_rank import rank_info, timed_step
from labkit.model import batch, build_model, count_params
from labkit.probes import Probes, exposed_comm_s
from labkit.slides import REMEASURED
from labkit.tables import median_step_s, wire_bytes

TARGETS = {
    "scratch/fsdp2 small": 1.0,
    "scratch/fsdp2 tiny": 1.1,
    "exposed ratio": 0.25,
    "probe cost": 0.05,
    "course s": 600.0,
}
# The budget strategy whose state arithmetic each engine implements (deepspeed adds its fp32 master copy).
BUDGET_STRATEGY = {"ddp": "ddp", "scratch": "zero3", "fsdp1": "zero3", "fsdp2": "zero3", "deepspeed": "zero3"}


def verdict(value: float, target: float) -> str:
    """'met' when `value` <= `target`, else by how much it missed (lower is better for every target)."""
    return "met" if value <= target else f"missed by {value / target - 1:.0%}"


def step_times(engines: list[str], cfg: RunConfig, reps: int) -> dict[str, float]:
    """Median step time (s) of each engine, the engines interleaved `reps` times."""
    samples: dict[str, list[float]] = {e: [] for e in engines}
    for _ in range(reps):
        for engine in engines:
            samples[engine].append(median_step_s(run(engine, cfg)))
    return {e: statistics.median(s) for e, s in samples.items()}


def exposed_comm(cfg: RunConfig, reps: int, comm_to_compute: float = 0.5) -> dict[str, float]:
    """Exposed communication (s per step, rank 0, mean of the timeline's kept steps) with prefetch off and on.

    "off"/"on": the emulated link set so that its time is `comm_to_compute` x the step's compute;
    "gloo_off"/"gloo_on": no link, so what is exposed is gloo's own time (on CPU its copies run on the
    same cores as the compute, which an interconnect's DMA would not).
    """
    base = run("scratch", cfg)
    wire = wire_bytes(base)
    link = wire / (comm_to_compute * median_step_s(base)) / 1e9
    out: dict[str, list[float]] = {"off": [], "on": [], "gloo_off": [], "gloo_on": []}
    for _ in range(reps):
        for label, link_gbytes, prefetch in (
            ("off", link, False),
            ("on", link, True),
            ("gloo_off", None, False),
            ("gloo_on", None, True),
        ):
            rec = run("scratch", replace(cfg, link_gbytes=link_gbytes, prefetch=prefetch))
            steps = sorted({e["step"] for e in rec["timeline"]} - {0})  # step 0 learns the prefetch order
            out[label].append(
                statistics.fmean(
                    exposed_comm_s([e for e in rec["timeline"] if e["step"] == k], 0) for k in steps
                )
            )
    link_s = wire / (link * 1e9)
    return {"link_gbytes": link, "link_s": link_s, **{k: statistics.median(v) for k, v in out.items()}}


def exposed_floor_ratio(cfg: RunConfig) -> float:
    """The least exposed/unprefetched comm ratio the scratch engine's unit plan allows (any link speed)."""
    return scratch.exposed_floor(build_model(cfg.model), cfg, cfg.world_size)["floor_share"]


def _probed_and_bare_steps(cfg: RunConfig, pairs: int) -> dict[str, list[float]]:
    """On each rank: one scratch engine, its steps in pairs of one bare and one probed (s per step, by mode).

    Both modes time the same `timed_step`; a probed step installs the probes (collective wrappers, block
    hooks, spans) just before and removes them just after, so the two see the same engine, data and load.
    The order within a pair alternates (bare first, then probed first), so a step's place in its pair
    biases neither mode.
    """
    import torch.distributed as dist

    torch.set_num_threads(1)
    info = rank_info()
    model = build_model(cfg.model, cfg.seed)
    engine = scratch.build(cfg, model, info)
    probes = Probes(info.rank, info.device)
    times: dict[str, list[float]] = {"bare": [], "probed": []}
    for step in range(2 * pairs):
        data = batch(step, cfg.model, cfg.seed, info.world_size, info.rank)
        pair, second = divmod(step, 2)
        mode = ("bare", "probed")[second ^ (pair % 2)]  # bare first in even pairs, probed first in odd ones
        dist.barrier()  # every rank starts the step together, as after the loop's barrier
        if mode == "bare":
            times[mode].append(timed_step(engine, step, data)[1])
            continue
        with probes:
            hooks = probes.timeline.watch_blocks(model)
            times[mode].append(timed_step(engine, step, data, probes)[1])
        for hook in hooks:
            hook.remove()
    return times


def probe_cost(cfg: RunConfig, pairs: int) -> dict[str, float]:
    """The scratch engine's step with and without the probes, alternating step by step on the same ranks.

    bare, probed: median step time (s, slowest rank); overhead: the median of each pair's difference over
    the median bare step (a pair's two steps run back to back, so a load change cancels out). The first pair
    (warm-up, the prefetch order being learnt) is dropped.
    """
    ranks = labkit.launch(_probed_and_bare_steps, cfg.world_size, cfg, pairs)
    slowest = {mode: [max(r[mode][i] for r in ranks) for i in range(1, pairs)] for mode in ("bare", "probed")}
    bare = statistics.median(slowest["bare"])
    difference = statistics.median(p - b for p, b in zip(slowest["probed"], slowest["bare"], strict=True))
    return {"bare": bare, "probed": statistics.median(slowest["probed"]), "overhead": difference / bare}


def own_accounting(engine: str, cfg: RunConfig) -> int:
    """The bytes per rank the engine's own module accounts for (`state_bytes_accounting`, by term for DeepSpeed)."""
    model = build_model(cfg.model)
    if engine in ("single", "ddp"):
        return 16 * count_params(model) + 4 * len(list(model.parameters()))  # whole, AdamW's step per tensor
    if engine == "deepspeed":
        from labkit.engines import deepspeed  # imported late: DeepSpeed prints as it loads

        return sum(deepspeed.state_bytes_accounting(model, cfg, cfg.world_size).values())
    module = {"scratch": scratch, "fsdp1": fsdp1, "fsdp2": fsdp2}[engine]
    return sum(module.state_bytes_accounting(model, cfg, cfg.world_size).values())


def memory_rows(engines: list[str], cfg: RunConfig) -> list[str]:
    """Markdown rows: each engine's state and peak memory per rank (B) against its own accounting and against
    `labkit.budget`'s state (the paper's terms; DeepSpeed's own estimator for deepspeed)."""
    n_params = count_params(build_model(cfg.model))
    rows = []
    for engine, record in zip(engines, run_many([(e, cfg) for e in engines]), strict=True):
        state = sum(record["state_bytes"].values())
        accounting = "deepspeed" if engine == "deepspeed" else "paper"
        predicted = budget.plan(
            n_params, cfg.world_size, BUDGET_STRATEGY[engine], precision="fp32", accounting=accounting
        )["state_bytes_per_rank"]
        own = own_accounting(engine, cfg)
        peak = max(record["peak_mem_bytes"])
        rows.append(
            f"| {engine} | {state:,} | {own:,} | {state / own:.3f} | {predicted:,.0f} | "
            f"{state / predicted:.3f} | {peak:,} | {peak / predicted:.2f} |"
        )
        print(rows[-1], flush=True)
    return rows


def course_seconds(jobs_dir: str) -> dict[str, float]:
    """Wall seconds to execute every course notebook with papermill, and to grade every solution."""
    venv_bin = os.path.dirname(sys.executable)
    out: dict[str, float] = {}
    for nb in sorted(glob.glob("notebooks/[0-9][0-9]_*.ipynb")):
        start = time.perf_counter()
        subprocess.run(
            [
                os.path.join(venv_bin, "papermill"),
                "--kernel",
                "labkit",
                "--cwd",
                "notebooks",
                nb,
                os.path.join(jobs_dir, os.path.basename(nb)),
            ],
            check=True,
            capture_output=True,
        )
        out[os.path.basename(nb)] = time.perf_counter() - start
        print(f"  {os.path.basename(nb)}: {out[os.path.basename(nb)]:.0f} s", flush=True)
    submissions = os.path.join(jobs_dir, "solutions")
    shutil.copytree("solutions", submissions)
    start = time.perf_counter()
    subprocess.run(
        [
            os.path.join(venv_bin, "labkit"),
            "grade",
            submissions,
            "--gradebook",
            os.path.join(jobs_dir, "grades.csv"),
        ],
        check=True,
        capture_output=True,
    )
    out["grading all solutions"] = time.perf_counter() - start
    print(f"  grading: {out['grading all solutions']:.0f} s", flush=True)
    return out


def course_lines(course: dict[str, float]) -> list[str]:
    """The lines of the course section under its heading: each notebook's and the grading's seconds, the total."""
    return [
        *(f"- {k}: {v:.0f} s" for k, v in course.items()),
        f"- total {sum(course.values()):.0f} s (target < {TARGETS['course s']:.0f} s)",
    ]


def course_only(out: str) -> int:
    """Measure the course alone and put it in place of `out`'s course section, saying when it was measured."""
    from sections import write_section

    with tempfile.TemporaryDirectory() as jobs_dir:
        course = course_seconds(jobs_dir)
    note = REMEASURED.format(date=time.strftime("%Y-%m-%d"))
    write_section(out, COURSE_HEADING, [COURSE_HEADING, "", note, "", *course_lines(course)])
    print("\n".join(course_lines(course)))
    return 0


COURSE_HEADING = "## The course, end to end (papermill, one notebook at a time; then `labkit grade`)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and configurations")
    parser.add_argument("--no-course", action="store_true", help="leave out the course timing (minutes)")
    parser.add_argument(
        "--course-only",
        action="store_true",
        help="measure the course alone and replace only its section of --out (the rest stays as it was)",
    )
    parser.add_argument("--out", default="benchmarks/results.md")
    args = parser.parse_args(argv)
    if args.course_only and (args.no_course or args.quick):
        parser.error("--course-only measures the course in full: pass it without --no-course and --quick")
    if args.course_only:
        return course_only(args.out)
    reps, steps = (2, 4) if args.quick else (3, 6)
    engines = ["scratch", "fsdp2", "deepspeed", "ddp"]
    lines = [
        f"# Benchmarks ({time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, CPU gloo)",
        "",
        "## Step time (median s per step; ratio to fsdp2)",
        "",
        "| model | ranks | dtype | " + " | ".join(engines) + " | scratch/fsdp2 |",
        "|---|---|---|" + "---|" * len(engines) + "---|",
    ]
    configs = [("tiny", 4, "float32"), ("small", 4, "float32"), ("tiny", 2, "bfloat16")]
    if not args.quick:
        configs += [("tiny", 2, "float32"), ("small", 2, "float32"), ("tiny", 4, "bfloat16")]
    ratios = {}
    for model, n, dtype in configs:
        cfg = RunConfig(model=model, world_size=n, steps=steps, dtype=dtype)
        times = step_times(engines, cfg, reps)
        ratio = times["scratch"] / times["fsdp2"] if "fsdp2" in times else float("nan")
        ratios[(model, n, dtype)] = ratio
        cells = " | ".join(f"{times[e]:.3f}" for e in engines)
        lines.append(f"| {model} | {n} | {dtype} | {cells} | {ratio:.2f} |")
        print(lines[-1], flush=True)

    lines += [
        "",
        "## Exposed communication, scratch, 2 ranks, emulated link set so comm = 0.5 x compute",
        "",
        "link ms: the emulated link's time per step (wire bytes / bandwidth). Least exposed: the part of it "
        "that this unit plan cannot hide behind any compute (`exposed_floor_ratio` x link ms). The last two "
        "columns run with no emulated link: what is exposed there is gloo's own time, whose copies share the "
        "two cores with the ranks' compute (the no-prefetch column holds both, so the ratio can fall below "
        "the least-exposed share).",
        "",
        "| model | blocks | link GB/s | link ms | exposed, no prefetch ms | exposed, prefetch ms | ratio "
        "| least exposed ms | gloo alone, no prefetch ms | gloo alone, prefetch ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    exposed_ratios = {}
    for model in ("tiny", "tiny_deep"):
        exposed_cfg = RunConfig(model=model, world_size=2, steps=steps)
        exposed = exposed_comm(exposed_cfg, reps)
        exposed_ratios[model] = exposed["on"] / exposed["off"]
        lines.append(
            f"| {model} | {len(build_model(model).blocks)} | {exposed['link_gbytes']:.4f} | "
            f"{exposed['link_s'] * 1e3:.1f} | {exposed['off'] * 1e3:.1f} | {exposed['on'] * 1e3:.1f} | "
            f"{exposed_ratios[model]:.2f} | {exposed_floor_ratio(exposed_cfg) * exposed['link_s'] * 1e3:.1f} | "
            f"{exposed['gloo_off'] * 1e3:.1f} | {exposed['gloo_on'] * 1e3:.1f} |"
        )
        print(lines[-1], flush=True)

    cfg = RunConfig(model="tiny", world_size=4, steps=steps)
    record = run("scratch", cfg)
    wire = {k: v["wire_bytes"] for k, v in record["comm"].items()}
    formula = scratch.predicted_wire_bytes(build_model("tiny"), cfg, 4)
    n_params = count_params(build_model("tiny"))
    state = budget.plan(n_params, 4, "zero3", precision="fp32")["state_bytes_per_rank"]
    lines += [
        "",
        "## Bytes and memory, scratch, tiny, 4 ranks",
        "",
        *(
            f"- {k}: measured {wire[k]:,} B, formula {formula[k]:,} B, ratio {wire[k] / formula[k]:.4f}"
            for k in formula
        ),
        f"- peak memory per rank {max(record['peak_mem_bytes']):,} B (state per budget {state:,.0f} B; "
        f"the rest is activations and gathered weights)",
    ]

    lines += [
        "",
        "## Memory per rank against each engine's accounting and labkit.budget, tiny, 4 ranks, fp32",
        "",
        "state: what the engine keeps between steps, measured; own: what the engine's module accounts for "
        "(`state_bytes_accounting`: DeepSpeed's term by term, its fp32 master partition and reduce bucket "
        "included); budget: `plan()`'s state per rank (the paper's 16 B/param / n; for deepspeed DeepSpeed's "
        "own estimator, which leaves those two out); peak: the step's CPU peak, activations included",
        "",
        "| engine | state B | own B | state/own | budget B | state/budget | peak B | peak/budget |",
        "|---|---|---|---|---|---|---|---|",
        *memory_rows([*engines[:2], "fsdp1", *engines[2:]], RunConfig(model="tiny", world_size=4, steps=2)),
    ]

    cost = probe_cost(RunConfig(model="tiny", world_size=4, steps=steps), pairs=10 * reps)
    overhead = cost["overhead"]
    lines += [
        "",
        "## Cost of the probes, scratch, tiny, 4 ranks, probed and bare steps alternating on the same ranks",
        "",
        f"median step {cost['probed'] * 1e3:.1f} ms probed, {cost['bare'] * 1e3:.1f} ms bare; median "
        f"difference of a pair {overhead:+.1%} of the bare step (target < {TARGETS['probe cost']:.0%})",
    ]

    course = None
    if not args.no_course and not args.quick:
        with tempfile.TemporaryDirectory() as jobs_dir:
            course = course_seconds(jobs_dir)
        lines += ["", COURSE_HEADING, "", *course_lines(course)]

    import cpu_adam  # this folder's own scripts (benchmarks/ is on sys.path when run_all.py runs)
    import slides

    lines += ["", *cpu_adam.section_lines(cpu_adam.measure([10**6, 10**7], reps=5 * reps))]
    if course is not None:
        with tempfile.TemporaryDirectory(prefix="labkit-slides-") as decks_dir:
            lines += ["", *slides.section_lines(*slides.build(decks_dir), decks_dir)]

    lines += ["", "## Against the targets", ""]
    for (model, n, dtype), r in ratios.items():
        if dtype == "float32" and n == 4:
            target = TARGETS[f"scratch/fsdp2 {model}"]
            lines.append(
                f"- scratch/fsdp2 on {model}, 4 ranks, fp32: {r:.2f} (target <= {target}): {verdict(r, target)}"
            )
    for model, ratio in exposed_ratios.items():
        lines.append(
            f"- exposed comm ratio on {model} {ratio:.2f} (target <= {TARGETS['exposed ratio']}): "
            f"{verdict(ratio, TARGETS['exposed ratio'])}"
        )
    lines.append(
        f"- probe cost {overhead:+.1%} (target < {TARGETS['probe cost']:.0%}): "
        f"{verdict(overhead, TARGETS['probe cost'])}"
    )
    worst = max(abs(wire[k] / formula[k] - 1) for k in formula)
    lines.append(
        f"- scratch wire bytes / formula: off by at most {worst:.4f} (target 0.005): {verdict(worst, 0.005)}"
    )
    if course is not None:
        total = sum(course.values())
        lines.append(
            f"- course {total:.0f} s (target < {TARGETS['course s']:.0f} s): "
            f"{verdict(total, TARGETS['course s'])}"
        )
    write_report(args.out, lines, keep_others=True)  # the sections other benchmarks append stay
    return 0


if __name__ == "__main__":
    sys.exit(main())
