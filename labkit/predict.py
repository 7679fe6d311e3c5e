"""Predict, then reveal: the learner commits to a number before the run shows it.

A cell tagged `predict` calls `predict(question, unit)`: a small text box with the unit beside it. The
cell that measures calls `guess.reveal(measured, formula=..., mistake=...)`, which shows the measurement,
the prediction and by how much they differ, the formula beside the measurement, and the usual mistake
when a prediction was entered and missed. Under papermill ("Run All" with the box empty) nobody typed: the
reveal says no prediction was entered and shows the measurement and the formula, nothing about mistakes.
A plain number works too: `predict(question, unit, value=1.5e6)`. A cause is predicted as a choice:
`predict(question, choices=(...))` shows the options; its reveal takes the right option's number (from 1).
`self_check_html(items)` is the other kind of question: a list whose answers open on a click.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from labkit.measured import Measured

# The prediction counts as right within this relative distance of the measurement.
RIGHT_WITHIN = 0.05

_DECIMAL = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}  # bytes, FLOPs, counts: 1 GB = 1e9 B
_SUBUNIT = {"": 1.0, "m": 1e-3, "u": 1e-6, "µ": 1e-6}  # seconds: 1 ms = 1e-3 s
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(,\d{3})+(\.\d*)?(e[-+]?\d+)?$", re.I)
_NUMBER = re.compile(
    r"^\s*([-+]?(?:\d[\d,_]*\.?\d*|\.\d+)(?:e[-+]?\d+)?)\s*([kmgtuµ]?)\s*([a-z%/]*)\s*$", re.I
)


def parse_number(text: str, unit: str = "") -> float | None:
    """The number a learner typed, in `unit`: '1536', '1,536', '1.5e6', '1.5 GB', '2 GiB'; '250 ms' for 's'.

    A k/M/G/T prefix is decimal (1 GB = 1e9 B), KiB/MiB/GiB/TiB binary; for seconds m and u are milli and
    micro. A unit typed after the number must be the question's (`unit`, or its singular). None if empty;
    anything else is a ValueError that says what would work.
    """
    if text is None or not str(text).strip():
        return None
    match = _NUMBER.match(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a number; type e.g. 1536, 1.5e6 or 1.5 MB")
    number, prefix, typed = match.groups()
    if "," in number and not _THOUSANDS.match(number):
        raise ValueError(
            f"{text!r}: a comma here separates thousands (1,536); type decimals with a point: 1.5"
        )
    scales = _SUBUNIT if unit == "s" else _DECIMAL
    if prefix.lower() not in scales:
        raise ValueError(f"{text!r}: the prefix {prefix!r} does not go with {unit or 'a plain number'}")
    scale = scales[prefix.lower()]
    if unit == "B" and prefix and typed == "iB":  # binary: 1 GiB = 2**30 B
        scale, typed = 1024.0 ** "kmgt".index(prefix.lower()) * 1024.0, "B"
    if typed and not _unit_ok(typed, unit):
        raise ValueError(
            f"{text!r}: the answer is in {unit or 'a plain number'}, not {typed!r}; type e.g. 1.5e6"
        )
    return float(number.replace(",", "").replace("_", "")) * scale


def _unit_ok(typed: str, unit: str) -> bool:
    """Whether `typed` (after the prefix) names `unit`: exactly or in the singular; other than B (b would be
    bits), in any case."""
    return typed in (unit, unit.rstrip("s")) or (unit != "B" and typed.lower() == unit.lower())


def format_quantity(value: float, unit: str) -> str:
    """`value` with its unit, readable: bytes in decimal units, seconds as ms below 1 s, else 4 digits."""
    if unit == "B":
        if abs(value) < 1e4:
            return f"{value:,.0f} B"
        for name, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if abs(value) >= scale:
                return f"{value / scale:.4g} {name}"
    if unit == "s" and abs(value) < 1:
        return f"{value * 1e3:.3g} ms"
    return f"{value:.4g} {unit}".rstrip()


@dataclass(frozen=True)
class Reveal:
    """Measured against predicted (and against a formula): what `Prediction.reveal` shows.

    `ratio` is predicted / measured (None without a prediction); `right` is within RIGHT_WITHIN of it, or
    inside `spread` (the measurement's interquartile range over its repeats, when it has one).
    """

    question: str
    unit: str
    measured: float
    predicted: float | None
    formula: float | None = None
    formula_text: str = ""
    mistake: str = ""
    source: str = "measured"  # or "computed" (by labkit.budget), said before the number
    spread: tuple[float, float, int] | None = None  # (q1, q3, repeats) of a repeated measurement
    choices: tuple[str, ...] = ()  # a choice: `measured` and `predicted` are option numbers, from 1

    @property
    def ratio(self) -> float | None:
        if self.predicted is None or self.measured == 0:
            return None
        return self.predicted / self.measured

    @property
    def right(self) -> bool:
        if self.predicted is None:
            return False
        if self.spread is not None and self.spread[0] <= self.predicted <= self.spread[1]:
            return True
        return math.isclose(self.predicted, self.measured, rel_tol=RIGHT_WITHIN, abs_tol=1e-12)

    def _q(self, value: float) -> str:
        return format_quantity(value, self.unit)

    def lines(self) -> list[str]:
        if self.choices:
            return self._choice_lines()
        q = self._q
        out = [f"{self.question}: {self.source} {q(self.measured)}{self._spread_text()}."]
        if self.predicted is None:
            out.append("No prediction entered (type one in the box above, then run this cell again).")
        elif self.right:
            out.append(f"You predicted {q(self.predicted)}: right (within {RIGHT_WITHIN:.0%}).")
        else:
            out.append(f"You predicted {q(self.predicted)}: {self._miss()}.")
        if self.formula is not None:
            label = f"Formula {self.formula_text} = " if self.formula_text else "Formula: "
            if self.unit == "B" and self.formula == self.measured:
                agree = "equal to the byte"
            elif self.unit != "B" and math.isclose(self.formula, self.measured, rel_tol=1e-9):
                agree = "equal"  # up to rounding: the same sum, added in another order
            elif self.spread is not None and self.spread[0] <= self.formula <= self.spread[1]:
                agree = f"inside the measurement's spread ({self.source} / formula = {self.measured / self.formula:.4g})"
            else:
                ratio = self.measured / self.formula if self.formula else None
                agree = f"{self.source} / formula = {ratio:.4g}" if ratio is not None else ""
            out.append(f"{label}{q(self.formula)}: {agree}.".replace(": .", "."))
        if self.mistake and self.predicted is not None and not self.right:
            out.append(f"The usual mistake: {self.mistake}")
        return out

    def _choice_lines(self) -> list[str]:
        def said(number: float) -> str:
            return f"({number:g}) {self.choices[int(number) - 1]}"

        out = [f"{self.question}: {self.source} {said(self.measured)}."]
        if self.predicted is None:
            out.append("No prediction entered (choose one above, then run this cell again).")
        else:
            out.append(f"You chose {said(self.predicted)}: {'right' if self.right else 'not this one'}.")
        if self.mistake and self.predicted is not None and not self.right:
            out.append(f"The usual mistake: {self.mistake}")
        return out

    def _spread_text(self) -> str:
        if self.spread is None:
            return ""
        q1, q3, n = self.spread
        return f" (the median of {n}; interquartile range {self._q(q1)} to {self._q(q3)})"

    def _miss(self) -> str:
        ratio = self.ratio
        if ratio is None or ratio <= 0:
            return f"off by {format_quantity(self.predicted - self.measured, self.unit)}"
        if ratio > 1:
            return f"{ratio:.3g}x the measurement (too high)"
        return f"1/{1 / ratio:.3g} of the measurement (too low)"

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def _repr_html_(self) -> str:
        colour = "#2e7d32" if self.right else ("#555" if self.predicted is None else "#c62828")
        body = "<br>".join(html.escape(line) for line in self.lines())
        return f'<div style="border-left:4px solid {colour};padding:4px 10px;margin:4px 0">{body}</div>'


class Prediction:
    """A learner's prediction: typed into a small widget, or given as `value`; None until entered."""

    def __init__(
        self, question: str, unit: str = "", value: float | None = None, choices: tuple[str, ...] = ()
    ):
        self.question = question
        self.unit = unit
        self._given = value
        self._box = None
        self.choices = tuple(choices)

    @property
    def value(self) -> float | None:
        """The predicted number (unit `self.unit`), or None when nothing was entered."""
        if self._given is not None:
            return float(self._given)
        if self.choices:
            picked = self._box.value if self._box is not None else None
            return None if picked is None else float(self._box.options.index(picked) + 1)
        return parse_number(self._box.value, self.unit) if self._box is not None else None

    def widget(self):
        """The text box with the question above it and the unit beside it (ipywidgets)."""
        import ipywidgets as W

        if self.choices and self._box is None:
            options = [f"({i}) {c}" for i, c in enumerate(self.choices, 1)]
            self._box = W.RadioButtons(options=options, value=None, layout=W.Layout(width="auto"))
        if self._box is None:
            self._box = W.Text(placeholder="your prediction", layout=W.Layout(width="14em"))
        label = W.HTML(f"<b>Predict.</b> {html.escape(self.question)}")
        return W.VBox([label, self._box if self.choices else W.HBox([self._box, W.Label(self.unit)])])

    def reveal(
        self,
        measured: float | Measured,
        formula: float | None = None,
        formula_text: str = "",
        mistake: str = "",
        source: str = "measured",
    ) -> Reveal:
        """Show the measurement beside the prediction (and the formula), and return what was shown.

        `measured` and `formula` are in the prediction's unit (a `Measured` shows its median and spread, and
        a prediction inside its interquartile range counts as right); `mistake` is one line on the usual error,
        shown only when a prediction was entered and missed; `source` says where `measured` comes from ("computed" for a
        figure of labkit.budget). A typed prediction that is not a number is reported, not raised.
        """
        try:
            predicted = self.value
        except ValueError as e:
            print(f"(your prediction was not read: {e})")
            predicted = None
        spread = None
        if isinstance(measured, Measured):
            spread = (measured.q1, measured.q3, measured.n) if measured.n > 1 else None
            measured = measured.median
        shown = Reveal(
            self.question,
            self.unit,
            float(measured),
            predicted,
            None if formula is None else float(formula),
            formula_text,
            mistake,
            source,
            spread,
            self.choices,
        )
        _show(shown)
        return _Shown(shown)

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.widget()._repr_mimebundle_(**kwargs) or {}
        bundle["text/plain"] = f"Predict: {self.question}" + (f" [{self.unit}]" if self.unit else "")
        return bundle


class _Shown(Reveal):
    """A Reveal already displayed by `reveal()`: as a cell's last value it is not displayed again."""

    def __init__(self, shown: Reveal):
        super().__init__(**{f: getattr(shown, f) for f in Reveal.__dataclass_fields__})

    def _ipython_display_(self) -> None:
        pass


def predict(
    question: str, unit: str = "", value: float | None = None, choices: tuple[str, ...] = ()
) -> Prediction:
    """Ask the learner to predict a number before it is measured; display the returned Prediction.

    In a cell tagged `predict`, `guess = predict("Bytes one rank sends", "B")` then `guess` shows the box.
    With `choices` (a cause among a few) the box is a list of options and `value` the chosen one's number.
    """
    return Prediction(question, unit, value, choices)


def _show(reveal: Reveal) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display({"text/plain": str(reveal), "text/html": reveal._repr_html_()}, raw=True)
    else:
        print(reveal)


def self_check_html(items: Sequence[tuple[str, str]]) -> str:
    """(question, answer) pairs as HTML `<details>` blocks: the answer shows when its question is clicked."""
    blocks = [
        f"<details style='margin:4px 0'><summary><b>{html.escape(q)}</b></summary>"
        f"<div style='margin:4px 0 8px 16px'>{html.escape(a)}</div></details>"
        for q, a in items
    ]
    return "\n".join(blocks)
