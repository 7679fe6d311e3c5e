"""What `check()` judges inside the student's kernel: the cells the grade would run, rebuilt from the kernel's
own input history (IPython's `In`), so that `check()` and `labkit grade` judge the same code.

The grade runs the pristine exercise's parameters and set-up cells, then the submission's answer cells, in a
fresh process (`exercises.graded_cells`). Here each answer cell is the latest input the kernel ran that
defines what the pristine answer cell defines. A cell the student added, or a locked cell they edited, is
never run by the grade: `Rebuilt.warnings` says so when an answer uses a name only such a cell defines, and
names each locked cell that ran edited.
"""

from __future__ import annotations

import ast
import builtins
import difflib
from dataclasses import dataclass, field

from labkit.grading.exercises import ANSWER, CHECK, GRADED_ROLES, role, source
from labkit.grading.locks import cell_label

EDITED_SIMILARITY = (
    0.6  # an input this close to a locked cell (difflib's ratio), but not equal, is that cell edited
)


@dataclass
class Rebuilt:
    """The cells the grade would run ([{"id", "role", "source"}], pristine order), the answer cells this
    kernel never ran (ids), and the sentences to show the student."""

    cells: list[dict]
    missing: list[str]
    warnings: list[str] = field(default_factory=list)


def defined_names(text: str) -> set[str]:
    """Names a cell defines at its top level (functions, classes, assignments, imports); none if it does not parse."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return set()
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def free_names(text: str) -> set[str]:
    """The names a cell reads, at any depth, that it binds nowhere (not as an argument, a local, a loop or
    comprehension variable, an import or a definition): what it needs from outside."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return set()
    read, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return read - bound


def rebuild(pristine, history: list[str], kernel_names: set[str], answer_names: set[str]) -> Rebuilt:
    """The graded cells from `history` (the kernel's inputs, oldest first), with what to warn about.

    `kernel_names`: the names the kernel holds now, to tell a name defined by a cell the grade skips from a
    typo (which the probe's own error reports). `answer_names`: what the exercise's checks call; a pristine
    answer cell that defines nothing yet (a bare `raise`) stands for those no other answer cell defines."""
    inputs = [text for text in history if isinstance(text, str) and text.strip()]
    answers = [c for c in pristine.cells if role(c) == ANSWER]
    stubbed = set().union(*(defined_names(source(c)) for c in answers))
    cells, missing = [], []
    for cell in pristine.cells:
        kind = role(cell)
        if kind not in GRADED_ROLES:
            continue
        text = source(cell)
        if kind == ANSWER:
            wanted = defined_names(text) or (answer_names - stubbed)
            text = next((h for h in reversed(inputs) if wanted & defined_names(h)), None)
            if text is None:
                missing.append(cell.id)
                continue
        cells.append({"id": cell.id, "role": kind, "source": text})
    warnings = _outside_names(cells, kernel_names) + _edited_locked_cells(pristine, inputs, cells)
    return Rebuilt(cells, missing, warnings)


def _outside_names(cells: list[dict], kernel_names: set[str]) -> list[str]:
    graded = set().union(*(defined_names(c["source"]) for c in cells)) | set(dir(builtins))
    used = set().union(*(free_names(c["source"]) for c in cells if c["role"] == ANSWER))
    outside = sorted(n for n in used - graded if n in kernel_names and not n.startswith("_"))
    return [
        f"your answer uses `{name}`, which only a cell outside the answer cells defines: the grade runs the "
        "set-up and the answer cells alone, so define it inside the answer cell"
        for name in outside
    ]


def _edited_locked_cells(pristine, inputs: list[str], cells: list[dict]) -> list[str]:
    graded = {c["source"].strip() for c in cells}
    locked = [c for c in pristine.cells if c.get("cell_type") == "code" and role(c) not in (ANSWER, CHECK)]
    originals = {source(c).strip() for c in locked}
    said, out = set(), []
    for text in inputs:
        if text.strip() in originals or text.strip() in graded:
            continue
        ratio, cell = max(
            ((difflib.SequenceMatcher(None, text, source(c)).ratio(), c) for c in locked),
            key=lambda pair: pair[0],
            default=(0.0, None),
        )
        if cell is not None and ratio >= EDITED_SIMILARITY and cell.id not in said:
            said.add(cell.id)
            out.append(
                f"{cell_label(pristine, cell.id)} ran edited: the grade runs the original, not your edit"
            )
    return out


def run_cells(cells: list[dict]) -> tuple[dict, list[str]]:
    """Run `cells` in a fresh namespace, as the grade's answers process does: (the namespace, one sentence
    per cell that raised)."""
    namespace: dict = {"__name__": "__main__"}
    errors = []
    for cell in cells:
        try:
            exec(compile(cell["source"], f"<cell {cell['id']}>", "exec"), namespace)  # noqa: S102
        except Exception as e:  # noqa: BLE001 (a broken answer cell only loses its checks' points)
            errors.append(f"cell {cell['id']!r} raised {type(e).__name__}: {e}")
    return namespace, errors
