"""Reads each timing verdict a notebook printed against the numbers printed with it.

A figure the lab measured prints as `12.3 ms (IQR 11.8 to 13.1 over 6)` (`labkit.measured.Measured.text`);
a verdict (above the floor, prefetch cut it, R rose, the closed form holds) is a sentence next to such
figures. `check(text)` finds every verdict it knows, asserts that the figures support it (or that an
"unresolved" sentence stands where they do not), and returns the names of the verdicts it checked, so a
test can require that some were found: a checker that found none would pass anything.
"""

from __future__ import annotations

import re

NUM = r"-?[\d,]+(?:\.\d+)?"
FIGURE = re.compile(rf"({NUM}) (?:ms|GFLOP/s) \(IQR ({NUM}) to ({NUM}) over (\d+)\)")
TOKENS = re.compile(rf"({NUM}) \(IQR ({NUM}) to ({NUM}) tokens per rank over (\d+)\)")


def _f(text: str) -> float:
    return float(text.replace(",", ""))


def _figures(line: str, pattern: re.Pattern = FIGURE) -> list[tuple[float, float, float]]:
    """(median, q1, q3) of every figure in `line`."""
    return [(_f(m.group(1)), _f(m.group(2)), _f(m.group(3))) for m in pattern.finditer(line)]


def _apart(a: tuple[float, float, float], b: tuple[float, float, float]) -> int:
    """+1 if a's IQR lies above b's, -1 below, 0 if they overlap (as printed, to its rounding)."""
    return 1 if a[1] > b[2] else -1 if a[2] < b[1] else 0


def check(text: str) -> list[str]:
    """Assert every known verdict in `text` against its printed figures; return the verdicts checked."""
    checked = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        for median, q1, q3 in _figures(line) + _figures(line, TOKENS):
            assert q1 <= median <= q3, f"a median outside its own IQR: {line}"
        for name, rule in RULES:
            if rule(lines, i):
                checked.append(name)
    return checked


def _floor(lines: list[str], i: int) -> bool:
    line, nxt = lines[i], lines[i + 1] if i + 1 < len(lines) else ""
    m = re.match(rf"measured with prefetch: .* exposed; the floor ({NUM}) ms$", line)
    if not m:
        return False
    [(_, q1, q3)] = _figures(line)
    floor = _f(m.group(1))
    if nxt.startswith("Above the floor"):
        assert q1 > floor, (line, nxt)
    elif nxt.startswith("Below the floor"):
        assert q3 < floor, (line, nxt)
    else:
        assert nxt.startswith("At the floor") and q1 <= floor <= q3, (line, nxt)
    return True


def _prefetch(lines: list[str], i: int) -> bool:
    line = lines[i]
    m = re.match(r"Prefetch cut the exposed time to (\d+)% of the (.*) without it\.$", line)
    resolved = bool(m)
    unresolved = line.startswith("This machine was too busy to resolve what prefetch did to the exposed time")
    if not (resolved or unresolved):
        return False
    if resolved:
        off = _figures(m.group(2))[0]
        above = [x for x in lines[:i] if x.startswith("measured with prefetch:")]
        assert above, f"a prefetch verdict with no measured line above it: {line}"
        on = _figures(above[-1])[0]
        assert on[2] < off[1], f"prefetch said to cut beyond the spread, yet the IQRs overlap: {on} {off}"
        assert int(m.group(1)) == round(100 * on[0] / off[0]), line
    else:
        on, off = _figures(line)
        assert _apart(on, off) == 0, line
    return True


def _busy(lines: list[str], i: int) -> bool:
    line = lines[i]
    if not line.startswith("rank 0 computing, waits cut out:"):
        return False
    off, on = _figures(line)
    if "slower with prefetch" in line:
        assert _apart(on, off) > 0, line
    elif "faster with prefetch" in line:
        assert _apart(on, off) < 0, line
    else:
        assert "no difference this run can resolve" in line and _apart(on, off) == 0, line
    return True


def _drawn(lines: list[str], i: int) -> bool:
    line = lines[i]
    m = re.match(
        rf"the step drawn, rank 0: ({NUM}) ms computing \+ ({NUM}) ms blocked of its own ({NUM}) ms step",
        line,
    )
    if not m:
        return False
    busy, blocked, own = (_f(g) for g in m.groups())
    assert abs(busy + blocked - own) <= 0.1 * own + 0.2, line
    return True


def _rate(lines: list[str], i: int) -> bool:
    line = lines[i]
    if not re.match(
        r"(R rose|R fell|This machine was too busy to resolve how R moved) across the sweep", line
    ):
        return False
    first, last = _figures(line)
    side = _apart(last, first)
    assert side == (1 if line.startswith("R rose") else -1 if line.startswith("R fell") else 0), line
    return True


def _crossover(lines: list[str], i: int) -> bool:
    line, nxt = lines[i], lines[i + 1] if i + 1 < len(lines) else ""
    m = re.match(
        rf"crossover: measured ({NUM}) tokens per rank .* closed form ({NUM}) at R = .* \(down to ({NUM}) with "
        rf"03's floor, .*\): ratio ({NUM})$",
        line,
    )
    if not m:
        return False
    measured, closed, low, ratio = (_f(g) for g in m.groups())
    assert abs(ratio - measured / closed) <= 0.006 and low < closed, line
    # the band: T* x (1 - f) (the floor on the link alone) less 25% to T* plus 25%, rounding allowed
    within = 0.75 * low * (1 - 0.002) <= measured <= 1.25 * closed * (1 + 0.002)
    outside = not 0.75 * low * (1 + 0.002) <= measured <= 1.25 * closed * (1 - 0.002)
    figures = _figures(nxt, TOKENS)
    if nxt.startswith("This machine was too busy to resolve the crossover: the exposed time did not settle"):
        pass  # the knee at the sweep's edge: no ratio is claimed
    elif nxt.startswith("The closed form, with R taken where compute meets the link, is within 25%"):
        assert within, (line, nxt)
    elif nxt.startswith("The measured crossover is"):
        assert outside and _apart(*figures) != 0, (line, nxt)
    else:
        assert nxt.startswith("This machine was too busy to resolve the crossover"), (line, nxt)
        assert outside and _apart(*figures) == 0, (line, nxt)
    return True


def _contest(lines: list[str], i: int) -> bool:
    line = lines[i]
    m = re.match(r".*: '(.+?)' .* vs '(.+?)' .*: (faster here '(.+)'|even \(within (\d+)%, or within)", line)
    if not m:
        return False
    a, b = _figures(line)
    if m.group(4):
        fast, slow = (a, b) if m.group(4) == m.group(1) else (b, a)
        assert fast[2] < slow[1] and fast[0] * 1.1 < slow[0], line  # beyond both spreads and the 10% margin
    else:
        assert (
            _apart(a, b) == 0 or abs(a[0] / b[0] - 1) <= 0.1 + 0.01 or abs(b[0] / a[0] - 1) <= 0.1 + 0.01
        ), line
    return True


RULES = [
    ("floor", _floor),
    ("prefetch", _prefetch),
    ("busy", _busy),
    ("drawn", _drawn),
    ("rate", _rate),
    ("crossover", _crossover),
    ("contest", _contest),
]
