"""Calibrate `labkit.budget`'s time model on this machine: its compute rate, its core share, gloo's cost.

`calibrate(model, world_sizes)` measures, through `labkit.launch` (real ranks, real gloo collectives):

    compute_flops_per_s    one rank alone at one thread: 6 x params x tokens / seconds of one training step
                           (forward, backward, AdamW) of the lab's model on its global batch
    core_share[n]          the part of that rate each of n ranks keeps when n ranks train at once on their
                           slices of the batch (ranks sharing cores, smaller matrices), per world size
    collectives[kind][n]   gloo's latency (s) and bandwidth (GB/s of ring wire bytes) for all-gather,
                           reduce-scatter and all-reduce: a line through a few message sizes, fitted by
                           the median of the pairwise slopes (Theil-Sen), which one slow call cannot tilt
    sync_s[n]              what one wait on the other ranks costs mid-step, beyond the collective itself:
                           the same steps with a barrier after each block's forward and backward, timing
                           each rank's seconds inside the barriers. Every rank leaves a barrier with the
                           last to arrive, so a synced step lasts each rank's compute plus its waits: the
                           rank that computed longest waited least, and its waits are what the barriers
                           added to the step. Per barrier, the median over steps of the least of the ranks'
                           waits (one run's own figure: no difference of two noisy step times). Ranks drift
                           apart while they compute (they share cores, the scheduler deals them time
                           slices); a collective waited on at once makes every rank wait for the last one,
                           where a prefetched one absorbs the drift behind the next block's compute

Every time is the rank's clock (`labkit.probes.clock`): on ranks with a core each, wall time less the
moments a rank waited for a core, so a neighbour's load does not enter the rates; the profile records how
much it took meanwhile (`machine.noise`: the ranks' run delay over wall time, and each figure's spread).

on CPU ranks (a GPU machine's own rates are not measured here: its plans keep the datasheet defaults),
and returns the profile as a JSON-able dict (`labkit.budget.check_machine_profile` says its keys), which
`labkit.budget.plan(..., machine=profile)` prices steps with. `predicted_step_s` is that plan's step for
one engine of a `labkit compare` run. Default plans (no profile) keep the GPU datasheet numbers.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from functools import partial

import torch
import torch.distributed as dist

import labkit
from labkit import budget
from labkit.engines import ENGINES
from labkit.engines.base import RunConfig
from labkit.engines.registry import FSDP2, SCRATCH
from labkit.measured import Measured, interleaved
from labkit.model import batch, build_model, config, count_params
from labkit.names import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, STEP_KINDS
from labkit.probes.clock import RankClock, rank_clock

KINDS = STEP_KINDS  # the collectives it measures
# full tensors, fp32 elements divisible by 2, 3 and 4; five, so the line's median slope ignores one bad size
PAYLOAD_BYTES = (96_000, 960_000, 1_920_000, 3_840_000, 9_600_000)
COMPUTE_STEPS = 4  # timed training steps per measurement, after one warm-up step
COLLECTIVE_REPS = 5  # timed calls per kind and size, after one warm-up call
REPEATS = 3  # interleaved rounds of the alone and together steps; their medians are kept
LOAD_CHANGE = 0.5  # a change of the 1-minute load average, per CPU, that `load_changed` reports


# ------------------------------------------------------------------------------------------ the fit


def robust_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Theil-Sen y = a + b x: b the median of the slopes between every two points at distinct x, a the median
    of y - b x; (a, b, the root-mean-square residual of y). One outlying point moves neither."""
    slopes = [
        (ys[j] - ys[i]) / (xs[j] - xs[i])
        for i in range(len(xs))
        for j in range(i + 1, len(xs))
        if xs[j] != xs[i]
    ]
    if not slopes:
        raise ValueError(f"a line needs points at two or more distinct x; got {len(xs)} point(s)")
    b = statistics.median(slopes)
    a = statistics.median(y - b * x for x, y in zip(xs, ys, strict=True))
    rms = math.sqrt(statistics.fmean((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True)))
    return a, b, rms


def collective_fit(points: list[tuple[int, float]]) -> dict:
    """gloo's cost of one collective kind at one world size: seconds = latency_s + wire_bytes / (gbytes x 1e9).

    `points`: (wire bytes one rank sends, median seconds of the call), fitted by `robust_line`. Returns the
    line, its residual and the points, so a profile carries the measurements its fit came from.
    """
    latency_s, s_per_byte, residual_s = robust_line([p[0] for p in points], [p[1] for p in points])
    if s_per_byte <= 0:
        raise ValueError(
            "the measured collective times do not grow with the message size (the machine was too busy); "
            "run labkit calibrate again on a quieter machine"
        )
    return {
        "latency_s": latency_s,
        "gbytes": 1 / s_per_byte / 1e9,
        "residual_s": residual_s,
        "points": [[int(w), s] for w, s in points],
    }


