"""The integrity rule: an answer cell must not use the labkit code that implements what it asks for.

`shard_rows = labkit.zero.sharding.shard_dim0` is labkit's answer, not the student's. Each exercise lists
the dotted prefixes of that code (`RULES`, read as `Exercise.forbidden`, e.g. `labkit.zero`) and the exact
names under them it hands out on purpose (`Exercise.allowed`). The grader reads the answer cells' source (never runs it):
every import, every attribute chain and `getattr` on an imported name, and every string naming a forbidden
module, resolved through the imports of the pristine set-up cells and of the answer cells so far. A check
whose answers are defined in a cell that uses one earns no points, with a sentence saying why. The answers
process adds what source cannot show: an answer object that *is* a function of a forbidden module
(`answer_origins`), however it was reached, and forbidden code an answer cell imports or calls, whatever name
it built to reach it (`UseWatch`). The grader's own code (`labkit.grading`: its probes, its reference answers) is
forbidden in every exercise.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import importlib.util
import inspect
import os
import sys
import threading
from collections.abc import Iterable, Sequence

GRADER = "labkit.grading"  # forbidden in every exercise: its probes and its reference answers
WATCH = f"{GRADER}.integrity.UseWatch"  # what an answer cell that turns the watch's trace off uses

# Per exercise: (forbidden: dotted prefixes of the labkit code that implements what its answers must write;
# allowed: exact dotted names under them that the exercise hands the student). Here, not in the grader's
# check modules, so that the public checks of the student release apply the same rule.
RULES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "ex01_memory": (("labkit.budget",), ()),
    "ex02_shard": (("labkit.zero", "labkit.layout", "labkit.buildalong.cells"), ()),
    # The set-up cell imports dim0_rows for pack_grads.
    "ex03_reduce_scatter": (
        ("labkit.zero", "labkit.layout", "labkit.buildalong.cells"),
        ("labkit.layout.dim0_rows",),
    ),
    "ex04_prefetch": (("labkit.zero", "labkit.engines"), ()),
    "ex05_deepspeed": (("labkit.engines",), ()),
    "ex06_hsdp": (("labkit.budget", "labkit.zero"), ()),
    "ex07_capstone": (
        ("labkit.zero", "labkit.buildalong.cells", "labkit.buildalong.checks", "labkit.engines.scratch"),
        (),
    ),
    "ex08_critical_batch": (("labkit.budget", "labkit.lessons.roofline", "labkit.lessons.production"), ()),
    "ex09_diagnose": (("labkit.flight", "labkit.lessons.uneven"), ()),
}


def stated_rule(exercise_id: str) -> str:
    """The rule as the exercise's first cell tells the student, rendered from `RULES` (a test holds every
    exercise to it, so the sentence and the grade cannot drift apart)."""
    forbidden, allowed = RULES[exercise_id]
    listed = ", ".join(f"`{p}`" for p in forbidden)
    text = (
        f"Your answer cells may not use the labkit code that does what they ask ({listed}), nor the grader's "
        f"own (`{GRADER}`): the grader watches what they import and call, and a check whose answers use it "
        "earns no points."
    )
    if allowed:
        handed = ", ".join(f"`{a}`" for a in allowed)
        text += f" The set-up cell hands you {handed}: that one is yours to use."
    return text


def _rule(forbidden: Sequence[str]) -> tuple[str, ...]:
    return (*forbidden, GRADER)


def _within(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _is_forbidden(path: str, forbidden: Sequence[str], allowed: Sequence[str]) -> bool:
    if path in allowed:
        return False
    return any(_within(path, p) for p in _rule(forbidden))


def _dotted(node: ast.AST, names: dict[str, str]) -> str | None:
    """`a.b.c` (or `getattr(a, "b")`) with `a` resolved through the imports in `names`, else None."""
    parts = []
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            parts.append(node.args[1].value)
            node = node.args[0]
        else:
            break
    if isinstance(node, ast.Name) and node.id in names:
        return ".".join([names[node.id], *reversed(parts)])
    return None


def _imports(tree: ast.AST) -> dict[str, str]:
    """{local name: dotted path} of every absolute import in `tree`."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    found[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    found[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                found[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return found


