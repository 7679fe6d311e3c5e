"""Exercise 04: the prefetch schedule, checked against what the scratch engine records.

The reference is measured, not written down: `engine_trace` runs `labkit.zero.ZeRO3(trace=...)` for two
steps of a small GPT and also records every all-gather the units issue (which unit, and whether it was an
asynchronous prefetch). One rank is enough: the order of the hooks does not depend on the world size.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

from labkit.grading.checks import ex04_prefetch_reference
from labkit.grading.kit import Check, Exercise, answer, judge_beside, probe_beside, rng, stand_ins, tally
from labkit.names import ALL_GATHER

MOMENTS = ("before_forward", "before_backward")
# The schedule and the counts may call the student's orders: a reference stands in for one that raises.
ORDERS = dict.fromkeys(ex04_prefetch_reference.ORDERS, lambda fn: fn(3))
REFERENCE = stand_ins(Path(ex04_prefetch_reference.__file__), ex04_prefetch_reference.ORDERS)
_LOCK = threading.Lock()


def _n_blocks(seed: int) -> list[int]:
    """One block (nothing after it to prefetch), four, then a drawn count of several."""
    return [1, 4, rng(seed, "blocks").choice([2, 3, 5, 6])]


@functools.cache
def _engine_run(n_blocks: int, reshard_after_forward: bool) -> tuple:
    import torch
    import torch.distributed as dist

    from labkit.model import GPT, ModelConfig, loss_fn
    from labkit.zero import ZeRO3, comm

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = ModelConfig(vocab_size=16, d_model=8, n_heads=2, n_layers=n_blocks, seq_len=4, global_batch=2)
    torch.manual_seed(0)
    model = GPT(cfg)
    trace: list = []
    engine = ZeRO3(model, reshard_after_forward=reshard_after_forward, prefetch=True, trace=trace)
    issuing = [None]
    all_gather = comm.all_gather

    def recorded_gather(out, shard, group=None, async_op=False):
        trace.append((ALL_GATHER, issuing[0], bool(async_op)))
        return all_gather(out, shard, group=group, async_op=async_op)

    for unit in engine.units:

        def start_gather(async_op, unit=unit, start=unit.start_gather):
            issuing[0] = unit.name
            return start(async_op)

        unit.start_gather = start_gather
    comm.all_gather = recorded_gather
    try:
        for step in range(2):
            trace.append(("step", step, None))
            tokens = torch.randint(
                cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(step)
            )
            loss_fn(model(tokens), tokens).backward()
            engine.finish_backward()
    finally:
        comm.all_gather = all_gather
        if created:
            dist.destroy_process_group()
    return tuple(tuple(t) if len(t) == 3 else (*t, None) for t in trace)


def engine_trace(n_blocks: int, reshard_after_forward: bool = True) -> list[tuple]:
    """The engine's record of two training steps: ("step", k, None), (moment, unit, None) and
    ("all_gather", unit, is_prefetch) entries, in the order they happened."""
    with _LOCK:
        return list(_engine_run(n_blocks, reshard_after_forward))


def _steady_step(n_blocks: int, reshard_after_forward: bool = True) -> list[tuple]:
    trace = engine_trace(n_blocks, reshard_after_forward)
    return trace[trace.index(("step", 1, None)) + 1 :]


def reference_schedule(n_blocks: int) -> list[list]:
    """[moment, unit, unit prefetched by that hook or None] for every before_* moment of a steady step."""
    schedule = []
    for kind, name, flag in _steady_step(n_blocks):
        if kind in MOMENTS:
            schedule.append([kind, name, None])
        elif kind == ALL_GATHER and flag and schedule and schedule[-1][2] is None:
            schedule[-1][2] = name
    return schedule


def _orders_probe(ns: dict, seed: int) -> list:
    fwd, bwd = answer(ns, "forward_order"), answer(ns, "backward_order")
    return [[list(fwd(n)), list(bwd(n))] for n in _n_blocks(seed)]


def _orders_judge(got: list, seed: int) -> tuple[float, str]:
    cases = []
    for n, (fwd, bwd) in zip(_n_blocks(seed), got, strict=True):
        steady = _steady_step(n)
        for moment, seen in (("before_forward", fwd), ("before_backward", bwd)):
            want = [name for kind, name, _ in steady if kind == moment]
            cases.append((seen == want, f"{n} blocks, {moment}: {seen}, the engine recorded {want}"))
    return tally(cases)


def _schedule_probe(fn, seed: int) -> list:
    return [[list(step) for step in fn(n)] for n in _n_blocks(seed)]


def _schedule_judge(got: list, seed: int) -> tuple[float, str]:
    cases = []
    for n, seen in zip(_n_blocks(seed), got, strict=True):
        want = reference_schedule(n)
        wrong = next((i for i, (a, b) in enumerate(zip(seen, want, strict=False)) if a != b), None)
        if wrong is None and len(seen) != len(want):
            why = f"{len(seen)} entries, the engine's step has {len(want)}"
        elif wrong is not None:
            why = f"entry {wrong} (counting from 0) is {seen[wrong]}, the engine did {want[wrong]}"
        else:
            why = ""
        cases.append((seen == want, f"{n} blocks: {why}"))
    return tally(cases)


def _count_probe(fn, seed: int) -> list:
    return [[int(fn(n, True)), int(fn(n, False))] for n in _n_blocks(seed)]


def _count_judge(got: list, seed: int) -> tuple[float, str]:
    cases = []
    for n, counts in zip(_n_blocks(seed), got, strict=True):
        for reshard, seen in zip((True, False), counts, strict=True):
            want = sum(kind == ALL_GATHER for kind, _, _ in _steady_step(n, reshard))
            cases.append(
                (
                    seen == want,
                    f"{n} blocks, reshard_after_forward={reshard}: {seen}, the engine issued {want}",
                )
            )
    return tally(cases)


EXERCISE = Exercise(
    "ex04_prefetch",
    "A prefetch schedule: what to gather, when",
    (
        Check(
            "the order the hooks fire in forward and backward",
            2,
            _orders_probe,
            _orders_judge,
            answers=("forward_order", "backward_order"),
        ),
        Check(
            "prefetch schedule of a steady step",
            3,
            probe_beside("prefetch_schedule", ORDERS, REFERENCE, _schedule_probe),
            judge_beside(_schedule_judge),
            answers=("prefetch_schedule",),
        ),
        Check(
            "all-gathers per step, with and without reshard_after_forward",
            2,
            probe_beside("all_gathers_per_step", ORDERS, REFERENCE, _count_probe),
            judge_beside(_count_judge),
            answers=("all_gathers_per_step",),
        ),
    ),
)
