"""Exercise 08's reference threshold: the stand-in for `critical_tokens_per_rank` when the student's raises,
so that `largest_useful_world_size`, built on it, is still judged (`kit.stand_ins`). Written out, not
`labkit.budget`'s (which the exercise forbids)."""

from __future__ import annotations


def critical_tokens_per_rank(
    flops_per_s: float, link_bytes_per_s: float, weight_bytes: float, world_size: int
) -> float:
    """T* = 3 (n-1)/n b / B x R / 6: the tokens per rank at which a ZeRO-3 step's link time equals its compute."""
    on_the_wire = 3 * (world_size - 1) / world_size * weight_bytes / link_bytes_per_s
    return on_the_wire * flops_per_s / 6
