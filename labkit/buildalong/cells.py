"""The learner's pieces as notebooks 02 and 03 hold them: their `build` cells run in a fresh namespace.

In the instructor's copy the cells are filled, so this gives the pieces that pass every check (the tests
plant mistakes into copies of them); in the student release it gives whatever the learner wrote, stubs
included. The namespace holds what 02's set-up cell gives its build cells: torch, torch.distributed as
dist, `lab` (single's hyper-parameters) and `write_this_piece`, then the `build-given` cells (load, free).
"""

from __future__ import annotations

from pathlib import Path

import nbformat

from labkit.buildalong.scaffold import Pieces
from labkit.course import course_path

NOTEBOOK = "notebooks/02_zero3_from_scratch.ipynb"
# 03's build cell writes 02's two gathering moments again, with prefetch
PREFETCH_NOTEBOOK = "notebooks/03_prefetch_overlap.ipynb"
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
    import torch
    import torch.distributed as dist

    from labkit.buildalong.stubs import write_this_piece
    from labkit.engines.base import RunConfig

    ns = {"torch": torch, "dist": dist, "lab": RunConfig(), "write_this_piece": write_this_piece}
    for cell_id, source in build_cells(path).items():
        exec(compile(source, f"<02 cell {cell_id}>", "exec"), ns)  # noqa: S102 (the course's own cells)
    return ns


def prefetch_namespace(path: Path | None = None, notebook_02: Path | None = None) -> dict:
    """02's namespace (`notebook_namespace`) with notebook 03's build cells run in it after 02's: its
    before_forward and before_backward are 03's, with prefetch (the instructor's copy: filled)."""
    ns = notebook_namespace(notebook_02)
    for cell_id, source in build_cells(path or course_path(PREFETCH_NOTEBOOK)).items():
        exec(compile(source, f"<03 cell {cell_id}>", "exec"), ns)  # noqa: S102 (the course's own cells)
    return ns


def unwritten_pieces(pieces: Pieces) -> list[str]:
    """The pieces still a stub (their code calls `write_this_piece`) or missing, in `Pieces` order."""
    return [
        name
        for name, fn in vars(pieces).items()
        if fn is None or "write_this_piece" in getattr(getattr(fn, "__code__", None), "co_names", ())
    ]
