"""`labkit release --student`: the copy students pull holds no answer, and check() still works from it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from release_helpers import (
    executed_from_release,
    executed_text,
    learners_copy,
    most_similar,
    type_in_the_filled_cells,
)

from labkit.buildalong import reveal
from labkit.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _answer_cells() -> dict[str, list[str]]:
    """{'<solution> <cell id>': its code lines, stripped, blank and comment lines dropped}."""
    cells = {}
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if "answer" in cell.get("metadata", {}).get("tags", []):
                cells[f"{path.name} {cell['id']}"] = _lines("".join(cell["source"]))
    return cells


def _lines(text: str) -> list[str]:
    return [s for ln in text.splitlines() if (s := ln.strip()) and s[0] != "#"]


def _readable(path: Path) -> str:
    """The file as a reader sees it, with the same normalisation: a notebook's cells, else its text."""
    text = path.read_text(errors="replace")
    if path.suffix == ".ipynb":
        text = "\n".join("".join(c["source"]) for c in json.loads(text)["cells"])
    return "\n".join(_lines(text))


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


def _answer_code_lines() -> dict[str, str]:
    """{line: where} for each line of answer code the release must not hold, found here independently of
    labkit.release: the solutions' answer cells and the notebooks' filled build cells, less what the pristine
    exercises and the stubs show, less lines with fewer than two names that are not keywords."""
    import keyword
    import re

    given = {ln for p in (ROOT / "exercises").glob("*.ipynb") for ln in _readable(p).splitlines()}
    code = [(ln, name) for name, lines in _answer_cells().items() for ln in lines]
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if "build" in cell["metadata"].get("tags", []):
                given.update(_lines(cell["metadata"]["labkit"]["stub"]))
                code += [(ln, f"{path.name} {cell['id']}") for ln in _lines("".join(cell["source"]))]

    def telling(line):
        return len([w for w in re.findall(r"[A-Za-z_]\w*", line) if not keyword.iskeyword(w)]) >= 2

    return {ln: where for ln, where in code if ln not in given and telling(ln)}


@pytest.fixture
def release(student_release: Path) -> Path:
    """The session's one student release (tests/conftest.py): read it; copy it to write in it."""
    return student_release


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
    # labkit's own ZeRO-3 stays in the instructor's copy: the student copy's scratch engine is the learner's
    assert (
        "This copy holds no ZeRO-3 of labkit's: its scratch engine is yours."
        in (release / "README.md").read_text()
    )
    assert not (release / "labkit" / "zero").exists()


COURSE_PATH = re.compile(r"(?<![\w/])(?:\.\./)?((?:tests|benchmarks|solutions|docs)/[\w./-]*\w)")


def test_every_path_the_release_names_is_in_it_or_said_to_be_the_instructors(release: Path):
    """A student reads every shipped text: a path to the suite, the benchmarks, the solutions or a doc the
    release leaves out is named only in a paragraph (a line of a .yml) that says it is the instructor's copy's. The Makefile
    names them to refuse its targets (`test_make_targets_the_release_cannot_run_say_so...`)."""
    import nbformat

    from labkit.grading.exercises import source

    unsaid = []
    for path in sorted(
        p for p in release.rglob("*") if p.is_file() and p.suffix in {".md", ".ipynb", ".yml"}
    ):
        if path.suffix == ".ipynb":
            texts = [source(c) for c in nbformat.read(path, as_version=4).cells]
        elif path.suffix == ".yml":  # comments: a line each
            texts = path.read_text().splitlines()
        else:
            texts = [path.read_text()]
        for paragraph in (p for text in texts for p in re.split(r"\n\s*\n", text)):
            for name in COURSE_PATH.findall(paragraph):
                if not (release / name).exists() and "instructor's copy" not in paragraph:
                    unsaid.append(f"{path.relative_to(release)}: {name}")
    assert not unsaid, unsaid


