"""The grader: solutions get full marks, pristine exercises 0 (status graded), and hostile submissions
built from the real exercises get the status and score the contract states.

Most cases share one batch of 30 submissions graded by `labkit grade DIR --gradebook` (the expensive part:
about 20 papermill runs); the time-limit case runs alone with a short --timeout.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from labkit.cli import main
from labkit.grading import exercises, locks
from labkit.grading.checks import judge_all, load

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
# tests/test_capstone.py grades the capstone's solution and exercise with its planted mistakes, in a batch of its own
GRADED_ELSEWHERE = {"07_capstone.ipynb"}
BATCH_SOLUTIONS = [p for p in SOLUTIONS if p.name not in GRADED_ELSEWHERE]
BATCH_EXERCISES = [p for p in EXERCISES if p.name not in GRADED_ELSEWHERE]
BATCH_TIMEOUT_S = 240  # generous: 2 shared cores; the time-limit test uses a short one
LOOP_TIMEOUT_S = 20


def labkit_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "labkit", *args], capture_output=True, text=True, timeout=timeout
    )


def read(path: Path):
    return nbformat.read(path, as_version=4)


def edited(path: Path, cell_id: str, source: str, append: bool = True):
    """The notebook at `path` with cell `cell_id`'s source replaced (or extended) by `source`."""
    nb = read(path)
    cell = next(c for c in nb.cells if c.id == cell_id)
    cell.source = f"{cell.source}\n{source}" if append else source
    return nb


SOL01 = ROOT / "solutions" / "01_memory.ipynb"
EX01 = ROOT / "exercises" / "01_memory.ipynb"

FAKE_REPORT = '{"exercise": "ex01_memory", "status": "graded", "score": 6, "max_score": 6, "checks": []}'

MONKEYPATCH = """
import labkit.grading.checks as checks
import labkit.grading.feedback as feedback
import labkit.grading.report as report

checks.judge_all = lambda *a, **k: [{"name": "all", "points": 6, "max_points": 6, "passed": True, "feedback": ""}]
checks.tally = lambda cases: (1.0, "patched")
checks.close = lambda *a, **k: True
report.build = lambda *a, **k: {"score": 6}
for c in checks.load("ex01_memory").checks:
    object.__setattr__(c, "judge", lambda observation, seed: (1.0, "patched"))
feedback.check = lambda *a, **k: print("Memory arithmetic per strategy: 6/6 (patched)")


def state_bytes_per_rank(params, world_size, strategy):
    return 0.0


def min_ranks_to_fit(params, gpu_bytes, strategy):
    return -1
"""