# ------------------------------------------------------------------------------------------ rank side


def _train_steps_s(
    model_name: str, world_size: int, rank: int, synced: bool = False
) -> tuple[list[float], list[float]]:
    """(seconds of each timed training step of `single`'s step on this rank's batch slice, seconds of each
    spent waiting in barriers); `synced`: with a barrier after each block's forward and each block's backward
    (`synced_waits`), none otherwise (its waits are 0)."""
    from labkit.engines.on_rank import timed_step
    from labkit.engines.single import SingleEngine

    cfg = RunConfig(model=model_name)
    engine = SingleEngine(build_model(model_name), cfg, torch.device("cpu"))
    clock, waited = rank_clock(), [0.0]

    def wait(*_) -> None:
        start = clock.now()
        dist.barrier()
        waited[0] += clock.now() - start

    if synced:
        for block in engine.model.blocks:
            block.register_forward_hook(wait)
            block.register_full_backward_hook(wait)
    steps, waits = [], []
    for s in range(COMPUTE_STEPS + 1):
        waited[0] = 0.0
        steps.append(timed_step(engine, s, batch(s, model_name, 0, world_size, rank))[1])
        waits.append(waited[0])
    return steps[1:], waits[1:]


def synced_waits(model_name: str) -> int:
    """Barriers in one synced step of `_train_steps_s`: one after each block's forward and its backward."""
    return 2 * len(build_model(model_name).blocks)


