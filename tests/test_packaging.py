"""Packaging: a wheel installed in another environment grades from outside the checkout; the course folder;
the declared dependencies; the GPU hub image's set-up steps are the Makefile's, its Jupyter extensions in the
server's environment, its library root's; the Zero to JupyterHub values (profiles whose descriptions are true, the
exchange volume, the start timeout and the pre-pullers)."""

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
# A dependency's dependency pinned for its cost, not imported by labkit: jsonschema (nbformat's validator) from
# 4.25 on compiles rfc3987-syntax's grammar when imported, 2 to 3 s in every process that reads a notebook.
SPEED_PINS = {"jsonschema"}
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
    runtime = set(_requirement_pins()) - _test_only() - JUPYTER_EXTENSIONS - SPEED_PINS
    assert declared == runtime, (
        f"declared but not pinned: {declared - runtime}; pinned, not declared: {runtime - declared}"
    )
    assert project["license"] == "MIT" and (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert project["dynamic"] == ["version"]


def test_reading_a_notebook_compiles_no_grammar():
    """The speed pin holds: nbformat's import (the grader, check() in a kernel, papermill) leaves rfc3987-syntax's
    grammar alone (a fresh interpreter: nothing else has imported it)."""
    code = "import sys, nbformat, labkit.grading.grader; print('rfc3987_syntax' in sys.modules, 'lark' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"], done.stdout


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
        if "--no-deps" in argv and ("-e" in argv or any(a.endswith(".whl") for a in argv)):
            return (
                "labkit, no deps",
            )  # editable from the checkout (Makefile), or the release's wheel (image)
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


def _final_stage() -> list[tuple[str, str, str]]:
    """The image's stage (after `FROM ${BASE}`) as (instruction, its arguments with continuations joined, the
    USER it runs as), comments left out."""
    text = (ROOT / "docker" / "Dockerfile").read_text().split("\nFROM ${BASE}", 1)[1]
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    stage, user = [], "${NB_UID}"  # docker-stacks' images end as the notebook user
    for line in filter(str.strip, joined.splitlines()):
        instruction, _, args = line.strip().partition(" ")
        user = args.strip() if instruction == "USER" else user
        stage.append((instruction, args.strip(), user))
    return stage


def _dockerfile_setup(as_user: bool = False) -> list:
    """The shell commands of the image's RUN lines (with the USER each runs as, if `as_user`)."""
    runs = [(c, user) for ins, args, user in _final_stage() if ins == "RUN" for c in _commands([args])]
    return runs if as_user else [c for c, _ in runs]


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


def test_the_jupyter_extensions_are_installed_where_jupyterlab_runs():
    """RISE, the widgets' JupyterLab side and nbgitpuller go into the server's environment (the base's conda root,
    where the hub's jupyterhub-singleuser and JupyterLab run), not the kernel's; the build checks both facts."""
    stage = _final_stage()
    env = dict(args.split("=", 1) for ins, args, _ in stage if ins == "ENV")
    assert env["SERVER_PY"] == "${CONDA_DIR}/bin/python" and env["PY"] == "${LABKIT_ENV}/bin/python"
    commands = _dockerfile_setup()
    pinned = re.compile(r"grep '\^([A-Za-z0-9_.-]+)==' requirements.txt")
    server = [c for c in commands if c.startswith("${SERVER_PY} -m pip install ")]
    installed = {name for c in server for name in pinned.findall(c)}
    assert JUPYTER_EXTENSIONS | {"ipywidgets"} <= installed <= set(_requirement_pins())
    elsewhere = [
        c for c in commands if "pip" in c and c not in server and JUPYTER_EXTENSIONS & set(pinned.findall(c))
    ]
    assert not elsewhere, f"a Jupyter extension installed outside the server's environment: {elsewhere}"
    hub_command = 'test "$(command -v jupyterhub-singleuser)" = "${CONDA_DIR}/bin/jupyterhub-singleuser"'
    [rise_check] = [c for c in commands if "labextension list" in c]
    assert (
        rise_check.startswith("${CONDA_DIR}/bin/jupyter ")
        and 'grep -q "jupyterlab-rise .*enabled"' in rise_check
    )
    assert commands.index(server[0]) < commands.index(hub_command) < commands.index(rise_check)
    [kernel] = [c for c in commands if (_step(c) or ("",))[0] == "kernel"]
    assert "--prefix ${CONDA_DIR}" in kernel  # registered where that server looks for kernels


def test_the_library_is_a_root_owned_wheel_install_the_notebook_user_cannot_edit():
    stage = _final_stage()
    copies = [args for ins, args, _ in stage if ins == "COPY"]
    assert any(a.endswith("/release /opt/labkit") for a in copies)
    assert not [a for a in copies if "--chown" in a], "COPY without --chown leaves the files root's"
    [(install, user)] = [
        (c, u) for c, u in _dockerfile_setup(as_user=True) if _step(c) == ("labkit, no deps",)
    ]
    argv = shlex.split(install)
    assert user == "root" and "-e" not in argv and any(a.endswith(".whl") for a in argv), install
    assert stage[-1][2] == "${NB_UID}", "the image must end as the notebook user"
    release = (ROOT / "docker" / "Dockerfile").read_text().split("\nFROM ${BASE}", 1)[0]
    [wheel] = [c for c in _commands([release]) if "pip wheel" in c]
    assert shlex.split(wheel)[-1] != "/release", (
        "a build in /release would leave build/ in the image's course"
    )


# Kubernetes' Ki/Mi/Gi and JupyterHub's ByteSpecification (mem_limit), whose K/M/G are powers of 1024 too.
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def _bytes(size: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]i?)?", str(size))
    return int(m[1]) * _UNITS[m[2] or ""]


