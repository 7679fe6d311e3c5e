"""Shared by the tests that run the student release's notebooks (test modules import from here, never from
each other)."""

from __future__ import annotations

from pathlib import Path

import nbformat


def executed_from_release(release: Path, path: Path, monkeypatch, timeout_s: int = 300) -> list[str]:
    """Run `path` with papermill, the kernel importing the release's labkit; each code cell's printed text."""
    import papermill as pm

    monkeypatch.setenv("PYTHONPATH", str(release))
    out = path.with_suffix(".executed.ipynb")
    pm.execute_notebook(
        str(path),
        str(out),
        kernel_name="labkit",
        cwd=str(path.parent),
        progress_bar=False,
        execution_timeout=timeout_s,
    )
    cells = nbformat.read(out, as_version=4).cells
    return ["".join(o.get("text", "") for o in c.outputs) for c in cells if c.cell_type == "code"]
