"""The learner's pieces as notebooks 02 and 03 hold them: their `build` cells run in a fresh namespace; and
`reset(piece)`, which puts a build cell back to its stub (`metadata.labkit.stub`) in the open notebook.

In the instructor's copy the cells are filled, so this gives the pieces that pass every check (the tests
plant mistakes into copies of them); in the student release it gives whatever the learner wrote, stubs
included. The namespace holds what 02's set-up cell gives its build cells: torch, torch.distributed as
dist, `lab` (single's hyper-parameters) and `write_this_piece`, then the `build-given` cells (load, free).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat

from labkit.buildalong.scaffold import Pieces
from labkit.course import course_path

NOTEBOOK = "notebooks/02_zero3_from_scratch.ipynb"
# 03's build cell writes 02's two gathering moments again, with prefetch
PREFETCH_NOTEBOOK = "notebooks/03_prefetch_overlap.ipynb"
OFFLOAD_NOTEBOOK = "notebooks/04_offload.ipynb"  # 04's build cell writes 02's make_optimizer again, offloaded
BUILD, GIVEN = "build", "build-given"


def build_cells(path: Path | None = None) -> dict[str, str]:
    """{cell id: source} of the notebook's `build-given` and `build` cells, in notebook order."""
    nb = nbformat.read(path or course_path(NOTEBOOK), as_version=4)
    return {c.id: c.source for c in nb.cells if {BUILD, GIVEN} & set(c.get("metadata", {}).get("tags", []))}


def pieces_from_notebook(path: Path | None = None) -> Pieces:
    """The `Pieces` that notebook 02's build cells define (its filled cells in the instructor's copy)."""
    ns = notebook_namespace(path)
    return Pieces(**{name: ns.get(name) for name in Pieces.__dataclass_fields__})


def notebook_namespace(path: Path | None = None) -> dict:
    """The namespace notebook 02's given and build cells leave: the pieces, `load`, `free`, `lab`."""
    return namespace_of(path or course_path(NOTEBOOK))


def prefetch_namespace(path: Path | None = None, notebook_02: Path | None = None) -> dict:
    """02's namespace (`notebook_namespace`) with notebook 03's build cells run in it after 02's: its
    before_forward and before_backward are 03's, with prefetch (the instructor's copy: filled)."""
    return namespace_of(notebook_02 or course_path(NOTEBOOK), path or course_path(PREFETCH_NOTEBOOK))


def namespace_of(*paths: Path) -> dict:
    """The namespace the given and build cells of `paths` leave, run in that order in one namespace that starts
    as 02's set-up cell gives its build cells (torch, dist, `lab`, `write_this_piece`)."""
    import torch
    import torch.distributed as dist

    from labkit.buildalong.stubs import write_this_piece
    from labkit.engines.base import RunConfig

    ns = {"torch": torch, "dist": dist, "lab": RunConfig(), "write_this_piece": write_this_piece}
    for path in paths:
        for cell_id, source in build_cells(path).items():
            exec(compile(source, f"<{path.name[:2]} cell {cell_id}>", "exec"), ns)  # noqa: S102 (the course's cells)
    return ns


def stubbed(path: Path, ns: dict) -> list[str]:
    """The functions `path`'s build cells define that are still stubs in `ns` (their code calls
    `write_this_piece`), in the order the cells define them."""
    names = [name for source in build_cells(path).values() for name in _DEFINES.findall(source)]
    return [name for name in dict.fromkeys(names) if _is_stub(ns.get(name))]


def _is_stub(fn) -> bool:
    return fn is None or "write_this_piece" in getattr(getattr(fn, "__code__", None), "co_names", ())


def unwritten_pieces(pieces: Pieces) -> list[str]:
    """The pieces still a stub (their code calls `write_this_piece`) or missing, in `Pieces` order."""
    return [name for name, fn in vars(pieces).items() if _is_stub(fn)]


_DEFINES = re.compile(r"^def (\w+)\(", re.M)
SESSION_ENV = "JPY_SESSION_NAME"  # the open notebook's path, which Jupyter's server gives its kernel


def build_stubs(notebooks_dir: Path | None = None) -> list[tuple[str, list[str], str]]:
    """(notebook name, the functions its stub defines, the stub) of every `build` cell of the course's
    notebooks, in course order; the stubs are what the student release puts in those cells."""
    folder = notebooks_dir or course_path("notebooks")
    found = []
    for path in sorted(folder.glob("[0-9][0-9]_*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            stub = cell.get("metadata", {}).get("labkit", {}).get("stub")
            if BUILD in cell.get("metadata", {}).get("tags", []) and stub:
                found.append((path.name, _DEFINES.findall(stub), stub.rstrip("\n")))
    return found


def stub_of(
    piece: str, notebook: str | None = None, open_notebook: str = "", notebooks_dir: Path | None = None
) -> str:
    """The stub of the build cell that defines `piece`; `notebook` (its name, or its number: "03") or else the
    notebook open in Jupyter (`open_notebook`, a path) picks one where two define it (02's and 03's
    `before_forward`). ValueError, one sentence, when none or several do."""
    cells = build_stubs(notebooks_dir)
    named = [(nb, stub) for nb, defined, stub in cells if piece in defined]
    if notebook:
        named = [(nb, stub) for nb, stub in named if nb.startswith(Path(notebook).name[:2])]
    opened = [(nb, stub) for nb, stub in named if nb == Path(open_notebook).name]
    named = opened if len(named) > 1 and opened else named
    if len(named) == 1:
        return named[0][1]
    if not named:
        pieces = ", ".join(dict.fromkeys(f for _, defined, _ in cells for f in defined))
        where = f" in notebook {notebook}" if notebook else ""
        raise ValueError(f"no build cell defines {piece!r}{where}; the pieces are {pieces}")
    numbers = " or ".join(f'"{nb[:2]}"' for nb, _ in named)
    raise ValueError(f"{piece!r} is a build cell of more than one notebook: pass notebook={numbers}")


def reset(piece: str, notebook: str | None = None) -> None:
    """Put the build cell that defines `piece` back to its stub: typed into that cell and run, it replaces the
    cell's text with the stub, as `%load` does (Jupyter, VS Code); with no notebook front end it prints the stub
    to paste there. Where two notebooks define `piece`, `notebook` or the open one picks."""
    stub = stub_of(piece, notebook, os.environ.get(SESSION_ENV, ""))
    try:
        from IPython import get_ipython
    except ImportError:
        get_ipython = None
    shell = get_ipython() if get_ipython is not None else None
    if shell is not None and hasattr(shell, "set_next_input"):
        shell.set_next_input(stub, replace=True)
        print(
            f"This cell now holds the stub of `{piece}` again: run it, so that your old `{piece}` is replaced by "
            "the stub, then write the piece."
        )
    else:
        print(
            f"{stub}\n\n(the stub of `{piece}`: paste it over your build cell, run it, then write the piece)"
        )
