"""The student release: a folder to push as its own git repository, the one students' nbgitpuller links pull.

It holds the notebooks, the pristine exercises, the docs a student reads and the labkit the notebooks
import, with no `solutions/` and none of the grader's checks (`labkit/grading/checks/ex*.py`: their hidden
cases and the judges that compute reference answers); there `check()` runs the public checks
(`labkit.grading.public`). Every `build` cell of the notebooks becomes its stub (`metadata.labkit.stub`):
the learner writes it. Each cheat sheet is written with its figure filled as `labkit slides` fills it, from
executed copies of the notebooks when given (papermill's), else saying which run prints it. Before the release
is done, every file is searched for every line of answer code: the lines of the solutions' answer cells and
of the filled build cells that their stubs do not show. After the build's deadline, `reference=True` adds
`reference/`: the notebooks that have build cells, filled (the course's own pieces), and nothing of the
exercises' solutions.
"""

from __future__ import annotations

import keyword
import re
import shutil
from pathlib import Path

import nbformat

from labkit.course import PACKAGE_DIR, course_dir
from labkit.grading.exercises import ANSWER, NOTEBOOK_VERSION, source
from labkit.grading.kit import CHECK_MODULES

MARKER = ".labkit-release"  # in a folder this command wrote: a later run may replace its contents
KEPT = (".git", MARKER)  # what a re-release leaves in place (the repository students pull)
COURSE_FILES = (
    "exercises",
    "notebooks",
    "docs/cheatsheets",
    "docs/budget.md",
    "docs/cluster.md",
    "pyproject.toml",
    "setup.py",
    "LICENSE",
    "requirements.txt",
    "environment.yml",
    "binder",
    "Makefile",
    "scripts/install-debian-packages",
)
# Under labkit/: the grader's checks, a wheel's course, labkit's own ZeRO-3 (in the student copy the scratch
# engine is the learner's: `labkit.buildalong.learners_engine`).
INSTRUCTOR_ONLY = (f"grading/checks/{CHECK_MODULES}", "_course", "zero")
JUNK = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", "*.executed.ipynb")
README = """# labkit: the student copy

Open `notebooks/00_start_here.ipynb` first. In the notebooks, each build cell is yours to write: run it as
it is and the check after it says which piece to write; once written, that check runs it on real ranks.
The exercises are in `exercises/`. Fill the cells marked `# YOUR ANSWER HERE` and run the last cell:
`check()` runs the public checks (your answers against torch's and DeepSpeed's own results, the rules each
exercise states, and its example). Your grade comes from the instructor's grader, which runs your answer
cells again on cases you have not seen.

This copy holds no ZeRO-3 of labkit's: its scratch engine is yours. Once your build cells of 02 pass their
checks, every notebook that runs the scratch engine runs your pieces (with your prefetch from 03 and your
offload from 04 where a run asks for them), and says which piece to fix when one fails.
Each exercise's first cell names the labkit code its answers may not use; the grader watches what your
answer cells import and call, and a check whose answers use that code earns no points.

On your own machine: `make lab` (Python 3.11, a few GB for torch and DeepSpeed).
"""


REFERENCE = "reference"  # the release's folder of filled build-along notebooks, with `reference=True`
REFERENCE_README = """# The course's own pieces

The notebooks here are the course's, with every build cell filled: the pieces labkit's instructor copy runs.
Your own notebooks in `notebooks/` are as you left them. Open one of these beside yours and compare piece by
piece; run its checks to see the reference pass them.
"""


