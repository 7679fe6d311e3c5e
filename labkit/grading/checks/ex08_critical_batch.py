"""Exercise 08: the critical tokens per rank, the largest useful world size, and FSDP2's accumulation step.

References: `labkit.budget.closed_form_critical_tokens` (T* = (b/2)(n-1)/n R/B) and the same search over whole
nodes; the accumulation step runs on 2 real ranks (`labkit.lessons.production.run_accumulation`) and is judged
against `single` on the whole batch (its losses, and the gradient rows each rank holds when the optimizer is
about to run: `labkit.grading.gradients`) and against FSDP2's reduce-scatter formula, once per optimizer step.
"""

from __future__ import annotations

from pathlib import Path

from labkit.budget import closed_form_critical_tokens
from labkit.grading import gradients, ranks
from labkit.grading.checks import ex08_critical_batch_reference
from labkit.grading.kit import (
    Check,
    Exercise,
    SharedLaunch,
    answer,
    close,
    draw_where,
    judge_beside,
    launch_timeout,
    probe_beside,
    rng,
    stand_ins,
    tally,
)
from labkit.names import REDUCE_SCATTER

RANKS = 2
MICRO_STEPS = 2
STEPS = 2
LAUNCH_TIMEOUT_S = 90.0
REL = 1e-5  # float32 both sides: only the order of the sums differs
_MACHINES = ((989e12 * 0.4, 50e9, 2), (312e12 * 0.5, 25e9, 2), (989e12 * 0.4, 400e9, 4))
# largest_useful_world_size may call the student's threshold: a reference stands in for one that raises.
CRITICAL = {"critical_tokens_per_rank": lambda fn: fn(*_MACHINES[0], 256)}
REFERENCE = stand_ins(Path(ex08_critical_batch_reference.__file__), list(CRITICAL))


def _critical_cases(seed: int) -> list[tuple[float, float, float, int]]:
    """The fact sheet's, two ranks, then one drawn case for each gradient width b of 1, 2 and 4 bytes."""
    r = rng(seed, "critical")
    drawn = [(r.uniform(1e13, 1e15), r.uniform(1e9, 4e11), w, r.choice([8, 64, 1000])) for w in (1, 2, 4)]
    return [(989e12 * 0.4, 50e9, 2, 256), (1e12, 1e9, 4, 2), *drawn]


def _critical_probe(ns: dict, seed: int) -> list[float]:
    fn = answer(ns, "critical_tokens_per_rank")
    return [float(fn(*case)) for case in _critical_cases(seed)]


def _critical_judge(got: list, seed: int) -> tuple[float, str]:
    cases = []
    for (r, b, w, n), value in zip(_critical_cases(seed), got, strict=True):
        want = closed_form_critical_tokens(r, b, w, n)
        cases.append(
            (close(value, want, rel_tol=1e-9), f"R={r:g}, B={b:g}, b={w}, n={n}: {value:g}, want {want:g}")
        )
    return tally(cases)


def _several_nodes(case: tuple[float, float, float, float, int]) -> bool:
    """The answer is one world size of at least two whole nodes (not None, not a boundary case)."""
    accepted = reference_useful(*case)
    return len(accepted) == 1 and accepted[0] is not None and accepted[0] >= 2 * case[-1]


def _useful_cases(seed: int) -> list[tuple[float, float, float, float, int]]:
    """Fixed: a world size, and None (not even one node); then one drawn case per machine of `_MACHINES`
    whose answer is several nodes."""
    r = rng(seed, "useful")
    drawn = [
        draw_where(
            r, lambda r, m=machine: (float(r.randrange(1, 64) * 2**20), *m, r.choice([4, 8])), _several_nodes
        )
        for machine in _MACHINES
    ]
    return [(4e6, 989e12 * 0.4, 50e9, 2, 8), (1000.0, 989e12 * 0.4, 50e9, 2, 8), *drawn]


def reference_useful(
    global_tokens: float, rate: float, link: float, weight: float, gpn: int
) -> list[int | None]:
    """The largest multiple of `gpn` whose share clears T* at that n (None: not even one node); with the
    neighbouring answer too when the boundary share is within 1e-9 of T* (rounding may put it either side)."""
    best, n, near = None, gpn, set()
    while True:
        share, critical = global_tokens / n, closed_form_critical_tokens(rate, link, weight, n)
        if abs(share - critical) <= 1e-9 * critical:
            near = {best, n}
        if share < critical:
            return sorted({best} | near, key=lambda v: -1 if v is None else v)
        best, n = n, n + gpn


def _useful_probe(fn, seed: int) -> list:
    out = []
    for case in _useful_cases(seed):
        value = fn(*case)
        out.append(None if value is None else int(value))
    return out


