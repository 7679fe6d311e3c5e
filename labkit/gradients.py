"""The gradient an answer leaves before its optimizer runs, judged against `single`'s on the same batch.

Why not the losses alone: AdamW divides each update by the gradient's own running scale, so an answer whose
gradients are c times too large (a sum where a mean is wanted: over micro-batches, over ranks) trains to
`single`'s losses. Its gradients are c x single's, and the feedback says so with the factor. The reference
is `single` itself, never an answer: the grader's checks, the public ones (`labkit.grading`) and notebook 02's
live checks (`labkit.buildalong`) share it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

GRAD_REL_TOL = 1e-4  # of the parameter's largest |gradient|: float32 sums in another order
GRAD_ABS_TOL = 1e-9  # and this much more: a gradient that is zero in exact arithmetic is float noise


def single_steps(cfg, batches) -> tuple[list[float], dict[str, Any]]:
    """`single` on `cfg`'s model and seed, one AdamW step per (tokens, targets) of `batches`: the loss of each
    step, and the first step's full gradients (before its AdamW step) by parameter name."""
    import torch

    from labkit.engines.single import SingleEngine
    from labkit.model import build_model

    engine = SingleEngine(build_model(cfg.model, cfg.seed), cfg, torch.device("cpu"))
    losses, grads = [], {}
    for step, (tokens, targets) in enumerate(batches):
        loss = engine.forward_loss(tokens, targets)
        engine.backward(loss)
        if step == 0:
            grads = {name: p.grad.detach().clone() for name, p in engine.model.named_parameters()}
        engine.optimizer_step()
        losses.append(loss.item())
    return losses, grads


def single_grads(cfg) -> dict[str, Any]:
    """{parameter name: full gradient} of `single` at step 0 of `cfg` (its model, seed, global batch), before
    any optimizer step: the mean over the whole batch."""
    from labkit.model import batch

    return single_steps(cfg, [batch(0, cfg.model, cfg.seed)])[1]


def mean_hint(k: int, summed: str, fix: str) -> Callable[[float], str]:
    """A `scale_hint` for `grads_mismatch`: a ratio of k (a sum of k means) says `summed` and `fix`; any
    other ratio says nothing (the gradients are wrong in some other way)."""

    def hint(ratio: float) -> str:
        if abs(ratio - k) < 0.01 * k:
            return f"every gradient is {ratio:.2f} x single's: {summed}; {fix}"
        return ""

    return hint


def grads_mismatch(got: dict, want: dict, where: str, scale_hint: Callable[[float], str]) -> str | None:
    """None when every gradient in `got` ({name: tensor}) equals `want`'s to GRAD_REL_TOL of the parameter's
    largest |gradient| (plus GRAD_ABS_TOL); else what differs, said with shapes or the largest difference, and `scale_hint(c)`
    when every gradient is c x want's (the usual mistake: a sum where a mean is wanted)."""
    dot = norm = 0.0
    problem = None
    for name, full in want.items():
        full = full.double()
        seen = got.get(name)
        if seen is None:
            return f"{where}: {name} had no gradient when the optimizer was about to run"
        if list(seen.shape) != list(full.shape):
            return f"{where}: the gradient of {name} has shape {list(seen.shape)}, want {list(full.shape)}"
        seen = seen.double()
        dot += float((seen * full).sum())
        norm += float((full * full).sum())
        err = float((seen - full).abs().max()) if full.numel() else 0.0
        scale = float(full.abs().max()) if full.numel() else 0.0
        if problem is None and not err <= GRAD_REL_TOL * scale + GRAD_ABS_TOL:
            problem = (
                f"{where}: the gradient of {name} differs from single's by up to {err:.3g} (of {scale:.3g})"
            )
    if problem is None:
        return None
    hint = scale_hint(dot / norm if norm else float("nan"))
    return problem + (f" ({hint})" if hint else "")