def release_student(
    out: Path, executed: Path | None = None, reference: bool = False, past: tuple[str, ...] = ()
) -> list[Path]:
    """Write the student release into `out` (new, empty, or an earlier release); returns the files written.
    `executed`: a folder of executed copies of the course notebooks, whose outputs fill the cheat sheets.
    `reference`: also write `reference/`, the notebooks that have build cells with those cells filled (to hand
    out after the build's deadline; a new folder, so a pull does not touch the notebooks students edited).
    `past`: the exercises whose deadline has passed too; `reference/` may show their answers, no other's."""
    out = Path(out)
    _clear(out)
    root = course_dir()
    for name in COURSE_FILES:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, out / name, ignore=JUNK)
        elif src.is_file():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out / name)
    fill_cheatsheets(out / "docs" / "cheatsheets", out / "notebooks", executed)
    copy_course_times(root, out)
    for path in sorted((out / "notebooks").glob("*.ipynb")):
        if reference and has_build_cells(path):
            (out / REFERENCE).mkdir(exist_ok=True)
            shutil.copy2(root / "notebooks" / path.name, out / REFERENCE / path.name)
        stub_build_cells(path)
    if reference:
        (out / REFERENCE / "README.md").write_text(REFERENCE_README)
    shutil.copytree(PACKAGE_DIR, out / "labkit", ignore=JUNK)
    for pattern in INSTRUCTOR_ONLY:
        for path in (out / "labkit").glob(pattern):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    (out / "README.md").write_text(README)
    (out / MARKER).write_text(
        "written by `labkit release --student`; the next run replaces everything but .git\n"
    )
    answers = answer_lines(root)
    leaks = answer_leaks(out, answers, skip=(REFERENCE,) if reference else ())
    # reference/ holds the filled build cells: there only the solutions' lines count
    if reference and not leaks:
        solved = {line: where for line, where in answers.items() if " build cell " not in where}
        due = _exercises_shown(out / REFERENCE, solved, root) - set(past)
        if due:
            _clear(out)
            raise ValueError(
                f"reference/ would show answers of {', '.join(sorted(due))} (lines of their solutions are in the "
                f"filled build cells); hand it out once those are due too: add --past {','.join(sorted(due))}"
            )
    if leaks:
        _clear(out)  # nothing of a release that shows an answer is left to push
        raise ValueError(f"the release would show the answer {leaks[0]}; remove it there and release again")
    return sorted(p for p in out.rglob("*") if p.is_file() and ".git" not in p.relative_to(out).parts)


def _exercises_shown(folder: Path, solved: dict[str, str], root: Path) -> set[str]:
    """The ids of the exercises whose solutions' answer lines (`solved`, answer_lines) a file in `folder` holds."""
    from labkit.grading.exercises import exercise_id

    ids = {
        path.name: exercise_id(nbformat.read(path, as_version=NOTEBOOK_VERSION))
        for path in (root / "solutions").glob("*.ipynb")
    }
    return {ids[leak.split(" cell ", 1)[0]] for leak in answer_leaks(folder, solved)}


