"""labkit's own code beside the learner's: shown once the learner's build has passed its checks.

The notebooks end a build with the lab's version of the same pieces. In the student release that reveal
must not come before the learner's own: `show` prints one sentence instead until the build passes.
"""

from __future__ import annotations

import inspect
import json

NOT_YET = "Not yet: labkit's own version is shown here once yours passes every check above."


def show(built: bool, *items) -> None:
    """Display each item once `built` (the learner's checks passed): a function or class as its source, a
    dict as JSON; else print NOT_YET."""
    if not built:
        print(NOT_YET)
        return
    from IPython.display import Code, display

    for item in items:
        if isinstance(item, dict):
            display(Code(json.dumps(item, indent=1), language="json"))
        else:
            display(Code(inspect.getsource(item), language="python"))
