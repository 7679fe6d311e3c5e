"""What a rank's output says: for a failed rank, the C++ exception behind an abort, where the rank's own code
was, the sentence for collectives that did not match, and torch's C++ frames folded to one line
(`labkit.cluster` turns these into the one exception a launch raises); for every rank, which lines reach the
notebook's cell (`shown_in_cell`: all but DeepSpeed's chatter, which stays in the rank's log file).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_WHAT = re.compile(r"what\(\):\s*(.+)")  # std::terminate's line: the C++ exception's message
_MISMATCH = ("doesn't match expected size", "collective mismatch")
DEEPSPEED_LOGGER = "DeepSpeed"  # the logger `deepspeed.utils.logger` writes to stdout with
# DeepSpeed's chatter: its logger's records below ERROR ("[date time] [WARNING] [file.py:line:function] ...") and
# the line its communication op prints each time a rank loads it.
_DEEPSPEED_CHATTER = re.compile(
    r"\[\d{4}-\d\d-\d\d [\d:,]+\] \[(?:DEBUG|INFO|WARNING)\] \[[^\]]*\.py:\d+:\w*\] "
    r"|DeepSpeed \S+ built successfully$"
)
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "remote process exited")


def user_frame(stack_dump: str, launcher_files: Sequence[str]) -> str:
    """Where the rank's main thread is: its innermost frame outside torch and `launcher_files`, and the torch
    function it is inside when that is deeper (e.g. a stuck rendezvous)."""
    block = next((b for b in stack_dump.split("\n\n") if "_rank_main" in b), "")
    frames = list(_FRAME.finditer(block))  # most recent call first
    for i, m in enumerate(frames):
        if f"{os.sep}torch{os.sep}" not in m["file"] and m["file"] not in launcher_files:
            inside = (
                f" (inside torch's {frames[0]['func']})" if i > 0 and "torch" in frames[0]["file"] else ""
            )
            return f"{m['file']}:{m['line']} in {m['func']}{inside}"
    return ""


def native_failure(log: str, launcher_files: Sequence[str]) -> tuple[str, str]:
    """From a rank's output after a C++ abort: (the exception's own message, where the rank's code was, as
    `user_frame` says it); ('', '') when the log holds no such message."""
    text = "\n".join(re.sub(r"^\[rank \d+\]\s?", "", line) for line in log.splitlines())
    cause = next((m.group(1).strip() for m in _WHAT.finditer(text)), "")
    return (cause, user_frame(text, launcher_files)) if cause else ("", "")


def fold_native_frames(text: str) -> str:
    """`text` without the C++ stack torch appends to an error ('Exception raised from ...', 'frame #N: ...'),
    one line saying how many frames were folded in its place."""
    kept, folded = [], 0
    for line in text.splitlines():
        if re.match(r"\s*(frame #\d+:|Exception raised from )", line):
            folded += 1
            continue
        if folded:
            kept.append(f"  ({folded} C++ frames folded)")
            folded = 0
        kept.append(line)
    if folded:
        kept.append(f"  ({folded} C++ frames folded)")
    return "\n".join(kept)


def collective_hint(message: str) -> str:
    """A sentence for the failures that mean the ranks' collectives did not match, else ''."""
    if not any(text in message for text in _MISMATCH):
        return ""
    return (
        " — the ranks' collectives did not match: every rank must call the same collectives, in the same "
        "order, with tensors of the same size"
    )


def tail_text(path: str, max_lines: int) -> str:
    """The last `max_lines` lines of the file at `path`; "" when it cannot be read."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-max_lines:]).rstrip()
    except OSError:
        return ""


def shown_in_cell(line: str) -> bool:
    """Whether a line a rank printed is shown in the caller's output: every line but DeepSpeed's chatter (its
    logger's DEBUG, INFO and WARNING records, its op's "built successfully"); its ERROR records, tracebacks and
    the rank's own prints always are. A failure's report reads the rank's whole log file, chatter included."""
    return not _DEEPSPEED_CHATTER.match(line)


class _ErrorsOnly(logging.Filter):
    """Passes a record at ERROR or above: what DeepSpeed's logger prints once `quiet_deepspeed_logger` ran."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


def quiet_deepspeed_logger() -> None:
    """Keep DeepSpeed's logger in this process to its errors: its WARNING and INFO records (the accelerator it
    picked as it is imported, its configuration) are chatter in a notebook cell. Safe to call before DeepSpeed
    is imported (the filter outlives the level DeepSpeed then sets) and more than once."""
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    if not any(isinstance(f, _ErrorsOnly) for f in logger.filters):
        logger.addFilter(_ErrorsOnly())


def follow_streams(stdout, stderr, old_stderr: set[int]) -> None:
    """Point every logging StreamHandler at this rank's `stderr` (those on a stream whose id is in `old_stderr`)
    or `stdout` (the rest): a forked rank inherits the handlers made in the parent (DeepSpeed's, on whatever
    sys.stdout was when it was imported: a notebook's or a test's stream object), which write where no one reads."""
    loggers = [
        logging.getLogger(),
        *(lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)),
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler:
                # assigned, not setStream: that flushes the old stream, the parent's (its buffer would print
                # twice), which may be closed by now (a finished test's capture)
                handler.stream = stderr if id(handler.stream) in old_stderr else stdout
