"""labkit's own code beside the learner's: shown once the learner's build has passed its checks.

The notebooks end a build with the lab's version of the same pieces. In the student release that reveal
must not come before the learner's own: `show` prints one sentence instead until every check it is given
passes (in 02: the checks of the piece shown and of every piece it builds on). labkit's own ZeRO-3 is not in
the student release at all: there, an item named by its dotted path in `labkit.zero` says so in one sentence.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Sequence
from typing import Any

from labkit.course import holds

NOT_SHIPPED = (
    "labkit's own ZeRO-3 is not in this copy: the scratch engine here is yours. Your instructor can hand out the "
    "course's pieces once the build is due (labkit release --student --reference)."
)
NOT_YET = "Not yet: labkit's own version is shown here once yours, and the pieces it builds on, pass their checks above."


def passed(checks: bool | Any | Sequence[Any]) -> bool:
    """True when `checks` is True, or a check result (anything with `.ok`) that passed, or a non-empty sequence
    of them that all passed."""
    if isinstance(checks, bool):
        return checks
    results = [checks] if hasattr(checks, "ok") else list(checks)
    return bool(results) and all(r.ok is True for r in results)


def show(checks: bool | Any | Sequence[Any], *items) -> None:
    """Display each item once every check in `checks` passed (see `passed`): a function or class (or its
    dotted path, "labkit.zero.hooks.ZeRO3.before_forward") as its source, a dict as JSON; else print NOT_YET.
    Where a dotted path's module is not in this copy (the student release), print NOT_SHIPPED instead."""
    if not passed(checks):
        print(NOT_YET)
        return
    from IPython.display import Code, display

    try:
        items = tuple(named(item) if isinstance(item, str) else item for item in items)
    except ModuleNotFoundError:
        print(NOT_SHIPPED)
        return
    for item in items:
        if isinstance(item, dict):
            display(Code(json.dumps(item, indent=1), language="json"))
        else:
            display(Code(inspect.getsource(item), language="python"))


def named(path: str) -> Any:
    """The object at dotted `path` (a module of labkit, then attributes); ModuleNotFoundError where this copy
    of labkit does not hold that module (`labkit.course.holds`: the student release leaves labkit.zero out)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 1, -1):  # a module under labkit, the longest first
        module = ".".join(parts[:cut])
        if holds(module):
            obj = importlib.import_module(module)
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            return obj
    raise ModuleNotFoundError(f"this copy of labkit holds no module of {path!r}")
