"""Fixtures shared by the notebook tests: ONE papermill run per course notebook per session.

`executed(name)` runs notebooks/<name> with papermill the first time any test asks for it (kernel `labkit`, cwd
notebooks/, a per-notebook timeout, two busy neighbours at nice 19 beside it: `labkit.neighbours`) and returns the executed copy; tests/test_notebooks.py and tests/test_claims.py
both read those copies, so a session that runs both executes each notebook once. The wall times are printed at the
end of the session (and written to `notebook_times.json` in the session's temporary folder).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import nbformat
import pytest

from labkit import KERNEL_NAME
from labkit.neighbours import busy_neighbours

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
NEIGHBOURS = 2  # busy processes at nice 19 beside every notebook run (issue 41: a class shares its nodes)
TIMEOUT_S = {"default": 420}  # per notebook, seconds (the slowest take ~2 min on a loaded 2-core laptop)

_times: dict[str, float] = {}


def _built_ops() -> dict[Path, int]:
    """{DeepSpeed op library: its modification time (ns)} in this environment's torch extensions folder."""
    from labkit import prebuild

    return {f: f.stat().st_mtime_ns for f in Path(prebuild.extensions_dir()).rglob("*.so")}


@pytest.fixture(scope="session")
def executed(tmp_path_factory, request):
    """{name: executed notebook}, each run lazily with papermill the first time a test asks for it."""
    import papermill as pm

    out_dir = tmp_path_factory.mktemp("executed")
    cache: dict[str, nbformat.NotebookNode] = {}

    def get(name: str) -> nbformat.NotebookNode:
        if name not in cache:
            start_s = time.perf_counter()
            with busy_neighbours(NEIGHBOURS, nice=19):  # a shared node: the timings must hold beside them
                pm.execute_notebook(
                    str(NOTEBOOKS / name),
                    str(out_dir / name),
                    kernel_name=KERNEL_NAME,
                    cwd=str(NOTEBOOKS),
                    progress_bar=False,
                    execution_timeout=TIMEOUT_S.get(name, TIMEOUT_S["default"]),
                )
            _times[name] = time.perf_counter() - start_s
            cache[name] = nbformat.read(out_dir / name, as_version=4)
        return cache[name]

    def report():
        if not _times:
            return
        (out_dir / "notebook_times.json").write_text(json.dumps(_times, indent=1))
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"  {name:<32} {s:6.1f} s" for name, s in _times.items()]
        lines.append(f"  {'total':<32} {sum(_times.values()):6.1f} s")
        if reporter is not None:
            reporter.write_line("\nnotebook wall times (papermill):\n" + "\n".join(lines))

    request.addfinalizer(report)
    get.out_dir = out_dir
    get.built_ops = _built_ops()  # before any notebook runs
    get.built_ops_now = _built_ops
    return get
