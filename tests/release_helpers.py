"""Shared by the tests that run the student release's notebooks (test modules import from here, never from
each other); the release itself is the session's `student_release` fixture (tests/conftest.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat

from labkit.course import course_path
from labkit.release import file_text, normalised_lines, telling


def learners_copy(release: Path, tmp_path: Path) -> Path:
    """A copy of the session's student release under `tmp_path`: the learner's own, to write in."""
    return Path(shutil.copytree(release, tmp_path / "student"))


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


def executed_text(release: Path, path: Path, monkeypatch) -> str:
    """`executed_from_release`'s printed text, joined, under the course's own per-notebook limit."""
    return "\n".join(executed_from_release(release, path, monkeypatch, timeout_s=420))


def answer_lines_shown(release: Path, notebook: str, cell) -> tuple[set[str], list[str]]:
    """(the telling lines of build cell `cell` of `notebook` that its stub does not show, each "file: line" of
    the release that shows one of them); the release's copy of the cell must be its stub."""
    theirs = {c["id"]: c for c in json.loads((release / notebook).read_text())["cells"]}
    assert "".join(theirs[cell.id]["source"]) == cell.metadata["labkit"]["stub"].rstrip("\n")
    given = set(normalised_lines(cell.metadata["labkit"]["stub"]))
    answer = {line for line in normalised_lines(cell.source) if telling(line) and line not in given}
    shown = [
        f"{path.relative_to(release)}: {line}"
        for path in sorted(p for p in release.rglob("*") if p.is_file() and ".git" not in p.parts)
        for line in answer & set(normalised_lines(file_text(path)))
    ]
    return answer, shown


def type_in_the_filled_cells(release: Path, notebook: str) -> None:
    """The learner writes every build cell of `notebook` in the release: here, the instructor's filled cells."""
    filled = {c["id"]: c["source"] for c in json.loads(course_path(notebook).read_text())["cells"]}
    path = release / notebook
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if "build" in cell["metadata"].get("tags", []):
            cell["source"] = filled[cell["id"]]
    path.write_text(json.dumps(nb))


# ------------------------------------------------------------------ similarity to labkit's own pieces
SHINGLE = 8  # tokens per shingle
KEPT_NAMES = {"torch", "dist", "math", "nn", "self"}  # names whose spelling carries the meaning


def _tokens(source: str) -> list[str]:
    """`source`'s code tokens, a local name as N (attributes, keywords and torch's modules kept): a renamed
    variable does not hide a copy."""
    import io
    import keyword
    import tokenize

    out, after_dot = [], False
    skip = {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.STRING,
    }
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type in skip or tok.type == tokenize.ENDMARKER:
                continue
            name = tok.type == tokenize.NAME and not keyword.iskeyword(tok.string)
            out.append("N" if name and not after_dot and tok.string not in KEPT_NAMES else tok.string)
            after_dot = tok.string == "."
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return []
    return out


def _shingles(source: str) -> set[tuple[str, ...]]:
    t = _tokens(source)
    return {tuple(t[i : i + SHINGLE]) for i in range(len(t) - SHINGLE + 1)}


def functions_in(source: str, where: str) -> dict[str, str]:
    """{"where: name": source} of every function (methods too) defined in `source`; {} if it does not parse."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {}
    return {
        f"{where}: {node.name}": ast.get_source_segment(source, node) or ""
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def reference_pieces() -> dict[str, str]:
    """labkit's own pieces: every function of labkit/zero/ and of the filled build cells (instructor's copy)."""
    from labkit.course import PACKAGE_DIR, course_dir

    found = {}
    for path in sorted((PACKAGE_DIR / "zero").glob("*.py")):
        found |= functions_in(path.read_text(), f"labkit/zero/{path.name}")
    for path in sorted((course_dir() / "notebooks").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if "build" in cell.get("metadata", {}).get("tags", []):
                found |= functions_in(cell.source, f"{path.name} {cell.id}")
    return found


def release_functions(release: Path) -> dict[str, str]:
    """Every function the release holds: in its .py files and in its notebooks' code cells."""
    found = {}
    for path in sorted(p for p in release.rglob("*") if p.is_file() and ".git" not in p.parts):
        name = path.relative_to(release).as_posix()
        if path.suffix == ".py":
            found |= functions_in(path.read_text(), name)
        elif path.suffix == ".ipynb":
            for cell in nbformat.read(path, as_version=4).cells:
                if cell.cell_type == "code":
                    found |= functions_in(cell.source, f"{name} {cell.get('id')}")
    return found


def most_similar(release: Path, min_tokens: int = 40) -> list[tuple[float, str, str]]:
    """For each reference piece of at least `min_tokens` tokens, the release function that holds the largest
    share of its shingles: (share, piece, release function), largest first."""
    found = [(_shingles(src), where) for where, src in release_functions(release).items()]
    out = []
    for piece, src in reference_pieces().items():
        mine = _shingles(src)
        if len(mine) + SHINGLE - 1 < min_tokens:
            continue
        share, where = max(((len(mine & theirs) / len(mine), w) for theirs, w in found), default=(0.0, ""))
        out.append((share, piece, where))
    return sorted(out, reverse=True)
