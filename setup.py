"""The wheel carries the course: build_py copies exercises/, solutions/, notebooks/, docs/ and requirements.txt into
labkit/_course/, where labkit.course finds them when labkit runs from an installed wheel (metadata: pyproject.toml)."""

import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

# setuptools' PEP 517 backend runs this file without its folder on sys.path (pip install -e . from a fresh clone).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from labkit.course import FILES, FOLDERS  # noqa: E402  (labkit.course imports only the standard library)


class BuildPyWithCourse(build_py):
    def run(self):
        super().run()
        if self.editable_mode:  # an editable install runs from the checkout, which holds the course itself
            return
        target = Path(self.build_lib) / "labkit" / "_course"
        for folder in (f for f in FOLDERS if Path(f).is_dir()):  # a student release has no solutions/
            shutil.copytree(
                Path(folder),
                target / folder,
                dirs_exist_ok=True,
                ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"),
            )
        for name in (f for f in FILES if Path(f).is_file()):
            shutil.copy2(name, target / name)


setup(cmdclass={"build_py": BuildPyWithCourse})
