"""A library's error (torch's, DeepSpeed's, pydantic's) said as one whole sentence on one line.

Checks quote the error an answer met, in the library's own words: its first sentence, never cut inside a word
or a link. A pydantic `ValidationError` (DeepSpeed's config schema) is said as its model, the field and the
message, without the documentation link that follows every one.
"""

from __future__ import annotations

import re

LONGEST_CHARS = 300  # a message longer than this is said up to the end of its first sentence
_SENTENCE_END = re.compile(r"[.!?](?=\s+[A-Z(\"'`])")


def error_text(error: BaseException) -> str:
    """'Type: message' with the message as `one_sentence` says it (the type alone when it has none)."""
    message = _pydantic(error) or one_sentence(str(error))
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def one_sentence(message: str) -> str:
    """`message` on one line: whole when it is short, else its first sentence; a first sentence longer than
    LONGEST_CHARS ends at the last whole word before it, then "…". Lines that only point to documentation
    ('For further information visit URL') are left out."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    text = " ".join(ln for ln in lines if not ln.lower().startswith("for further information visit"))
    text = " ".join(text.split())
    if len(text) <= LONGEST_CHARS:
        return text
    end = _SENTENCE_END.search(text)
    if end is not None and end.end() <= LONGEST_CHARS:
        return text[: end.end()]
    cut = text.rfind(" ", 0, LONGEST_CHARS)
    return text[: cut if cut > 0 else LONGEST_CHARS].rstrip(" ,;:") + " …"


def _pydantic(error: BaseException) -> str:
    """A pydantic ValidationError as '<model> rejects <field>: <message> (got <input>)', and how many more."""
    errors = getattr(error, "errors", None)
    title = getattr(error, "title", None)
    if not callable(errors) or not isinstance(title, str):
        return ""
    try:
        found = errors()
    except Exception:  # noqa: BLE001 - not pydantic's after all: say its message instead
        return ""
    if not found:
        return ""
    first = found[0]
    field = ".".join(str(part) for part in first.get("loc", ())) or "the input"
    given = first.get("input")
    shown = repr(given) if len(repr(given)) <= 80 else f"a {type(given).__name__}"
    more = f", and {len(found) - 1} more" if len(found) > 1 else ""
    return f"{title} rejects {field}: {first.get('msg', 'invalid')} (got {shown}){more}"