def build_batch(folder: Path, report_dir: Path) -> dict[str, str]:
    """Write the 30 submissions; returns {file name: what it is}."""
    kinds: dict[str, str] = {}

    def put(name: str, nb, kind: str) -> None:
        nbformat.write(nb, folder / name)
        kinds[name] = kind

    def put_text(name: str, text: str | bytes, kind: str) -> None:
        (folder / name).write_bytes(text if isinstance(text, bytes) else text.encode())
        kinds[name] = kind

    for path in BATCH_SOLUTIONS:
        put(f"sol_{path.name}", read(path), "solution")
    for path in BATCH_EXERCISES:
        put(f"ex_{path.name}", read(path), "exercise")
    put("exit.ipynb", edited(SOL01, "answer-fit", "import os\nos._exit(1)"), "exit")
    put("segfault.ipynb", edited(SOL01, "answer-fit", "import ctypes\nctypes.string_at(0)"), "segfault")
    fake_print = 'print("Score: 6/6")\nprint(\'{"exercise": "ex01_memory", "status": "graded", "score": 6, "max_score": 6}\')'
    put("fake_print.ipynb", edited(EX01, "answer-fit", fake_print), "fake_print")
    fake_report = (
        f"for target in ('report.json', '01_memory.report.json', r'{report_dir / 'fake_report.report.json'}'):\n"
        f"    open(target, 'w').write('{FAKE_REPORT}')"
    )
    put("fake_report.ipynb", edited(EX01, "answer-fit", fake_report), "fake_report")
    solved = next(c.source for c in read(SOL01).cells if c.id == "answer-state")
    put("locked_edit.ipynb", edited(EX01, "setup", solved), "locked_edit")
    put("locked_edit_solution.ipynb", edited(SOL01, "check", "print('edited')"), "locked_edit_solution")
    put("monkeypatch.ipynb", edited(EX01, "answer-state", MONKEYPATCH, append=False), "monkeypatch")
    unfinished = edited(SOL01, "answer-fit", "raise RuntimeError('unfinished')", append=False)
    put("partial01.ipynb", unfinished, "partial01")
    sol06 = ROOT / "solutions" / "06_hsdp.ipynb"
    put(
        "partial06.ipynb",
        edited(sol06, "answer-cross", 'crosses_groups = {"all_gather"}', append=False),
        "partial06",
    )
    put("sys_exit.ipynb", edited(SOL01, "answer-fit", "import sys\nsys.exit(3)", append=False), "sys_exit")
    no_answer = read(SOL01)
    no_answer.cells = [c for c in no_answer.cells if c.id != "answer-fit"]
    put("missing_answer.ipynb", no_answer, "missing_answer")
    put_text("not_json.ipynb", b"\x00\xffthis is not a notebook", "unreadable")
    put_text("truncated.ipynb", json.dumps(nbformat.writes(read(SOL01)))[:200], "unreadable")
    put_text("not_a_notebook.ipynb", '{"cells": 3}', "unreadable")
    bare = read(SOL01)
    bare.metadata.pop("labkit")
    put("no_metadata.ipynb", bare, "no_metadata")
    for name, ex_id in (
        ("unknown.ipynb", "ex99_missing"),
        ("path_id.ipynb", "../../etc/passwd"),
        ("module_id.ipynb", "os"),
    ):
        nb = read(SOL01)
        nb.metadata["labkit"]["exercise"] = ex_id
        put(name, nb, "unknown")
    assert len(kinds) == 30
    return kinds


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    folder = root / "submissions"
    folder.mkdir()
    gradebook = root / "grades.csv"
    report_dir = root / "grades-reports"
    kinds = build_batch(folder, report_dir)
    start = time.monotonic()
    done = labkit_cli(
        "grade", str(folder), "--gradebook", str(gradebook), "--timeout", str(BATCH_TIMEOUT_S), "--jobs", "3"
    )
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    reports = {
        name: json.loads((report_dir / name.replace(".ipynb", ".report.json")).read_text()) for name in kinds
    }
    with open(gradebook, newline="") as f:
        rows = list(csv.DictReader(f))
    print(f"\nbatch of {len(kinds)}: {elapsed:.1f} s")
    return {"kinds": kinds, "reports": reports, "rows": rows, "stdout": done.stdout, "dir": report_dir}


def of_kind(batch, kind: str) -> dict[str, dict]:
    return {name: batch["reports"][name] for name, k in batch["kinds"].items() if k == kind}


def lock_entry(report: dict) -> dict:
    return next(c for c in report["checks"] if c["name"] == "locked cells unchanged")


def answer_checks(report: dict) -> list[dict]:
    return [c for c in report["checks"] if c["name"] != "locked cells unchanged"]


@pytest.mark.timeout(900)
def test_solutions_score_full_marks(batch):
    solutions = of_kind(batch, "solution")
    assert len(solutions) == len(BATCH_SOLUTIONS) >= 6
    for name, r in solutions.items():
        assert r["status"] == "graded", (name, r["reason"])
        assert r["max_score"] > 0 and r["score"] == r["max_score"], (name, r["checks"])
        assert all(c["passed"] for c in r["checks"]), name
        assert Path(r["executed_notebook"]).exists()


def test_pristine_exercises_score_zero_without_error(batch):
    pristine = of_kind(batch, "exercise")
    assert len(pristine) == len(BATCH_EXERCISES)
    for name, r in pristine.items():
        assert r["status"] == "graded", (name, r["reason"])
        assert r["score"] == 0 and r["max_score"] > 0
        assert not any(c["passed"] for c in answer_checks(r)), name
        assert lock_entry(r)["passed"]
        assert any("NotImplementedError" in c["feedback"] for c in answer_checks(r)), name


