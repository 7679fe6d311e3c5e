"""Collect and return on Zero to JupyterHub: a hub's layout built in a folder (a home per student, which only
their own server mounts, and the exchange every server mounts), where students `labkit submit`, the instructor
collects and grades with `labkit grade --exchange` and returns with `labkit feedback --return`, and each
student's `labkit feedback` brings their page into their home. The end-to-end test grades (slow); the others
do not."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from labkit import exchange
from labkit.cli import main
from labkit.grading import report

ROOT = Path(__file__).resolve().parents[1]
EXERCISE, EXERCISE_ID = "01_memory.ipynb", "ex01_memory"  # the cheapest to grade: arithmetic, no ranks
SOLVED, PRISTINE = ROOT / "solutions" / EXERCISE, ROOT / "exercises" / EXERCISE


class Hub:
    """A Zero-to-JupyterHub-like layout under `root`: homes/<user>/ (each student's own volume, holding their
    pulled course) and exchange/ (the volume mounted at /srv/exchange in every user pod)."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch):
        self.root, self.exchange, self.mp = root, root / "exchange", monkeypatch
        self.exchange.mkdir()
        monkeypatch.setenv(exchange.EXCHANGE_ENV, str(self.exchange))

    def home(self, user: str) -> Path:
        return self.root / "homes" / user

    def pull(self, user: str, notebook: Path) -> Path:
        """The student's copy of the exercise in their home, as nbgitpuller left it and they filled it in."""
        target = self.home(user) / "labkit-student" / "exercises" / EXERCISE
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(notebook, target)
        return target

    def as_student(self, user: str, *argv: str) -> int:
        """`labkit ARGV` in `user`'s server: their $JUPYTERHUB_USER and $HOME, in their course folder."""
        self.mp.setenv(exchange.USER_ENV, user)
        self.mp.setenv("HOME", str(self.home(user)))
        self.mp.chdir(self.home(user) / "labkit-student")
        return main(list(argv))


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Hub:
    return Hub(tmp_path, monkeypatch)


# ------------------------------------------------------------------------------------------ the exchange alone


def test_a_submission_is_private_whole_and_named_by_its_time(hub):
    notebook = hub.pull("alice", SOLVED)
    when = datetime(2026, 12, 6, 21, 5, 3, 250000, tzinfo=timezone.utc)
    done = exchange.submit(notebook, hub.exchange, "alice", now=when)
    assert done.path == hub.exchange / "inbound/alice/ex01_memory/20261206T210503.250000Z.ipynb"
    assert done.path.read_bytes() == notebook.read_bytes()
    assert done.path.stat().st_mtime == when.timestamp()
    assert mode(done.path) == 0o600
    assert mode(hub.exchange / "inbound/alice") == mode(done.path.parent) == 0o700
    assert [p.name for p in done.path.parent.iterdir()] == [done.path.name]  # no partial file left


def test_collect_takes_each_students_latest_and_counts_the_others(hub, tmp_path):
    start = datetime(2026, 12, 6, 9, tzinfo=timezone.utc)
    for user, times in {"alice": [2, 0, 1], "bob": [5]}.items():
        for hours in times:
            notebook = hub.pull(user, SOLVED if hours == max(times) else PRISTINE)
            exchange.submit(notebook, hub.exchange, user, now=start + timedelta(hours=hours))
    (hub.exchange / "inbound/bob/ex01_memory/notes.ipynb").write_text("{}")  # not named by a time: not one
    collected = exchange.collect(hub.exchange, EXERCISE_ID, tmp_path / "out")
    assert [(c.user, c.attempts, c.file.name) for c in collected] == [
        ("alice", 3, "alice.ipynb"),
        ("bob", 1, "bob.ipynb"),
    ]
    alice = collected[0]
    assert alice.file.read_bytes() == SOLVED.read_bytes()  # the latest, though not the last written
    assert alice.file.stat().st_mtime == (start + timedelta(hours=2)).timestamp()


@pytest.mark.parametrize("name", ["../bob", "bob/x", ".hidden", "", "a b"])
def test_a_user_name_that_is_not_one_folder_is_refused(hub, name):
    with pytest.raises(ValueError, match="cannot name an exchange folder"):
        exchange.submit(hub.pull("x", SOLVED), hub.exchange, name)
    assert not (hub.exchange / "inbound").exists() or not any((hub.exchange / "inbound").iterdir())


