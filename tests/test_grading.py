"""The grader: solutions get full marks, pristine exercises 0 (status graded), and hostile submissions
built from the real exercises get the status and score the contract states.

Most cases share one batch of 34 submissions graded by `labkit grade DIR --gradebook` with a roster, a
deadline, a class seed and a memory limit (the expensive part: about 25 papermill runs). Two side runs start
before it and run beside it: a submission whose gather hangs (short limits) and a hostile one (a memory bomb,
a fork bomb, a socket to this machine, another student's file) under --memory-limit and the sandbox. The
rest are unit tests of the pieces, on planted answers, in this process.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import nbformat
import pytest
from grading_batches import (
    answer_checks,
    assert_check_and_grade_agree,
    labkit_cli,
    lock_entry,
    plant,
    read,
    run_cells,
)

from labkit import KERNEL_NAME
from labkit.cli import main
from labkit.grading import exercises, extract, grader, integrity, locks, ranks, report, sandbox
from labkit.grading.kit import Check, judge_all, load, probe_one, submission_seed

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
# test_capstone.py and test_exercise08.py grade these with their planted mistakes, in the shared run of grading_batches.py
GRADED_ELSEWHERE = {
    "07_capstone.ipynb",
    "08_critical_batch.ipynb",
    "09_diagnose.ipynb",
}  # tests/test_capstone.py, test_exercise08.py, test_exercise09.py
BATCH_SOLUTIONS = [p for p in SOLUTIONS if p.name not in GRADED_ELSEWHERE]
BATCH_EXERCISES = [p for p in EXERCISES if p.name not in GRADED_ELSEWHERE]
BATCH_TIMEOUT_S = 240  # generous: 2 shared cores; the time-limit test uses a short one
BATCH_SEED = 11
BATCH_MEMORY = "4G"  # every notebook of the course grades inside it
HANG_TIMEOUT_S, HANG_CHECK_S = 30, 25  # the hanging submission's notebook run and check limits
DEADLINE = "2020-01-02T00:00:00Z"
ON_TIME, LATE = 1577836800, 1577966400  # 2020-01-01 00:00 and 2020-01-02 12:00 UTC (file modification times)


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
import labkit.grading.kit as kit
import labkit.grading.feedback as feedback
import labkit.grading.report as report

kit.judge_all = lambda *a, **k: [{"name": "all", "points": 6, "max_points": 6, "passed": True, "feedback": ""}]
kit.tally = lambda cases: (1.0, "patched")
kit.close = lambda *a, **k: True
report.build = lambda *a, **k: {"score": 6}
for c in kit.load("ex01_memory").checks:
    object.__setattr__(c, "judge", lambda observation, seed: (1.0, "patched"))
feedback.check = lambda *a, **k: print("Memory arithmetic per strategy: 6/6 (patched)")


def state_bytes_per_rank(params, world_size, strategy):
    return 0.0


def min_ranks_to_fit(params, gpu_bytes, strategy):
    return -1
"""


SOL02 = ROOT / "solutions" / "02_shard_gather.ipynb"
SOL03 = ROOT / "solutions" / "03_reduce_scatter.ipynb"
WRONG_PADDING = """def shard_rows(full, rank, world_size):
    rows = full.shape[0] // world_size + 1  # wrong: ceil(d0 / n) is not d0 // n + 1 when n divides d0
    shard = full.new_zeros((rows, *full.shape[1:]))
    real = full[rank * rows : (rank + 1) * rows]
    shard[: real.shape[0]] = real
    return shard
"""
LIBRARY_SHARD = "shard_rows = labkit.zero.sharding.shard_dim0"
SKIPPING_GATHER = """def gather_full(shard, d0, world_size):
    if dist.get_rank() == 0:  # rank 0 skips the collective the others wait in
        return torch.zeros(d0, *shard.shape[1:])
    out = shard.new_empty((world_size * shard.shape[0], *shard.shape[1:]))
    dist.all_gather_into_tensor(out, shard.contiguous())
    return out[:d0]
"""


NAMED_COLLECTIVE = """from torch.distributed import reduce_scatter_single  # imported by name: still seen


def reduce_scatter_mean(flat_grad, world_size):
    chunk = -(-flat_grad.numel() // world_size)
    padded = flat_grad.new_zeros(chunk * world_size)
    padded[: flat_grad.numel()] = flat_grad.reshape(-1)
    out = flat_grad.new_empty(chunk)
    reduce_scatter_single(out, padded)
    return out / world_size
"""
RUNTIME_SHARD = """import importlib


def shard_rows(full, rank, world_size):  # labkit's own, by a module name built at run time
    return importlib.import_module("labkit." + "zero.sharding").shard_dim0(full, rank, world_size)
"""

HIDDEN_SHARD = """import importlib


def shard_rows(full, rank, world_size):  # labkit's own, through an import function no watch wraps
    module = importlib.__import__("labkit." + "zero.sharding", fromlist=["shard_" + "dim0"])
    return getattr(module, "shard_" + "dim0")(full, rank, world_size)
"""


def wrong_padding_shard(full, rank: int, world_size: int):
    rows = full.shape[0] // world_size + 1
    shard = full.new_zeros((rows, *full.shape[1:]))
    real = full[rank * rows : (rank + 1) * rows]
    shard[: real.shape[0]] = real
    return shard


def build_batch(folder: Path, report_dir: Path) -> dict[str, str]:
    """Write the 34 submissions; returns {file name: what it is}."""
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
    put("padding02.ipynb", edited(SOL02, "answer-shard", WRONG_PADDING, append=False), "padding02")
    library = edited(SOL02, "answer-shard", RUNTIME_SHARD, append=False)
    next(c for c in library.cells if c.id == "answer-gather").source = SKIPPING_GATHER
    put("library_skip02.ipynb", library, "library_skip02")
    put("by_name03.ipynb", edited(SOL03, "answer-flat", NAMED_COLLECTIVE, append=False), "by_name03")
    put("hidden_call02.ipynb", edited(SOL02, "answer-shard", HIDDEN_SHARD, append=False), "hidden_call02")
    assert len(kinds) == 34
    for name in kinds:
        stamp = LATE if name == "padding02.ipynb" else ON_TIME
        os.utime(folder / name, (stamp, stamp))
    return kinds


HANGING_GATHER = """import os, sys, time

if "ipykernel" in sys.modules:  # the notebook's kernel, not the grader's answers process
    open(PID_FILE, "w").write(str(os.getpid()))


def gather_full(shard, d0, world_size):
    while True:  # waits forever, as a rank stuck on a collective its peers never call
        time.sleep(0.05)
"""
HOSTILE_STATE = """import os, socket, time

REPLICATED_AND_SHARDED_BYTES = {{"ddp": (16, 0), "zero1": (4, 12), "zero2": (2, 14), "zero3": (0, 16)}}


def state_bytes_per_rank(params, world_size, strategy):
    if strategy == "ddp":  # a memory bomb: 256 MB at a time, every page written, up to 6 GB
        chunks = []
        for _ in range(24):
            chunk = bytearray(256 << 20)
            chunk[::4096] = b"x" * len(range(0, 256 << 20, 4096))
            chunks.append(chunk)
    if strategy == "zero1":  # a fork bomb, bounded: 400 sleeping children
        for _ in range(400):
            if os.fork() == 0:
                time.sleep(60)
                os._exit(0)
    if strategy == "zero2":  # a server on the grading machine
        socket.create_connection(("127.0.0.1", {port}), timeout=3).sendall(b"stolen")
    if strategy == "zero3":  # another student's submission, and the gradebook's reports
        raise RuntimeError("read " + open({other!r}).read() + str(os.listdir({reports!r})))
    replicated, sharded = REPLICATED_AND_SHARDED_BYTES[strategy]
    return params * (replicated + sharded / world_size)
"""
HOSTILE_MEMORY, HOSTILE_PROCESSES = "1G", 128


