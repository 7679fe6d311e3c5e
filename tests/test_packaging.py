"""Packaging: a wheel installed in another environment grades from outside the checkout; the course folder;
the declared dependencies; the GPU hub image's set-up steps are the Makefile's; the Zero to JupyterHub values."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement

import labkit
from labkit import course
from labkit.cli import main
from labkit.limits import DEEPSPEED_SHM_BYTES_PER_RANK, NCCL_SHM_BYTES

ROOT = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^(?P<name>[A-Za-z0-9_.\-]+)==(?P<version>[^\s;#]+)$")
JUPYTER_EXTENSIONS = {"nbgitpuller", "jupyterlab-rise"}  # the Jupyter server's and JupyterLab's, not labkit's
SOURCES = ("labkit", "pyproject.toml", "setup.py", "README.md", "LICENSE", *course.FOLDERS, *course.FILES)


def _requirement_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        m = PIN.match(line.split("#", 1)[0].strip())
        if m:
            pins[m["name"].lower()] = m["version"]
    return pins


def _test_only() -> set[str]:
    [line] = [
        ln
        for ln in (ROOT / "binder" / "environment.yml").read_text().splitlines()
        if ln.startswith("# test-only:")
    ]
    return set(line.split(":", 1)[1].split())


def test_pyproject_declares_every_runtime_pin_and_the_license():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {Requirement(spec).name.lower() for spec in project["dependencies"]}
    runtime = set(_requirement_pins()) - _test_only() - JUPYTER_EXTENSIONS
    assert declared == runtime, (
        f"declared but not pinned: {declared - runtime}; pinned, not declared: {runtime - declared}"
    )
    assert project["license"] == "MIT" and (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert project["dynamic"] == ["version"]


def test_version_is_labkits(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"labkit {labkit.__version__}"


# ------------------------------------------------------------------------------------------ the course folder


def test_course_folder_is_the_checkout_unless_told(monkeypatch, tmp_path):
    monkeypatch.delenv(course.COURSE_ENV, raising=False)
    monkeypatch.delenv(course.EXERCISES_ENV, raising=False)
    assert course.course_dir() == ROOT and course.course_path("solutions") == ROOT / "solutions"
    (tmp_path / "exercises").mkdir()
    monkeypatch.setenv(course.COURSE_ENV, str(tmp_path))
    assert course.course_path("notebooks") == tmp_path / "notebooks"
    monkeypatch.setenv(course.EXERCISES_ENV, str(tmp_path / "mine"))
    assert course.course_path("exercises") == tmp_path / "mine"


def test_a_course_folder_without_exercises_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(course.COURSE_ENV, str(tmp_path))
    submission = tmp_path / "s.ipynb"
    shutil.copy(ROOT / "solutions" / "01_memory.ipynb", submission)
    assert main(["grade", str(submission)]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"labkit grade: {course.COURSE_ENV}={tmp_path} holds no exercises/ folder; point it at a labkit checkout\n"
    )


# ------------------------------------------------------------------------------------------------ the wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """labkit's wheel, built from a copy of the sources and installed into a new venv that borrows this one's
    other packages (a .pth line: nothing is downloaded); returns the venv's bin folder."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "_course"))
        else:
            shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            str(src),
            "-w",
            str(tmp / "dist"),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = (tmp / "dist").glob("labkit-*.whl")
    env = tmp / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    site = Path(
        subprocess.check_output(
            [env / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True,
        ).strip()
    )
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(env / "bin" / "python"),
            "install",
            "--no-deps",
            "-q",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    for folder in course.FOLDERS:
        assert any(n.startswith(f"labkit/_course/{folder}/") for n in names), folder
    assert {f"labkit/_course/{name}" for name in course.FILES} <= set(names)
    assert "labkit-" + labkit.__version__ + ".dist-info/licenses/LICENSE" in names
    return env / "bin"


def _outside(bin_dir: Path) -> dict[str, str]:
    """An environment that knows nothing of the checkout: its venv first on PATH, no labkit variables."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", course.COURSE_ENV, course.EXERCISES_ENV)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"}


def test_an_installed_wheel_grades_a_solution_to_full_marks_from_outside_the_checkout(installed, tmp_path):
    env = _outside(installed)
    where = subprocess.run(
        [installed / "python", "-c", "import labkit.course as c; print(c.__file__); print(c.course_dir())"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert not where[0].startswith(str(ROOT)) and where[1].endswith(os.path.join("labkit", "_course")), where
    version = subprocess.run([installed / "labkit", "--version"], env=env, capture_output=True, text=True)
    assert version.stdout.strip() == f"labkit {labkit.__version__}"
    shutil.copy(ROOT / "solutions" / "01_memory.ipynb", tmp_path / "alice.ipynb")
    argv = [installed / "labkit", "grade", "alice.ipynb", "--out", "alice.json"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    report = json.loads((tmp_path / "alice.json").read_text())
    assert (report["exercise"], report["status"]) == ("ex01_memory", "graded"), report
    assert report["score"] == report["max_score"] == 6, report


# ------------------------------------------------------------------------------------------- the GPU image


def _commands(lines: list[str]) -> list[str]:
    """Shell commands, continuation lines joined and `&&` chains split."""
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [c.strip() for line in joined.splitlines() for c in line.split("&&") if c.strip()]


def _step(command: str) -> tuple[str, ...] | None:
    """What a set-up command does, in terms the Makefile and the Dockerfile share; None for other commands."""
    argv = shlex.split(command.replace("$(TORCH)", "$TORCH"))
    if argv[0].endswith("install-debian-packages"):
        return ("debian", *[a for a in argv[1:] if a != "--optional"])
    if "install" in argv and any(a in ("pip", "$(PIP)") for a in argv):
        if "-r" in argv:
            return ("pins", argv[argv.index("-r") + 1])
        if "$TORCH" in argv:
            return ("torch first",)
        if "--no-deps" in argv and "-e" in argv:
            return ("labkit, no deps",)
        return None
    if argv[1:3] == ["-m", "labkit.prebuild"]:
        return ("prebuild",)
    if "ipykernel" in argv and "install" in argv:
        return ("kernel", argv[argv.index("--name") + 1])
    return None


def _makefile_setup() -> list[str]:
    text = (ROOT / "Makefile").read_text()
    recipe = text.split("\n$(STAMP):", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    return _commands([ln.strip() for ln in recipe])


def _dockerfile_setup() -> list[str]:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    final = text.split("\nFROM ${BASE}", 1)[1]
    runs = re.findall(r"^RUN ((?:[^\n]*\\\n)*[^\n]*)", final, flags=re.M)
    return _commands(runs)


def test_the_images_set_up_is_the_makefiles_step_for_step():
    make = [s for c in _makefile_setup() if (s := _step(c))]
    docker_commands = _dockerfile_setup()
    docker = [s for c in docker_commands if (s := _step(c))]
    assert make == [
        ("debian", "binder/apt.txt"),
        ("torch first",),
        ("pins", "requirements.txt"),
        ("labkit, no deps",),
        ("prebuild",),
        ("kernel", labkit.KERNEL_NAME),
    ]
    assert docker == make, docker
    # torch's pin is read from requirements.txt the same way, and comes from PyTorch's CUDA index there
    torch_expr = re.search(r"sed -n '[^']*' requirements.txt", (ROOT / "Makefile").read_text())[0]
    assert torch_expr in (ROOT / "docker" / "Dockerfile").read_text()
    [torch_install] = [c for c in docker_commands if _step(c) == ("torch first",)]
    assert "--index-url ${TORCH_INDEX}" in torch_install
    # DeepSpeed's CUDA ops after the CPU prebuild, only where nvcc is, at DeepSpeed's pin
    [cuda_ops] = [c for c in docker_commands if "DS_BUILD_" in c]
    assert "nvcc" in cuda_ops and "grep '^deepspeed==' requirements.txt" in cuda_ops
    assert {"DS_BUILD_FUSED_ADAM=1", "DS_BUILD_QUANTIZER=1", "DS_ACCELERATOR=cuda"} <= set(cuda_ops.split())
    assert docker_commands.index(cuda_ops) > next(
        i for i, c in enumerate(docker_commands) if _step(c) == ("prebuild",)
    )


def test_the_image_serves_the_student_release_outside_home_with_nbgitpuller():
    text = (ROOT / "docker" / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE=quay\.io/jupyter/pytorch-notebook:cuda12-", text, flags=re.M)
    assert "labkit release --student /release" in text and "COPY --from=release" in text
    assert re.search(r"^WORKDIR /opt/labkit$", text, flags=re.M) and "/opt/labkit\n" in text
    assert "grep '^nbgitpuller==' requirements.txt" in text and "nbgitpuller" in _requirement_pins()
    ignored = (ROOT / "docker" / "Dockerfile.dockerignore").read_text().split()
    assert {".venv", ".git"} <= set(ignored)


# Kubernetes' Ki/Mi/Gi and JupyterHub's ByteSpecification (mem_limit), whose K/M/G are powers of 1024 too.
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def _bytes(size: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]i?)?", str(size))
    return int(m[1]) * _UNITS[m[2] or ""]


def test_the_hub_values_offer_1_2_4_8_gpus_with_limits_and_a_memory_backed_shm():
    values = yaml.safe_load((ROOT / "docker" / "values.yaml").read_text())["singleuser"]
    profiles = values["profileList"]
    gpus = []
    for p in profiles:
        o = p["kubespawner_override"]
        assert (
            o["extra_resource_limits"]["nvidia.com/gpu"] == o["extra_resource_guarantees"]["nvidia.com/gpu"]
        )
        gpus.append(int(o["extra_resource_limits"]["nvidia.com/gpu"]))
        assert o["cpu_limit"] >= o["cpu_guarantee"] > 0 and _bytes(o["mem_limit"]) >= _bytes(
            o["mem_guarantee"]
        )
    assert gpus == [1, 2, 4, 8] and [p.get("default", False) for p in profiles].count(True) == 1
    [shm] = [v for v in values["storage"]["extraVolumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    [mount] = [m for m in values["storage"]["extraVolumeMounts"] if m["name"] == shm["name"]]
    assert mount["mountPath"] == "/dev/shm"
    shm_bytes = _bytes(shm["emptyDir"]["sizeLimit"])
    assert shm_bytes >= 8 * DEEPSPEED_SHM_BYTES_PER_RANK + NCCL_SHM_BYTES, (
        "DeepSpeed's CPU comm on 8 ranks, and NCCL"
    )
    assert all(_bytes(p["kubespawner_override"]["mem_limit"]) > 2 * shm_bytes for p in profiles)
    assert values["cpu"]["limit"] and values["memory"]["limit"]