def _useful_judge(got: list, seed: int) -> tuple[float, str]:
    cases = []
    for (g, r, b, w, gpn), value in zip(_useful_cases(seed), got, strict=True):
        accepted = reference_useful(g, r, b, w, gpn)
        want = " or ".join(str(a) for a in accepted)
        cases.append(
            (value in accepted, f"G={g:g}, R={r:g}, B={b:g}, b={w}, {gpn} per node: {value}, want {want}")
        )
    return tally(cases)


_shared = SharedLaunch()


def _launch(ns: dict, seed: int) -> list[dict]:
    """One launch of 2 ranks serves both accumulation checks (kept for the same answer and seed): per rank,
    {"steps": its rows per step, "grads": its gradient rows before the first optimizer step}."""
    fn = answer(ns, "accumulate_gradients")
    return _shared.result(
        (fn, seed),
        lambda: ranks.launch(
            gradients.accumulation_rank,
            RANKS,
            fn,
            MICRO_STEPS,
            _model_seed(seed),
            STEPS,
            timeout=launch_timeout(LAUNCH_TIMEOUT_S),
        ),
    )


def _model_seed(seed: int) -> int:
    return rng(seed, "model").randrange(1000)


def _scatter_probe(ns: dict, seed: int) -> list:
    return [[step[REDUCE_SCATTER] for step in rank["steps"]] for rank in _launch(ns, seed)]


def _scatter_judge(got: list, seed: int) -> tuple[float, str]:
    from labkit.engines import fsdp2
    from labkit.engines.base import RunConfig
    from labkit.model import build_model

    cfg = RunConfig(model="tiny", world_size=RANKS, steps=STEPS)
    want_bytes = fsdp2.predicted_wire_bytes(build_model("tiny"), cfg, RANKS)[REDUCE_SCATTER]
    units = len(build_model("tiny").blocks) + 1  # each block, then the root
    cases = []
    for rank, steps in enumerate(got):
        for step, sent in enumerate(steps):
            calls, sent_bytes = sent.get("calls"), sent.get("wire_bytes")
            cases.append(
                (
                    calls == units and sent_bytes == want_bytes,
                    f"rank {rank}, step {step}: {calls} reduce-scatters, {sent_bytes} B; want {units}, {want_bytes} B "
                    "(one per unit, once per optimizer step)",
                )
            )
    return tally(cases)


def _loss_probe(ns: dict, seed: int) -> dict:
    launched = _launch(ns, seed)
    return {
        "losses": [step["loss"] for step in launched[0]["steps"]],
        "grads": [r["grads"] for r in launched],
    }


def _loss_judge(got: dict, seed: int) -> tuple[float, str]:
    from labkit.engines.base import RunConfig
    from labkit.lessons.production import single_run

    cfg = RunConfig(model="tiny", world_size=RANKS, steps=STEPS, seed=_model_seed(seed))
    want = single_run(cfg)["losses"]
    cases = [
        (close(value, w, rel_tol=REL), f"step {step}: loss {value:.6f}, single's {w:.6f} on the whole batch")
        for step, (value, w) in enumerate(zip(got["losses"], want, strict=True))
    ]
    why = gradients.grads_mismatch(
        gradients.gathered_rows(got["grads"]),
        gradients.single_grads(cfg),
        f"step 0, every rank's rows before AdamW (the mean over the {RANKS} ranks' batches)",
        gradients.accumulation_hint(MICRO_STEPS),
    )
    cases.append((why is None, why or ""))
    return tally(cases)


EXERCISE = Exercise(
    "ex08_critical_batch",
    "The critical batch, and an accumulation loop",
    (
        Check(
            "critical tokens per rank",
            2,
            _critical_probe,
            _critical_judge,
            answers=("critical_tokens_per_rank",),
        ),
        Check(
            "largest useful world size",
            2,
            probe_beside("largest_useful_world_size", CRITICAL, REFERENCE, _useful_probe),
            judge_beside(_useful_judge),
            answers=("largest_useful_world_size", "critical_tokens_per_rank"),
        ),
        Check(
            "one reduce-scatter per unit per optimizer step",
            3,
            _scatter_probe,
            _scatter_judge,
            answers=("accumulate_gradients",),
            limit_s=LAUNCH_TIMEOUT_S + 15,
            group="ranks",
        ),
        Check(
            "losses and gradients (before AdamW) equal single's on the whole batch",
            3,
            _loss_probe,
            _loss_judge,
            answers=("accumulate_gradients",),
            limit_s=LAUNCH_TIMEOUT_S + 15,
            group="ranks",
        ),
    ),
)