def uses(
    source: str, names: dict[str, str], forbidden: Sequence[str], allowed: Sequence[str] = ()
) -> list[str]:
    """The forbidden dotted names one cell's `source` reaches; `names` (imports so far) is extended in place."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found: list[str] = []
    here = _imports(tree)
    for path in here.values():
        if _is_forbidden(path, forbidden, allowed):
            found.append(path)
    names.update(here)
    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Call)):
            child = node.value if isinstance(node, ast.Attribute) else (node.args[0] if node.args else None)
            if child is not None:
                inner.add(id(child))
    for node in ast.walk(tree):
        path = None
        if isinstance(node, (ast.Attribute, ast.Call)) and id(node) not in inner:
            path = _dotted(node, names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in names:
            path = names[node.id]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            path = next((p for p in _rule(forbidden) if p in text), None)
        if path and _is_forbidden(path, forbidden, allowed):
            found.append(path)
    return sorted(set(found))


def defined(source: str) -> set[str]:
    """Top-level names a cell binds: functions, classes, assignments and imports."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names = set(_imports(tree))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def scan(cells: Iterable[dict], forbidden: Sequence[str], allowed: Sequence[str] = ()) -> dict[str, dict]:
    """{answer cell id: {"uses": [dotted names], "defines": [names]}} for every answer cell that breaks the rule.

    `cells` are the answers process's cells in order ({"id", "role", "source"}): set-up cells only add
    their imports; answer cells are checked."""
    names: dict[str, str] = {}
    flagged = {}
    for cell in cells:
        found = uses(cell["source"], names, forbidden, allowed)
        if cell["role"] == "answer" and found:
            flagged[cell["id"]] = {"uses": found, "defines": sorted(defined(cell["source"]))}
    return flagged


_LABKIT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


@functools.cache
def module_of_file(filename: str) -> str | None:
    """`labkit.layout` for labkit's own `.../labkit/layout.py` (a code object's `co_filename`),
    else None: where a function's code comes from, whatever globals it was given to run with."""
    path = "" if filename.startswith("<") else os.path.realpath(filename)
    if not path.startswith(_LABKIT + os.sep) or not path.endswith(".py"):
        return None
    parts = os.path.relpath(path[: -len(".py")], os.path.dirname(_LABKIT)).split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def origin(obj) -> tuple[str, str] | None:
    """(module, 'module.qualname') of a function, method, class or module, or of what a functools.partial
    wraps; None for anything else (an instance, a number). A function's module is its code's file where that
    is labkit's, so labkit's code run under other globals is still labkit's."""
    obj = getattr(obj, "func", obj)  # a functools.partial of it
    obj = getattr(obj, "__func__", obj)  # a bound method
    if inspect.ismodule(obj):
        return obj.__name__, obj.__name__
    if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
        return None
    code = getattr(obj, "__code__", None)
    module = module_of_file(code.co_filename) if hasattr(code, "co_filename") else None
    module = module or getattr(obj, "__module__", None)
    if not isinstance(module, str):
        return None
    return module, f"{module}.{getattr(obj, '__qualname__', getattr(obj, '__name__', '?'))}"


def answer_origins(
    namespace: dict, names: Iterable[str], forbidden: Sequence[str], allowed: Sequence[str] = ()
) -> dict[str, str]:
    """{answer name: 'module.qualname'} for answers that are themselves labkit's forbidden functions or classes."""
    found = {}
    for name in names:
        where = origin(namespace.get(name))
        if where is not None and _is_forbidden(where[0], forbidden, ()) and where[1] not in allowed:
            found[name] = where[1]
    return found