def test_a_dying_kernel_is_an_error_with_the_reason(batch):
    exit_report = batch["reports"]["exit.ipynb"]
    segv_report = batch["reports"]["segfault.ipynb"]
    for r in (exit_report, segv_report):
        assert r["status"] == "error" and r["score"] == 0 and r["max_score"] == 6
        assert "answer-fit" in r["reason"]
    assert "exited with status 1" in exit_report["reason"]
    assert "SIGSEGV" in segv_report["reason"]


def test_a_fake_score_or_report_earns_nothing(batch):
    for name in ("fake_print.ipynb", "fake_report.ipynb"):
        r = batch["reports"][name]
        assert r["status"] == "graded" and r["score"] == 0, name
        assert "seed" in r  # the report on disk is the grader's, written after the run
    evidence = Path(batch["reports"]["fake_print.ipynb"]["executed_notebook"]).read_text()
    assert "Score: 6/6" in evidence  # the fake score was printed, and ignored


def test_edited_locked_cells_earn_nothing_and_are_reported(batch):
    r = batch["reports"]["locked_edit.ipynb"]
    assert r["status"] == "graded" and r["score"] == 0
    assert not lock_entry(r)["passed"] and "setup" in lock_entry(r)["feedback"]
    # The edit is ignored, not punished: a solution with an edited check cell keeps its answers' points.
    r = batch["reports"]["locked_edit_solution.ipynb"]
    assert r["score"] == r["max_score"] and "check" in lock_entry(r)["feedback"]


def test_monkeypatching_the_grader_earns_nothing(batch):
    r = batch["reports"]["monkeypatch.ipynb"]
    assert r["status"] == "graded" and r["score"] == 0 and r["max_score"] == 6
    assert not any("patched" in c["feedback"] for c in r["checks"])
    assert "6/6 (patched)" in Path(r["executed_notebook"]).read_text()  # it fooled only its own kernel


def test_partial_credit_and_answer_cells_that_raise(batch):
    r = batch["reports"]["partial01.ipynb"]
    assert (r["status"], r["score"]) == ("graded", 4)
    fit = next(c for c in r["checks"] if c["name"].startswith("fewest ranks"))
    assert "RuntimeError: unfinished" in fit["feedback"]
    assert batch["reports"]["partial06.ipynb"]["score"] == 6
    assert batch["reports"]["sys_exit.ipynb"]["score"] == 4
    missing = batch["reports"]["missing_answer.ipynb"]
    assert (
        missing["score"] == 4
        and "missing" in next(c for c in missing["checks"] if not c["passed"])["feedback"]
    )


def test_unreadable_and_unknown_submissions_get_a_clear_status(batch):
    for name, r in of_kind(batch, "unreadable").items():
        assert (r["status"], r["exercise"], r["score"]) == ("error", None, 0), name
        assert r["reason"].startswith("not a readable notebook"), name
    assert "metadata.labkit.exercise" in batch["reports"]["no_metadata.ipynb"]["reason"]
    for name, r in of_kind(batch, "unknown").items():
        assert r["status"] == "error" and "unknown exercise id" in r["reason"], name
        assert "ex01_memory" in r["reason"]  # it lists the known ids


def test_the_gradebook_has_one_correct_row_per_submission(batch):
    rows = batch["rows"]
    assert [row["file"] for row in rows] == sorted(batch["kinds"])
    assert list(rows[0]) == ["file", "exercise", "status", "score", "max", "runtime"]
    for row in rows:
        r = batch["reports"][row["file"]]
        assert row["status"] == r["status"] and row["exercise"] == (r["exercise"] or "")
        assert float(row["score"]) == r["score"] and float(row["max"]) == r["max_score"]
        assert float(row["runtime"]) == pytest.approx(r["runtime_s"], abs=0.01)
    progress = [line for line in batch["stdout"].splitlines() if line.startswith("[")]
    assert len(progress) == 30 and progress[-1].startswith("[30/30]")


def test_grading_takes_seconds_beyond_the_notebook_run(batch):
    for name in ("sol_01_memory.ipynb", "sol_06_hsdp.ipynb", "sol_02_shard_gather.ipynb"):
        r = batch["reports"][name]
        beyond = r["runtime_s"] - r["timings_s"]["notebook"]
        print(f"{name}: notebook {r['timings_s']['notebook']:.1f} s, answers + judge {beyond:.1f} s")
        assert beyond < 20, (name, r["timings_s"])


