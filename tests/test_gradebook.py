"""The gradebook without grading anything: Canvas's download names read (whose, LATE, the -N re-upload), the
latest submission counted, the deadline kept for re-grades, and Canvas's import file (the assignment's id in
its column, unmatched files reported and never given blank IDs). Grading runs are in tests/test_exchange.py.
"""

from __future__ import annotations

import csv

import pytest

from labkit.cli import UsageError, main
from labkit.grading import report

DEADLINE = "2026-12-10T12:00:00Z"
BEFORE, AFTER = "2026-12-10T11:00:00Z", "2026-12-10T13:00:00Z"
CANVAS_ROSTER = (
    "Student,ID,SIS User ID,SIS Login ID,Section,Shard and gather (991),Memory (990)\n"
    "    Points Possible,,,,,6,6\n"
    '"Doe, Jane",101,u101,jdoe,A,,\n'
    '"Li, Bo",102,u102,boli,A,,\n'
    '"Ng, Zoe",103,u103,zng,A,,\n'
)


def a_report(file: str, score: float, submitted_at: str = BEFORE, **extra) -> dict:
    """A graded report of one 6-point check, as the grader writes it (the student: the file's stem)."""
    check = {"name": "c", "points": score, "max_points": 6, "passed": score == 6, "feedback": "f"}
    student = file.removesuffix(".ipynb")
    fields = {"student": student, "submitted_at": submitted_at, "seed": 1, "class_seed": 7, **extra}
    return report.build(file, "ex02_shard", "graded", [check], 1.0, **fields)


@pytest.fixture
def roster(tmp_path) -> list[dict]:
    path = tmp_path / "roster.csv"
    path.write_text(CANVAS_ROSTER)
    return report.read_roster(path)


def test_a_canvas_export_row_without_a_sis_login_is_known_by_its_canvas_id(tmp_path):
    path = tmp_path / "roster.csv"
    path.write_text(CANVAS_ROSTER + '"Roe, Max",104,,,A,,\n')
    assert [s["student"] for s in report.read_roster(path)] == ["jdoe", "boli", "zng", "104"]


def test_canvas_download_names_are_read():
    f = report.canvas_file("doejane_LATE_101_5551_02_shard_gather-2.ipynb")
    assert f == report.CanvasFile("doejane", True, "101", "5551", "02_shard_gather.ipynb", 2)
    on_time = report.canvas_file("libo_102_5552_02_shard_gather.ipynb")
    assert (on_time.late, on_time.resubmission, on_time.user_id) == (False, 0, "102")
    assert report.canvas_file("alice.ipynb") is None
    assert report.canvas_file("bob_LATE_x.ipynb") is None
    assert report.canvas_name("Doe, Jane") == report.canvas_name("Jane Doe") == "doejane"
    assert report.canvas_name("O'Neil-Smith, Ann") == "oneilsmithann"


def test_canvas_files_match_the_roster_by_id_then_name_and_late_is_canvass_tag(roster):
    reports = [
        # Tagged LATE by Canvas, though the file's time (the download's) is before the deadline.
        a_report("doejane_LATE_101_5551_02_shard_gather.ipynb", 6, BEFORE),
        # Not tagged, though the file's time is after it; matched by the name alone (no such ID).
        a_report("libo_999_5552_02_shard_gather.ipynb", 3, AFTER),
        a_report("nobodyx_888_5553_02_shard_gather.ipynb", 5),
    ]
    rows = report.gradebook_rows(reports, roster, report.parse_deadline(DEADLINE), "ex02_shard", 6)
    by_student = {r["student"]: r for r in rows}
    assert set(by_student) == {"jdoe", "boli", "nobodyx", "zng"}
    jane, bo, stranger, zoe = (by_student[s] for s in ("jdoe", "boli", "nobodyx", "zng"))
    assert (jane["late"], jane["name"]) == ("yes", "Doe, Jane")
    assert (bo["late"], bo["name"]) == ("no", "Li, Bo")
    assert "not on the roster (no roster row has Canvas ID 888 or the name 'nobodyx')" in stranger["warning"]
    assert (zoe["status"], zoe["score"]) == ("missing", "0")


