"""The stubs of the student release: a build cell the learner has not written yet raises `NotWritten`.

In the instructor's copy every `build` cell is filled; its `metadata.labkit.stub` holds the cell the
release puts in its place (`labkit.release`): the same names, a hint that names the idea, and a call to
`write_this_piece`. A check that meets one says "write this piece" and nothing else.
"""

from __future__ import annotations

from typing import NoReturn

SENTENCE = "write this piece"


class NotWritten(NotImplementedError):
    """Raised by a stub: the piece `name` is still to be written."""


def write_this_piece(name: str, idea: str = "") -> NoReturn:
    """What a stub's body calls: raises `NotWritten` with 'write this piece: NAME (IDEA)'."""
    raise NotWritten(f"{SENTENCE}: {name}" + (f" ({idea})" if idea else ""))


def unwritten(error: BaseException | str) -> str | None:
    """The 'write this piece: ...' sentence when `error` (an exception, or a rank's report) comes from a stub."""
    text = str(error)
    start = text.find(f"{SENTENCE}: ")
    if start < 0:
        return None
    return text[start:].splitlines()[0].rstrip(" .") + ", then run this check again"


def raised(where: str, error: BaseException, *libraries) -> dict[str, str]:
    """What the learner's code raised in `where`: {"error": "Type: its first whole sentence", "where",
    "line": " (line N: source)"} for the last frame outside torch, labkit and the `libraries` (modules), or ""
    when none is."""
    import os
    import traceback

    import torch

    import labkit
    from labkit.errors import error_text

    ours = tuple(os.path.dirname(m.__file__) for m in (torch, labkit, *libraries))
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(ours)]
    line = f" (line {frames[-1].lineno}: {frames[-1].line})" if frames else ""
    return {"error": error_text(error), "where": where, "line": line}
