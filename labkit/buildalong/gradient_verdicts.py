"""How 02's verdicts judge gradients: against `single`'s at step 0, each rank's mean, the worst relative
error, and the sentence that names a constant factor (a sum over ranks not divided, a mean taken twice)."""

from __future__ import annotations

import functools
import math

import torch

from labkit.engines.base import RunConfig
from labkit.gradients import GRAD_ABS_TOL, GRAD_REL_TOL, grads_mismatch, mean_hint, single_grads
from labkit.layout import dim0_rows, owned_rows


@functools.lru_cache(maxsize=4)
def single_gradients(model: str) -> dict:
    """single's full gradients at step 0 of `model` (seed 0, the global batch), before its optimizer runs."""
    return single_grads(RunConfig(model=model))


def rows_expected(full: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """What a judge holds rank `rank`'s piece of `full` to: its owned rows (`labkit.layout.owned_rows`)
    followed by zero rows up to ceil(d0/n), in `full`'s dtype."""
    mine = owned_rows(full, rank, n)
    missing = dim0_rows(full.shape[0], n)[0] - mine.shape[0]
    return torch.cat([mine, mine.new_zeros((missing, *full.shape[1:]))])


def mean_over_ranks(grads: list):
    """The ranks' gradients of one parameter summed and divided by n (None when a rank has none or the shapes
    differ: the shape check says so)."""
    if any(g is None for g in grads) or len({tuple(g.shape) for g in grads}) != 1:
        return None
    return sum(g.double() for g in grads) / len(grads)


def worst_rel(got: dict, want: dict) -> float:
    """The largest |got - want| of any parameter relative to that parameter's largest |want| (plus the absolute
    tolerance `grads_mismatch` allows), so that it is at most GRAD_REL_TOL exactly when they match."""
    worst = 0.0
    for name, w in want.items():
        g = got.get(name)
        if g is None or tuple(g.shape) != tuple(w.shape):
            return math.inf
        if w.numel():
            err = float((g.double() - w.double()).abs().max())
            worst = max(worst, err / (float(w.abs().max()) + GRAD_ABS_TOL / GRAD_REL_TOL))
    return worst


def grads_said(got: dict, want: dict, where: str, n: int, after_grad: bool = True) -> str | None:
    """`labkit.gradients.grads_mismatch` of `got` against `want`; when every gradient is c x want's, that
    factor leads the sentence, and for an `after_grad` a factor of n (a sum over ranks, not divided) or 1/n
    (the mean taken twice) says which."""
    summed = mean_hint(
        n,
        "after_grad did not divide by n",
        f"the reduce-scatter sums the {n} ranks' gradients: divide that sum by n = {n}, once",
    )
    twice = mean_hint(
        1 / n, "the mean was taken twice", "ReduceOp.AVG already divides by n: sum, then divide once"
    )
    hinted: list[str] = []

    def hint(ratio: float) -> str:
        said = ""
        if proportional(got, want, ratio):
            named = (summed(ratio) or twice(ratio)) if after_grad and n > 1 else ""
            said = named or f"every gradient is {ratio:.2f} x single's"
        hinted.append(said)
        return said

    text = grads_mismatch(got, want, where, hint)
    if text and hinted and hinted[-1]:
        return f"{hinted[-1]} ({text.removesuffix(f' ({hinted[-1]})')})"
    return text


def proportional(got: dict, want: dict, c: float) -> bool:
    """Every gradient in `got` is c x `want`'s, to the tolerance `grads_mismatch` allows."""
    if not math.isfinite(c):
        return False
    for name, w in want.items():
        g = got.get(name)
        if g is None or tuple(g.shape) != tuple(w.shape):
            return False
        scaled = c * w.double()
        if (
            w.numel()
            and float((g.double() - scaled).abs().max())
            > GRAD_REL_TOL * float(scaled.abs().max()) + GRAD_ABS_TOL
        ):
            return False
    return True
