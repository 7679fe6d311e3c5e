"""Prefetch: while unit i computes, the next unit's all-gather is already on the wire.

The order is learnt, not declared: the first step records the order in which units start their forward
and their backward; every later step, each unit's hook issues the all-gathers of the next `depth` units
(asynchronously) before its own compute, in forward order during forward and in backward order during
backward. Depth d holds up to d + 1 units' weights gathered at once: d units of memory for more overlap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from labkit.zero.unit import ShardedUnit


class Prefetcher:
    """Knows which units come next; `enabled=False` turns every prefetch into a no-op."""

    def __init__(self, enabled: bool = True, depth: int = 1):
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(f"prefetch_depth={depth!r}: pass a whole number of units, 1 or more")
        self.enabled = enabled
        self.depth = depth
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

    def ahead_in_forward(self, unit: ShardedUnit) -> list[ShardedUnit]:
        """The `depth` units after `unit` in forward order (fewer at the end; none while recording)."""
        return self._ahead(self.forward_order, unit)

    def ahead_in_backward(self, unit: ShardedUnit) -> list[ShardedUnit]:
        """The `depth` units after `unit` in backward order (fewer at the end; none while recording)."""
        return self._ahead(self.backward_order, unit)

    def _ahead(self, order: list[ShardedUnit], unit: ShardedUnit) -> list[ShardedUnit]:
        if not self.enabled or self.recording or unit not in order:
            return []
        i = order.index(unit) + 1
        return order[i : i + self.depth]
