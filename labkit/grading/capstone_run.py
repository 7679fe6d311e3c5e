"""One training run the capstone's checks judge (`Run`), and `single`'s reference on it: the loss of every step
and the first step's full gradients, computed once per run in the grading process."""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any

LOCK = threading.RLock()  # held while a model is registered, and around single's reference (which registers)


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run the checks judge: `model` (a name `labkit.model` knows, or `custom`'s name: it is
    registered under it in every process that uses the run, the ranks included), its `seed` (weights and
    batches), on `ranks` ranks for `steps` steps, with the lab's AdamW defaults."""

    model: str
    seed: int = 0
    ranks: int = 3
    steps: int = 3
    custom: Any = None  # a labkit.model.ModelConfig the lab does not name

    def config(self):
        """The `RunConfig` the loop trains (and `single` reproduces)."""
        from labkit.engines.base import RunConfig

        return RunConfig(model=self.registered(), world_size=self.ranks, steps=self.steps, seed=self.seed)

    def registered(self) -> str:
        """`model`, a name `labkit.model.build_model` knows in this process."""
        from labkit import model

        if self.custom is not None:
            with LOCK:
                model.CONFIGS.setdefault(self.model, self.custom)
        return self.model

    @property
    def n_layers(self) -> int:
        from labkit.model import config

        return config(self.registered()).n_layers

    def unit_shapes(self) -> dict[str, list[tuple[tuple[int, ...], str]]]:
        """{unit name: [(shape, parameter name)]}: the root (everything outside the blocks), then each block."""
        return _unit_shapes(self.registered())

    def padded_elements(self, unit: str | None = None) -> int:
        """Elements of the padded full parameters (of one unit, or all): what an all-gather fills."""
        from labkit.budget import padded_numel

        units = self.unit_shapes()
        chosen = units.values() if unit is None else [units[unit]]
        return sum(padded_numel(shape, self.ranks) for params in chosen for shape, _ in params)


@functools.cache
def _unit_shapes(model: str) -> dict[str, list[tuple[tuple[int, ...], str]]]:
    from labkit.model import GPT, config
    from labkit.units import model_units

    units = model_units(GPT(config(model)))
    return {unit: [(tuple(p.shape), name) for name, p in params] for unit, _, params in units}


@functools.cache
def _single_run(run: Run) -> tuple[tuple[float, ...], dict]:
    """`single` on the run's model: the loss of every step and the full gradients of the first."""
    from labkit.gradients import single_steps
    from labkit.model import batch

    cfg = run.config()
    losses, grads = single_steps(cfg, (batch(step, cfg.model, cfg.seed) for step in range(cfg.steps)))
    return tuple(losses), grads


def single_reference(run: Run) -> tuple[tuple[float, ...], dict]:
    """(losses per step, first-step gradients by parameter name) of `single` on the run."""
    with LOCK:
        return _single_run(run)
