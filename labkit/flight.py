"""torch's flight recorder on the lab's ranks: each rank's collectives, dumped, and read by torch's own analyser.

`record(fn, world_size, *args, dump_dir=DIR)` runs `fn` through `labkit.launch` with the recorder on
(`TORCH_FR_BUFFER_SIZE`): every rank dumps its entries to `DIR/rank_<r>` when `fn` returns or raises, and,
for a run that hangs, every `dump_after_s` seconds while it runs, until the launch's timeout stops it. It
returns a `Flight`: the ranks' results or the launch's error, the dumps, and what the analysis found.

`analyse(DIR)` is torch's `fr_trace` on the dumps (its report, as text) beside the lab's one-line reading
(`first_mismatch`: the first collective the ranks did not agree on). The code wins over the docs here: on
gloo ranks torch 2.13's dump keys the default group's config by "" while its entries name the group "0",
and torch's analyser then stops with KeyError('0', 0); `load` gives the config the name its entries use.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import labkit
from labkit.cluster import rank_environ

BUFFER_ENTRIES = 2000  # collectives each rank keeps (the recorder is a ring: older ones drop out)
DUMP_PREFIX = "rank_"


class Entry(NamedTuple):
    """One collective a rank recorded: its number in the group, its name ("all_reduce"), tensor sizes."""

    seq: int
    group: str
    op: str
    sizes: list


class Flight(NamedTuple):
    """A recorded run: the ranks' results (None if the launch failed), the launch's error, the dumps' folder
    and the analysis (`analyse`)."""

    results: list | None
    error: BaseException | None
    dump_dir: Path
    analysis: dict[str, Any]


def _dump(dump_dir: str, rank: int) -> None:
    from torch._C._distributed_c10d import _dump_fr_trace

    path = os.path.join(dump_dir, f"{DUMP_PREFIX}{rank}")
    with open(path + ".tmp", "wb") as f:
        f.write(_dump_fr_trace())
    os.replace(path + ".tmp", path)  # a reader never sees half a dump


def _recorded_rank(fn: Callable, dump_dir: str, dump_after_s: float | None, *args: Any, **kwargs: Any) -> Any:
    """On each rank: `fn`, the recorder's entries dumped when it ends (and every `dump_after_s`, for a hang)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    done, writing = threading.Event(), threading.Lock()  # one writer of the dump at a time

    def dump_while_running() -> None:  # the last dump before a timeout shows where a hung rank waits
        while not done.wait(dump_after_s):
            with writing:
                _dump(dump_dir, rank)

    if dump_after_s:
        threading.Thread(target=dump_while_running, daemon=True).start()
    try:
        return fn(*args, **kwargs)
    finally:
        done.set()
        with writing:
            _dump(dump_dir, rank)


