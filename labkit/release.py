"""The student release: a folder to push as its own git repository, the one students' nbgitpuller links pull.

It holds the notebooks, the pristine exercises, the docs a student reads and the labkit the notebooks
import, with no `solutions/` and none of the grader's checks (`labkit/grading/checks/ex*.py`: their hidden
cases and the judges that compute reference answers); there `check()` runs the public checks
(`labkit.grading.public`). Before it is done, every file is searched for every answer cell of the solutions.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat

from labkit.course import PACKAGE_DIR, course_dir, course_path
from labkit.grading.exercises import ANSWER, NOTEBOOK_VERSION, role, source

MARKER = ".labkit-release"  # in a folder this command wrote: a later run may replace its contents
KEPT = (".git", MARKER)  # what a re-release leaves in place (the repository students pull)
COURSE_FILES = ("exercises", "notebooks", "docs/cheatsheets", "docs/budget.md", "docs/cluster.md",
                "pyproject.toml", "setup.py", "LICENSE", "requirements.txt", "environment.yml", "binder",
                "Makefile", "scripts/install-debian-packages")  # fmt: skip
INSTRUCTOR_ONLY = ("grading/checks/ex*.py", "_course")  # under labkit/: the grader's checks, a wheel's course
JUNK = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", "*.executed.ipynb")
README = """# labkit: the student copy

Open `notebooks/00_start_here.ipynb` first; the exercises are in `exercises/`. Fill the cells marked
`# YOUR ANSWER HERE` and run the last cell: `check()` runs the public checks (your answers against torch's
and DeepSpeed's own results, the rules each exercise states, and its example). Your grade comes from the
instructor's grader, which runs your answer cells again on cases you have not seen.

On your own machine: `make lab` (Python 3.11, a few GB for torch and DeepSpeed).
"""


def release_student(out: Path) -> list[Path]:
    """Write the student release into `out` (new, empty, or an earlier release); returns the files written."""
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
    shutil.copytree(PACKAGE_DIR, out / "labkit", ignore=JUNK)
    for pattern in INSTRUCTOR_ONLY:
        for path in (out / "labkit").glob(pattern):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    (out / "README.md").write_text(README)
    (out / MARKER).write_text(
        "written by `labkit release --student`; the next run replaces everything but .git\n"
    )
    leaks = answer_leaks(out, course_path("solutions"))
    if leaks:
        _clear(out)  # nothing of a release that shows an answer is left to push
        raise ValueError(f"the release would show the answer {leaks[0]}; remove it there and release again")
    return sorted(p for p in out.rglob("*") if p.is_file() and ".git" not in p.relative_to(out).parts)


def _clear(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; pass a folder (new, empty, or an earlier release)")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).exists():
        raise ValueError(f"{out} holds files that are not a labkit release; pass a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)
    for path in out.iterdir():
        if path.name not in KEPT:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def normalised_lines(text: str) -> list[str]:
    """The lines of `text` that carry code: stripped, without blank lines and comment lines."""
    return [s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")]


def file_text(path: Path) -> str:
    """What a reader sees in a file: a notebook's cell sources (its JSON escapes undone), else the text."""
    if path.suffix == ".ipynb":
        return "\n".join(source(c) for c in nbformat.read(path, as_version=NOTEBOOK_VERSION).cells)
    return path.read_text(errors="replace")


def answer_leaks(folder: Path, solutions: Path) -> list[str]:
    """'<solution> cell <id> in <file>' for every answer cell of `solutions` whose code appears in a file."""
    answers = []
    for nb_path in sorted(solutions.glob("*.ipynb")) if solutions.is_dir() else []:
        for cell in nbformat.read(nb_path, as_version=NOTEBOOK_VERSION).cells:
            if role(cell) == ANSWER:
                answers.append((f"{nb_path.name} cell {cell.id}", "\n".join(normalised_lines(source(cell)))))
    leaks = []
    for path in sorted(
        p for p in folder.rglob("*") if p.is_file() and ".git" not in p.relative_to(folder).parts
    ):
        text = "\n".join(normalised_lines(file_text(path)))
        leaks += [f"{name} in {path.relative_to(folder)}" for name, code in answers if code and code in text]
    return leaks
