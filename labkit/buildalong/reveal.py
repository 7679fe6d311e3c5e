"""labkit's own code beside the learner's: shown once the learner's build has passed its checks.

The notebooks end a build with the lab's version of the same pieces. In the student release that reveal
must not come before the learner's own: `show` prints one sentence instead until every check it is given
passes (in 02: the checks of the piece shown and of every piece it builds on).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from typing import Any

NOT_YET = "Not yet: labkit's own version is shown here once yours, and the pieces it builds on, pass their checks above."


def passed(checks: bool | Any | Sequence[Any]) -> bool:
    """True when `checks` is True, or a check result (anything with `.ok`) that passed, or a non-empty sequence
    of them that all passed."""
    if isinstance(checks, bool):
        return checks
    results = [checks] if hasattr(checks, "ok") else list(checks)
    return bool(results) and all(r.ok is True for r in results)


def show(checks: bool | Any | Sequence[Any], *items) -> None:
    """Display each item once every check in `checks` passed (see `passed`): a function or class as its
    source, a dict as JSON; else print NOT_YET."""
    if not passed(checks):
        print(NOT_YET)
        return
    from IPython.display import Code, display

    for item in items:
        if isinstance(item, dict):
            display(Code(json.dumps(item, indent=1), language="json"))
        else:
            display(Code(inspect.getsource(item), language="python"))