def _collectives_s(kind: str, n: int) -> dict[int, list[float]]:
    """{payload bytes: seconds of each timed call} of one collective kind on this rank, a barrier before each
    call, the sizes interleaved (each round every size, in alternating order) so a passing load touches them
    alike; the first round warms up and is dropped. Seconds on the rank's clock."""
    clock = rank_clock()
    calls = {}
    for p in PAYLOAD_BYTES:
        full, shard = torch.ones(p // 4), torch.ones(p // 4 // n)
        calls[p] = {
            ALL_GATHER: partial(dist.all_gather_single, full, shard),
            REDUCE_SCATTER: partial(dist.reduce_scatter_single, shard, full),
            ALL_REDUCE: partial(dist.all_reduce, full),
        }[kind]
    out: dict[int, list[float]] = {p: [] for p in PAYLOAD_BYTES}
    for i, p in enumerate(interleaved(PAYLOAD_BYTES, COLLECTIVE_REPS + 1)):
        dist.barrier()
        start = clock.now()
        calls[p]()
        if i >= len(PAYLOAD_BYTES):
            out[p].append(clock.now() - start)
    return out


def _measure_rank(model_name: str, alone_first: bool, repeats: int) -> dict:
    """On each rank, `repeats` rounds of: (rank 0 alone, when asked) the one-rank steps, then every rank's
    steps at once, with and without a barrier after each block (in alternating order); then each collective
    at each size. Interleaving the rounds lets a passing load touch the figures alike; the parent keeps
    their medians. One thread per rank, as the engines run."""
    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    out: dict = {"alone_s": [], "together_s": [], "synced_waits_s": []}
    delay, wall_s = RankClock(), time.perf_counter()
    for i in range(repeats):
        if alone_first:
            if rank == 0:
                out["alone_s"] += _train_steps_s(model_name, 1, 0)[0]
            dist.barrier()
        for synced in (False, True) if i % 2 == 0 else (True, False):
            steps_s, waits_s = _train_steps_s(model_name, n, rank, synced)
            if synced:
                out["synced_waits_s"] += waits_s
            else:
                out["together_s"] += steps_s
            dist.barrier()
    out["collectives"] = {k: _collectives_s(k, n) for k in KINDS}
    out["run_delay_share"] = delay.run_delay_s() / (time.perf_counter() - wall_s)
    return out


# ------------------------------------------------------------------------------------------ parent


def drift_per_wait_s(waits_by_rank: list[list[float]], waits_per_step: int) -> list[float]:
    """Per synced step, what one barrier added to it (seconds): the least of the ranks' seconds inside the
    step's `waits_per_step` barriers, over that count. `waits_by_rank[r][s]`: rank r's waits in step s."""
    return [min(step) / waits_per_step for step in zip(*waits_by_rank, strict=True)]


def _slowest(per_rank: list[list[float]]) -> float:
    """The median over calls of the slowest rank's time of each call (seconds)."""
    return statistics.median(max(times) for times in zip(*per_rank, strict=True))


def calibrate(
    model: str = "small",
    world_sizes: tuple[int, ...] = (2, 4),
    timeout_s: float = 120.0,
    repeats: int = REPEATS,
) -> dict:
    """Measure this machine and return its profile (see the module docstring; seconds, bytes, GB/s).

    The compute rate and each core share are medians over `repeats` interleaved rounds of steps; the
    profile keeps the machine's load average when it was measured (`load_changed` compares a later one).
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats!r}: pass 1 or more rounds of steps")
    load_before = list(os.getloadavg())
    cfg = config(model)
    flops_per_token = 6 * count_params(build_model(model))
    sizes = sorted(set(world_sizes))
    if not sizes or sizes[0] < 2:
        raise ValueError(f"world_sizes={world_sizes!r}: pass world sizes of 2 ranks or more, e.g. (2, 4)")
    rate = None
    core_share, collectives, sync_s = {"1": 1.0}, {k: {} for k in KINDS}, {"1": 0.0}
    noise: dict[str, dict[str, float]] = {"run_delay_share": {}, "compute_spread": {}, "sync_spread": {}}
    for n in sizes:
        ranks = labkit.launch(
            _measure_rank, n, model, rate is None, repeats, timeout=timeout_s * repeats, device_type="cpu"
        )
        if rate is None:
            rate = flops_per_token * cfg.global_batch * cfg.seq_len / statistics.median(ranks[0]["alone_s"])
            noise["compute_spread"]["1"] = _relative_spread(ranks[0]["alone_s"])
        tokens = cfg.global_batch // n * cfg.seq_len
        together_s = _slowest([r["together_s"] for r in ranks])
        noise["compute_spread"][str(n)] = _relative_spread(
            [max(t) for t in zip(*(r["together_s"] for r in ranks), strict=True)]
        )
        noise["run_delay_share"][str(n)] = max(r["run_delay_share"] for r in ranks)
        core_share[str(n)] = flops_per_token * tokens / together_s / rate
        least_waits_s = drift_per_wait_s([r["synced_waits_s"] for r in ranks], synced_waits(model))
        sync_s[str(n)] = statistics.median(least_waits_s)
        noise["sync_spread"][str(n)] = _relative_spread(least_waits_s)
        for kind in KINDS:
            points = [
                (
                    budget.collective_wire_bytes(kind, p, n),
                    _slowest([r["collectives"][kind][p] for r in ranks]),
                )
                for p in PAYLOAD_BYTES
            ]
            collectives[kind][str(n)] = collective_fit(points)
    return budget.check_machine_profile(
        {
            "machine": {
                "cpus": os.cpu_count(),
                "processor": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "backend": "gloo",
                "threads_per_rank": 1,
                "load_average_before": load_before,
                "load_average": list(os.getloadavg()),
                "repeats": repeats,
                "noise": noise,
            },
            "model": model,
            "compute_flops_per_s": rate,
            "core_share": core_share,
            "collectives": collectives,
            "sync_s": sync_s,
        }
    )


def _relative_spread(seconds: list[float]) -> float:
    """The interquartile range of `seconds` over their median: how noisy a measurement was."""
    m = Measured.of(seconds)
    return m.spread / m.median if m.median else 0.0


# ------------------------------------------------------------------------------------------ prediction


def plan_options(engine: str, cfg: RunConfig, profile: dict) -> tuple[int, str, dict]:
    """(ranks, strategy, options) of the `labkit.budget.plan` that prices one step of `engine` under `cfg`.

    The lab's model and batch slice, fp32 or bf16 state, one node of ranks whose links are the emulated
    link (`cfg.link_gbytes`; none: infinitely fast, so gloo's own cost is all), one collective per unit
    (the scratch engine's root split in two: `root_units=2`). FSDP2 on gloo ranks is priced without
    prefetch: with no separate stream to run its all-gathers on, it overlaps almost none of them
    (docs/measured.md; 03 shows its timeline). The strategy is the engine's registry row's (`labkit.engines.ENGINES`).
    """
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} has no budget strategy; use one of {', '.join(ENGINES)}")
    spec = ENGINES[engine]
    n = 1 if spec.single_rank else cfg.world_size
    model_cfg = config(cfg.model)
    link = cfg.link_gbytes or math.inf
    options = {
        **budget.model_options(model_cfg, n),
        "tokens_per_rank": model_cfg.global_batch // n * model_cfg.seq_len,
        "precision": "fp32" if cfg.dtype == "float32" else "bf16_mixed",
        "gpus_per_node": n,
        "link_gbytes": link,
        "intra_gbytes": link,
        "prefetch": cfg.prefetch and not (engine == FSDP2 and _on_gloo(profile)),
        "reshard_after_forward": cfg.reshard_after_forward,
        "machine": profile,
    }
    if engine == SCRATCH:
        from labkit.engines.scratch import split_root

        options["root_units"] = 2 if split_root(cfg) else 1  # its input and output units
    return n, spec.strategy, options


def _on_gloo(profile: dict) -> bool:
    return profile.get("machine", {}).get("backend") == "gloo"


def predicted_step_s(engine: str, cfg: RunConfig, profile: dict) -> float:
    """The calibrated plan's step time (seconds) for `engine` under `cfg`: what `labkit compare` records."""
    n, strategy, options = plan_options(engine, cfg, profile)
    params = count_params(build_model(cfg.model))
    return budget.plan(params, n, strategy, **options)["step_time_s"]


def load_changed(profile: dict, now: tuple[float, ...] | None = None) -> str | None:
    """One sentence when this machine's 1-minute load average before a run (`now`, default
    `os.getloadavg()`) differs from the one before the profile's calibration by more than `LOAD_CHANGE` per
    CPU; None when it holds or the profile did not record it. Both are read before any rank starts, so the
    measurement's own ranks are in neither; the average lags, so ranks that ended within the last minute
    (a calibration just before) still count in it."""
    machine = profile.get("machine", {})
    then = machine.get("load_average_before")
    if not then:
        return None
    now = now or os.getloadavg()
    cpus = machine.get("cpus") or os.cpu_count() or 1
    if abs(now[0] - then[0]) <= LOAD_CHANGE * cpus:
        return None
    busier = "busier" if now[0] > then[0] else "quieter"
    return (
        f"the machine is {busier} than when it was calibrated (1-minute load average {then[0]:.1f} then, "
        f"{now[0]:.1f} now, on {cpus} CPUs): the calibrated rates may not hold; calibrate again to trust the "
        "predictions"
    )


def profile_table(profile: dict) -> str:
    """The profile's figures as the text table `labkit calibrate` prints."""
    from labkit.tables import fixed_width

    lines = [
        f"compute, one rank alone ({profile['model']}, one thread): {profile['compute_flops_per_s'] / 1e9:.1f} GFLOP/s",
        "core share per rank: " + ", ".join(f"{n} ranks {s:.2f}" for n, s in profile["core_share"].items()),
    ]
    if "sync_s" in profile:
        lines.append(
            "a wait on every rank mid-step (the ranks' drift): "
            + ", ".join(f"{n} ranks {s * 1e3:.2f} ms" for n, s in profile["sync_s"].items() if n != "1")
        )
    machine = profile.get("machine", {})
    if "load_average_before" in machine:
        lines.append(
            f"medians of {machine['repeats']} interleaved rounds; 1-minute load average "
            f"{machine['load_average_before'][0]:.1f} before, {machine['load_average'][0]:.1f} after"
        )
    if "noise" in machine:
        noise = machine["noise"]
        spreads = [("compute", noise["compute_spread"]), ("drift", noise.get("sync_spread", {}))]
        lines.append(
            "how busy: other work held a rank's core "
            + ", ".join(f"{v:.0%} of the time at {n} ranks" for n, v in noise["run_delay_share"].items())
            + "".join(
                f"; {what} spread (IQR / median) " + ", ".join(f"{v:.0%} at {n}" for n, v in by_n.items())
                for what, by_n in spreads
                if by_n
            )
        )
    rows = [("collective", "ranks", "latency ms", "GB/s", "residual ms")]
    for kind, by_n in profile["collectives"].items():
        for n, fit in by_n.items():
            rows.append(
                (
                    kind,
                    n,
                    f"{fit['latency_s'] * 1e3:.2f}",
                    f"{fit['gbytes']:.3f}",
                    f"{fit['residual_s'] * 1e3:.2f}",
                )
            )
    return "\n".join([*lines, "", fixed_width(rows, rule=True)])
