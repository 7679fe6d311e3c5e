"""Exercise 04's reference orders: the stand-ins for `forward_order` and `backward_order` when the student's
raise, so that the schedule and the counts built on them are still judged (`kit.stand_ins`)."""

from __future__ import annotations

ORDERS = ("forward_order", "backward_order")


def forward_order(n_blocks: int) -> list[str]:
    """The root, then each block, as their before_forward hooks fire."""
    return ["root"] + [f"blocks.{i}" for i in range(n_blocks)]


def backward_order(n_blocks: int) -> list[str]:
    """The root first (its output hook fires first in backward), then the blocks from the last."""
    return ["root"] + [f"blocks.{i}" for i in reversed(range(n_blocks))]
