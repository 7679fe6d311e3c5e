"""Launch a probe's ranks with every collective they call on record, and say what went wrong in the student's terms.

Each rank appends one line per event to its own file while it runs (a collective entered, with its tensors'
shapes, and left; the rank's function returned or raised), so the record survives a rank that is killed.
When the launch fails, `diagnose` compares the ranks' records: the first collective where they disagree
becomes one sentence ("rank 0 returned without calling all_gather_single; ranks 1-2 waited in it")
instead of gloo's "Connection closed by peer".
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from labkit.grading.kit import Diagnosis, TimedOut
from labkit.names import RING_KINDS

_CELL_AT = re.compile(r"<cell (?P<cell>[^>]+)>:(?P<line>\d+) in (?P<func>\S+)")  # labkit.launch's "where"
_SHAPE_KINDS = (*RING_KINDS, "all_to_all")


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float) -> list[Any]:
    """`labkit.launch(fn, world_size, *args)`, its failures re-raised as a `Diagnosis` in one sentence."""
    import labkit

    directory = tempfile.mkdtemp(prefix="labkit-ranks-")
    try:
        return labkit.launch(_recording, world_size, fn, directory, *args, timeout=timeout)
    except labkit.LaunchError as e:
        records = read_records(directory, world_size)
        doing = getattr(e, "doing", None) or {}
        story = diagnose(records, doing)
        if story is None and isinstance(e, labkit.LaunchTimeout):
            raise TimedOut(_timeout_story(timeout, doing)) from None
        raise Diagnosis(story or _first_line(e)) from None
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _recording(fn: Callable[..., Any], directory: str, *args: Any) -> Any:
    """On each rank: `fn(*args)` with every torch.distributed collective it calls written down as it happens."""
    import torch
    import torch.distributed as dist

    from labkit.collectives import COLLECTIVES, Patch

    fd = os.open(
        os.path.join(directory, f"rank{dist.get_rank()}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND
    )

    def note(**event) -> None:
        os.write(fd, (json.dumps(event) + "\n").encode())

    def shapes(values) -> list[list[int]]:
        found = []
        for v in values:
            if isinstance(v, torch.Tensor):
                found.append(list(v.shape))
            elif isinstance(v, (list, tuple)):
                found += [list(t.shape) for t in v if isinstance(t, torch.Tensor)]
        return found

    def wrap(name: str, current: Callable) -> Callable:
        def recorded(*a, **kw):
            note(e="enter", name=name, shapes=shapes([*a, *kw.values()]))
            result = current(*a, **kw)
            note(e="exit")
            return result

        return recorded

    try:
        with Patch(COLLECTIVES, wrap, outermost=True):
            value = fn(*args)
    except BaseException as e:
        note(e="raised", error=_first_line(e))
        raise
    note(e="done")
    return value


def read_records(directory: str, world_size: int) -> list[list[dict]]:
    """Each rank's events, in rank order (an unreadable line ends that rank's record)."""
    records = []
    for rank in range(world_size):
        events = []
        try:
            with open(os.path.join(directory, f"rank{rank}.jsonl")) as f:
                for line in f:
                    event = json.loads(line)
                    if not isinstance(event, dict):
                        break
                    events.append(event)
        except (OSError, ValueError):
            pass
        records.append(events)
    return records


def diagnose(records: Sequence[Sequence[dict]], doing: dict[int, str] | None = None) -> str | None:
    """The first collective the ranks disagree on, as a sentence; None when their records agree."""
    from labkit.collectives import COLLECTIVES

    calls = [[e for e in events if e.get("e") == "enter"] for events in records]
    ranks = range(len(records))
    for k in range(max((len(c) for c in calls), default=0)):
        at = {r: calls[r][k] if k < len(calls[r]) else None for r in ranks}
        names: dict[str, list[int]] = {}
        for r, event in at.items():
            if event is not None:
                names.setdefault(str(event.get("name")), []).append(r)
        absent = [r for r, event in at.items() if event is None]
        if len(names) == 1 and not absent:
            name = next(iter(names))
            kind = COLLECTIVES[name].kind if name in COLLECTIVES else ""
            seen = {r: at[r].get("shapes") for r in ranks}
            if kind in _SHAPE_KINDS and len({json.dumps(s) for s in seen.values()}) > 1:
                each = "; ".join(f"rank {r} {_shapes_text(s)}" for r, s in seen.items())
                return (
                    f"at their {_ordinal(k)} collective ({name}) the ranks passed tensors of different shapes "
                    f"({each}): every rank must pass the same shapes, so pad every shard to the same rows"
                )
            continue
        if len(names) == 1:
            ((name, callers),) = names.items()
            why = "; ".join(_absence(records[r], r, doing) for r in absent)
            return (
                f"{_ranks(absent)} never called {name} (the {_ordinal(k)} collective of {_ranks(callers)}): "
                f"{why}; {_ranks(callers)} waited in it. Every rank must call the same collectives"
            )
        parts = [f"{_ranks(rs)} called {name}" for name, rs in names.items()]
        if absent:
            parts.append(f"{_ranks(absent)} called none")
        return (
            f"at the {_ordinal(k)} collective, {', '.join(parts)}: every rank must call the same collectives "
            "in the same order"
        )
    return None


def _absence(events: Sequence[dict], rank: int, doing: dict[int, str] | None) -> str:
    last = events[-1] if events else {}
    if last.get("e") == "done":
        return f"rank {rank} returned without calling it"
    if last.get("e") == "raised":
        return f"rank {rank} raised {last.get('error')} first"
    where = (doing or {}).get(rank, "")
    return f"rank {rank} was still busy elsewhere ({where})" if where else f"rank {rank} stopped before it"


def _timeout_story(timeout: float, doing: dict[int, str]) -> str:
    alike: dict[str, list[int]] = {}
    for rank, what in sorted(doing.items()):
        what = _CELL_AT.sub(lambda m: f"line {m['line']} of cell {m['cell']!r} in {m['func']}", what)
        alike.setdefault(what, []).append(rank)
    each = (
        "; ".join(f"{_ranks(rs)}: {what}" for what, rs in alike.items()) or "no rank said what it was doing"
    )
    return f"the ranks did not finish within {timeout:.0f} s ({each})"


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0]


def _shapes_text(shapes: Any) -> str:
    if not isinstance(shapes, list) or not shapes:
        return "no tensors"
    return " and ".join(str(s) for s in shapes)


def _ranks(ranks: Sequence[int]) -> str:
    """'rank 0', 'ranks 1-2', 'ranks 0, 2'."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def _ordinal(k: int) -> str:
    """0 -> '1st', 1 -> '2nd', ... (k counts from 0)."""
    n = k + 1
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