@pytest.mark.timeout(300)
def test_an_infinite_loop_times_out_and_is_killed(tmp_path):
    pid_file = tmp_path / "kernel.pid"
    loop = f"import os\nopen(r'{pid_file}', 'w').write(str(os.getpid()))\nwhile True:\n    pass"
    submission = tmp_path / "loop.ipynb"
    nbformat.write(edited(SOL01, "answer-fit", loop), submission)
    out = tmp_path / "out" / "loop.json"
    start = time.monotonic()
    done = labkit_cli("grade", str(submission), "--out", str(out), "--timeout", str(LOOP_TIMEOUT_S))
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    r = json.loads(out.read_text())
    assert (r["status"], r["score"], r["max_score"]) == ("timeout", 0, 6)
    assert "answer-fit" in r["reason"] and r["runtime_s"] < LOOP_TIMEOUT_S + 5
    assert elapsed < LOOP_TIMEOUT_S + 40  # no hang: the CLI's start-up (seconds on a loaded machine) included
    assert (tmp_path / "out" / "loop.executed.ipynb").exists()
    pid = int(pid_file.read_text())
    status = Path(f"/proc/{pid}/status")
    assert not status.exists() or "zombie" in status.read_text()  # the kernel (its own session) is gone


@pytest.mark.parametrize(
    "args, says",
    [
        (["missing.ipynb"], "does not exist"),
        (["{dir}"], "--gradebook"),
        (["{file}", "--gradebook", "g.csv"], "--gradebook is for a folder"),
        (["{dir}", "--gradebook", "g.csv", "--out", "r.json"], "--out is for one submission"),
        (["{file}", "--timeout", "0"], "--timeout"),
        (["{file}", "--jobs", "0"], "--jobs"),
        (["{file}", "--timeout", "soon"], "--timeout"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys, args, says):
    (tmp_path / "sub.ipynb").write_text("{}")
    args = [a.format(dir=tmp_path, file=tmp_path / "sub.ipynb") for a in args]
    assert main(["grade", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err and "Traceback" not in err


def test_exercises_and_solutions_are_twins():
    assert [p.name for p in EXERCISES] == [p.name for p in SOLUTIONS] and len(EXERCISES) >= 6
    for ex_path, sol_path in zip(EXERCISES, SOLUTIONS, strict=True):
        ex, sol = read(ex_path), read(sol_path)
        assert exercises.exercise_id(ex) == exercises.exercise_id(sol) and load(exercises.exercise_id(ex))
        assert ex.metadata.kernelspec.name == "python3"
        assert locks.verify(ex, sol).intact, sol_path  # the same locked cells, the same ids
        roles = [exercises.role(c) for c in ex.cells]
        assert roles.count("parameters") == 1 and roles.count("check") == 1 and "answer" in roles
        for nb in (ex, sol):
            for cell in nb.cells:
                if cell.cell_type == "code":
                    assert cell.outputs == [] and cell.execution_count is None, (ex_path, cell.id)
        for cell in ex.cells:
            if exercises.role(cell) == "answer":
                assert "YOUR ANSWER HERE" in cell.source and "NotImplementedError" in cell.source


def test_locks_ignore_line_endings_and_trailing_space_but_not_edits():
    assert locks.checksum("a = 1\r\nb = 2  \n") == locks.checksum("a = 1\nb = 2")
    assert locks.checksum("a = 1") != locks.checksum("a = 2")
    nb = read(EX01)
    nb.cells[2].source += "\nx = 1"
    result = locks.verify(read(EX01), nb)
    assert result.edited == [nb.cells[2].id] and not result.intact


def test_forged_or_malformed_observations_earn_nothing():
    exercise = load("ex01_memory")
    forged = {c.name: {"value": [6.0] * 6} for c in exercise.checks}
    malformed = {c.name: {"value": {"score": 6}} for c in exercise.checks}
    for observations in (forged, malformed, {"score": 6}, {}):
        entries = judge_all(exercise, observations, seed=1)
        assert sum(e["points"] for e in entries) == 0