def test_returned_feedback_is_private_and_replaces_the_older_page(hub, tmp_path):
    page = tmp_path / "alice.feedback.md"
    for score in ("3/6", "6/6"):
        page.write_text(f"# Memory: {score}\n")
        target = exchange.return_feedback(hub.exchange, "alice", EXERCISE_ID, page)
    assert target == hub.exchange / "feedback/alice/ex01_memory.feedback.md"
    assert target.read_text() == "# Memory: 6/6\n" and mode(target) == 0o600
    assert mode(target.parent) == 0o700 and exchange.feedback_pages(hub.exchange, "alice") == [target]


NOBODY = 65534  # an unprivileged uid, for a test run as root (whom no folder's mode stops)


def unprivileged(fn) -> str:
    """`fn()`'s returned text, run as an unprivileged user: here if this is one, else in a child that drops root."""
    if os.geteuid() != 0:
        return fn()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root, run, send the text back, leave without pytest's teardown
        status, said = 1, "the child stopped"
        try:
            os.close(read)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            said, status = fn(), 0
        except BaseException as e:  # noqa: BLE001 (said to the parent, whose assertion shows it)
            said = f"{type(e).__name__}: {e}"
        finally:
            os.write(write, said.encode())
            os._exit(status)
    os.close(write)
    with os.fdopen(read) as pipe:
        said = pipe.read()
    assert os.waitpid(pid, 0)[1] == 0, said
    return said


def test_a_server_that_mounts_only_its_own_folders_cannot_submit_as_another():
    """Zero to JupyterHub with per-user subPath mounts: alice's pod has inbound/alice, and inbound/ itself is
    the container's own (not writable), so a submission as bob cannot create inbound/bob."""
    shared = Path(tempfile.mkdtemp())  # in the system's temporary folder, which every user may cross
    root = shared / "exchange"
    (root / "inbound" / "alice").mkdir(parents=True)
    notebook = shared / EXERCISE
    shutil.copyfile(SOLVED, notebook)
    for path in (shared, root):
        os.chmod(path, 0o755)
    os.chmod(notebook, 0o644)
    if os.geteuid() == 0:
        os.chown(root / "inbound" / "alice", NOBODY, NOBODY)
    os.chmod(root / "inbound", 0o555)

    def both() -> str:
        done = exchange.submit(notebook, root, "alice")
        try:
            exchange.submit(notebook, root, "bob")
        except ValueError as e:
            return f"{done.path.parent}\n{e}\n{(root / 'inbound' / 'bob').exists()}"
        return "bob's submission was written"

    try:
        alice_folder, refusal, bob_made = unprivileged(both).split("\n")
    finally:
        os.chmod(root / "inbound", 0o755)
        shutil.rmtree(shared)
    assert alice_folder == str(root / "inbound" / "alice" / EXERCISE_ID)
    assert "may not write" in refusal and "stops at" in refusal, refusal
    assert bob_made == "False"