def flags(exercise, cells: Sequence[dict], origins, uses) -> tuple[dict[str, str], list[dict]]:
    """({check name: why it earns nothing}, what was found, for a report) from the rule's three halves: the
    answer cells' source (`scan` of `cells`, {"id", "role", "source"} as graded), the forbidden code each
    answer cell imported or called as it ran (`uses`, `UseWatch.found()`) and the answers that are labkit's
    own functions (`origins`, `answer_origins`). A check loses its points when a cell that defines one of
    its answers is flagged, or one of its answers is labkit's. `exercise`: a `labkit.grading.kit.Exercise`.
    `origins` and `uses` may come from an untrusted process: anything not of their shape is ignored."""
    flagged = scan(cells, exercise.forbidden, exercise.allowed)
    sources = {c["id"]: c["source"] for c in cells if c["role"] == "answer"}
    for cell_id, paths in (uses if isinstance(uses, dict) else {}).items():
        if cell_id in sources and isinstance(paths, list) and cell_id not in flagged:
            found_uses = [p for p in paths if isinstance(p, str)]
            flagged[cell_id] = {"uses": found_uses, "defines": sorted(defined(sources[cell_id]))}
    out: dict[str, str] = {}
    found: list[dict] = []
    for cell_id, hit in flagged.items():
        found.append({"cell": cell_id, "uses": hit["uses"]})
        for check in exercise.checks:
            if set(check.answers) & set(hit["defines"]) and check.name not in out:
                out[check.name] = sentence(hit["uses"], cell_id)
    for name, path in (origins if isinstance(origins, dict) else {}).items():
        if not isinstance(path, str):
            continue
        found.append({"answer": str(name), "is": path})
        for check in exercise.checks:
            if name in check.answers and check.name not in out:
                out[check.name] = (
                    f"no points: your answer `{name}` is {path}, labkit's own implementation of what this "
                    "exercise asks you to write; write it yourself"
                )
    return out, found


def sentence(uses_: Sequence[str], cell: str) -> str:
    """The feedback of a flagged check."""
    if all(_within(u, GRADER) for u in uses_):
        return (
            f"no points: your answer cell {cell!r} uses {', '.join(uses_)}, the grader's own code (answer cells "
            "may not call or change it); write the answer yourself"
        )
    return (
        f"no points: your answer cell {cell!r} uses {', '.join(uses_)}, labkit's own implementation of what "
        "this exercise asks you to write (answer cells may not call it); write it yourself"
    )