def test_the_latest_submission_counts_and_the_gradebook_says_so(roster):
    first = a_report("lijo_102_5552_02_shard_gather.ipynb", 6, AFTER)
    again = a_report("lijo_102_5552_02_shard_gather-1.ipynb", 2, BEFORE)  # Canvas's -1: the later upload
    plain_old = a_report("carl.ipynb", 6, BEFORE)
    plain_new = a_report("carl.ipynb", 1, AFTER, student="carl")
    plain_new["file"] = "carl-resubmitted.ipynb"
    rows = report.gradebook_rows([first, again, plain_old, plain_new], roster)
    counted = {r["file"]: r["counted"] for r in rows if r["file"]}
    assert counted == {
        "lijo_102_5552_02_shard_gather.ipynb": "no: lijo_102_5552_02_shard_gather-1.ipynb is later",
        "lijo_102_5552_02_shard_gather-1.ipynb": "yes: the latest of 2 submissions",
        "carl.ipynb": "no: carl-resubmitted.ipynb is later",
        "carl-resubmitted.ipynb": "yes: the latest of 2 submissions",
    }
    assert {r["student"] for r in rows if r["file"].startswith("lijo")} == {"boli"}  # matched by ID 102


def test_the_canvas_import_names_the_assignment_by_id_and_leaves_out_unmatched_files(roster, tmp_path):
    reports = [
        a_report("doejane_101_5551_02_shard_gather.ipynb", 6),
        a_report("libo_102_5552_02_shard_gather.ipynb", 5),
        a_report("libo_102_5552_02_shard_gather-1.ipynb", 2),  # the latest counts, though lower
        a_report("nobodyx_888_5553_02_shard_gather.ipynb", 4),
    ]
    rows = report.gradebook_rows(reports, roster, None, "ex02_shard", 6)
    column, warning = report.canvas_column("Shard and gather", list(roster[0]))
    assert (column, warning) == ("Shard and gather (991)", "")
    out = tmp_path / "canvas.csv"
    left_out = report.write_canvas(rows, roster, out, column)
    assert [r["file"] for r in left_out] == ["nobodyx_888_5553_02_shard_gather.ipynb"]
    with open(out, newline="") as f:
        lines = list(csv.reader(f))
    assert lines == [
        ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "Shard and gather (991)"],
        ["Doe, Jane", "101", "u101", "jdoe", "A", "6"],
        ["Li, Bo", "102", "u102", "boli", "A", "2"],
        ["Ng, Zoe", "103", "u103", "zng", "A", "0"],
    ]
    assert all(line[1] for line in lines[1:])  # never a blank ID


def test_the_assignment_column_without_an_id_says_how_to_give_it():
    assert report.canvas_column("HW 2 (77)") == ("HW 2 (77)", "")
    column, warning = report.canvas_column("HW 2", ["Student", "ID", "HW 1 (76)"])
    assert column == "HW 2" and "--canvas-assignment 'NAME (ID)'" in warning and "HW 1 (76)" in warning


def test_without_a_roster_a_canvas_file_gives_canvass_user_id(tmp_path):
    rows = report.gradebook_rows([a_report("doejane_LATE_101_5551_02_shard_gather.ipynb", 4)])
    assert (rows[0]["student"], rows[0]["late"]) == ("doejane", "yes")
    out = tmp_path / "canvas.csv"
    assert report.write_canvas(rows, None, out, "HW (1)") == []
    assert out.read_text().splitlines()[1] == "doejane,101,,,,4"


def test_the_deadline_is_kept_beside_the_seed_and_a_regraded_row_keeps_late(tmp_path):
    deadline = report.parse_deadline(DEADLINE)
    book = tmp_path / "g.csv"
    report.write_gradebook(report.gradebook_rows([a_report("ann.ipynb", 3, AFTER)], None, deadline), book)
    rows = report.read_gradebook(book)
    header = list(rows[0])
    assert header.index("deadline") == header.index("class_seed") + 1
    assert (rows[0]["late"], rows[0]["deadline"]) == ("yes", DEADLINE)
    kept = report.parse_deadline(report.recorded(rows, "deadline"))
    assert kept == deadline
    regraded = report.gradebook_row(a_report("ann.ipynb", 6, AFTER), kept)
    [row] = report.update_gradebook(book, regraded)
    assert (row["late"], row["score"], row["deadline"]) == ("yes", "6", DEADLINE)


