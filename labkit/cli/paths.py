"""Where a command will write, checked before it does any work: a path it cannot write is refused in one
sentence (exit status 2) at once, not found out after minutes of ranks, when the result would be lost."""

from __future__ import annotations

import os
from pathlib import Path

from labkit.cli import UsageError


def writable_file(command: str, flag: str, path: str | os.PathLike, make_parents: bool = False) -> Path:
    """`path` as a Path when a file can be written there: not a folder, in a folder that exists (or, with
    `make_parents`, under one that does) and that this user may write; else UsageError naming `flag`."""
    target, said = Path(path), f"labkit {command}: {flag} {path}"
    if target.is_dir():
        raise UsageError(f"{said} is a folder; pass a file's path")
    _check_folder(target.parent, said, make_parents)
    return target


def writable_folder(command: str, flag: str, path: str | os.PathLike) -> Path:
    """`path` as a Path when a folder can be written there: an existing folder, or a new one under one."""
    target, said = Path(path), f"labkit {command}: {flag} {path}"
    if target.exists() and not target.is_dir():
        raise UsageError(f"{said} is a file; pass a folder (new or existing)")
    _check_folder(target, said, make_parents=True)
    return target


def _check_folder(folder: Path, said: str, make_parents: bool) -> None:
    existing = folder
    while make_parents and not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.exists():
        raise UsageError(
            f"{said}: the folder {folder} does not exist; create it, or pass a path in one that does"
        )
    if not existing.is_dir():
        raise UsageError(f"{said}: {existing} is a file, not a folder; pass a path in a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(
            f"{said}: this user may not write in {existing}; pass a path in a folder you can write"
        )