def _values() -> dict:
    return yaml.safe_load((ROOT / "docker" / "values.yaml").read_text())


def _gpus(profile: dict) -> int:
    """The GPUs a profile requests (its limit and guarantee agree), 0 for none."""
    o = profile["kubespawner_override"]
    limit = o.get("extra_resource_limits", {}).get("nvidia.com/gpu")
    assert limit == o.get("extra_resource_guarantees", {}).get("nvidia.com/gpu"), profile["display_name"]
    return int(limit or 0)


def _claims(description: str, notebooks: set[str]) -> list[tuple[set[str], str | None, set[int]]]:
    """What a profile's description says, clause by clause (split at ';'): (the notebooks the clause speaks of:
    by number, "every notebook" or "the others"; where their ranks run: cpu where it says CPU, else cuda where it
    says GPU; the rank counts it names, "2 to 4 ranks" as {2, 4})."""
    said, claims = set(), []
    for clause in description.split(";"):
        if "every notebook" in clause.lower():
            covered = set(notebooks)
        elif "the others" in clause:
            covered = notebooks - said
        else:
            covered = set(re.findall(r"\b(\d\d)\b", clause))
        said |= covered
        device = "cpu" if "CPU" in clause else "cuda" if "GPU" in clause else None
        ranks = {
            int(n) for pair in re.findall(r"\b(\d)(?: (?:or|to) (\d))? ranks", clause) for n in pair if n
        }
        claims.append((covered, device, ranks))
    return claims


def test_each_hub_profile_requests_the_gpus_it_names_and_says_truly_where_each_notebook_runs():
    """A CPU profile, 2 and 4 GPUs; each description checked against where `labkit.launch` puts each course
    notebook's default ranks on that many GPUs (`classroom.notebook_placement`)."""
    from labkit import classroom

    needs = {need.notebook[:2]: need for need in classroom.notebook_needs(ROOT / "notebooks")}
    profiles = _values()["singleuser"]["profileList"]
    assert sorted(_gpus(p) for p in profiles) == [0, 2, 4]
    assert [p.get("default", False) for p in profiles].count(True) == 1
    for p in profiles:
        gpus, named = _gpus(p), re.fullmatch(r"(\d+) GPUs?|CPU only", p["display_name"])
        assert named and int(named[1] or 0) == gpus, p["display_name"]
        where = {k: classroom.notebook_placement(need, gpus)["device"] for k, need in needs.items()}
        claims = _claims(p["description"], set(needs))
        assert sorted(k for covered, _, _ in claims for k in covered) == sorted(needs), p["description"]
        for covered, device, ranks in claims:
            assert {where[k] for k in covered} == {device}, (p["display_name"], covered, where)
            sizes = [needs[k].ranks for k in covered]
            assert ranks == {min(sizes), max(sizes)}, (p["display_name"], covered, sizes)
    [cpu] = [p for p in profiles if _gpus(p) == 0]
    assert cpu["kubespawner_override"]["environment"]["NVIDIA_VISIBLE_DEVICES"] == "void"


def test_each_profile_holds_the_largest_notebooks_ranks_and_a_memory_backed_shm():
    from labkit import classroom
    from labkit.placement import RANKS_PER_CORE

    values = _values()["singleuser"]
    needs = classroom.notebook_needs(ROOT / "notebooks")
    [shm] = [v for v in values["storage"]["extraVolumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    [mount] = [m for m in values["storage"]["extraVolumeMounts"] if m["name"] == shm["name"]]
    assert mount["mountPath"] == "/dev/shm"
    shm_bytes = _bytes(shm["emptyDir"]["sizeLimit"])
    ranks = max(n.ranks for n in needs)
    assert shm_bytes >= ranks * DEEPSPEED_SHM_BYTES_PER_RANK + NCCL_SHM_BYTES, (
        "DeepSpeed's CPU comm, and NCCL"
    )
    for p in values["profileList"]:
        o = p["kubespawner_override"]
        assert o["cpu_limit"] >= o["cpu_guarantee"] > 0
        assert _bytes(o["mem_limit"]) >= _bytes(o["mem_guarantee"])
        assert o["cpu_limit"] * RANKS_PER_CORE >= ranks, p["display_name"]
        assert _bytes(o["mem_limit"]) >= max(n.memory_bytes for n in needs) + shm_bytes, p["display_name"]
        assert _bytes(o["mem_limit"]) > 2 * shm_bytes
    assert values["cpu"]["limit"] and values["memory"]["limit"]


def test_the_hub_mounts_one_exchange_waits_for_a_large_image_and_pulls_it_ahead():
    values, text = _values(), (ROOT / "docker" / "values.yaml").read_text()
    storage = values["singleuser"]["storage"]
    [mount] = [m for m in storage["extraVolumeMounts"] if m["mountPath"] == "/srv/exchange"]
    assert not mount.get("readOnly") and "subPath" not in mount  # students write their hand-ins there
    [volume] = [v for v in storage["extraVolumes"] if v["name"] == mount["name"]]
    claim = yaml.safe_load((ROOT / "docker" / "exchange-pvc.yaml").read_text())
    assert claim["kind"] == "PersistentVolumeClaim"
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "every student's pod mounts it at once"
    assert (
        "kubectl apply --namespace labkit -f docker/exchange-pvc.yaml" in text
    )  # the chart does not create it
    # A large image: KubeSpawner's 300 s default can pass in the pull alone; both of the chart's pre-pullers on.
    assert values["singleuser"]["startTimeout"] >= 600
    assert values["prePuller"]["hook"]["enabled"] and values["prePuller"]["continuous"]["enabled"]
    assert values["prePuller"]["pullProfileListImages"] is True
    assert re.search(r"helm upgrade .*\n.*--timeout \d+m", text), "the hook puller makes helm upgrade wait"
