"""The gradients an exercise's answer leaves on each rank, recorded before its optimizer runs.

The judge (`single_grads`, `grads_mismatch`, `mean_hint`: against `single`'s gradient on the same batch, with
the factor when every gradient is c x single's) lives in `labkit.gradients`, which notebook 02's live checks
share; it is re-exported here. The reference is `single` itself, never an answer: the grader's checks and the
public ones (the student release) share it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labkit.gradients import GRAD_REL_TOL, grads_mismatch, mean_hint, single_grads

__all__ = [
    "GRAD_REL_TOL",
    "FirstStepGrads",
    "accumulation_hint",
    "accumulation_rank",
    "uneven_rank",
    "gathered_rows",
    "grads_mismatch",
    "mean_hint",
    "single_grads",
]


class FirstStepGrads:
    """A step function `step_fn(model, *batch)` that also records, the first time it returns (before the
    harness's optimizer step), this rank's local gradient of every parameter (a DTensor's own rows)."""

    def __init__(self, step_fn: Callable[..., float]):
        self.step_fn = step_fn
        self.grads: dict[str, dict | None] | None = None

    def __call__(self, model, *batch) -> float:
        loss = self.step_fn(model, *batch)
        if self.grads is None:
            self.grads = {name: _local_grad(p) for name, p in model.named_parameters()}
        return loss


def _local_grad(p) -> dict | None:
    """This rank's gradient of `p` as JSON: a DTensor's own rows (`to_local`), None when it has none."""
    from labkit.grading.kit import tensor_json

    if p.grad is None:
        return None
    return tensor_json(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)


def accumulation_rank(step_fn: Callable[..., float], micro_steps: int, seed: int, steps: int) -> dict:
    """Rank side: exercise 08's harness (`labkit.lessons.production.run_accumulation`) around `step_fn`;
    {"steps": its rows per step, "grads": this rank's gradient rows after the first step's `step_fn`}."""
    from labkit.lessons.production import run_accumulation

    recorder = FirstStepGrads(step_fn)
    rows = run_accumulation(recorder, micro_steps, seed, steps)
    return {"steps": rows, "grads": recorder.grads or {}}


def uneven_rank(step_fn: Callable[..., float], rows: list, seed: int) -> dict:
    """Rank side: exercise 09's harness (`labkit.lessons.uneven.run_uneven`) around `step_fn`; {"steps": its
    rows per step, "grads": this rank's gradient rows after the first step's `step_fn`}."""
    from labkit.lessons.uneven import run_uneven

    recorder = FirstStepGrads(step_fn)
    steps = run_uneven(recorder, rows, seed)
    return {"steps": steps, "grads": recorder.grads or {}}


def accumulation_hint(k: int) -> Callable[[float], str]:
    """`mean_hint` of an accumulation loop over k micro-batches."""
    return mean_hint(
        k, f"the sum of the {k} micro-batches' mean gradients", f"divide each micro-batch's loss by k = {k}"
    )


def gathered_rows(ranks_grads: list[dict]) -> dict[str, Any]:
    """{name: every rank's rows concatenated in rank order} (dim-0 sharded gradients made whole again); a
    parameter some rank left without a gradient maps to None."""
    import torch

    out: dict[str, Any] = {}
    for name in ranks_grads[0]:
        parts = [r.get(name) for r in ranks_grads]
        if any(not isinstance(p, dict) for p in parts):
            out[name] = None
            continue
        out[name] = torch.cat(
            [torch.tensor(p["values"], dtype=torch.float64).view(p["shape"]) for p in parts]
        )
    return out
