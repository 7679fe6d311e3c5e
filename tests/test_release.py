"""`labkit release --student`: the copy students pull holds no answer, and check() still works from it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _answer_cells() -> dict[str, list[str]]:
    """{'<solution> <cell id>': its code lines, stripped, blank and comment lines dropped}."""
    cells = {}
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if "answer" in cell.get("metadata", {}).get("tags", []):
                lines = [
                    s for ln in "".join(cell["source"]).splitlines() if (s := ln.strip()) and s[0] != "#"
                ]
                cells[f"{path.name} {cell['id']}"] = lines
    return cells


def _readable(path: Path) -> str:
    """The file as a reader sees it, with the same normalisation: a notebook's cells, else its text."""
    text = path.read_text(errors="replace")
    if path.suffix == ".ipynb":
        text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"])
    return "\n".join(s for ln in text.splitlines() if (s := ln.strip()) and s[0] != "#")


def _found(folder: Path, cells: dict[str, list[str]]) -> list[str]:
    found = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and ".git" not in p.parts):
        text = _readable(path)
        found += [
            f"{name} in {path.relative_to(folder)}"
            for name, lines in cells.items()
            if "\n".join(lines) in text
        ]
    return found


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("student")
    assert main(["release", "--student", str(out)]) == 0
    return out


def test_release_holds_the_course_and_no_solutions_or_grader_checks(release: Path):
    assert not (release / "solutions").exists()
    assert sorted(p.name for p in (release / "exercises").glob("*.ipynb")) == sorted(
        p.name for p in (ROOT / "exercises").glob("*.ipynb")
    )
    assert sorted(p.name for p in (release / "notebooks").glob("*.ipynb")) == sorted(
        p.name for p in (ROOT / "notebooks").glob("*.ipynb")
    )
    assert [p.name for p in (release / "labkit" / "grading" / "checks").glob("*.py")] == ["__init__.py"]
    assert (release / "labkit" / "grading" / "public.py").is_file()
    assert not (release / "docs" / "instructor.md").exists() and (release / "docs" / "cheatsheets").is_dir()


def test_no_answer_cell_of_the_solutions_is_anywhere_in_the_release(release: Path, tmp_path: Path):
    cells = _answer_cells()
    assert len(cells) >= 19, sorted(cells)
    assert _found(release, cells) == []
    # the search finds an answer where one is: pasted into a copied notebook's cell
    leaked = tmp_path / "leaked"
    shutil.copytree(release / "exercises", leaked)
    path = leaked / "02_shard_gather.ipynb"
    nb = json.loads(path.read_text())
    nb["cells"][3]["source"] = "\n    ".join(cells["02_shard_gather.ipynb answer-shard"])
    path.write_text(json.dumps(nb))
    assert _found(leaked, cells) == [f"02_shard_gather.ipynb answer-shard in {path.name}"]


def test_the_release_refuses_a_course_whose_notebooks_show_an_answer(tmp_path: Path, monkeypatch, capsys):
    course = tmp_path / "course"
    for name in ("exercises", "solutions", "notebooks"):
        shutil.copytree(ROOT / name, course / name)
    answer = _answer_cells()["01_memory.ipynb answer-fit"]
    (course / "notebooks" / "README.md").write_text("\n".join(answer))
    monkeypatch.setenv("LABKIT_COURSE", str(course))
    assert main(["release", "--student", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "labkit release: the release would show the answer 01_memory.ipynb cell answer-fit in"
    )
    assert err.endswith("remove it there and release again") and "\n" not in err
    assert not any(p.name != ".labkit-release" for p in (tmp_path / "out").iterdir()), "nothing left to push"


def test_a_release_again_keeps_git_and_a_foreign_folder_is_refused(release: Path, tmp_path: Path, capsys):
    (release / ".git").mkdir(exist_ok=True)
    (release / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (release / "stale.txt").write_text("from an old release")
    assert main(["release", "--student", str(release)]) == 0
    assert (release / ".git" / "HEAD").is_file() and not (release / "stale.txt").exists()
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.md").write_text("my notes")
    assert main(["release", "--student", str(other)]) == 2
    assert "not a labkit release; pass a new or empty folder" in capsys.readouterr().err
    assert (other / "notes.md").read_text() == "my notes"


CHECK = """
import json, sys
import labkit
assert labkit.__file__.startswith(sys.argv[1]), labkit.__file__
ns = {"__name__": "__main__"}
for cell in json.load(open(sys.argv[2]))["cells"]:
    if {"parameters", "setup", "answer"} & set(cell["metadata"].get("tags", [])):
        exec("".join(cell["source"]), ns)
from labkit.grading.feedback import check
check("ex02_shard", ns)
"""


def _check_from_release(release: Path, notebook: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(release)}
    done = subprocess.run([sys.executable, "-c", CHECK, str(release), str(notebook)], cwd=release, env=env,
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_check_runs_the_public_checks_from_the_release(release: Path):
    """On 3 ranks, from the release's own labkit: a solution passes them, the pristine stubs do not."""
    solved = _check_from_release(release, ROOT / "solutions" / "02_shard_gather.ipynb")
    assert "2/2 (public checks only: the grade runs your answer cells again" in solved, solved
    assert "ok  1/1  round trip on 3 ranks: all 2 cases right" in solved, solved
    pristine = _check_from_release(release, release / "exercises" / "02_shard_gather.ipynb")
    assert "0/2 (public checks only" in pristine and "NotImplementedError" in pristine, pristine
