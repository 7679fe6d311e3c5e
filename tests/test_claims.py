"""docs/claims.md: one row per fact-sheet claim, each pointing at a notebook cell whose output shows it.

The table's rows are parsed here; every cell reference must name a cell of the committed notebook, and against
the executed notebooks (the `executed` fixture of tests/conftest.py: the same papermill run tests/test_notebooks.py
reads, once per notebook per session) the cell's output must match the row's pattern — or, for a `stated` row's
markdown cell, its text. The README's own figures are held to the committed benchmark results they quote.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import nbformat
import pytest
from prose import TYPED_FIGURE

ROOT = Path(__file__).resolve().parents[1]
CLAIMS = ROOT / "docs" / "claims.md"
FACT_SHEET = ROOT.parent / "shared" / "reference" / "claims.md"
NOTEBOOKS = ROOT / "notebooks"
STATUSES = ("measured", "computed", "inspected", "stated", "not shown")
N_CLAIMS = 26


class Ref(NamedTuple):
    claim: int
    notebook: str
    cell_id: str
    pattern: str


class Row(NamedTuple):
    claim: int
    statuses: tuple[str, ...]
    refs: tuple[Ref, ...]
    how: str


def _cells(text: str) -> list[str]:
    """A markdown table row's cells, split on unescaped pipes, `\\|` read back as `|`."""
    parts = re.split(r"(?<!\\)\|", text.strip())[1:-1]
    return [p.strip().replace("\\|", "|") for p in parts]


def _ticked(cell: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"`([^`]+)`", cell)]


def parse(text: str) -> list[Row]:
    """The claims table: `| # | claim | status | cell | output shows | how |`, one row per claim."""
    rows = []
    for line in text.splitlines():
        if not re.match(r"^\|\s*\d+\s*\|", line):
            continue
        number, _claim, status, cell, shows, how = _cells(line)
        refs, patterns = _ticked(cell), _ticked(shows)
        assert len(refs) == len(patterns), f"claim {number}: {len(refs)} cells but {len(patterns)} patterns"
        parsed = []
        for ref, pattern in zip(refs, patterns, strict=True):
            notebook, _, cell_id = ref.partition("#")
            parsed.append(Ref(int(number), notebook, cell_id, pattern))
        statuses = tuple(s.strip() for s in status.split("+"))
        rows.append(Row(int(number), statuses, tuple(parsed), how))
    return rows


ROWS = parse(CLAIMS.read_text())
REFS = [ref for row in ROWS for ref in row.refs]


def _cell(nb: nbformat.NotebookNode, cell_id: str) -> nbformat.NotebookNode | None:
    return next((c for c in nb.cells if c.get("id") == cell_id), None)


def cell_text(cell: nbformat.NotebookNode) -> str:
    """What a learner sees of a cell: a markdown cell's text; a code cell's streams, plain text and HTML."""
    if cell.cell_type == "markdown":
        return cell.source
    out = []
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            out.append(o.text)
        elif o.output_type in ("execute_result", "display_data"):
            data = o.get("data", {})
            out += [data.get("text/plain", ""), data.get("text/html", ""), data.get("text/markdown", "")]
        elif o.output_type == "error":
            out.append(f"{o.ename}: {o.evalue}")
    return "\n".join(out)


def test_one_row_per_claim_each_with_a_status_a_cell_and_how():
    assert [r.claim for r in ROWS] == list(range(1, N_CLAIMS + 1))
    if FACT_SHEET.is_file():  # the fact sheet beside the project, where the checkout has it
        numbered = re.findall(r"^(\d+)\. ", FACT_SHEET.read_text(), re.M)
        assert len(numbered) == len(ROWS), f"the fact sheet has {len(numbered)} claims, the table {len(ROWS)}"
    for row in ROWS:
        unknown = [s for s in row.statuses if s not in STATUSES]
        assert not unknown, f"claim {row.claim}: status {unknown} is not one of {STATUSES}"
        assert row.refs or row.statuses == ("not shown",), f"claim {row.claim} names no cell"
        assert row.how and "\n" not in row.how, f"claim {row.claim}: one line of how"


@pytest.mark.parametrize("ref", REFS, ids=[f"{r.claim}-{r.notebook[:2]}-{r.cell_id}" for r in REFS])
def test_each_reference_names_a_cell_of_the_committed_notebook(ref):
    path = NOTEBOOKS / ref.notebook
    assert path.is_file(), f"claim {ref.claim}: no notebook {ref.notebook}"
    cell = _cell(nbformat.read(path, as_version=4), ref.cell_id)
    assert cell is not None, f"claim {ref.claim}: {ref.notebook} has no cell {ref.cell_id}"
    re.compile(ref.pattern)
    stated = "stated" in next(r for r in ROWS if r.claim == ref.claim).statuses
    if cell.cell_type == "markdown":
        assert stated, (
            f"claim {ref.claim}: {ref.notebook}#{ref.cell_id} is prose; only a `stated` part may cite it"
        )
        assert re.search(ref.pattern, cell.source, re.M), f"claim {ref.claim}: the cell does not say it"


@pytest.mark.parametrize("name", sorted({r.notebook for r in REFS}))
def test_each_cited_cell_shows_its_claim_in_the_executed_notebook(executed, name):
    nb = executed(name)
    missing = []
    for ref in (r for r in REFS if r.notebook == name):
        cell = _cell(nb, ref.cell_id)
        assert cell is not None, f"claim {ref.claim}: the executed {name} has no cell {ref.cell_id}"
        if not re.search(ref.pattern, cell_text(cell), re.M):
            missing.append(f"claim {ref.claim}: {ref.cell_id} does not show /{ref.pattern}/")
    assert not missing, "\n".join(missing)


def test_the_readme_types_only_figures_quoted_from_the_benchmark_results():
    """The README's figures with a unit (the notebooks' and cheat sheets' are scanned in test_notebooks.py) are
    quotes of a committed benchmarks/results*.md, which says when and where a run measured them: each is in
    its prose as written, or its number is a cell of its tables."""
    text = "\n".join(p.read_text() for p in sorted((ROOT / "benchmarks").glob("results*.md")))
    prose = " ".join(text.split())
    cells = {
        c.strip() for line in text.splitlines() if line.startswith("|") for c in line.strip("|").split("|")
    }
    typed = [m.group(0) for m in TYPED_FIGURE.finditer((ROOT / "README.md").read_text())]
    assert typed, "the scan finds the README's quoted benchmark figures"
    unquoted = [f for f in typed if f not in prose and re.match(r"\d(?:[\d,.]*\d)?", f).group(0) not in cells]
    assert not unquoted, (
        f"README figures no benchmarks/results*.md holds (quote the file, or say it in words): {unquoted}"
    )