class UseWatch:
    """Records every forbidden labkit code an answer cell imports or calls while installed, however it got
    there: a module name built at run time (`importlib.import_module("labkit." + "zero")`, `__import__`),
    `sys.modules[...]`, `getattr` with a built name, `eval` of a string. Reading the source shows none of them.

    Imports: it wraps `builtins.__import__` and `importlib.import_module` and notes a forbidden module when
    the importing frame is an answer cell's code. Calls: a trace function (`sys.settrace`, and
    `threading.settrace` for threads started later) sees each Python function begin, and notes
    `module.qualname` when the function's module is forbidden (its code's file, where that is labkit's, so
    that labkit's code run under other globals counts) and its caller is an answer cell's code; and, as a
    function an answer cell calls begins, the forbidden code among its arguments (`threading.Thread(target=
    ...)`, `executor.submit(...)`: the answer used it, whoever calls it later). An
    answer cell's code is code compiled as `<cell ID>`, or code that such code compiled and ran itself
    (`eval`, `exec`). A call through other code (the scaffold the exercise hands out, say) is not the answer
    cell's. An answer cell that turns the trace off (`sys.settrace`, `threading.settrace`) is noted as a use
    of this watch, the grader's own code, and the trace stays on. Each hit is one line `ID<TAB>name`
    appended to `log`, once per process, so the forked children that run the probes (and the ranks they
    fork) report theirs too."""

    def __init__(self, forbidden: Sequence[str], allowed: Sequence[str], cells: Iterable[str], log):
        self.forbidden, self.allowed = tuple(forbidden), tuple(allowed)
        self.frames = {f"<cell {c}>": c for c in cells}
        self.log = os.fspath(log)
        self._noted: set[tuple[str, str]] = set()
        self._saved: tuple = ()
        self._wrappers: set = set()

    def _answer_cell(self, frame) -> str | None:
        """The answer cell whose code `frame` runs, looking through code that cell compiled at run time."""
        while frame is not None:
            filename = frame.f_code.co_filename
            if filename in self.frames:
                return self.frames[filename]
            if not filename.startswith("<") or filename.startswith(("<cell ", "<frozen ")):
                return None  # a file's code, another cell's, or the import machinery: not the answer's
            frame = frame.f_back
        return None

    def _note(self, cell: str | None, paths: Iterable[str]) -> None:
        if cell is None:
            return
        hits = [
            p
            for p in paths
            if _is_forbidden(p, self.forbidden, self.allowed) and (cell, p) not in self._noted
        ]
        if hits:
            self._noted.update((cell, p) for p in hits)
            fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                os.write(fd, "".join(f"{cell}\t{p}\n" for p in hits).encode())
            finally:
                os.close(fd)

    def _on_call(self, frame, event, arg):
        """The trace function: runs as each Python function begins; returns None, so no line is traced."""
        # a global trace function only ever sees "call"; labkit's code under other globals is still labkit's
        module = module_of_file(frame.f_code.co_filename) or frame.f_globals.get("__name__")
        if isinstance(module, str) and module.startswith("labkit"):
            if frame.f_code in self._wrappers:  # the watch's own wrappers note what they see themselves
                return None
            path = f"{module}.{frame.f_code.co_qualname}"
            if _is_forbidden(path, self.forbidden, self.allowed):
                self._note(self._answer_cell(frame.f_back), [path])
        caller = frame.f_back
        if caller is not None and caller.f_code.co_filename.startswith("<"):
            self._note_handed(frame, self._answer_cell(caller))
        return None

    def _note_handed(self, frame, cell: str | None) -> None:
        """Forbidden functions, classes or modules an answer cell hands to the function `frame` begins (a
        thread's target, an executor's task, a callback): whoever calls them later, the answer used them."""
        if cell is None:
            return
        code, values = frame.f_code, frame.f_locals  # at "call", f_locals also holds the closure's cells
        named = code.co_argcount + code.co_kwonlyargcount
        handed = [values.get(name) for name in code.co_varnames[:named]]
        rest = iter(code.co_varnames[named:])
        if code.co_flags & inspect.CO_VARARGS:
            handed += list(values.get(next(rest), ()))
        if code.co_flags & inspect.CO_VARKEYWORDS:
            handed += list(values.get(next(rest), {}).values())
        found = (origin(value) for value in handed)
        self._note(cell, [where[1] for where in found if where is not None])

    def install(self) -> UseWatch:
        """Start watching (with no answer cells to watch, there is nothing to see: nothing is installed)."""
        if not self.frames:
            return self
        real_import, real_import_module = builtins.__import__, importlib.import_module
        real_settrace, real_thread_settrace = sys.settrace, threading.settrace

        def watched_import(name, globals=None, locals=None, fromlist=(), level=0):
            if not level and isinstance(name, str):
                # `from a import b` is `a.b`, as the source rule reads it
                names = [f"{name}.{f}" for f in fromlist or () if isinstance(f, str)]
                self._note(self._answer_cell(sys._getframe(1)), names or [name])
            return real_import(name, globals, locals, fromlist, level)

        def watched_import_module(name, package=None):
            if isinstance(name, str):
                absolute = importlib.util.resolve_name(name, package) if name.startswith(".") else name
                self._note(self._answer_cell(sys._getframe(1)), [absolute])
            return real_import_module(name, package)

        def guarded(real):
            def settrace(function):
                cell = self._answer_cell(sys._getframe(1))
                if cell is None:
                    return real(function)
                self._note(cell, [WATCH])  # the trace stays on

            return settrace

        traces = (sys.gettrace(), threading.gettrace())
        self._saved = (real_import, real_import_module, real_settrace, real_thread_settrace, traces)
        settrace, thread_settrace = guarded(real_settrace), guarded(real_thread_settrace)
        self._wrappers = {
            f.__code__ for f in (watched_import, watched_import_module, settrace, thread_settrace)
        }
        builtins.__import__, importlib.import_module = watched_import, watched_import_module
        sys.settrace, threading.settrace = settrace, thread_settrace
        real_thread_settrace(self._on_call)
        real_settrace(self._on_call)
        return self

    def remove(self) -> None:
        if not self._saved:
            return
        real_import, real_import_module, real_settrace, real_thread_settrace, traces = self._saved
        builtins.__import__, importlib.import_module = real_import, real_import_module
        sys.settrace, threading.settrace = real_settrace, real_thread_settrace
        real_settrace(traces[0])
        real_thread_settrace(traces[1])

    def found(self) -> dict[str, list[str]]:
        """{answer cell id: [the forbidden modules it imported and `module.qualname`s it called]} from the log."""
        hits: dict[str, set[str]] = {}
        try:
            with open(self.log) as f:
                for line in f:
                    cell, _, path = line.rstrip("\n").partition("\t")
                    if cell in self.frames.values() and path:
                        hits.setdefault(cell, set()).add(path)
        except OSError:
            pass
        return {cell: sorted(paths) for cell, paths in hits.items()}
