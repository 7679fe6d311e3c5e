"""Exercise 07's hidden model: the GPT the grader trains the student's ZeRO-3 on, drawn from the seed.

Its widths, depth and sequence length are uneven against `RANKS`, so every rank's shards carry padding.
`hidden_run(seed)` is the `labkit.grading.capstone.Run` the grade's checks probe and judge.
"""

from __future__ import annotations

from labkit.grading.capstone import Run
from labkit.grading.kit import rng

RANKS = 3
STEPS = 3
N_LAYERS = 3


def model_config(seed: int):
    """The model the grader trains: tiny's kind of GPT, its dim-0 sizes (vocab, d_model, 4 d_model, seq_len)
    not multiples of 3, so every rank's shards carry padding. Always 3 blocks: with 2, the root and two blocks
    (what may be whole at once during the forward) are the whole model, so weights never freed would pass
    the forward's peak for some students and not others."""
    from labkit.model import ModelConfig

    r = rng(seed, "model")
    d_model, n_heads = r.choice([(20, 4), (20, 5), (28, 4), (32, 4), (40, 5)])
    return ModelConfig(
        vocab_size=r.choice([37, 41, 43, 47, 53]),
        d_model=d_model,
        n_heads=n_heads,
        n_layers=N_LAYERS,
        seq_len=r.choice([7, 8, 10, 11, 13]),
        global_batch=6,
    )


def model_name(cfg) -> str:
    """The name the hidden model `cfg` is registered under in `labkit.model` (see `capstone.Run.custom`)."""
    return (
        f"capstone_v{cfg.vocab_size}_d{cfg.d_model}_h{cfg.n_heads}_l{cfg.n_layers}_t{cfg.seq_len}"
        f"_b{cfg.global_batch}"
    )


def hidden_run(seed: int) -> Run:
    """The grade's run: the lab's AdamW defaults, `STEPS` steps on `RANKS` ranks, the seed's model and batches."""
    cfg = model_config(seed)
    return Run(model=model_name(cfg), seed=seed, ranks=RANKS, steps=STEPS, custom=cfg)