@pytest.mark.parametrize(
    "user, argv, says",
    [
        ("", ["submit", "exercises/01_memory.ipynb"], "$JUPYTERHUB_USER is not set"),
        ("alice", ["submit", "exercises/none.ipynb"], "does not exist"),
        ("alice", ["submit", "exercises/plain.ipynb"], "not one of the course's exercises"),
        ("alice", ["submit", "exercises/01_memory.ipynb", "--exchange", "/nonexistent"], "does not exist"),
        ("alice", ["feedback", "--exchange", "/nonexistent"], "does not exist here"),
        ("alice", ["feedback", "--return", "g.csv", "--to", "x"], "drop it"),
        ("alice", ["feedback", "--return", "g.csv"], "not a file"),
    ],
)
def test_bad_student_and_return_arguments_are_one_line_and_exit_2(hub, capsys, user, argv, says):
    hub.pull("alice", SOLVED)
    (hub.home("alice") / "labkit-student/exercises/plain.ipynb").write_text('{"metadata": {}, "cells": []}')
    hub.mp.setenv("HOME", str(hub.home("alice")))
    hub.mp.chdir(hub.home("alice") / "labkit-student")
    if user:
        hub.mp.setenv(exchange.USER_ENV, user)
    else:
        hub.mp.delenv(exchange.USER_ENV, raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err and "Traceback" not in err, err


# ------------------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_class_submits_is_collected_graded_and_gets_its_feedback_home(hub, capsys):
    """Three students submit (bob twice: the latest counts; carol after the deadline), one never does; the
    instructor collects, grades and returns; each student's `labkit feedback` puts the page in their home. A
    re-grade of one file and of the whole folder keeps `late` (the gradebook keeps the deadline)."""
    hub.pull("bob", PRISTINE)
    assert hub.as_student("bob", "submit", f"exercises/{EXERCISE}") == 0  # unfinished: scores 0
    for user in ("alice", "bob"):
        hub.pull(user, SOLVED)
        assert hub.as_student(user, "submit", f"exercises/{EXERCISE}") == 0
    assert "1 earlier submissions" in capsys.readouterr().out  # bob's second
    deadline = datetime.now(timezone.utc) + timedelta(hours=1)
    exchange.submit(hub.pull("carol", SOLVED), hub.exchange, "carol", now=deadline + timedelta(minutes=5))

    instructor = hub.root / "instructor"
    instructor.mkdir()
    hub.mp.chdir(instructor)
    (instructor / "roster.csv").write_text(
        "student,name\nalice,Alice A\nbob,Bob B\ncarol,Carol C\ndave,Dave D\n"
    )
    grade = ["grade", "--exchange", "--exercise", EXERCISE_ID, "--gradebook", "ex01.csv", "--answers-only"]
    deadline_text = deadline.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert main([*grade, "--roster", "roster.csv", "--deadline", deadline_text]) == 0
    out = capsys.readouterr().out
    assert f"collected 3 submissions of {EXERCISE_ID}" in out and "1 earlier ones stay" in out
    rows = {r["student"]: r for r in report.read_gradebook(instructor / "ex01.csv")}
    assert set(rows) == {"alice", "bob", "carol", "dave"}
    full = {r["max"] for r in rows.values()}.pop()
    for user in ("alice", "bob", "carol"):
        assert (rows[user]["status"], rows[user]["score"]) == ("graded", full), rows[user]
        assert rows[user]["file"] == f"{user}.ipynb"
    assert rows["bob"]["counted"] == "yes: the latest of 2 submissions" and rows["alice"]["counted"] == "yes"
    assert [rows[u]["late"] for u in ("alice", "bob", "carol")] == ["no", "no", "yes"]
    assert rows["dave"]["status"] == "missing" and rows["carol"]["deadline"] == deadline_text

    assert main(["feedback", "--return", "ex01.csv"]) == 0
    assert "returned 3 feedback pages" in capsys.readouterr().out
    for user in ("alice", "bob", "carol"):
        assert hub.as_student(user, "feedback") == 0
        page = hub.home(user) / "labkit-feedback" / f"{EXERCISE_ID}.feedback.md"
        assert page.read_text().splitlines()[0].endswith(f": {full}/{full}"), page.read_text()
        assert f"`{user}.ipynb`" in page.read_text()  # their own page, not another's
        assert mode(hub.exchange / "feedback" / user) == 0o700
    assert not (hub.exchange / "feedback" / "dave").exists()

    hub.mp.chdir(instructor)
    regrades = [
        ["grade", "ex01-submissions/carol.ipynb", "--gradebook", "ex01.csv", "--answers-only"],
        ["grade", "ex01-submissions", "--gradebook", "ex01.csv", "--answers-only", "--roster", "roster.csv"],
    ]
    for argv in regrades:
        assert main(argv) == 0
        assert "as the gradebook records it" in capsys.readouterr().out
        rows = {r["student"]: r for r in report.read_gradebook(instructor / "ex01.csv")}
        assert [rows[u]["late"] for u in ("alice", "bob", "carol")] == ["no", "no", "yes"], argv
        assert rows["carol"]["deadline"] == deadline_text
        assert rows["bob"]["counted"] == "yes: the latest of 2 submissions"  # the exchange's count, kept
    reports = json.loads((instructor / "ex01-reports" / "carol.report.json").read_text())
    assert reports["student"] == "carol" and reports["score"] == float(full)
