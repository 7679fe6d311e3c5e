"""The fast lane's marker, and the fixture shared by the notebook tests: ONE papermill run per course notebook.

`slow` marks every test of a module that starts ranks, kernels, notebooks, browsers or grading runs (SLOW_MODULES),
every test that asks for a fixture that launches (SLOW_FIXTURES: an executed notebook, the clinic's runs, the shared
grading run), and any test marked by hand; `fast` marks a test that starts no process in a module that does (it stays
in the fast lane): `make test-fast` (`pytest -m "not slow"`) runs the rest in a minute or
two, for daily work; `make test` runs everything.

`executed(name)` runs notebooks/<name> with papermill the first time any test asks for it (kernel `labkit`, cwd
notebooks/, a per-notebook timeout, two busy neighbours at nice 19 beside it: `labkit.neighbours`) and returns the
executed copy; tests/test_notebooks.py and tests/test_claims.py both read those copies, so a session that runs both
executes each notebook once. The wall times are printed at the end of the session (and written to
`notebook_times.json` in the session's temporary folder).

`student_release` is the session's one student release (`labkit release --student`), which the tests of the
release's notebooks share. `shared_grades` grades, once per session, every submission the collected modules registered with
tests/grading_batches.py (the capstone's and exercise 08's): one pair of `labkit grade` runs several modules read.
"""

from __future__ import annotations

import json
import os
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

# Modules whose tests start processes (ranks, kernels, notebooks, browsers, grading runs): seconds each.
SLOW_MODULES = {
    "test_activation_checkpointing", "test_benchmarks", "test_browser", "test_build", "test_build_deepspeed",
    "test_build_fsdp2", "test_buildalong_reveal", "test_calibrate", "test_capstone", "test_claims",
    "test_cli_outputs", "test_cluster", "test_compare_cli", "test_deepspeed", "test_doctor", "test_grading_fairness",
    "test_engines_single_ddp", "test_exercise08", "test_fsdp1", "test_fsdp2", "test_gpu_path", "test_grading",
    "test_hf", "test_instructor", "test_limits", "test_multinode", "test_notebooks", "test_packaging",
    "test_probes", "test_production", "test_real_models", "test_release", "test_setup", "test_slides_browser",
    "test_timeline", "test_zero",
}  # fmt: skip
SLOW_FIXTURES = {"executed", "clinic_run", "shared_grades"}

_times: dict[str, float] = {}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts processes; `make test-fast` leaves it out")
    config.addinivalue_line(
        "markers", "fast: starts no process, though its module does; `make test-fast` runs it"
    )


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("fast"):
            continue
        if item.module.__name__.rpartition(".")[2] in SLOW_MODULES or SLOW_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


def _built_ops() -> dict[Path, int]:
    """{DeepSpeed op library: its modification time (ns)} in this environment's torch extensions folder."""
    from labkit import prebuild

    return {f: f.stat().st_mtime_ns for f in Path(prebuild.extensions_dir()).rglob("*.so")}


@pytest.fixture(scope="session")
def shared_grades(tmp_path_factory):
    """{folder:file stem: report} of the shared grading run (`grading_batches.grade_registered`), run the
    first time a test asks for it; `grading_batches.reports_of` reads one module's part."""
    import grading_batches

    return grading_batches.grade_registered(tmp_path_factory.mktemp("shared-grades"))


@pytest.fixture(scope="session")
def student_release(tmp_path_factory) -> Path:
    """One `labkit release --student` of the session (it refuses a release whose files show an answer): read it
    as it is, or copy it before writing in it as a learner would (`tests/release_helpers.py`)."""
    from labkit.cli import main

    out = tmp_path_factory.mktemp("student")
    assert main(["release", "--student", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def executed(tmp_path_factory, request):
    """{name: executed notebook}, each run lazily with papermill the first time a test asks for it."""
    import papermill as pm

    out_dir = tmp_path_factory.mktemp("executed")
    cache: dict[str, nbformat.NotebookNode] = {}

    def get(name: str) -> nbformat.NotebookNode:
        if name not in cache:
            start_s = time.perf_counter()
            # the instructor's copy, whatever a student-copy test asking first put on the kernel's path
            pythonpath = os.environ.pop("PYTHONPATH", None)
            try:
                with busy_neighbours(NEIGHBOURS, nice=19):  # a shared node: the timings must hold beside them
                    pm.execute_notebook(
                        str(NOTEBOOKS / name),
                        str(out_dir / name),
                        kernel_name=KERNEL_NAME,
                        cwd=str(NOTEBOOKS),
                        progress_bar=False,
                        execution_timeout=TIMEOUT_S.get(name, TIMEOUT_S["default"]),
                    )
            finally:
                if pythonpath is not None:
                    os.environ["PYTHONPATH"] = pythonpath
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
