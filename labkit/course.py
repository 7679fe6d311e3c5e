"""Where the course's files live: exercises, solutions, notebooks, docs (one answer for every module).

In this order: `$LABKIT_COURSE` (a folder holding `exercises/`, `notebooks/`, ...), else the checkout the
package runs from (`labkit/`'s parent, when it holds `exercises/`), else the copy a wheel carries inside
the package (`labkit/_course/`, written by setup.py's build step). A folder of one kind alone can still be
named: `$LABKIT_EXERCISES` for the pristine exercises (what the grader compares submissions with).
"""

from __future__ import annotations

import os
from pathlib import Path

COURSE_ENV = "LABKIT_COURSE"
EXERCISES_ENV = "LABKIT_EXERCISES"
FOLDERS = ("exercises", "solutions", "notebooks", "docs")  # what a wheel carries under labkit/_course/
FILES = ("requirements.txt",)  # and these (the pins `labkit doctor` compares with)
PACKAGE_DIR = Path(__file__).resolve().parent
PACKAGED = PACKAGE_DIR / "_course"


def holds(module: str) -> bool:
    """Whether this copy of labkit holds `module` ("labkit.zero"), read from its files: the student release
    leaves some out, and an import finder of another copy installed beside it must not answer for it."""
    parts = module.split(".")[1:]
    base = PACKAGE_DIR.joinpath(*parts)
    return (base / "__init__.py").is_file() or base.with_suffix(".py").is_file()


def course_dir() -> Path:
    """The course folder (see the module docstring); ValueError, saying what to set, when there is none."""
    override = os.environ.get(COURSE_ENV)
    if override:
        path = Path(override).expanduser()
        if not (path / "exercises").is_dir():
            raise ValueError(
                f"{COURSE_ENV}={override} holds no exercises/ folder; point it at a labkit checkout"
            )
        return path
    for candidate in (PACKAGE_DIR.parent, PACKAGED):
        if (candidate / "exercises").is_dir():
            return candidate
    raise ValueError(
        f"labkit found no course folder beside {PACKAGE_DIR}; set {COURSE_ENV} to a labkit checkout"
    )


def course_path(folder: str) -> Path:
    """One folder or file of the course, e.g. course_path("solutions"); `exercises` honours $LABKIT_EXERCISES."""
    if folder == "exercises" and os.environ.get(EXERCISES_ENV):
        return Path(os.environ[EXERCISES_ENV]).expanduser()
    return course_dir() / folder