def _clear(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; pass a folder (new, empty, or an earlier release)")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).exists():
        raise ValueError(f"{out} holds files that are not a labkit release; pass a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    for path in out.iterdir():
        if path.name not in KEPT:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


# A sheet's figure where no executed notebook was given: the notebook's own run prints it.
UNRUN_FIGURE = "_the line your run of the notebook prints, from the cell named below_"


def fill_cheatsheets(sheets: Path, notebooks: Path, executed: Path | None = None) -> None:
    """Fill each cheat sheet `NN_name.md` in `sheets` in place, as `labkit slides` does (`cheatsheet_markdown`):
    from `executed`'s copy of notebook `NN_name.ipynb` when it has one, else from `notebooks`' (unexecuted: the
    sheet says where its figure is printed)."""
    from labkit.slides import cheatsheet_markdown

    for sheet in sorted(sheets.glob("[0-9][0-9]_*.md")):
        name = f"{sheet.stem}.ipynb"
        ran = executed / name if executed is not None and (executed / name).is_file() else notebooks / name
        nb = nbformat.read(ran, as_version=NOTEBOOK_VERSION) if ran.is_file() else nbformat.v4.new_notebook()
        sheet.write_text(cheatsheet_markdown(sheet.read_text(), nb, UNRUN_FIGURE))


COURSE_TIMES_NOTE = (
    "Copied by `labkit release` from the instructor's copy's benchmarks/results.md: how long the course "
    'benchmark took to run each notebook, which its "runs in" line prints (`labkit.slides.runs_in`).'
)


def copy_course_times(root: Path, out: Path) -> None:
    """Give the release the course benchmark's times (`labkit.slides.BENCHMARK_FILES`: the release has no
    benchmarks/): the course section of `root`'s results, with its title, if it has one."""
    from labkit.slides import BENCHMARK_FILES, course_section

    results, copy = (Path(name) for name in BENCHMARK_FILES)
    section = course_section((root / results).read_text()) if (root / results).is_file() else []
    if section:
        title, _, *times = section
        (out / copy).parent.mkdir(parents=True, exist_ok=True)
        (out / copy).write_text("\n".join([title, "", COURSE_TIMES_NOTE, "", *times]) + "\n")


BUILD = "build"


def has_build_cells(path: Path) -> bool:
    """Whether the notebook at `path` has a `build` cell (one the student release stubs)."""
    nb = nbformat.read(path, as_version=NOTEBOOK_VERSION)
    return any(BUILD in c.get("metadata", {}).get("tags", []) for c in nb.cells)


def stub_build_cells(path: Path) -> int:
    """Put each `build` cell's stub (`metadata.labkit.stub`) in its place in the notebook at `path`; how many."""
    nb = nbformat.read(path, as_version=NOTEBOOK_VERSION)
    cells = [c for c in nb.cells if BUILD in c.get("metadata", {}).get("tags", [])]
    for cell in cells:
        stub = cell.metadata.get("labkit", {}).get("stub")
        if not isinstance(stub, str) or not stub.strip():
            raise ValueError(
                f"{path.name}: build cell {cell.id} has no stub; put the cell the learner starts from in its "
                "metadata.labkit.stub"
            )
        cell.source = stub.rstrip("\n")
        cell.outputs, cell.execution_count = [], None
    if cells:
        nbformat.write(nb, path)
    return len(cells)


def normalised_lines(text: str) -> list[str]:
    """The lines of `text` that carry code: stripped, without blank lines and comment lines."""
    return [s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")]


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def telling(line: str) -> bool:
    """A line that says something of an answer: two names or more that are not Python keywords
    (`return out`, `else:` or `import torch` could be any code's)."""
    return len([w for w in _NAME.findall(line) if not keyword.iskeyword(w)]) >= 2


def answer_lines(root: Path) -> dict[str, str]:
    """{line: where it answers} for every telling line of answer code in the course at `root`: the solutions'
    answer cells (less what the pristine exercise's cells show) and the notebooks' filled build cells (less
    what their stubs show)."""
    given: set[str] = set()
    answers: list[tuple[str, str]] = []
    for path in sorted((root / "exercises").glob("*.ipynb")):
        given.update(normalised_lines(file_text(path)))
    solutions = root / "solutions"
    for path in sorted(solutions.glob("*.ipynb")) if solutions.is_dir() else []:
        for cell in nbformat.read(path, as_version=NOTEBOOK_VERSION).cells:
            if ANSWER in cell.get("metadata", {}).get("tags", []):
                answers += [(line, f"{path.name} cell {cell.id}") for line in normalised_lines(source(cell))]
    for path in sorted((root / "notebooks").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=NOTEBOOK_VERSION).cells:
            if BUILD in cell.get("metadata", {}).get("tags", []):
                given.update(normalised_lines(cell.metadata.get("labkit", {}).get("stub", "")))
                answers += [
                    (line, f"{path.name} build cell {cell.id}") for line in normalised_lines(cell.source)
                ]
    return {line: where for line, where in reversed(answers) if telling(line) and line not in given}


def file_text(path: Path) -> str:
    """What a reader sees in a file: a notebook's cell sources (its JSON escapes undone), else the text."""
    if path.suffix == ".ipynb":
        return "\n".join(source(c) for c in nbformat.read(path, as_version=NOTEBOOK_VERSION).cells)
    return path.read_text(errors="replace")


def answer_leaks(folder: Path, answers: dict[str, str], skip: tuple[str, ...] = ()) -> list[str]:
    """'<where> in <file> (<line>)' for every line of `answers` (answer_lines) that a file in `folder` holds
    (but those under its top-level folders named in `skip`)."""
    leaks = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        parts = path.relative_to(folder).parts
        if ".git" in parts or parts[0] in skip:
            continue
        lines = set(normalised_lines(file_text(path)))
        leaks += [
            f"{where} in {path.relative_to(folder)} ({line})"
            for line, where in answers.items()
            if line in lines
        ]
    return leaks
