"""Exercise 07's hidden model: the GPT the grader trains the student's ZeRO-3 on, drawn from the seed.

Its widths, depth and sequence length are uneven against `RANKS`, so every rank's shards carry padding. The
probe trains it (`run_config`) and the judges size their references by its units (`unit_shapes`,
`padded_elements`).
"""

from __future__ import annotations

import threading

from labkit.grading.kit import rng

RANKS = 3
STEPS = 3
LOCK = threading.RLock()  # held while a model is registered, and around single's reference (which registers)


def model_config(seed: int):
    """The model the grader trains: tiny's kind of GPT, its dim-0 sizes (vocab, d_model, 4 d_model, seq_len)
    not multiples of 3, so every rank's shards carry padding."""
    from labkit.model import ModelConfig

    r = rng(seed, "model")
    d_model, n_heads = r.choice([(20, 4), (20, 5), (28, 4), (32, 4), (40, 5)])
    return ModelConfig(
        vocab_size=r.choice([37, 41, 43, 47, 53]),
        d_model=d_model,
        n_heads=n_heads,
        n_layers=r.choice([2, 3]),
        seq_len=r.choice([7, 8, 10, 11, 13]),
        global_batch=6,
    )


def register(cfg) -> str:
    """The name under which `cfg` is a model of `labkit.model` (added if new): the loop builds models by name."""
    from labkit import model

    name = (
        f"capstone_v{cfg.vocab_size}_d{cfg.d_model}_h{cfg.n_heads}_l{cfg.n_layers}_t{cfg.seq_len}"
        f"_b{cfg.global_batch}"
    )
    with LOCK:
        model.CONFIGS.setdefault(name, cfg)
    return name


def run_config(seed: int):
    """The run: the lab's AdamW defaults, `STEPS` steps on `RANKS` ranks, the seed's model and batches."""
    from labkit.engines.base import RunConfig

    return RunConfig(model=register(model_config(seed)), world_size=RANKS, steps=STEPS, seed=seed)


def unit_shapes(seed: int) -> dict[str, list[tuple[tuple[int, ...], str]]]:
    """{unit name: [(shape, parameter name)]}: the root (everything outside the blocks), then each block."""
    from labkit.model import GPT
    from labkit.zero.hooks import model_units

    units = model_units(GPT(model_config(seed)))
    return {unit: [(tuple(p.shape), name) for name, p in params] for unit, _, params in units}


def padded_elements(seed: int, unit: str | None = None) -> int:
    """Elements of the padded full parameters (of one unit, or all): what an all-gather fills."""
    from labkit.budget import padded_numel

    units = unit_shapes(seed)
    chosen = units.values() if unit is None else [units[unit]]
    return sum(padded_numel(shape, RANKS) for params in chosen for shape, _ in params)
