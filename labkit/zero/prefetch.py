"""Prefetch: while unit i computes, the next unit's all-gather is already on the wire.

The order is learnt, not declared: the first step records the order in which units start their forward
and their backward; every later step, each unit's hook issues the next unit's all-gather (asynchronously)
before its own compute, in forward order during forward and in backward order during backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from labkit.zero.unit import ShardedUnit


class Prefetcher:
    """Knows which unit comes next; `enabled=False` turns every prefetch into a no-op."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.forward_order: list[ShardedUnit] = []
        self.backward_order: list[ShardedUnit] = []
        self.recording = True

    def saw_forward(self, unit: ShardedUnit) -> None:
        if self.recording and unit not in self.forward_order:
            self.forward_order.append(unit)

    def saw_backward(self, unit: ShardedUnit) -> None:
        if self.recording and unit not in self.backward_order:
            self.backward_order.append(unit)

    def finish_recording(self) -> None:
        """Called after the first backward: the orders are fixed from now on."""
        self.recording = False

    def next_in_forward(self, unit: ShardedUnit) -> ShardedUnit | None:
        return self._next(self.forward_order, unit)

    def next_in_backward(self, unit: ShardedUnit) -> ShardedUnit | None:
        return self._next(self.backward_order, unit)

    def _next(self, order: list[ShardedUnit], unit: ShardedUnit) -> ShardedUnit | None:
        if not self.enabled or self.recording or unit not in order:
            return None
        i = order.index(unit) + 1
        return order[i] if i < len(order) else None