def record(
    fn: Callable,
    world_size: int,
    *args: Any,
    dump_dir: str | Path,
    dump_after_s: float | None = None,
    timeout: float = 120.0,
    **kwargs: Any,
) -> Flight:
    """Run `fn(*args, **kwargs)` on `world_size` ranks under the flight recorder; its `Flight`.

    `dump_dir`: a folder for the dumps (made; earlier dumps in it removed). `dump_after_s`: each rank also
    dumps every this many seconds while it runs (a hang's only dumps, the last before the timeout read; set
    it below `timeout`). A launch
    that fails or times out is not raised: its error is in the `Flight`, beside the analysis of the dumps.
    """
    if dump_after_s is not None and not 0 < dump_after_s < timeout:
        raise ValueError(f"dump_after_s={dump_after_s!r}: pass seconds above 0 and below timeout={timeout!r}")
    out = Path(dump_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{DUMP_PREFIX}*"):
        old.unlink()
    results, error = None, None
    try:  # the buffer size is read by each rank's process group
        with rank_environ({"TORCH_FR_BUFFER_SIZE": str(BUFFER_ENTRIES)}):
            results = labkit.launch(
                _recorded_rank, world_size, fn, str(out), dump_after_s, *args, timeout=timeout, **kwargs
            )
    except (labkit.LaunchError, labkit.LaunchTimeout) as e:
        error = e
    return Flight(results, error, out, analyse(out))


def load(dump_dir: str | Path) -> dict[int, dict]:
    """{rank: its dump} from `dump_dir`, each with its default group's config named as its entries name it."""
    dumps = {}
    for path in sorted(Path(dump_dir).glob(f"{DUMP_PREFIX}*")):
        if path.suffix == ".tmp":
            continue
        dump = pickle.loads(path.read_bytes())
        named = {e["process_group"] for e in dump["entries"]}
        config = dump.get("pg_config", {})
        if "" in config and len(named) == 1:  # see the module's docstring
            name, desc = next(iter(named))
            config[name] = {**config.pop(""), "name": name, "desc": desc}
        dumps[int(path.name.removeprefix(DUMP_PREFIX))] = dump
    return dumps


def entries(dumps: dict[int, dict]) -> dict[int, list[Entry]]:
    """{rank: its collectives in the order it issued them}."""
    return {
        rank: [
            Entry(
                e["collective_seq_id"],
                e["process_group"][1],
                e["profiling_name"].partition(":")[2] or e["profiling_name"],
                e["input_sizes"],
            )
            for e in dump["entries"]
            if not e.get("is_p2p")
        ]
        for rank, dump in dumps.items()
    }


def first_mismatch(by_rank: dict[int, list[Entry]]) -> str | None:
    """One sentence on the first collective (per group, in order) the ranks did not agree on, or one on a
    rank that issued fewer; None when every rank issued the same collectives."""
    groups = {e.group for es in by_rank.values() for e in es}
    for group in sorted(groups):
        lists = {r: [e for e in es if e.group == group] for r, es in by_rank.items()}
        longest = max(len(es) for es in lists.values())
        for i in range(longest):
            seen = {r: es[i] if i < len(es) else None for r, es in lists.items()}
            kinds = {(e.op, str(e.sizes)) if e else None for e in seen.values()}
            if len(kinds) == 1:
                continue
            said = "; ".join(
                f"rank {r}: {e.op} of {e.sizes}" if e else f"rank {r}: nothing (it issued {len(lists[r])})"
                for r, e in sorted(seen.items())
            )
            return f"collective #{i + 1} of group {group!r} differs between the ranks: {said}"
    return None


def analyse(dump_dir: str | Path) -> dict[str, Any]:
    """{"ranks": the ranks that dumped, "entries": `entries`, "mismatch": `first_mismatch`, "torch": what
    torch's analyser (`torch.distributed.flight_recorder`) printed for the same dumps}."""
    dumps = load(dump_dir)
    by_rank = entries(dumps)
    out = {"ranks": sorted(dumps), "entries": by_rank, "mismatch": first_mismatch(by_rank), "torch": ""}
    if not dumps:
        return out
    version = str(next(iter(dumps.values()))["version"])
    text = io.StringIO()
    logger = logging.getLogger("Flight Recorder")  # torch's analyser reports here, and on stdout
    handlers, propagate = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [], False
    try:
        # its logger's first use adds a handler on stderr, once per process: made here, then dropped
        from torch.distributed.flight_recorder.components.fr_logger import FlightRecorderLogger

        FlightRecorderLogger()
        logger.handlers = [logging.StreamHandler(text)]
        with contextlib.redirect_stdout(text):  # its import says "tabulate is not installed"
            from torch.distributed.flight_recorder.components.builder import build_db
            from torch.distributed.flight_recorder.components.config_manager import JobConfig

            details = {
                f"{DUMP_PREFIX}{r}": {
                    "host_name": f"host_rank{r}",
                    "rank": r,
                    **{k: d[k] for k in ("entries", "version", "pg_config")},
                }
                for r, d in dumps.items()
            }
            build_db(details, JobConfig().parse_args([str(dump_dir)]), version)
    finally:
        logger.handlers, logger.propagate = handlers, propagate
    out["torch"] = text.getvalue().strip()
    return out