def test_a_regraded_file_keeps_the_student_its_row_was_matched_to(roster, tmp_path):
    file = "doejane_101_5551_02_shard_gather.ipynb"
    book = tmp_path / "g.csv"
    report.write_gradebook(report.gradebook_rows([a_report(file, 2)], roster, None, "ex02_shard", 6), book)
    rows = report.update_gradebook(book, report.gradebook_row(a_report(file, 5)))
    [jane] = [r for r in rows if r["file"] == file]
    assert (jane["student"], jane["name"], jane["score"]) == ("jdoe", "Doe, Jane", "5")
    assert len(rows) == 3  # jane, and the missing rows of bo and zoe


def test_an_old_gradebook_without_the_new_columns_takes_them_on_update(tmp_path):
    book = tmp_path / "old.csv"
    book.write_text("student,file,status,score,late\nann,ann.ipynb,graded,3,yes\n")
    rows = report.update_gradebook(book, report.gradebook_row(a_report("ben.ipynb", 6)))
    assert [r["counted"] for r in rows] == ["yes", "yes"]
    assert list(report.read_gradebook(book)[0])[:5] == ["student", "file", "status", "score", "late"]


# ---------------------------------------------------------------------------------------- the command line


@pytest.mark.parametrize(
    "args, says",
    [
        ([], "pass a SUBMISSION"),
        (["--exchange", "{dir}", "--exercise", "ex01_memory"], "--exchange needs --gradebook"),
        (["--exchange", "{dir}", "--gradebook", "{dir}/g.csv"], "pass --exercise ID"),
        (["{dir}", "--exchange", "{dir}", "--gradebook", "{dir}/g.csv", "--exercise", "ex01_memory"], "drop"),
        (
            ["--exchange", "{dir}", "--gradebook", "{dir}/g.csv", "--exercise", "ex01_memory",
             "--student-pattern", "x"],
            "drop --student-pattern",
        ),
        (["--exchange", "{dir}/none", "--gradebook", "{dir}/g.csv", "--exercise", "ex01_memory"], "no inbound/"),
        (["{dir}/canvas", "--gradebook", "{dir}/g.csv", "--deadline", "2026-12-10"], "LATE tag"),
        (["{dir}/one.ipynb", "--roster", "{dir}/r.csv"], "--roster adds a folder's missing students"),
    ],
)  # fmt: skip
def test_bad_grade_arguments_are_one_line_and_exit_2(tmp_path, capsys, args, says):
    (tmp_path / "canvas").mkdir()
    (tmp_path / "canvas" / "doejane_LATE_101_5551_02_shard_gather.ipynb").write_text("{}")
    (tmp_path / "canvas" / "libo_102_5552_02_shard_gather.ipynb").write_text("{}")
    (tmp_path / "one.ipynb").write_text("{}")
    (tmp_path / "r.csv").write_text("student\nann\n")
    args = [a.format(dir=tmp_path) for a in args]
    assert main(["grade", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err and "Traceback" not in err, err


def test_the_deadline_applies_to_a_mixed_folders_other_files_only(tmp_path):
    """A folder of Canvas files and others keeps --deadline (for the others): it is not refused."""
    from labkit.cli.grade import _refuse_deadline_of_canvas_files

    (tmp_path / "doejane_LATE_101_5551_02_shard_gather.ipynb").write_text("{}")
    (tmp_path / "ann.ipynb").write_text("{}")
    assert _refuse_deadline_of_canvas_files(None, tmp_path) is None  # no UsageError
    (tmp_path / "ann.ipynb").unlink()
    with pytest.raises(UsageError, match="LATE tag"):
        _refuse_deadline_of_canvas_files(None, tmp_path)