@pytest.mark.parametrize(("target", "folder"), [("test", "tests"), ("bench", "benchmarks")])
def test_make_targets_the_release_cannot_run_say_so_before_any_set_up(
    release: Path, target: str, folder: str
):
    done = subprocess.run(["make", target], cwd=release, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.splitlines()[0] == (
        f"make: this copy has no {folder}/: the student release of the course leaves the test suite and the "
        "benchmarks out"
    )
    assert not (release / ".venv").exists()  # nothing was set up first


def test_no_line_of_answer_code_is_anywhere_in_the_release(release: Path):
    lines = _answer_code_lines()
    assert len(lines) >= 80, len(lines)
    assert any("reduce_scatter_single" in ln for ln in lines)  # the capstone's and 02's
    held = [
        f"{where}: {ln!r} in {path.relative_to(release)}"
        for path in sorted(p for p in release.rglob("*") if p.is_file() and ".git" not in p.parts)
        for ln in set(_readable(path).splitlines()) & set(lines)
        for where in [lines[ln]]
    ]
    assert held == []
    assert not (release / "labkit" / "build" / "reference.py").exists()


def test_the_release_turns_every_build_cell_into_its_stub(release: Path):
    built = 0
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        mine = {c["id"]: c for c in json.loads(path.read_text())["cells"]}
        theirs = {c["id"]: c for c in json.loads((release / "notebooks" / path.name).read_text())["cells"]}
        assert list(mine) == list(theirs), path.name
        for cell_id, cell in mine.items():
            if "build" in cell["metadata"].get("tags", []):
                built += 1
                assert "".join(theirs[cell_id]["source"]) == cell["metadata"]["labkit"]["stub"].rstrip("\n")
                assert "write_this_piece(" in "".join(theirs[cell_id]["source"])
            else:
                assert theirs[cell_id]["source"] == cell["source"], (path.name, cell_id)
    assert built >= 6


def test_the_reference_after_the_deadline_holds_the_filled_build_cells_and_no_solution(
    release: Path, tmp_path: Path, capsys
):
    assert not (release / "reference").exists()  # not without --reference
    out = tmp_path / "after-deadline"
    # The capstone's hooks are 02's pieces: the reference waits for the exercises it would answer.
    assert main(["release", "--student", str(out), "--reference"]) == 2
    refused = capsys.readouterr().err.strip().splitlines()
    assert refused == [
        "labkit release: reference/ would show answers of ex02_shard, ex05_deepspeed, ex07_capstone (lines of "
        "their solutions are in the filled build cells); hand it out once those are due too: add --past "
        "ex02_shard,ex05_deepspeed,ex07_capstone"
    ]
    assert not any(p.name != ".labkit-release" for p in out.iterdir())
    assert main(["release", "--student", str(out), "--past", "ex07_capstone"]) == 2
    assert capsys.readouterr().err.strip().endswith("pass it with --reference")
    past = "ex02_shard,ex05_deepspeed,ex07_capstone"
    assert main(["release", "--student", str(out), "--reference", "--past", past]) == 0
    assert "and reference/: the build cells filled" in capsys.readouterr().out
    with_builds = [
        path.name
        for path in sorted((ROOT / "notebooks").glob("*.ipynb"))
        if any("build" in c["metadata"].get("tags", []) for c in json.loads(path.read_text())["cells"])
    ]
    assert {"02_zero3_from_scratch.ipynb", "03_prefetch_overlap.ipynb", "04_offload.ipynb"} <= set(
        with_builds
    )
    assert sorted(p.name for p in (out / "reference").glob("*.ipynb")) == with_builds
    for name in with_builds:  # the instructor's cells, as they are; the student's notebooks still stubs
        assert (out / "reference" / name).read_text() == (ROOT / "notebooks" / name).read_text()
        assert (out / "notebooks" / name).read_text() == (release / "notebooks" / name).read_text()
    others = {k: v for k, v in _answer_cells().items() if not k.startswith(("02_", "05_", "07_"))}
    assert _found(out, others) == []  # no other exercise's solution anywhere, reference/ included
    assert (
        _found(out / "notebooks", _answer_cells()) == [] and _found(out / "exercises", _answer_cells()) == []
    )
    build_lines = {ln for ln, where in _answer_code_lines().items() if where.startswith(tuple(with_builds))}
    held = set(_readable(out / "reference" / "02_zero3_from_scratch.ipynb").splitlines())
    assert len(build_lines & held) >= 20  # the filled pieces are there to read
    outside = [p for p in out.rglob("*") if p.is_file() and "reference" not in p.relative_to(out).parts[:1]]
    assert not any(set(_readable(p).splitlines()) & build_lines for p in outside if ".git" not in p.parts)


def test_a_build_cell_without_a_stub_is_refused(tmp_path: Path, monkeypatch, capsys):
    course = tmp_path / "course"
    for name in ("exercises", "solutions", "notebooks"):
        shutil.copytree(ROOT / name, course / name)
    path = course / "notebooks" / "02_zero3_from_scratch.ipynb"
    nb = json.loads(path.read_text())
    cell = next(c for c in nb["cells"] if "build" in c["metadata"].get("tags", []))
    del cell["metadata"]["labkit"]["stub"]
    path.write_text(json.dumps(nb))
    monkeypatch.setenv("LABKIT_COURSE", str(course))
    assert main(["release", "--student", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"build cell {cell['id']} has no stub" in err and "\n" not in err


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
    (course / "notebooks" / "README.md").write_text(answer[-1])  # one line of it is enough
    monkeypatch.setenv("LABKIT_COURSE", str(course))
    assert main(["release", "--student", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "labkit release: the release would show the answer 01_memory.ipynb cell answer-fit in"
    )
    assert err.endswith("remove it there and release again") and "\n" not in err
    assert not any(p.name != ".labkit-release" for p in (tmp_path / "out").iterdir()), "nothing left to push"


def test_a_release_again_keeps_git_and_a_foreign_folder_is_refused(release: Path, tmp_path: Path, capsys):
    release = Path(shutil.copytree(release, tmp_path / "again"))  # the session's release stays as it was
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
    done = subprocess.run(
        [sys.executable, "-c", CHECK, str(release), str(notebook)],
        cwd=release,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_check_runs_the_public_checks_from_the_release(release: Path, tmp_path: Path):
    """On 3 ranks, from the release's own labkit: a solution passes them, the pristine stubs do not, and an
    answer that is labkit's own function earns nothing there either (the integrity rule ships)."""
    solved = _check_from_release(release, ROOT / "solutions" / "02_shard_gather.ipynb")
    assert "2/2 (public checks only: the grade runs your answer cells again" in solved, solved
    assert "ok  1/1  round trip on 3 ranks: all 2 cases right" in solved, solved
    pristine = _check_from_release(release, release / "exercises" / "02_shard_gather.ipynb")
    assert "0/2 (public checks only" in pristine and "NotImplementedError" in pristine, pristine
    borrowed = json.loads((ROOT / "solutions" / "02_shard_gather.ipynb").read_text())
    next(c for c in borrowed["cells"] if c.get("id") == "answer-shard")["source"] = (
        "from labkit.zero.sharding import shard_dim0 as shard_rows"
    )
    (tmp_path / "borrowed.ipynb").write_text(json.dumps(borrowed))
    library = _check_from_release(release, tmp_path / "borrowed.ipynb")
    assert "no points: your answer `shard_rows` is labkit.zero.sharding.shard_dim0" in library, library


def test_labkit_grade_in_the_release_refuses_in_one_sentence(release: Path):
    """The release has no grader checks: `labkit grade` says so and exits 2, before grading anything."""
    done = subprocess.run(
        [sys.executable, "-m", "labkit", "grade", "exercises/02_shard_gather.ipynb"],
        cwd=release,
        env={**os.environ, "PYTHONPATH": str(release)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "labkit grade: this copy of labkit has no grader checks (the student release leaves them out); grade "
        "with the instructor's copy, and run the last cell of an exercise, check(), for its public checks"
    ]
    assert not list(release.glob("exercises/*.report.json"))


# ------------------------------------------------------------------------------- the public checks, here


def _namespace(notebook: Path, replace: dict[str, str] | None = None) -> dict:
    """What the kernel holds after the parameters, set-up and answer cells (`replace`: {cell id: source})."""
    from labkit.grading import exercises

    ns = {"__name__": "__main__"}
    for cell in json.loads(notebook.read_text())["cells"]:
        if exercises.role(cell) in exercises.GRADED_ROLES:
            try:
                exec((replace or {}).get(cell["id"], "".join(cell["source"])), ns)
            except NotImplementedError:
                pass  # a stub cell that raises at top level defines nothing
    return ns


def _public_results(exercise_id: str, ns: dict) -> list[bool]:
    from labkit.grading import public
    from labkit.grading.kit import judge_all, probe_all

    exercise = public.load(exercise_id, exercise_id)
    return [e["passed"] for e in judge_all(exercise, probe_all(exercise, ns, 0), 0)]


def _solutions() -> dict[str, Path]:
    from labkit.grading import exercises

    return exercises.index(ROOT / "solutions")


@pytest.mark.parametrize("exercise_id", sorted(_solutions()))
def test_every_exercise_has_public_checks_a_solution_passes_and_a_stub_fails(exercise_id):
    solution = _solutions()[exercise_id]
    assert all(_public_results(exercise_id, _namespace(solution))), exercise_id
    pristine = ROOT / "exercises" / solution.name
    assert not any(_public_results(exercise_id, _namespace(pristine))), exercise_id


FLOOR_SHARD = """
def shard_rows(full, rank, world_size):
    rows = full.shape[0] // world_size  # floor: the classic mistake
    return full[rank * rows : (rank + 1) * rows].clone()
"""
SWAPPED_GROUPS = """
def hsdp_groups(world_size, group_size):
    shard = [list(range(j, world_size, group_size)) for j in range(group_size)]
    return shard, [list(range(s, s + group_size)) for s in range(0, world_size, group_size)]
"""


@pytest.mark.parametrize(
    "exercise_id, cell, source, failed",
    [
        ("ex02_shard", "answer-shard", FLOOR_SHARD, [True, True]),
        ("ex06_hsdp", "answer-mesh", SWAPPED_GROUPS, [True, False, False, False]),
    ],
)
def test_a_common_mistake_fails_its_public_check(exercise_id, cell, source, failed):
    ns = _namespace(_solutions()[exercise_id], {cell: source})
    assert [not ok for ok in _public_results(exercise_id, ns)] == failed


# ----------------------------------------------------------------------- the student copy of 02, executed


def test_the_student_02_runs_on_its_stubs_and_passes_once_the_pieces_are_written(
    release: Path, tmp_path: Path, monkeypatch
):
    name = "02_zero3_from_scratch.ipynb"
    copy = tmp_path / "notebooks" / name
    copy.parent.mkdir()
    shutil.copy(release / "notebooks" / name, copy)
    stubbed = "\n".join(executed_from_release(release, copy, monkeypatch))
    verdicts = re.findall(r"^([✓✗]) (\w+): (.*)$", stubbed, re.M)
    assert len(verdicts) == 6 and all(v[0] == "✗" and "write this piece: " in v[2] for v in verdicts), stubbed
    assert "Not yet: the runs below train your six pieces" in stubbed
    assert (
        stubbed.count(reveal.NOT_YET) == 3 and "def start_gather" not in stubbed
    )  # labkit's own: after yours
    # the learner writes each piece: here, the instructor's filled cells typed into the stubs
    filled = {c["id"]: c["source"] for c in json.loads((ROOT / "notebooks" / name).read_text())["cells"]}
    nb = json.loads(copy.read_text())
    for cell in nb["cells"]:
        if "build" in cell["metadata"].get("tags", []):
            cell["source"] = filled[cell["id"]]
    copy.write_text(json.dumps(nb))
    written = "\n".join(executed_from_release(release, copy, monkeypatch))
    verdicts = re.findall(r"^([✓✗]) (\w+): ", written, re.M)
    assert [v[0] for v in verdicts] == ["✓"] * 6, written
    assert reveal.NOT_YET not in written
    assert reveal.NOT_SHIPPED in written and "def start_gather" not in written  # no code of labkit's to show
    assert float(re.search(r"largest relative difference: (\S+)", written).group(1)) < 1e-4


# ----------------------------------------------------- the student copy's scratch engine: the learner's own


def test_compare_in_the_student_copy_refuses_what_the_learners_engine_cannot_run_yet(release: Path):
    """Before 02 is written, and for a setting the learner's engine does not do: one sentence, exit code 2."""
    said = {}
    for flags in (
        ["--engines", "scratch,fsdp2"],
        ["--engines", "scratch", "--hsdp", "2", "--world-size", "4"],
    ):
        r = subprocess.run(
            [sys.executable, "-m", "labkit", "compare", *flags, "--steps", "1"],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(release)},
            cwd=release,
            timeout=120,
        )
        assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r
        said[flags[-1]] = r.stderr
    assert "Your 02 still has shard, gather, before_forward" in said["scratch,fsdp2"]
    assert (
        "Your engine does not do --hsdp = 2, so the scratch engine of this copy (yours) cannot run: leave"
        in said["4"]
    )


def test_the_student_07_runs_the_learners_engine_as_the_instructors_copy_runs_the_filled_cells(
    release: Path, tmp_path: Path, monkeypatch, executed
):
    """No row of labkit's engine; the learner's (their 02 and 03, here the filled cells) beside the libraries, with
    the losses and bytes the instructor's copy measures for the same cells."""
    name = "07_head_to_head.ipynb"
    copy = learners_copy(release, tmp_path)
    for notebook in ("02_zero3_from_scratch", "03_prefetch_overlap"):  # 07's runs prefetch: 03's moments
        type_in_the_filled_cells(copy, f"notebooks/{notebook}.ipynb")
    written = executed_text(copy, copy / "notebooks" / name, monkeypatch)
    instructor = "\n".join(
        "".join(o.get("text", "") for o in c.get("outputs", [])) for c in executed(name).cells
    )
    assert not re.search(r"^scratch ", written, re.M) and re.search(r"^scratch ", instructor, re.M)
    mine = [
        line for line in written.splitlines() if line.startswith("Your engine trained to single's losses")
    ]
    assert len(mine) == 1 and mine[0] in instructor.splitlines(), (mine, instructor)


COPIED = 0.6  # a piece whose 8-token shingles are this share of one function's or more is in the release


def test_the_release_holds_no_function_of_labkits_own_pieces(release: Path, tmp_path: Path):
    """labkit's own pieces (labkit/zero/ and the filled build cells) against every function of the release,
    locals renamed away: none holds a piece (the largest share stays under COPIED); planted renamed copies of
    two pieces in a copy of the release are found."""
    import inspect

    from labkit.zero.optimizer import ShardedAdamW
    from labkit.zero.sharding import shard_dim0

    worst = most_similar(release)
    assert len(worst) >= 40 and worst[0][0] < COPIED, worst[:3]
    copy = learners_copy(release, tmp_path)
    renamed = {"full": "weight", "rows": "per_rank", "out": "mine", "lo": "first", "hi": "last", "grad": "g"}
    planted = "\n\n".join(inspect.getsource(fn).replace("    def step", "def step") for fn in (shard_dim0,))
    planted += "\n\n" + inspect.cleandoc(inspect.getsource(ShardedAdamW.step).replace("@torch.no_grad()", ""))
    for old, new in renamed.items():
        planted = re.sub(rf"\b{old}\b", new, planted)
    (copy / "labkit" / "helpers.py").write_text(planted)
    found = {
        piece: share for share, piece, where in most_similar(copy) if where.startswith("labkit/helpers.py")
    }
    assert found["labkit/zero/sharding.py: shard_dim0"] >= COPIED, found
    assert found["labkit/zero/optimizer.py: step"] >= COPIED, found


LEARNERS_RUNS = """
import json
from labkit.engines import scratch
from labkit.engines.base import RunConfig
from labkit.engines.loop import run, run_many
from labkit.model import build_model

cfgs = {
    "02": RunConfig(model="tiny", world_size=2, steps=3, prefetch=False),
    "03": RunConfig(model="tiny", world_size=2, steps=3),
    "04": RunConfig(model="tiny", world_size=2, steps=3, prefetch=False, offload="cpu"),
}
single = run("single", RunConfig(model="tiny", world_size=1, steps=3))["losses"]
out = {"own": scratch.labkits_own()}
for (name, cfg), rec in zip(cfgs.items(), run_many([("scratch", c) for c in cfgs.values()])):
    net = build_model("tiny")
    out[name] = {
        "loss_rel": max(abs(a - b) / b for a, b in zip(rec["losses"], single)),
        "wire": {k: v["wire_bytes"] for k, v in rec["comm"].items()},
        "formula": scratch.predicted_wire_bytes(net, cfg, 2),
        "state": rec["state_bytes"],
        "accounting": scratch.state_bytes_accounting(net, cfg, 2),
    }
print(json.dumps(out))
"""


def test_the_student_copys_scratch_engine_is_the_learners_and_names_a_wrong_piece(
    release: Path, tmp_path: Path
):
    """In the student copy `scratch` runs the learner's cells: 02's, with 03's moments when it prefetches and
    04's optimizer when it offloads; each trains to single's losses and sends the formula's bytes, its state
    equal to the accounting. A planted mistake in 02, then one in 03, stops `labkit compare` before any run,
    naming the piece and its check."""
    copy = learners_copy(release, tmp_path)
    env = {**os.environ, "PYTHONPATH": str(copy)}
    for notebook in ("02_zero3_from_scratch", "03_prefetch_overlap", "04_offload"):
        type_in_the_filled_cells(copy, f"notebooks/{notebook}.ipynb")
    r = subprocess.run(
        [sys.executable, "-c", LEARNERS_RUNS], capture_output=True, text=True, env=env, cwd=copy, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    runs = json.loads(r.stdout.strip().splitlines()[-1])
    assert runs.pop("own") is False
    for name, got in runs.items():
        assert got["loss_rel"] < 1e-4 and got["wire"] == got["formula"], (name, got)
        assert {k: b for k, b in got["accounting"].items() if k in got["state"]} == got["state"], (name, got)
    assert (
        runs["04"]["state"]["optimizer"] == 0 and runs["02"]["state"]["optimizer"] > 0
    )  # m and v on the host
    notebook = copy / "notebooks" / "02_zero3_from_scratch.ipynb"
    text = notebook.read_text()
    assert text.count("summed / unit.n") == 1
    notebook.write_text(text.replace("summed / unit.n", "summed"))  # after_grad sums, never divides
    r = subprocess.run(
        [sys.executable, "-m", "labkit", "compare", "--engines", "scratch", "--no-prefetch", "--steps", "1"],
        capture_output=True,
        text=True,
        env=env,
        cwd=copy,
        timeout=300,
    )
    assert r.returncode == 2 and r.stdout == "", r
    assert (
        "Your `after_grad` fails 02's `reduce_scatter` check, so the scratch engine of this copy (yours)"
        in r.stderr
    )
    # 02 put right, and 03's forward moment without its prefetch: a prefetching run names 03's check
    notebook.write_text(text)
    prefetching = copy / "notebooks" / "03_prefetch_overlap.ipynb"
    line = "start_gather(unit.next)  # in flight while this unit computes"
    assert prefetching.read_text().count(line) == 1
    prefetching.write_text(prefetching.read_text().replace(line, "pass"))
    r = subprocess.run(
        [sys.executable, "-m", "labkit", "compare", "--engines", "scratch", "--steps", "1"],
        capture_output=True,
        text=True,
        env=env,
        cwd=copy,
        timeout=300,
    )
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r
    assert "Your `before_forward` and `before_backward` fail 03's `prefetch` check, so" in r.stderr, r.stderr
