"""The set-up: pins agree everywhere, the Makefile's targets and stamp, README == .ci/run, the op prebuild."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from labkit import KERNEL_NAME, prebuild

ROOT = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^(?P<name>[A-Za-z0-9_.\-]+)==(?P<version>[^\s;#]+)$")


def _pins(lines: list[str]) -> list[tuple[str, str]]:
    pins = []
    for line in lines:
        m = PIN.match(line.strip())
        if m:
            pins.append((m["name"].lower().replace("_", "-"), m["version"]))
    return pins


def requirements() -> list[tuple[str, str]]:
    lines = [ln.split("#", 1)[0].strip() for ln in (ROOT / "requirements.txt").read_text().splitlines()]
    lines = [ln for ln in lines if ln]
    assert all(PIN.match(ln) for ln in lines), f"every line of requirements.txt is name==version: {lines}"
    return _pins(lines)


def test_requirements_pin_torch_first():
    pins = requirements()
    assert pins[0] == ("torch", "2.13.0")
    names = [name for name, _ in pins]
    assert len(names) == len(set(names)), "a package is pinned twice"
    for needed in (
        "deepspeed",
        "jupyterlab",
        "ipykernel",
        "ipywidgets",
        "matplotlib",
        "nbval",
        "papermill",
        "pytest",
    ):
        assert needed in names
    assert Version(dict(pins)["deepspeed"]).release[:2] == (0, 19)
    assert Version(dict(pins)["jupyterlab"]).major == 4
    assert Version(dict(pins)["ipywidgets"]).major == 8


def test_environment_yml_carries_the_same_pins():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    assert "python=3.11" in deps
    pip_section = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    assert _pins(pip_section) == requirements(), "environment.yml's pip pins drifted from requirements.txt"
    others = [entry for entry in pip_section if not PIN.match(entry.strip())]
    assert others == ["-e ."], f"only labkit itself besides the pins: {others}"


def test_pyproject_floors_are_met_by_the_pins():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = dict(requirements())
    for spec in project["dependencies"]:
        req = Requirement(spec)
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"pyproject depends on {name}, which requirements.txt does not pin"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{name}=={pins[name]} does not meet {req}"
        )
    assert project["scripts"]["labkit"] == "labkit.cli:main"


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*):(?!=)", text, flags=re.M))


def test_every_committed_notebook_names_the_labkit_kernel():
    """On a hub whose server runs from another environment, `python3` would open without labkit."""
    import json

    notebooks = sorted(ROOT.glob("notebooks/*.ipynb")) + sorted(ROOT.glob("exercises/*.ipynb"))
    notebooks += sorted(ROOT.glob("solutions/*.ipynb"))
    names = {
        p.relative_to(ROOT).as_posix(): json.loads(p.read_text())["metadata"]["kernelspec"]["name"]
        for p in notebooks
    }
    assert len(names) >= 22 and set(names.values()) == {KERNEL_NAME}, names
    registered = [
        line for line in (ROOT / "Makefile").read_text().splitlines() if "ipykernel install" in line
    ]
    registered += [
        line
        for line in (ROOT / "binder" / "postBuild").read_text().splitlines()
        if "ipykernel install" in line
    ]
    assert len(registered) == 2 and all(f"--name {KERNEL_NAME} " in line for line in registered), registered


def test_makefile_targets():
    targets = _make_targets()
    assert {"lab", "test", "lint", "setup"} <= targets
    text = (ROOT / "Makefile").read_text()
    assert "--notebook-dir notebooks" in text
    assert "--sys-prefix --name labkit" in text
    assert "-m labkit.prebuild" in text
    assert (ROOT / "notebooks").is_dir()


def _code_blocks(markdown: str) -> list[list[str]]:
    blocks, current = [], None
    for line in markdown.splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_readme_gives_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    intro = readme.split("\n## ", 1)[0]
    assert _code_blocks(intro) == [["make lab"], ["make test"]], (
        "exactly two commands before the first section"
    )
    first_test_line = next(ln for block in _code_blocks(readme) for ln in block if "test" in ln)
    assert first_test_line == "make test"
    ci = ROOT / ".ci" / "run"
    assert ci.stat().st_mode & stat.S_IXUSR, ".ci/run is executable"
    text = ci.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    commands = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert commands[-1] == first_test_line, ".ci/run ends with the README's test command, verbatim"
    for section in ("## GPU hub install", "## The CLI", "## Layout"):
        assert section in readme


def test_readme_lists_every_cli_command():
    from labkit.cli import COMMANDS

    cli_section = (ROOT / "README.md").read_text().split("## The CLI", 1)[1].split("\n## ", 1)[0]
    for name in COMMANDS:
        assert f"`labkit {name}" in cli_section, f"README's CLI section does not describe `labkit {name}`"


# ------------------------------------------------------------------------------------- the set-up stamp


def _dry_run(workdir: Path) -> str:
    # A clean make: not a sub-make of `make test PYTEST_ARGS=...`, whose variables would carry over.
    env = {
        k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")
    }
    for name in ("PYTHON", "VENV", "PORT", "ARGS", "PYTEST_ARGS"):
        env.pop(name, None)
    out = subprocess.run(
        ["make", "--no-print-directory", "-n", "test"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture
def fake_checkout(tmp_path: Path) -> Path:
    """The Makefile and its inputs beside a stand-in venv, so `make -n` can be read without touching .venv."""
    for name in ("Makefile", "requirements.txt", "pyproject.toml", "binder/apt.txt", "tests/apt.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)
    old = time.time() - 100
    for name in ("Makefile", "requirements.txt", "pyproject.toml", "binder/apt.txt", ".venv/bin/python"):
        os.utime(tmp_path / name, (old, old))
    return tmp_path


def test_first_make_test_installs_torch_first_then_builds_ops_and_kernel(fake_checkout: Path):
    lines = _dry_run(fake_checkout).splitlines()
    installs = [i for i, ln in enumerate(lines) if "pip install" in ln]
    # Debian packages (libaio for NVMe offload) before the prebuild that compiles against them; the test
    # suite's own (Chromium) before pytest.
    assert lines[0] == "scripts/install-debian-packages --optional binder/apt.txt"
    assert "scripts/install-debian-packages binder/apt.txt tests/apt.txt" in lines[-2]
    assert 'pip install "torch==2.13.0"' in lines[installs[0]]
    assert "-r requirements.txt" in lines[installs[1]]
    assert "--no-deps -e ." in lines[installs[2]]
    after = "\n".join(lines[installs[2] :])
    assert after.index("-m labkit.prebuild") < after.index("ipykernel install") < after.index("-m pytest")


def test_stamp_makes_a_second_make_test_do_no_install_work(fake_checkout: Path):
    stamp = fake_checkout / ".venv" / ".labkit-setup"
    stamp.touch()
    lines = [ln.strip() for ln in _dry_run(fake_checkout).splitlines()]
    assert lines == [
        "scripts/install-debian-packages binder/apt.txt tests/apt.txt",
        ".venv/bin/python -m pytest",
    ], lines
    later = time.time() + 5
    os.utime(fake_checkout / "requirements.txt", (later, later))  # a changed pin redoes the set-up
    assert "pip install -r requirements.txt" in _dry_run(fake_checkout)


def test_this_checkout_is_set_up_when_run_by_make():
    stamp = ROOT / ".venv" / ".labkit-setup"
    inputs = [ROOT / "requirements.txt", ROOT / "pyproject.toml"]
    if not stamp.exists() or any(p.stat().st_mtime > stamp.stat().st_mtime for p in inputs):
        pytest.skip("this checkout's venv was not set up by make (run `make test`)")
    out = _dry_run(ROOT)
    assert "pip install" not in out and "-m pytest" in out
    assert all(s in ("built", "skipped") for s in _op_statuses().values()), _op_statuses()


def _op_statuses() -> dict[str, str]:
    return {name: prebuild.op_status(name).status for _, name in prebuild.CPU_OPS}


# ------------------------------------------------------------------------------------------ op prebuild


def test_op_status_reads_the_build_folder_and_finds_interrupted_builds(tmp_path: Path):
    ext = tmp_path / "ext"
    assert prebuild.op_status("cpu_adam", str(ext)).status == "missing"
    assert not ext.exists(), "inspecting creates nothing"

    build = ext / "cpu_adam"
    build.mkdir(parents=True)
    (build / "cpu_adam.so").write_bytes(b"")
    assert prebuild.op_status("cpu_adam", str(ext)).status == "built"

    lock = build / "lock"
    fd = os.open(lock, os.O_CREAT | os.O_EXCL)  # what torch's FileBaton does while it builds
    try:
        status = prebuild.op_status("cpu_adam", str(ext))
        assert status.status == "building" and os.getpid() in status.lock_holders
        assert not prebuild.clear_interrupted(status) and lock.exists(), "a live build's lock is left alone"
    finally:
        os.close(fd)
    status = prebuild.op_status("cpu_adam", str(ext))  # the builder died: nobody holds the lock
    assert status.status == "interrupted" and status.lock_holders == []
    assert prebuild.clear_interrupted(status) and not lock.exists()
    assert prebuild.op_status("cpu_adam", str(ext)).status == "built"


def test_extensions_dir_honours_torch_extensions_dir(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert prebuild.extensions_dir() == str(tmp_path)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    from torch.utils.cpp_extension import _get_build_directory

    assert os.path.join(prebuild.extensions_dir(), "deepspeed_shm_comm") == _get_build_directory(
        "deepspeed_shm_comm", verbose=False
    ), "the same folder torch builds in"


def test_pin_writes_a_pth_that_every_python_of_the_env_reads(tmp_path: Path):
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    python = env / "bin" / "python"
    base = {k: v for k, v in os.environ.items() if k not in ("TORCH_EXTENSIONS_DIR", "PYTHONPATH")}
    code = "from labkit.prebuild import pin_environment; print(pin_environment())"
    out = subprocess.run(
        [python, "-c", code],
        env={**base, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert out.stdout.strip().endswith(prebuild.PTH_NAME)
    read = "import os, shutil; print(os.environ.get('TORCH_EXTENSIONS_DIR')); print(shutil.which('ninja'))"
    seen = subprocess.run(
        [python, "-c", read], env=base, capture_output=True, text=True, check=True, timeout=60
    )
    extensions, ninja = seen.stdout.split("\n")[:2]
    assert extensions == str(env / "torch_extensions")
    if shutil.which("ninja", path=base.get("PATH")):  # the env's ninja is a link to the one set-up found
        assert ninja == str(env / prebuild.NINJA_DIR / "ninja")
    mine = subprocess.run(
        [python, "-c", read],
        env={**base, "TORCH_EXTENSIONS_DIR": "/elsewhere"},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert mine.stdout.split("\n")[0] == "/elsewhere", "a TORCH_EXTENSIONS_DIR set by the user wins"


def test_debian_packages_script_does_nothing_when_all_are_installed(tmp_path: Path):
    listing = tmp_path / "apt.txt"
    listing.write_text("# always there on Debian\ndpkg coreutils\n")
    out = subprocess.run(
        [ROOT / "scripts" / "install-debian-packages", listing], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout == "" and out.stderr == ""
