"""One way to declare a setting and one way to check it: `RunConfig` (a comparison run) and `PlanInputs` (a
budget plan) are both frozen dataclasses whose fields are declared with `setting(...)`.

A field's `Spec` says its kind, its bounds or choices, its unit, its help and its CLI flag; the CLI's flags
and the calculator's controls are made from it. Building the dataclass runs `check` on every field, which
returns the value normalised (a `rounded` count given as 1.5e9 becomes the int 1500000000) or raises
ValueError in one style, one sentence: "name=value: pass what it takes". Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, field
from typing import Any, NamedTuple

REQUIRED = MISSING  # the default of a field every caller must give


class Spec(NamedTuple):
    """How one field is checked, and what the CLI and the calculator say about it.

    kind: "count" (a whole number, at least `low`, at most `high`; a `rounded` one takes a float such as
    1.5e9 / 7), "number" (0 or more), "rate" (above 0, at most `high`; infinity passes), "pair" (two numbers in [0, 1)),
    "choice" (one of `choices`) or "switch" (True or False); a class may check kinds of its own (`check`'s
    `extra`). `optional`: None is accepted (the default is None). `example`: what an error suggests.
    `assumption`: an input a plan's step time rests on. `flag`: its CLI flag where the CLI does not make it
    from the name; `flag_help`: the flag's help when the flag switches the setting off.
    """

    kind: str
    help: str
    unit: str = ""
    choices: tuple[str, ...] = ()
    low: int | None = None
    high: float | None = None
    example: str = ""
    rounded: bool = False
    optional: bool = False
    assumption: bool = False
    flag: str = ""
    flag_help: str = ""


def setting(default: Any, kind: str, help: str, **spec: Any) -> Any:
    """A dataclass field with its `Spec` (in its metadata under "spec"); `default` may be `REQUIRED`."""
    spec.setdefault("optional", default is None)
    return field(default=default, metadata={"spec": Spec(kind, help, **spec)})


def spec_of(f) -> Spec:
    """The `Spec` of a dataclass field declared with `setting`."""
    return f.metadata["spec"]


def _alternatives(choices: tuple[str, ...]) -> str:
    quoted = [repr(c) for c in choices]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _e_g(s: Spec) -> str:
    return f" (e.g. {s.example})" if s.example else ""


def _count(name: str, value: Any, s: Spec) -> int:
    if s.rounded and _real(value) and value >= 1:
        value = round(value)
    whole = _real(value) and int(value) == value
    if not whole or (s.low is not None and value < s.low) or (s.high is not None and value > s.high):
        of = f" of {s.unit}" if s.unit else ""
        least = "" if s.low is None else f", {s.low} or more"
        most = "" if s.high is None else f", at most {s.high:,}"
        raise ValueError(f"{name}={value!r}: pass a whole number{of}{least}{most}{_e_g(s)}")
    return int(value)


def _number(name: str, value: Any, s: Spec) -> float:
    if not _real(value) or value < 0:
        raise ValueError(f"{name}={value!r}: pass a number, 0 or more{_e_g(s)}")
    return float(value)


def _rate(name: str, value: Any, s: Spec) -> float:
    """Above 0, at most `high`; infinity passes (an infinitely fast link: no time on the wire)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    if not number or value <= 0 or (s.high is not None and value > s.high):
        unit = f" ({s.unit})" if s.unit else ""
        most = "" if s.high is None else f", at most {s.high:g}"
        none = ", or None" if s.optional else ""
        raise ValueError(f"{name}={value!r}: pass a number above 0{unit}{most}{none}{_e_g(s)}")
    return float(value)


def _pair(name: str, value: Any, s: Spec) -> tuple[float, float]:
    if not isinstance(value, tuple) or len(value) != 2 or not all(_real(b) and 0 <= b < 1 for b in value):
        raise ValueError(f"{name}={value!r}: pass a tuple of two numbers in [0, 1), e.g. (0.9, 0.95)")
    return value


def _choice(name: str, value: Any, s: Spec) -> str:
    if value not in s.choices:
        raise ValueError(f"{name}={value!r}: pass {_alternatives(s.choices)}")
    return value


def _switch(name: str, value: Any, s: Spec) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: pass True or False")
    return value


CHECKS: dict[str, Callable[[str, Any, Spec], Any]] = {
    "count": _count,
    "number": _number,
    "rate": _rate,
    "pair": _pair,
    "choice": _choice,
    "switch": _switch,
}


def check(
    name: str, value: Any, s: Spec, extra: Mapping[str, Callable[[str, Any, Spec], Any]] | None = None
) -> Any:
    """`value` of field `name` checked against its `Spec` and normalised; ValueError, one sentence, if it does
    not fit. None passes where the field is `optional`. `extra`: checks of the declaring class's own kinds."""
    if value is None and s.optional:
        return None
    return {**CHECKS, **(extra or {})}[s.kind](name, value, s)