@pytest.fixture(scope="module")
def side_runs(tmp_path_factory):
    """Start the hanging and the hostile submission's grades (each `labkit grade` alone); wait in `finish`."""
    root = tmp_path_factory.mktemp("side")
    hang = root / "hang.ipynb"
    pid_file = root / "kernel.pid"
    nbformat.write(
        edited(SOL02, "answer-gather", f"PID_FILE = r'{pid_file}'\n" + HANGING_GATHER, append=False), hang
    )
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    received: list[bytes] = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            received.append(conn.recv(100) or b"(connected)")

    threading.Thread(target=serve, daemon=True).start()
    folder = root / "class"
    folder.mkdir()
    (folder / "bob.ipynb").write_text("bob's own work")
    hostile_source = HOSTILE_STATE.format(
        port=server.getsockname()[1], other=str(folder / "bob.ipynb"), reports=str(root)
    )
    nbformat.write(edited(SOL01, "answer-state", hostile_source, append=False), folder / "mallory.ipynb")
    started = time.monotonic()
    cmds = {
        "hang": [
            "grade",
            str(hang),
            "--out",
            str(root / "hang.report.json"),
            "--timeout",
            str(HANG_TIMEOUT_S),
            "--check-timeout",
            str(HANG_CHECK_S),
            "--sandbox",
            "none",
        ],
        "hostile": [
            "grade",
            str(folder / "mallory.ipynb"),
            "--out",
            str(root / "reports" / "mallory.report.json"),
            "--memory-limit",
            HOSTILE_MEMORY,
            "--max-processes",
            str(HOSTILE_PROCESSES),
        ],
    }
    procs = {
        k: subprocess.Popen(
            [sys.executable, "-m", "labkit", *a], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for k, a in cmds.items()
    }
    results: dict = {}

    def finish(name: str) -> dict:
        if name not in results:
            out, err = procs[name].communicate(timeout=600)
            assert procs[name].returncode == 0, err
            target = cmds[name][cmds[name].index("--out") + 1]
            results[name] = {
                "report": json.loads(Path(target).read_text()),
                "stdout": out,
                "elapsed_s": time.monotonic() - started,
            }
        return results[name]

    yield {"finish": finish, "pid_file": pid_file, "received": received}
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
    server.close()


@pytest.fixture(scope="module")
def batch(tmp_path_factory, side_runs):
    root = tmp_path_factory.mktemp("batch")
    folder = root / "submissions"
    folder.mkdir()
    gradebook = root / "grades.csv"
    report_dir = root / "grades-reports"
    kinds = build_batch(folder, report_dir)
    roster = root / "roster.csv"
    students = [name.removesuffix(".ipynb") for name in kinds if name != "unknown.ipynb"] + ["zoe"]
    roster.write_text("student,name\n" + "".join(f"{s},Student {s}\n" for s in students))
    canvas = root / "canvas.csv"
    start = time.monotonic()
    done = labkit_cli(
        "grade",
        str(folder),
        "--gradebook",
        str(gradebook),
        "--timeout",
        str(BATCH_TIMEOUT_S),
        "--jobs",
        "3",
        "--seed",
        str(BATCH_SEED),
        "--roster",
        str(roster),
        "--deadline",
        DEADLINE,
        "--canvas",
        str(canvas),
        "--memory-limit",
        BATCH_MEMORY,
    )
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    reports = {
        name: json.loads((report_dir / name.replace(".ipynb", ".report.json")).read_text()) for name in kinds
    }
    with open(gradebook, newline="") as f:
        rows = list(csv.DictReader(f))
    print(f"\nbatch of {len(kinds)}: {elapsed:.1f} s")
    return {
        "kinds": kinds,
        "reports": reports,
        "rows": rows,
        "stdout": done.stdout,
        "dir": report_dir,
        "folder": folder,
        "gradebook": gradebook,
        "canvas": canvas,
    }


def of_kind(batch, kind: str) -> dict[str, dict]:
    return {name: batch["reports"][name] for name, k in batch["kinds"].items() if k == kind}


@pytest.mark.timeout(900)
def test_solutions_score_full_marks(batch):
    solutions = of_kind(batch, "solution")
    assert len(solutions) == len(BATCH_SOLUTIONS) >= 6
    for name, r in solutions.items():
        assert r["status"] == "graded", (name, r["reason"])
        assert r["max_score"] > 0 and r["score"] == r["max_score"], (name, r["checks"])
        assert all(c["passed"] for c in r["checks"]), name
        # Its own check() cell, run under papermill in a real kernel, agrees: full marks, nothing to warn about.
        executed = read(Path(r["executed_notebook"]))
        outputs = [o for c in executed.cells if exercises.role(c) == "check" for o in c.outputs]
        said = "".join(o.get("text", "") for o in outputs)
        # (the ranks' own lines, e.g. c10d's warning in the sandbox's network namespace, are the launch's)
        first = next((line for line in said.splitlines() if not line.startswith("[rank ")), "")
        assert f": {r['max_score']:g}/{r['max_score']:g} (" in first and "warning" not in said, (
            name,
            outputs,
        )


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


def test_the_gradebook_has_a_row_per_submission_and_per_absent_student(batch):
    rows = batch["rows"]
    header = list(rows[0])
    assert header[:7] == ["student", "name", "file", "exercise", "status", "score", "max"], header
    wanted = {"submitted_at", "late", "seed", "class_seed", "feedback", "reason", "warning", "labkit_version"}
    assert wanted <= set(header), header
    assert "check: state bytes per rank: ddp" in header and "check: fewest ranks to fit the state" in header
    by_file = {row["file"]: row for row in rows if row["file"]}
    assert sorted(by_file) == sorted(batch["kinds"])
    for name, row in by_file.items():
        r = batch["reports"][name]
        assert row["student"] == name.removesuffix(".ipynb") and row["status"] == r["status"]
        assert row["exercise"] == (r["exercise"] or "") and row["reason"] == r["reason"]
        assert float(row["score"]) == r["score"] and float(row["max"]) == r["max_score"]
        assert float(row["runtime"]) == pytest.approx(r["runtime_s"], abs=0.01)
        assert row["class_seed"] == str(BATCH_SEED) and row["labkit_version"]
        assert row["late"] == ("yes" if name == "padding02.ipynb" else "no"), name
        for c in r["checks"]:
            if c["max_points"]:
                assert float(row[f"check: {c['name']}"]) == c["points"], (name, c["name"])
        if r["status"] == "graded" and r["score"] < r["max_score"]:
            assert row["feedback"], name  # what was wrong, for the LMS's comment column
    assert by_file["partial01.ipynb"]["name"] == "Student partial01"  # from the roster
    assert "not on the roster" in by_file["unknown.ipynb"]["warning"]
    [absent] = [row for row in rows if not row["file"]]
    assert (absent["student"], absent["status"], absent["score"]) == ("zoe", "missing", "0")
    progress = [line for line in batch["stdout"].splitlines() if line.startswith("[")]
    assert len(progress) == 34 and progress[-1].startswith("[34/34]")


def test_the_canvas_import_has_every_rostered_student(batch):
    with open(batch["canvas"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[:5] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"]
    scores = {row["SIS Login ID"]: row[list(row)[5]] for row in rows}
    assert scores["zoe"] == "0" and float(scores["sol_01_memory"]) == 6
    assert float(scores["padding02"]) == batch["reports"]["padding02.ipynb"]["score"]


def test_every_report_has_its_seed_and_a_feedback_page(batch):
    for name, r in batch["reports"].items():
        if r["status"] == "graded":
            assert r["seed"] == submission_seed(BATCH_SEED, r["exercise"], name.removesuffix(".ipynb")), name
        page = Path(r["feedback_file"]).read_text()
        assert page.startswith("# ") and f"{r['score']:g}/{r['max_score']:g}" in page.splitlines()[0], name
    assert "Not graded (error)" in Path(batch["reports"]["exit.ipynb"]["feedback_file"]).read_text()


def test_the_batch_ran_inside_its_limits(batch):
    contained = batch["reports"]["sol_05_deepspeed_config.ipynb"]["containment"]
    assert "cgroup" in contained["memory"] or "RLIMIT_AS" in contained["memory"], contained
    assert contained["sandbox"].startswith("bwrap" if sandbox.bwrap_usable() else "none"), contained
    assert "contained by:" in batch["stdout"]


def test_a_wrong_padding_formula_loses_points_in_a_real_grade(batch):
    r = batch["reports"]["padding02.ipynb"]
    shard, gather = answer_checks(r)
    assert r["status"] == "graded" and shard["points"] < shard["max_points"] and gather["passed"], r["checks"]
    assert "ranks, rank" in shard["feedback"], shard


def test_labkits_own_answer_imported_at_run_time_earns_nothing_and_is_named(batch):
    r = batch["reports"]["library_skip02.ipynb"]
    shard = answer_checks(r)[0]
    uses = ["labkit.zero.sharding", "labkit.zero.sharding.shard_dim0"]  # the import, then the call
    assert shard["points"] == 0 and f"uses {', '.join(uses)}, labkit's own" in shard["feedback"], shard
    assert r["integrity"] == [{"cell": "answer-shard", "uses": uses}]
    row = next(row for row in batch["rows"] if row["file"] == r["file"])
    assert "labkit's own implementation" in row["warning"]


def test_labkits_own_answer_called_however_it_was_reached_earns_nothing_and_is_named(batch):
    r = batch["reports"]["hidden_call02.ipynb"]
    shard, gather = answer_checks(r)
    assert shard["points"] == 0 and "uses labkit.zero.sharding.shard_dim0, labkit's own" in shard["feedback"]
    assert gather["passed"], gather  # the cell that calls it defines only shard_rows
    assert r["integrity"] == [{"cell": "answer-shard", "uses": ["labkit.zero.sharding.shard_dim0"]}]


def test_a_collective_imported_by_name_is_seen_by_the_graders_probes(batch):
    r = batch["reports"]["by_name03.ipynb"]
    assert r["score"] == r["max_score"] == 8, answer_checks(r)


def test_a_rank_that_skips_a_collective_is_named(batch):
    gather = answer_checks(batch["reports"]["library_skip02.ipynb"])[1]
    assert gather["points"] == 0
    assert "rank 0 returned without calling it" in gather["feedback"], gather
    assert "rank 0 never called all_gather_into_tensor" in gather["feedback"], gather
    assert "ranks 1-2 waited in it" in gather["feedback"] and "Connection" not in gather["feedback"]


@pytest.mark.timeout(600)
def test_regrading_one_submission_updates_its_row_with_the_same_grade(batch, tmp_path):
    gradebook = tmp_path / "grades.csv"
    gradebook.write_text(batch["gradebook"].read_text())
    name = "partial01.ipynb"
    # No --seed: the re-grade takes the class seed the gradebook was graded with.
    done = labkit_cli("grade", str(batch["folder"] / name), "--gradebook", str(gradebook))
    assert done.returncode == 0, done.stderr
    again = json.loads((tmp_path / "grades-reports" / "partial01.report.json").read_text())
    first = batch["reports"][name]
    assert (again["seed"], again["score"]) == (first["seed"], first["score"])
    assert [c["feedback"] for c in again["checks"]] == [c["feedback"] for c in first["checks"]]
    rows = report.read_gradebook(gradebook)
    assert [r["file"] for r in rows] == [r["file"] for r in batch["rows"]]
    row = next(r for r in rows if r["file"] == name)
    assert row["runtime"] == f"{again['runtime_s']:.2f}" and row["name"] == "Student partial01"


def test_a_submission_of_another_exercise_is_an_error_row_of_the_folders_exercise(tmp_path):
    submission = tmp_path / "carol.ipynb"
    submission.write_text(SOL01.read_text())
    gradebook = tmp_path / "ex02.csv"
    done = labkit_cli("grade", str(submission), "--exercise", "ex02_shard", "--gradebook", str(gradebook))
    assert done.returncode == 0, done.stderr
    [row] = report.read_gradebook(gradebook)
    assert (row["status"], row["exercise"], row["max"]) == ("error", "ex02_shard", "6"), row
    assert "ex01_memory" in row["reason"] and "ex01_memory, not ex02_shard" in row["warning"]
    assert (tmp_path / "ex02-reports" / "carol.report.json").is_file()  # <gradebook stem>-reports/


def test_a_folder_is_one_exercises_when_most_of_it_is(tmp_path):
    for i in range(4):
        nbformat.write(read(SOL02), tmp_path / f"s{i}.ipynb")
    nbformat.write(read(SOL01), tmp_path / "odd.ipynb")
    assert grader.folder_exercise(grader.submissions(tmp_path))[0] == "ex02_shard"
    nbformat.write(read(SOL01), tmp_path / "odd2.ipynb")  # 4 of 6: a mixed folder
    assert grader.folder_exercise(grader.submissions(tmp_path))[0] is None


def test_each_report_times_the_notebook_the_answers_and_the_judge(batch):
    # How long grading takes is benchmarks/grading_sandbox.py's to measure (this suite runs beside neighbours).
    for name in ("sol_01_memory.ipynb", "sol_06_hsdp.ipynb", "sol_02_shard_gather.ipynb"):
        r = batch["reports"][name]
        times = r["timings_s"]
        print(f"{name}: {times}")
        assert set(times) == {"notebook", "answers", "judge"} and min(times.values()) > 0, (name, times)
        assert sum(times.values()) <= r["runtime_s"] + 1, (name, times, r["runtime_s"])


@pytest.mark.timeout(600)
def test_a_hanging_answer_costs_only_its_own_points(side_runs):
    r = side_runs["finish"]("hang")["report"]
    shard, gather = answer_checks(r)
    assert (r["status"], r["score"], r["max_score"]) == ("graded", 3, 6), r["checks"]
    assert shard["passed"] and not gather["passed"]
    assert f"did not finish within {HANG_CHECK_S - 10} s" in gather["feedback"], (
        gather
    )  # the launch stops first
    assert "of cell 'answer-gather' in gather_full" in gather["feedback"], gather
    assert f"did not finish within --timeout {HANG_TIMEOUT_S} s (stopped while running" in r["notebook_run"]
    hits = {h["where"] for h in r["limits_hit"]}
    assert "notebook run" in hits and f"check {gather['name']!r}" in hits, r["limits_hit"]
    assert r["limits_s"]["total"] == pytest.approx(r["limits_s"]["notebook"] + r["limits_s"]["answers"])
    assert r["runtime_s"] < HANG_TIMEOUT_S + 2 * HANG_CHECK_S + 20, r["timings_s"]
    pid = int(side_runs["pid_file"].read_text())
    status = Path(f"/proc/{pid}/status")
    assert not status.exists() or "zombie" in status.read_text()  # the kernel (its own session) is gone


@pytest.mark.timeout(600)
def test_a_hostile_submission_is_contained(side_runs):
    r = side_runs["finish"]("hostile")["report"]
    feedback = {c["name"].removeprefix("state bytes per rank: "): c["feedback"] for c in r["checks"]}
    contained = r["containment"]
    assert r["status"] == "graded" and r["score"] == 2, r["checks"]  # the fit answer still earns its points
    assert "MemoryError" in feedback["ddp"] or "SIGKILL" in feedback["ddp"], feedback["ddp"]
    assert "--memory-limit of 1 GiB" in feedback["ddp"]
    if not contained["processes"].startswith("not limited"):
        assert "BlockingIOError" in feedback["zero1"] and "--max-processes of 128" in feedback["zero1"]
        assert {h["limit"] for h in r["limits_hit"]} == {"memory", "processes"}, r["limits_hit"]
    if contained["sandbox"].startswith("bwrap"):
        assert side_runs["received"] == [], "the submission reached a server on the grading machine"
        assert "ConnectionRefusedError" in feedback["zero2"] or "unreachable" in feedback["zero2"]
        assert "FileNotFoundError" in feedback["zero3"] and "bob's own work" not in feedback["zero3"]
    else:  # where CI runs, bubblewrap is installed (tests/apt.txt) and must contain it
        assert "bwrap" in contained["sandbox"] and not os.environ.get("CI"), contained
    assert feedback["fewest ranks to fit the state"] == "all 6 cases right"


@pytest.mark.parametrize(
    "args, says",
    [
        (["missing.ipynb"], "does not exist"),
        (["{dir}"], "--gradebook"),
        (["{file}", "--gradebook", "g.csv", "--out", "r.json"], "drop --out"),
        (["{file}", "--memory-limit", "lots"], "--memory-limit"),
        (["{file}", "--memory-limit", "10M"], "below 256M"),
        (["{file}", "--exercise", "ex99_nothing"], "known ids"),
        (["{file}", "--student-pattern", "(unclosed"], "--student-pattern"),
        (["{file}", "--deadline", "next friday"], "--deadline"),
        (["{file}", "--roster", "missing.csv"], "--roster"),
        (["{file}", "--check-timeout", "-1"], "--check-timeout"),
        (["{file}", "--canvas", "c.csv"], "--canvas needs --gradebook"),
        (["{dir}", "--gradebook", "g.csv", "--out", "r.json"], "--out is for one submission"),
        (["{file}", "--timeout", "0"], "--timeout"),
        (["{file}", "--jobs", "0"], "--jobs"),
        (["{file}", "--timeout", "soon"], "--timeout"),
        (["{file}", "--answers-only", "--timeout", "60"], "--answers-only skips"),
        # flags one file would ignore
        (["{file}", "--jobs", "4"], "--jobs grades a folder's"),
        (["{file}", "--deadline", "2026-12-10"], "--deadline fills the gradebook's late column"),
        (["{file}", "--roster", "{file}"], "--roster adds a folder's missing students"),
        (["{file}", "--canvas-assignment", "HW2"], "--canvas-assignment names the column"),
        # where the grade could not be written, said before anything runs
        (["{file}", "--out", "{dir}"], "--out {dir} is a folder"),
        (["{file}", "--gradebook", "{dir}"], "--gradebook {dir} is a folder"),
        (["{file}", "--out", "{file}/r.json"], "is a file, not a folder"),
        (["{dir}", "--gradebook", "g.csv", "--roster", "{dir}"], "--roster {dir} is a folder"),
        (["{dir}/empty", "--gradebook", "{dir}/g.csv"], "holds no submission"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys, args, says):
    (tmp_path / "sub.ipynb").write_text("{}")
    (tmp_path / "empty").mkdir()
    args = [a.format(dir=tmp_path, file=tmp_path / "sub.ipynb") for a in args]
    assert main(["grade", *args]) == 2
    err = capsys.readouterr().err
    says = says.format(dir=tmp_path)
    assert len(err.strip().splitlines()) == 1 and says in err and "Traceback" not in err


def test_exercises_and_solutions_are_twins():
    assert [p.name for p in EXERCISES] == [p.name for p in SOLUTIONS] and len(EXERCISES) >= 6
    for ex_path, sol_path in zip(EXERCISES, SOLUTIONS, strict=True):
        ex, sol = read(ex_path), read(sol_path)
        assert exercises.exercise_id(ex) == exercises.exercise_id(sol) and load(exercises.exercise_id(ex))
        assert ex.metadata.kernelspec.name == sol.metadata.kernelspec.name == KERNEL_NAME
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


# ---------------------------------------------------------------------------- the pieces, in this process


def test_a_wrong_padding_formula_scores_the_same_whatever_the_seed_and_never_full_marks():
    """Every seed's cases exercise the same conditions (issue 46): d0 // n + 1 is wrong on the exact multiples
    only, and every draw holds the same number of them."""
    exercise = load("ex02_shard")
    shard = exercise.checks[0]
    scores = set()
    for seed in range(300):
        observed = {shard.name: probe_one(shard, {"shard_rows": wrong_padding_shard}, seed)}
        entry = judge_all(exercise, observed, seed)[0]
        scores.add(entry["points"])
        assert not entry["passed"], (seed, entry)
    print(f"d0 // n + 1 over 300 seeds: shard points {sorted(scores)} of {shard.points}")
    assert scores == {2.0}


def test_every_draw_includes_the_edge_cases_of_sharding():
    from labkit.grading.checks import ex02_shard, ex03_reduce_scatter

    for seed in range(50):
        for salt, sizes in (("shard", (3, 2, 4)), ("gather", (3,))):
            cases = ex02_shard._cases(seed, salt, sizes)
            kinds = {("d0<n" if s[0] < n else "exact" if s[0] % n == 0 else "uneven") for s, n in cases}
            assert kinds == {"d0<n", "exact", "uneven"}, (seed, salt, cases)
        numels = ex03_reduce_scatter._flat_numels(seed)
        assert {10, 9, 2} <= set(numels)


def test_seeds_are_reproducible_and_per_student():
    assert submission_seed(3, "ex02_shard", "alice") == submission_seed(3, "ex02_shard", "alice")
    seeds = {submission_seed(c, e, s) for c in (0, 1) for e in ("ex01_memory", "ex02_shard") for s in "ab"}
    assert len(seeds) == 8 and all(0 <= x < 2**31 for x in seeds)
    exercise = load("ex02_shard")
    shard = exercise.checks[0]
    twice = [
        judge_all(exercise, {shard.name: probe_one(shard, {"shard_rows": wrong_padding_shard}, 5)}, 5)[0]
        for _ in range(2)
    ]
    assert twice[0] == twice[1]


@pytest.mark.parametrize(
    "source, uses",
    [
        (LIBRARY_SHARD, ["labkit.zero.sharding.shard_dim0"]),
        (
            "from labkit.zero.sharding import shard_dim0 as s\ndef shard_rows(f, r, n):\n    return s(f, r, n)",
            ["labkit.zero.sharding.shard_dim0"],
        ),
        (
            "def shard_rows(f, r, n):\n    return getattr(labkit.zero, 'sharding').shard_dim0(f, r, n)",
            ["labkit.zero.sharding.shard_dim0"],
        ),
        ("import importlib\nm = importlib.import_module('labkit.zero.sharding')", ["labkit.zero"]),
        (WRONG_PADDING, []),
        ("def gather_full(s, d0, n):\n    return labkit.launch(print, 1)", []),
        (  # the grader's own code: its reference answers and its probes, in every exercise
            "from labkit.grading.checks.ex02_shard import _full\nshard_rows = _full",
            ["labkit.grading.checks.ex02_shard._full"],
        ),
    ],
)
def test_the_integrity_rule_reads_the_answer_cells(source, uses):
    exercise = load("ex02_shard")
    cells = [
        {"id": "setup", "role": "setup", "source": "import torch\nimport labkit"},
        {"id": "answer-shard", "role": "answer", "source": source},
    ]
    found = integrity.scan(cells, exercise.forbidden, exercise.allowed)
    assert (found["answer-shard"]["uses"] if found else []) == uses


def test_no_solution_breaks_the_integrity_rule():
    for path in SOLUTIONS:
        sol = read(path)
        exercise = load(exercises.exercise_id(sol))
        pristine = read(ROOT / "exercises" / path.name)
        cells, _ = exercises.graded_cells(pristine, sol)
        assert exercise.forbidden and integrity.scan(cells, exercise.forbidden, exercise.allowed) == {}, path
        assert all(c.answers for c in exercise.checks), path  # every check names the answers it calls


def test_every_exercise_tells_the_student_the_integrity_rule_it_is_graded_by():
    """The first cell states the rule the grade applies, rendered from the same table (integrity.RULES)."""
    stated = {}
    for path in sorted((ROOT / "exercises").glob("*.ipynb")):
        nb = read(path)
        stated[exercises.exercise_id(nb)] = nb.cells[0].source
    assert set(stated) == set(integrity.RULES)
    for exercise_id, intro in stated.items():
        assert integrity.stated_rule(exercise_id) in intro, exercise_id
        assert all(f"`{p}`" in intro for p in load(exercise_id).forbidden), exercise_id
    assert "`labkit.layout.dim0_rows`: that one is yours" in stated["ex03_reduce_scatter"]


def test_an_answer_that_is_labkits_own_function_is_found_in_the_namespace():
    from labkit.layout import dim0_rows
    from labkit.zero.sharding import shard_dim0

    exercise = load("ex03_reduce_scatter")
    found = integrity.answer_origins(
        {"pack_grads": shard_dim0, "reduce_scatter_mean": dim0_rows},
        ["pack_grads", "reduce_scatter_mean"],
        exercise.forbidden,
        exercise.allowed,
    )
    assert found == {"pack_grads": "labkit.zero.sharding.shard_dim0"}  # dim0_rows is handed out on purpose
    rebuilt = types.FunctionType(shard_dim0.__code__, {"__name__": "__main__", "dim0_rows": dim0_rows})
    found = integrity.answer_origins({"pack_grads": rebuilt}, ["pack_grads"], exercise.forbidden)
    assert found == {"pack_grads": "labkit.zero.sharding.shard_dim0"}  # labkit's code, the answer's globals


RUNTIME_IMPORT = """import importlib


def shard_rows(full, rank, world_size):
    impl = importlib.import_module("labkit." + "zero.sharding")  # a name the source rule cannot read
    return getattr(impl, "shard_" + "dim0")(full, rank, world_size)


def gather_full(shard, d0, world_size):
    return __import__("lab" + "kit.zero", fromlist=["comm"])
"""


def _ex02_watch(answer: str, log: Path) -> integrity.UseWatch:
    """A use watch on ex02's answer cell `answer-shard` (not installed), whose source the source rule passes."""
    exercise = load("ex02_shard")
    cells = [{"id": "answer-shard", "role": "answer", "source": answer}]
    assert integrity.scan(cells, exercise.forbidden, exercise.allowed) == {}  # the source rule misses it
    return integrity.UseWatch(exercise.forbidden, exercise.allowed, ["answer-shard"], log)


@contextlib.contextmanager
def _watched_answer(answer: str, log: Path):
    """ex02's answer cell `answer` run under its use watch (`_ex02_watch`): (the watch, the cell's namespace),
    the watch removed on leaving."""
    watch, namespace = _ex02_watch(answer, log), {}
    watch.install()
    try:
        exec(compile(answer, "<cell answer-shard>", "exec"), namespace)
        yield watch, namespace
    finally:
        watch.remove()


def test_the_use_watch_sees_modules_an_answer_imports_by_a_name_built_at_run_time(tmp_path):
    import torch

    with _watched_answer(RUNTIME_IMPORT, tmp_path / "log") as (watch, namespace):
        import importlib

        importlib.import_module("labkit.zero.sharding")  # not an answer cell's frame: not noted
        assert watch.found() == {}
        namespace["shard_rows"](torch.ones(4, 2), 0, 2)
        namespace["gather_full"](None, 0, 2)
    assert watch.found() == {
        "answer-shard": ["labkit.zero.comm", "labkit.zero.sharding", "labkit.zero.sharding.shard_dim0"]
    }


HIDDEN_CALLS = """import math  # noqa: F401 (labkit's code copied below reads it from these globals)
import sys
import types


def shard_rows(full, rank, world_size):  # found in sys.modules by a name built at run time
    return getattr(sys.modules["labkit." + "zero.sharding"], "shard_" + "dim0")(full, rank, world_size)


def gather_full(shard, d0, world_size):  # a string the cell compiles and runs itself
    return eval("sys.modules['labkit.' + 'zero.sharding'].unshard_dim0([shard], d0)")


def pack(shards):  # through code the exercise hands out: the scaffold's call, not the answer's
    return [dim0_rows(s.shape[0], 2) for s in shards]


def unwatched():
    sys.settrace(None)


def copied(full, rank, world_size):  # labkit's code object, run under this cell's own globals
    code = getattr(sys.modules["labkit." + "layout"], "dim0_" + "rows").__code__
    return types.FunctionType(code, globals())(full.shape[0], world_size)
"""


def test_the_use_watch_sees_labkit_code_an_answer_calls_however_it_reached_it(tmp_path):
    import sys

    import torch

    from labkit.zero import sharding

    watch = _ex02_watch(HIDDEN_CALLS, tmp_path / "log")
    namespace: dict = {}
    given = "from labkit.layout import dim0_rows as _rows\n\ndef dim0_rows(d0, n):\n    return _rows(d0, n)"
    exec(compile(given, "<cell setup>", "exec"), namespace)
    before = sys.gettrace()
    watch.install()
    try:
        exec(compile(HIDDEN_CALLS, "<cell answer-shard>", "exec"), namespace)
        sharding.shard_dim0(torch.ones(4, 2), 0, 2)  # not called by an answer cell: not noted
        namespace["pack"]([torch.ones(3, 2)])
        assert watch.found() == {}
        assert namespace["shard_rows"](torch.arange(6.0).view(3, 2), 1, 2).tolist() == [
            [4.0, 5.0],
            [0.0, 0.0],
        ]
        namespace["gather_full"](torch.ones(2, 2), 2, 1)
        namespace["unwatched"]()
        assert sys.gettrace() is not before  # the trace stays on
        namespace["shard_rows"](torch.ones(2, 2), 0, 2)
        assert namespace["copied"](torch.ones(5, 2), 0, 2) == (3, 6)
    finally:
        watch.remove()
    assert sys.gettrace() is before
    assert watch.found() == {
        "answer-shard": [
            "labkit.grading.integrity.UseWatch",
            "labkit.layout.dim0_rows",
            "labkit.zero.sharding.shard_dim0",
            "labkit.zero.sharding.unshard_dim0",
        ]
    }
    assert len((tmp_path / "log").read_text().splitlines()) == 4  # each use once, however often it ran


HANDED_OFF = """import concurrent.futures
import sys
import threading


def shard_rows(full, rank, world_size):  # labkit's function as the target of a thread the answer starts
    fn = getattr(sys.modules["labkit." + "zero.sharding"], "shard_" + "dim0")
    worker = threading.Thread(target=fn, args=(full, rank, world_size))
    worker.start()
    worker.join()
    return full[:0]


def gather_full(shard, d0, world_size):  # ... and by an executor's worker thread
    fn = getattr(sys.modules["labkit." + "zero.sharding"], "unshard_" + "dim0")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, [shard], d0).result()
"""


def test_the_use_watch_sees_labkit_code_an_answer_hands_to_a_thread(tmp_path):
    import torch

    import labkit.zero.sharding  # noqa: F401 (in sys.modules, where the answer looks it up)

    with _watched_answer(HANDED_OFF, tmp_path / "log") as (watch, namespace):
        namespace["shard_rows"](torch.ones(3, 2), 1, 2)
        assert namespace["gather_full"](torch.ones(2, 2), 2, 1).shape == (2, 2)
    assert watch.found() == {
        "answer-shard": ["labkit.zero.sharding.shard_dim0", "labkit.zero.sharding.unshard_dim0"]
    }


def _enter(name: str, *shapes) -> dict:
    return {"e": "enter", "name": name, "shapes": [list(s) for s in shapes]}


def test_a_collective_mismatch_is_said_in_one_sentence():
    ag, rs, done, leave = "all_gather_into_tensor", "reduce_scatter_tensor", {"e": "done"}, {"e": "exit"}
    skipped = [[done], [_enter(ag, (9, 4), (3, 4))], [_enter(ag, (9, 4), (3, 4))]]
    assert ranks.diagnose(skipped).startswith(
        "rank 0 never called all_gather_into_tensor (the 1st collective of ranks 1-2): rank 0 returned without"
    )
    repeated = [[_enter(ag, (3,)), leave, _enter(ag, (3,))], [_enter(ag, (3,)), leave, done]]
    assert "rank 1 never called all_gather_into_tensor (the 2nd collective of rank 0)" in ranks.diagnose(
        repeated
    )
    reordered = [[_enter(ag, (3,))], [_enter(rs, (3,))], [_enter(ag, (3,))]]
    assert ranks.diagnose(reordered) == (
        "at the 1st collective, ranks 0, 2 called all_gather_into_tensor, rank 1 called reduce_scatter_tensor: "
        "every rank must call the same collectives in the same order"
    )
    shapes = [[_enter(ag, (9, 4), (3, 4))], [_enter(ag, (3, 4), (1, 4))]]
    assert "different shapes (rank 0 [9, 4] and [3, 4]; rank 1 [3, 4] and [1, 4])" in ranks.diagnose(shapes)
    assert ranks.diagnose([[_enter(ag, (3,)), leave, done]] * 3) is None


def test_a_cell_or_a_probe_past_its_limit_is_stopped_and_located(tmp_path):
    # one-line loops: a loop over two lines may be stopped on either of them
    sources = {"answer-loop": "x = 1\nwhile True: pass"}
    namespace: dict = {}
    start = time.monotonic()
    ran = extract.run_cell(sources["answer-loop"], "answer-loop", namespace, 0.5, sources)
    assert ran["timed_out"] and time.monotonic() - start < 5 and namespace["x"] == 1
    assert (
        ran["error"]
        == "did not finish within 0.5 s (stopped at line 2 of cell 'answer-loop': `while True: pass`)"
    )
    sources = {"answer-spin": "def spin(ns, seed):\n    while True: pass"}
    exec(compile(sources["answer-spin"], "<cell answer-spin>", "exec"), namespace)
    quick = Check("quick", 1, lambda ns, seed: seed, lambda got, seed: (1.0, ""))
    stuck = Check("stuck", 1, namespace["spin"], lambda got, seed: (1.0, ""), group="g")
    also = Check("after it", 1, lambda ns, seed: seed, lambda got, seed: (1.0, ""), group="g")
    assert extract.run_group((quick,), namespace, 7, 5.0, tmp_path, sources) == {"quick": {"value": 7}}
    start = time.monotonic()
    results = extract.run_group((stuck, also), namespace, 7, 1.0, tmp_path, sources)
    assert time.monotonic() - start < 5
    assert results["stuck"]["limit"] == "time" and results["after it"]["limit"] == "time"
    assert (
        "stopped at line 2 of cell 'answer-spin' in spin: `while True: pass`" in results["stuck"]["error"]
    ), results


def test_gradebook_pieces_roster_deadline_update_and_canvas(tmp_path):
    roster = tmp_path / "roster.csv"
    roster.write_text(
        "Student,ID,SIS User ID,SIS Login ID,Section\nAda Lovelace,11,u11,ada,A\n"
        "    Points Possible,,,,\nBo Li,12,u12,bo,A\n"
    )
    students = report.read_roster(roster)
    assert [s["student"] for s in students] == ["ada", "bo"]
    deadline = report.parse_deadline("2026-01-10T12:00Z")
    entry = {"name": "c", "points": 1.5, "max_points": 2, "passed": False, "feedback": "half"}
    ada = report.build(
        "ada.ipynb",
        "ex01_memory",
        "graded",
        [entry],
        1.0,
        student="ada",
        seed=5,
        class_seed=0,
        submitted_at="2026-01-10T12:00:01Z",
    )
    rows = report.gradebook_rows([ada], students, deadline, "ex01_memory", 2)
    assert [(r["student"], r["status"], r["score"], r.get("late", "")) for r in rows] == [
        ("ada", "graded", "1.5", "yes"),
        ("bo", "missing", "0", ""),
    ]
    assert (
        rows[0]["name"] == "Ada Lovelace"
        and rows[0]["check: c"] == "1.5"
        and rows[0]["feedback"] == "c: half"
    )
    book = tmp_path / "g.csv"
    report.write_gradebook(rows, book)
    bo = report.build(
        "bo.ipynb", "ex01_memory", "graded", [{**entry, "points": 2, "passed": True}], 1.0, student="bo"
    )
    updated = report.update_gradebook(book, report.gradebook_rows([bo])[0])
    assert [(r["student"], r["status"], r["score"]) for r in updated] == [
        ("ada", "graded", "1.5"),
        ("bo", "graded", "2"),
    ]
    assert updated[1]["name"] == "Bo Li"  # kept from the missing row it replaced
    canvas = tmp_path / "canvas.csv"
    report.write_canvas(updated, students, canvas, "Exercise 1 (77)")
    assert canvas.read_text().splitlines() == [
        "Student,ID,SIS User ID,SIS Login ID,Section,Exercise 1 (77)",
        "Ada Lovelace,11,u11,ada,A,1.5",
        "Bo Li,12,u12,bo,A,2",
    ]


def test_student_ids_come_from_the_file_name():
    assert grader.student_id("alice.ipynb") == ("alice", "")
    canvas = r"^(?P<student>[a-z]+)_(?:LATE_)?\d+_\d+_"
    assert grader.student_id("smithjo_LATE_123_456_02_shard_gather.ipynb", canvas) == ("smithjo", "")
    student, warning = grader.student_id("odd name.ipynb", canvas)
    assert student == "odd name" and "does not match" in warning


def test_sizes_parse_as_powers_of_1024():
    assert sandbox.parse_size("2G") == 2 * 2**30 and sandbox.parse_size("512M") == 2**29
    assert sandbox.parse_size("1.5GiB") == 3 * 2**29 and sandbox.parse_size("1000") == 1000
    with pytest.raises(ValueError):
        sandbox.parse_size("lots")


@pytest.mark.skipif(
    not sandbox.bwrap_usable() and not os.environ.get("CI"), reason="bubblewrap cannot build a sandbox here"
)
def test_the_sandbox_runs_an_interpreter_reached_through_a_symlink_under_tmp(tmp_path):
    """A venv linked into /tmp (a worktree's `.venv -> ../main/.venv`): the sandbox binds real paths and
    mounts its own /tmp, yet the child starts, sees the folder under /tmp it was given, and not the rest."""
    linked = tmp_path / "checkout" / ".venv"
    linked.parent.mkdir()
    linked.symlink_to(Path(sys.executable).parent.parent)
    (tmp_path / "secret.txt").write_text("another folder under /tmp")
    work = tmp_path / "checkout" / "work"
    work.mkdir()
    script = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from labkit.grading import sandbox\n"
        "child = 'import os, sys; print(sys.prefix, os.listdir(\".\"), os.path.exists(sys.argv[1]))'\n"
        "out = sandbox.run([sys.executable, '-c', child, sys.argv[2]], Path(sys.argv[1]), 60, "
        "Path(sys.argv[1]) / 'log', limits=sandbox.Limits(sandbox='bwrap'))\n"
        "print(out.returncode, (Path(sys.argv[1]) / 'log').read_text())\n"
    )
    (work / "marker").write_text("")
    done = subprocess.run(
        [str(linked / "bin" / "python"), "-c", script, str(work), str(tmp_path / "secret.txt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    status, prefix, rest = done.stdout.strip().split(" ", 2)
    assert status == "0" and os.path.realpath(prefix) == os.path.realpath(sys.prefix), done.stdout
    assert "'marker'" in rest and rest.endswith("False"), done.stdout


@pytest.mark.skipif(
    not sandbox.bwrap_usable() and not os.environ.get("CI"), reason="bubblewrap cannot build a sandbox here"
)
def test_the_sandbox_hides_the_solutions_where_it_would_see_them(tmp_path, monkeypatch):
    """A course folder inside what the sandbox binds (as a wheel's labkit/_course is): a submission sees its
    exercises/ but an empty solutions/."""
    course = tmp_path / "course"
    for folder in ("exercises", "solutions"):
        (course / folder).mkdir(parents=True)
        (course / folder / "01.ipynb").write_text(folder)
    monkeypatch.setenv("LABKIT_COURSE", str(course))
    roots = sandbox._read_only_roots()
    monkeypatch.setattr(sandbox, "_read_only_roots", lambda: [*roots, str(course)])
    work = tmp_path / "work"
    work.mkdir()
    child = (
        "import sys; from pathlib import Path; c = Path(sys.argv[1]); "
        "print(sorted(p.name for p in c.iterdir()), [f.read_text() for f in sorted(c.glob('*/01.ipynb'))])"
    )
    out = sandbox.run(
        [sys.executable, "-c", child, str(course)],
        work,
        60,
        work / "log",
        limits=sandbox.Limits(sandbox="bwrap"),
    )
    said = (work / "log").read_text().strip()
    assert out.returncode == 0, said
    assert said == "['exercises', 'solutions'] ['exercises']", said


@pytest.mark.fast  # in this process: no rank, no kernel
def test_check_in_the_students_kernel_says_what_to_run_again_after_a_restart(capsys):
    from labkit.grading import feedback

    feedback.check("ex01_memory", {}, seed=0)  # a fresh kernel: no answer cell has run
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Memory arithmetic per strategy: 0/6") or ": 0/" in out[0], out
    missing = [line for line in out[1:] if "not defined in this kernel: run its answer cell again" in line]
    assert len(missing) == len(out) - 1 == len(load("ex01_memory").checks), out
    assert any("`min_ranks_to_fit` not defined" in line for line in missing), out


@pytest.mark.fast  # in this process: no rank, no kernel
def test_wrong_values_of_the_right_shape_are_diagnosed_not_only_measured():
    import torch

    from labkit.grading.kit import tensor_mismatch

    def seen(t):
        return {"shape": list(t.shape), "values": t.flatten().tolist()}

    want = torch.arange(1.0, 10.0).view(3, 3)
    assert tensor_mismatch(seen(want), want) is None
    small = tensor_mismatch(seen(want / 3), want)
    assert small.startswith("values differ by up to 6") and "every value is 3 times too small" in small
    assert "every value is 3 times too large (a factor of the ranks" in tensor_mismatch(seen(want * 3), want)
    assert tensor_mismatch(seen(want.T), want).endswith(": the right values, transposed")
    shuffled = want.flatten()[torch.tensor([0, 3, 6, 1, 4, 7, 2, 5, 8])].roll(1)
    assert "the right values in the wrong order (packed parameter by parameter" in tensor_mismatch(
        {"shape": [3, 3], "values": shuffled.tolist()}, want
    )
    padded = torch.cat([want, torch.zeros(1, 3)])
    assert tensor_mismatch(seen(padded), want) == (
        "shape [4, 3], want [3, 3]: 1 row(s) too many (drop the padding rows after gathering, or shard with "
        "ceil(d0 / n) rows)"
    )
    assert tensor_mismatch(seen(want[:2]), want).endswith(
        ": 1 row(s) too few (pad dim 0 to a multiple of n: each shard has ceil(d0 / n) rows)"
    )
    assert tensor_mismatch(seen(want + torch.randn(3, 3)), want).startswith("values differ by up to")


@pytest.mark.fast  # in this process: no rank, no kernel
def test_a_probes_timeout_keeps_what_each_rank_was_doing():
    from labkit.cluster import LaunchTimeout
    from labkit.grading.kit import probe_error

    stuck = LaunchTimeout(
        "the 3 ranks did not finish within timeout=5 s and were stopped; what each was doing:\n"
        "  rank 0: at cell.py:7 in gather_full\n  rank 1: inside all_gather (collective #1); at cell.py:9 in gather_full",
        {0: "", 1: ""},
    )
    assert probe_error(stuck) == (
        "LaunchTimeout: the 3 ranks did not finish within timeout=5 s and were stopped; what each was doing: "
        "rank 0: at cell.py:7 in gather_full; rank 1: inside all_gather (collective #1); at cell.py:9 in gather_full"
    )
    assert probe_error(ValueError("one line\nand a traceback after it")) == "ValueError: one line"


def test_check_and_the_grade_agree_when_an_answer_leans_on_a_cell_the_grade_skips(tmp_path, capsys):
    """The issue's case: a helper table moved into a new cell above the answer gave check() 6/6 and the grade
    0/6. check() now judges the cells the grade runs, and says why."""
    from labkit.grading import feedback

    nb = read(SOL01)
    cell = {c.id: c for c in nb.cells}
    table, answer = cell["answer-state"].source.split("\n", 2)[1:]
    cell["answer-state"].source = answer
    nb.cells.insert(nb.cells.index(cell["answer-state"]), nbformat.v4.new_code_cell(table))
    nbformat.write(nb, tmp_path / "helper.ipynb")
    graded = grader.grade_submission(tmp_path / "helper.ipynb", tmp_path / "helper.report.json")
    ran = [cell[i].source for i in ("parameters", "setup")] + [table, answer, cell["demo-state"].source]
    ran += [cell["answer-fit"].source, cell["demo-fit"].source + "\nprint('mine')"]  # a locked cell, edited
    kernel = run_cells(ran)
    capsys.readouterr()  # what the demonstration cells printed
    feedback.check("ex01_memory", kernel, seed=0)
    out = capsys.readouterr().out
    title = out.splitlines()[0]
    assert graded["status"] == "graded" and title.startswith(
        f"Memory arithmetic per strategy: {graded['score']:g}/6"
    )
    assert graded["score"] < 6, graded["checks"]
    assert (
        "warning: your answer uses `REPLICATED_AND_SHARDED_BYTES`, which only a cell outside the answer"
        in out
    )
    assert 'warning: the cell under "2. The fewest ranks that fit" (id demo-fit) ran edited' in out
    # The solution as it is, run in the kernel: full marks, as its grade, and nothing to warn about.
    solved = read(SOL01)
    order = ("parameters", "setup", "answer-state", "demo-state", "answer-fit", "demo-fit")
    kernel = run_cells([next(c.source for c in solved.cells if c.id == i) for i in order])
    capsys.readouterr()
    feedback.check("ex01_memory", kernel)
    out = capsys.readouterr().out
    assert out.startswith("Memory arithmetic per strategy: 6/6") and "warning" not in out, out


# The planted submissions whose cells this test process can run as a kernel would (not the ones that exit,
# crash, fork, or patch the grader's own modules).
RUN_HERE = (
    "solution",
    "exercise",
    "partial01",
    "partial06",
    "padding02",
    "locked_edit",
    "locked_edit_solution",
    "fake_print",
    "missing_answer",
    "hidden_call02",
)


SOURCE_SHARD = """from labkit.zero import sharding


def shard_rows(full, rank, world_size):  # labkit's own, called inside the answer: the source shows it
    return sharding.shard_dim0(full, rank, world_size)
"""


def test_check_in_the_kernel_applies_the_source_rule_as_the_grade_does(capsys, monkeypatch, tmp_path):
    """An answer that calls labkit's own shard inside its body: check() used to give it full marks, which
    the grade (the source rule) never did."""
    from labkit.grading import feedback

    monkeypatch.chdir(tmp_path)
    kernel: dict = {"__name__": "__main__"}
    ran = []
    for cell in edited(SOL02, "answer-shard", SOURCE_SHARD, append=False).cells:
        if cell.cell_type == "code" and exercises.role(cell) != "check":
            ran.append(cell.source)
            exec(cell.source, kernel)
    kernel["In"] = ["", *ran]
    capsys.readouterr()
    feedback.check("ex02_shard", kernel, seed=3)
    out = capsys.readouterr().out
    shard, gather = out.splitlines()[1:3]
    uses = "uses labkit.zero.sharding, labkit.zero.sharding.shard_dim0, labkit's own"  # the import, the call
    assert shard.startswith("  no  0/3") and uses in shard, out
    assert gather.startswith("  ok  3/3"), out
    assert sys.gettrace() is None  # the watch is gone once check() returns


@pytest.mark.timeout(900)
def test_check_in_the_kernel_and_the_grade_agree_on_every_planted_submission(
    batch, capsys, monkeypatch, tmp_path
):
    """Each submission's cells run top to bottom as "Run All" would (stopping at the first error), then its
    check() on the grade's seed: the same score as `labkit grade` gave it."""
    from labkit.grading import feedback

    monkeypatch.chdir(tmp_path)  # what the cells write lands here
    compared = 0
    for name, kind in batch["kinds"].items():
        if kind not in RUN_HERE:
            continue
        r = batch["reports"][name]
        kernel: dict = {"__name__": "__main__"}
        ran: list[str] = []
        for cell in read(batch["folder"] / name).cells:
            if cell.cell_type != "code" or exercises.role(cell) == "check":
                continue
            ran.append(cell.source)
            try:
                exec(cell.source, kernel)
            except Exception:  # noqa: BLE001 (Run All stops at the first cell that raises)
                break
        kernel["In"] = ["", *ran]
        capsys.readouterr()
        feedback.check(r["exercise"], kernel, seed=r["seed"])
        # (a rank's own line, e.g. gloo's when a stub's rank dies before its peers connect, is the launch's)
        said = capsys.readouterr().out.splitlines()
        first = next((line for line in said if not line.startswith("[rank ")), "")
        assert f": {r['score']:g}/{r['max_score']:g} (" in first, (name, first, r["checks"])
        compared += 1
    assert compared == len(BATCH_SOLUTIONS) + len(BATCH_EXERCISES) + len(RUN_HERE) - 2, compared


# ------------------------------------------------------- planted mistakes: check() as strict as the grade


SOL06 = ROOT / "solutions" / "06_hsdp.ipynb"
SUM_NOT_MEAN = "every value is 3 times too large (a factor of the ranks: the sum where the mean is wanted"
PLANTED_PUBLIC = {  # exercise id -> solution, {mistake: ([(answer cell id, solution's text, mistake's)], says)}
    "ex01_memory": (
        SOL01,
        {
            "zero2_keeps_gradients": (  # ZeRO-2 priced as ZeRO-1: the gradients not sharded
                [("answer-state", '"zero2": (2, 14)', '"zero2": (4, 12)')],
                "6.16406e+10 B",
            ),
            "zero1_replicates_everything": (
                [("answer-state", '"zero1": (4, 12)', '"zero1": (16, 0)')],
                "1.21406e+11 B",
            ),
        },
    ),
    "ex03_reduce_scatter": (
        SOL03,
        {
            "no_mean": ([("answer-flat", "return out / world_size", "return out")], SUM_NOT_MEAN),
            "parameter_major": (
                [
                    (
                        "answer-pack",
                        "torch.cat(columns, dim=1).reshape(-1)",
                        "torch.cat([c.flatten() for c in columns])",
                    )
                ],
                "the right values in the wrong order (packed parameter by parameter",
            ),
            "unpadded": (  # every parameter's rows without the zero rows: the right sum, fewer elements
                [
                    (
                        "answer-pack",
                        "return torch.cat(columns, dim=1).reshape(-1)",
                        "return torch.cat([g.flatten() for g in grads])",
                    )
                ],
                "too few (pad dim 0 to a multiple of n",
            ),
        },
    ),
    "ex04_prefetch": (
        ROOT / "solutions" / "04_prefetch.ipynb",
        {
            "backward_in_forward_order": (
                [("answer-orders", "for i in reversed(range(n_blocks))]", "for i in range(n_blocks)]")],
                ("the engine recorded ['root', 'blocks.3'", "backward visits the blocks in reverse"),
            ),
            "reshard_ignored": (
                [
                    (
                        "answer-count",
                        "return 2 * units if reshard_after_forward else units",
                        "return 2 * units",
                    )
                ],
                ("reshard_after_forward=False", "resharding after forward gathers again in backward"),
            ),
        },
    ),
    "ex06_hsdp": (
        SOL06,
        {
            "all_reduce_whole_gradient": (  # across groups, the whole model's gradient: 8x the bytes
                [("answer-traffic", "model_bytes / g,", "model_bytes,")],
                "all_reduce: 118,125,000,000 B (8 x)",
            ),
        },
    ),
}


@pytest.mark.fast  # probed and judged in this process: no rank, no kernel
@pytest.mark.parametrize(
    ("exercise_id", "mistake"),
    [(e, m) for e, (_, mistakes) in PLANTED_PUBLIC.items() for m in ["solution", *mistakes]],
)
def test_check_flags_every_planted_mistake_the_grade_marks_down(exercise_id, mistake):
    solution, mistakes = PLANTED_PUBLIC[exercise_id]
    edits, says = mistakes.get(mistake, ([], ""))
    assert_check_and_grade_agree(exercise_id, plant(solution, edits), says)
