"""The house's shape, read from labkit's sources (issue 44): imports form no cycle, modules and functions stay
small, and each shared name is spelled in one module (`labkit.names`, `labkit.engines.registry`)."""

from __future__ import annotations

import ast
from pathlib import Path

import labkit
from labkit import names

PACKAGE = Path(labkit.__file__).parent
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 80
KINDS = set(names.RING_KINDS)
STRATEGY_NAMES = set(names.STRATEGIES)
# The modules that may spell a collective kind or a strategy name as a literal, and why.
KIND_SPELLERS = {
    "names.py": "where they are defined",
    "collectives.py": "torch's function names (all_gather, broadcast, ...) key its table of functions",
    "buildalong/checks.py": "02's build steps, named after its pieces: 'reduce_scatter' is a step, not a kind",
    "buildalong/verdicts.py": "the verdicts of 02's build steps, keyed by step ('reduce_scatter')",
}
STRATEGY_SPELLERS = {
    "names.py": "where they are defined",
    "engines/registry.py": "the ddp engine's name, which the data-parallel strategy's shares",
}


def _sources() -> dict[str, ast.Module]:
    return {
        p.relative_to(PACKAGE).as_posix(): ast.parse(p.read_text())
        for p in sorted(PACKAGE.rglob("*.py"))
        if "_course" not in p.parts
    }


def _module_name(rel: str) -> str:
    parts = ["labkit", *rel.removesuffix(".py").split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (read by type checkers, never run)."""
    return {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
        for n in ast.walk(node)
        if isinstance(n, (ast.Import, ast.ImportFrom))
    }


def _imports(rel: str, tree: ast.Module, modules: set[str]) -> set[str]:
    """The labkit modules `rel` imports anywhere (function-level imports too), each a module of `modules`."""
    me = _module_name(rel)
    package = me if rel.endswith("__init__.py") else me.rpartition(".")[0]
    skip, out = _type_checking_only(tree), set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            targets = subs + ([base] if len(subs) < len(node.names) else [])
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != me:
                out.add(t)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` (its modules in order), or [] when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        path.pop()
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_the_imports_form_no_cycle_function_level_imports_included():
    trees = _sources()
    modules = {_module_name(rel) for rel in trees}
    graph = {_module_name(rel): _imports(rel, tree, modules) for rel, tree in trees.items()}
    assert sum(map(len, graph.values())) > 300  # the walk sees the house's imports
    assert "labkit.names" in graph["labkit.budget.traffic"]  # relative and absolute both resolved
    assert not _cycle(graph), " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_no_module_over_600_lines_and_no_function_over_80():
    long_modules, long_functions = {}, {}
    for rel, tree in _sources().items():
        lines = len((PACKAGE / rel).read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            long_modules[rel] = lines
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    long_functions[f"{rel}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines (split them by job): {long_modules}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


def _literal_spellers(words: set[str]) -> dict[str, set[str]]:
    """{module: the `words` it spells as string literals}, docstrings left out."""
    found: dict[str, set[str]] = {}
    for rel, tree in _sources().items():
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in words and id(node) not in docstrings:
                found.setdefault(rel, set()).add(node.value)
    return found


def test_the_collective_kinds_and_the_strategies_are_spelled_in_labkit_names():
    kinds, strategies = _literal_spellers(KINDS), _literal_spellers(STRATEGY_NAMES)
    assert not set(kinds) - set(KIND_SPELLERS), {m: kinds[m] for m in set(kinds) - set(KIND_SPELLERS)}
    assert not set(strategies) - set(STRATEGY_SPELLERS), {
        m: strategies[m] for m in set(strategies) - set(STRATEGY_SPELLERS)
    }
    assert set(kinds) == set(KIND_SPELLERS) and set(strategies) == set(
        STRATEGY_SPELLERS
    )  # no stale exception
    assert len(KIND_SPELLERS) <= 5 and len(STRATEGY_SPELLERS) <= 3


def test_one_collectives_table_and_one_collective_type():
    tables, types = [], []
    for rel, tree in _sources().items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == "Collective":
                types.append(rel)
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(getattr(t, "id", "") == "COLLECTIVES" for t in targets):
                tables.append(rel)
    assert tables == ["collectives.py"] and types == ["collectives.py"], (tables, types)


def test_the_request_is_checked_without_torch():
    """The CLI refuses a bad request before loading torch: validation, the run's schema and the registry are
    torch-free."""
    import subprocess
    import sys

    code = (
        "import sys, labkit.engines.validation, labkit.engines.run_config, labkit.fields, labkit.names\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
