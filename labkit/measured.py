"""A measured figure with its spread, and comparisons that speak only beyond it.

The lab's timings are taken on shared machines, so one figure is never enough: `Measured` keeps every
repeat of a measurement (interleaved with what it is compared with, on the rank's clock), and reports its
median and interquartile range, as `torch.utils.benchmark` does. `compare` orders two figures only when
their interquartile ranges do not overlap; `beyond` does the same for a figure against a computed one.
`unresolved` is the one sentence a lesson prints instead of a verdict the spread does not support.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

ADVICE = "run the cell again, or with fewer kernels running on this machine"


@dataclass(frozen=True)
class Measured:
    """The repeats of one measurement (any unit; seconds for times) with their median and spread."""

    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Iterable[float]) -> Measured:
        values = tuple(float(v) for v in values)
        if not values:
            raise ValueError("a measurement needs at least one value")
        return cls(values)

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def q1(self) -> float:
        return self._quartiles()[0]

    @property
    def q3(self) -> float:
        return self._quartiles()[1]

    @property
    def spread(self) -> float:
        """The interquartile range q3 - q1 (0.0 for a single value)."""
        q1, q3 = self._quartiles()
        return q3 - q1

    def _quartiles(self) -> tuple[float, float]:
        if self.n == 1:
            return self.values[0], self.values[0]
        q1, _, q3 = statistics.quantiles(self.values, n=4, method="inclusive")
        return q1, q3

    def scaled(self, factor: float) -> Measured:
        """The same repeats times `factor` (seconds to ms: 1e3)."""
        return Measured(tuple(v * factor for v in self.values))

    def shown(self, factor: float = 1e3, digits: int = 1) -> float:
        """The median as `text` prints it (times `factor`, rounded to `digits`): a sentence's ratio of two
        figures is taken from these, so that it is the ratio of the numbers printed beside it."""
        return round(self.scaled(factor).median, digits)

    def text(self, unit: str = "ms", factor: float = 1e3, digits: int = 1) -> str:
        """'12.3 ms (IQR 11.8 to 13.1 over 5)': the median and its interquartile range, in `unit`."""
        m = self.scaled(factor)
        if m.n == 1:
            return f"{m.median:.{digits}f} {unit} (one run: no spread)"
        return f"{m.median:.{digits}f} {unit} (IQR {m.q1:.{digits}f} to {m.q3:.{digits}f} over {m.n})"


def interleaved(labels: Sequence[T], rounds: int) -> list[T]:
    """`rounds` rounds of `labels`, every other round reversed (A B, B A, A B, ...): a machine that speeds up
    or slows down while they run weighs on every label alike, and none always runs first."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds!r}: pass 1 or more rounds")
    return [label for r in range(rounds) for label in (labels if r % 2 == 0 else labels[::-1])]


def compare(a: Measured, b: Measured) -> int:
    """+1 if `a` is larger than `b` beyond both spreads (a's q1 above b's q3), -1 if smaller, 0 if their
    interquartile ranges overlap (this run cannot tell them apart). A single value has no spread to
    trust: compared with anything, it is 0."""
    if a.n < 2 or b.n < 2:
        return 0
    if a.q1 > b.q3:
        return 1
    if a.q3 < b.q1:
        return -1
    return 0


def beyond(a: Measured, value: float) -> int:
    """+1 if the whole interquartile range of `a` lies above `value`, -1 if below, else 0 (or one repeat)."""
    if a.n < 2:
        return 0
    return 1 if a.q1 > value else -1 if a.q3 < value else 0


def unresolved(what: str, figures: Sequence[tuple[str, Measured]], predicted: str = "") -> str:
    """One sentence: this machine was too busy to resolve `what`, with each figure's spread, what the
    budget predicts (`predicted`, a phrase) and what to do."""
    shown = "; ".join(f"{name} {m.text()}" for name, m in figures)
    also = f"; the budget predicts {predicted}" if predicted else ""
    return f"This machine was too busy to resolve {what}: {shown}{also}; {ADVICE}."
