"""`labkit doctor`: the report is real (versions, backend, a 2-rank all_reduce) and gaps exit 1 with advice; the
Jupyter server it checks is the one it runs under (a real process tree: a script named like the hub's server, on
a Python whose environment holds RISE, or a bare one that does not)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labkit import classroom, cluster, doctor, limits, page_server, prebuild
from labkit.cli import main

KEYS = {
    "versions",
    "pinned",
    "devices",
    "backend",
    "limits",
    "max_ranks",
    "max_ranks_by_device",
    "notebooks",
    "toolchain",
    "deepspeed_ops",
    "ninja",
    "kernel",
    "server",
    "smoke_test",
    "problems",
    "ok",
    "torch",
}


@pytest.fixture(scope="module")
def cli_json() -> tuple[subprocess.CompletedProcess, dict]:
    """One real `labkit doctor --json -` in its own process, smoke test included."""
    out = subprocess.run(
        [sys.executable, "-m", "labkit", "doctor", "--json", "-"], capture_output=True, text=True, timeout=180
    )
    return out, json.loads(out.stdout)  # stdout carries the JSON and nothing else


def test_json_report_is_real(cli_json):
    _, report = cli_json
    assert set(report) == KEYS
    v = report["versions"]
    assert v["torch"] == torch.__version__
    assert v["python"] == platform.python_version()
    for name in ("deepspeed", "ipywidgets"):  # the kernel's; JupyterLab is the server's (`server`)
        assert v[name] == importlib.metadata.version(name)
    assert "jupyterlab" not in v
    where = cluster.placement(2)
    assert report["backend"] == {
        "world_size": 2,
        "backend": where.backend,
        "device_type": where.device_type,
        "start_method": where.start_method,
    }
    assert report["max_ranks"] == cluster.max_ranks()
    assert report["max_ranks_by_device"]["cpu"] == cluster.max_ranks("cpu")
    lim, now = report["limits"], limits.read_limits()
    assert (lim["cpus"], lim["cpus_source"]) == (now.cpus.value, now.cpus.source)
    assert (
        lim["memory_source"] == now.memory.source
        and abs(lim["memory_bytes"] - now.memory.value) < 0.25 * now.memory.value
    )
    assert lim["shm_total_bytes"] == now.shm_total_bytes and lim["ranks_bound_by"] == cluster.rank_limit()[1]
    if not torch.cuda.is_available():
        assert report["devices"]["summary"] == "cpu only" and report["devices"]["cuda_count"] == 0
    ops = report["deepspeed_ops"]
    assert ops["extensions_dir"] == prebuild.extensions_dir()
    assert set(ops["ops"]) == {name for _, name in prebuild.CPU_OPS}


def test_smoke_test_all_reduces_on_two_ranks(cli_json):
    _, report = cli_json
    smoke = report["smoke_test"]
    assert smoke["ran"] and smoke["ok"], smoke
    assert smoke["collective"] == "all_reduce" and smoke["world_size"] == 2
    assert smoke["values"] == [3.0, 3.0] == [smoke["expected"]] * 2  # 1 + 2 on every rank
    assert 0 < smoke["collective_s"] < smoke["wall_s"] < doctor.SMOKE_TIMEOUT_S


def test_exit_status_and_advice_follow_the_problems(cli_json):
    out, report = cli_json
    assert report["ok"] == (not report["problems"])
    assert out.returncode == (0 if report["ok"] else 1), out.stderr
    advice = [ln for ln in out.stderr.splitlines() if ln.startswith("labkit doctor: ")]
    assert advice == [f"labkit doctor: {p}" for p in report["problems"]]


def test_json_to_a_file_and_the_table(tmp_path: Path, capsys):
    path = tmp_path / "doctor.json"
    status = main(["doctor", "--skip-smoke", "--json", str(path)])
    report = json.loads(path.read_text())
    assert status == (0 if report["ok"] else 1)
    assert report["smoke_test"] == {"ran": False}
    table = capsys.readouterr().out
    assert f"torch           {torch.__version__}" in table and "smoke test      skipped" in table
    assert f"jupyter server  {doctor._server_line(report['server'])}" in table


def test_unbuilt_ops_exit_1_with_one_line_of_advice(monkeypatch, tmp_path: Path, capsys):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "nothing-built-here"))
    status = main(["doctor", "--skip-smoke", "--json", "-"])
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert status == 1 and not report["ok"]
    assert set(report["deepspeed_ops"]["ops"].values()) <= {"missing", "skipped"}
    assert not report["deepspeed_ops"]["ready"]
    # async_io (NVMe offload) counts only where libaio is installed; without it the op is "skipped".
    unbuilt = [n for n, s in report["deepspeed_ops"]["ops"].items() if s == "missing"]
    assert unbuilt[:3] == ["deepspeed_shm_comm", "fused_adam", "cpu_adam"]
    assert ("async_io" in unbuilt) == prebuild.libaio_available()
    line = (
        f"DeepSpeed CPU ops not built ({', '.join(unbuilt)}): run `make lab` or `python -m labkit.prebuild`"
    )
    assert line in report["problems"]
    assert f"labkit doctor: {line}" in out.err.splitlines()
    assert not (tmp_path / "nothing-built-here").exists(), "the doctor inspects, it never builds"


def test_interrupted_build_is_reported(monkeypatch, tmp_path: Path):
    for _, name in prebuild.CPU_OPS:
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.so").write_bytes(b"")
    (tmp_path / "fused_adam" / "lock").write_bytes(b"")  # left behind by a killed build
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    report = doctor.diagnose(smoke=False)
    assert report["deepspeed_ops"]["ops"]["fused_adam"] == "interrupted"
    assert report["deepspeed_ops"]["ops"]["cpu_adam"] == "built"
    [line] = [p for p in report["problems"] if "fused_adam" in p]
    assert "lock" in line and "python -m labkit.prebuild" in line
    assert not report["ok"]


def test_missing_kernel_is_reported(monkeypatch):
    monkeypatch.setattr(doctor, "KERNEL_NAME", "labkit-no-such-kernel")
    report = doctor.diagnose(smoke=False)
    assert report["kernel"]["registered"] is False
    assert any("ipykernel install --sys-prefix --name labkit-no-such-kernel" in p for p in report["problems"])


def _planted_failure() -> None:
    raise RuntimeError("planted in the smoke test")


def test_a_failing_smoke_test_is_a_problem(monkeypatch):
    monkeypatch.setattr(doctor, "_all_reduce_rank", _planted_failure)
    report = doctor.diagnose()
    smoke = report["smoke_test"]
    assert smoke["ran"] and not smoke["ok"] and "planted in the smoke test" in smoke["error"]
    assert any(p.startswith("the 2-rank all_reduce smoke test failed") for p in report["problems"])
    assert not report["ok"]


def test_registered_kernel_runs_this_python():
    kernel = doctor.diagnose(smoke=False)["kernel"]
    if not kernel["registered"]:
        pytest.skip("the labkit kernel is not registered here (run `make test`)")
    assert kernel["python"] == "python" or os.path.samefile(kernel["python"], sys.executable)


# ----------------------------------------------------------------------- DeepSpeed's ops for this node


def _node(**changes) -> prebuild.Toolchain:
    """A made-up GPU node with everything the CUDA ops need; `changes` take pieces away."""
    base = {
        "gpus": 1,
        "torch_cuda": "12.8",
        "cuda_home": "/usr/local/cuda",
        "nvcc_release": "12.8",
        "libaio": True,
        "linux": True,
    }
    return prebuild.Toolchain(**{**base, **changes})


def _actions(tc: prebuild.Toolchain) -> dict[tuple[str, str], str]:
    return {(op.accelerator, op.name): op.action for op in prebuild.plan_ops(tc)}


CPU_PLAN = {("cpu", name): "build" for _, name in prebuild.CPU_OPS}


def test_a_cpu_machine_builds_the_cpu_ops_only():
    assert _actions(_node(gpus=0, torch_cuda=None, cuda_home=None, nvcc_release=None)) == CPU_PLAN
    assert _actions(_node(gpus=0)) == CPU_PLAN  # a CUDA wheel without a GPU: nothing runs on CUDA ranks
    no_aio = _actions(_node(gpus=0, libaio=False, linux=False))
    assert no_aio[("cpu", "async_io")] == no_aio[("cpu", "deepspeed_shm_comm")] == "skip"


def test_a_gpu_node_with_a_matching_nvcc_builds_the_cuda_ops_too():
    plan = _actions(_node())
    assert plan == {**CPU_PLAN, ("cuda", "async_io"): "build", ("cuda", "quantizer"): "build"}
    assert _actions(_node(nvcc_release="12.4"))[("cuda", "quantizer")] == "build"  # another minor: accepted


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        (
            {"cuda_home": None, "nvcc_release": None},
            "no CUDA toolkit: CUDA_HOME is not set and no nvcc is on PATH",
        ),
        ({"nvcc_release": None}, "/usr/local/cuda/bin/nvcc does not run"),
        ({"nvcc_release": "11.8"}, "nvcc is CUDA 11.8 but torch was built for CUDA 12.8"),
    ],
)
def test_a_cuda_op_that_cannot_be_built_is_refused_in_one_sentence(changes, reason):
    ops = {op.name: op for op in prebuild.plan_ops(_node(**changes)) if op.accelerator == "cuda"}
    assert {op.action for op in ops.values()} == {"skip"} and ops["quantizer"].reason == reason
    sentence = ops["async_io"].refusal("12.8")
    assert sentence == (
        f"DeepSpeed's CUDA op async_io cannot be built on this node ({reason}), so NVMe offload on GPU ranks "
        "is refused: install the CUDA 12.8 toolkit (nvcc) and set CUDA_HOME to it, then run "
        "`python -m labkit.prebuild`"
    )
    assert sentence.count(". ") == 0 and "\n" not in sentence


def test_without_libaio_only_async_io_is_refused_and_the_advice_is_libaio():
    ops = {op.name: op for op in prebuild.plan_ops(_node(libaio=False)) if op.accelerator == "cuda"}
    assert ops["quantizer"].action == "build" and ops["async_io"].action == "skip"
    assert "install libaio" in ops["async_io"].refusal("12.8")


def test_cuda_ops_have_a_folder_of_their_own(monkeypatch, tmp_path: Path):
    """DeepSpeed names the CPU and CUDA builds of async_io alike: one folder would rebuild each over the other."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert prebuild.extensions_dir() == str(tmp_path)
    assert prebuild.extensions_dir("cuda") == str(tmp_path / prebuild.CUDA_SUBDIR)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", prebuild.extensions_dir("cuda"))  # inside a CUDA rank
    assert prebuild.extensions_dir("cuda") == str(tmp_path / prebuild.CUDA_SUBDIR)


def test_the_doctor_reports_the_toolchain_and_each_cuda_ops_status(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / prebuild.CUDA_SUBDIR / "quantizer").mkdir(parents=True)
    (tmp_path / prebuild.CUDA_SUBDIR / "quantizer" / "quantizer.so").write_bytes(b"")
    monkeypatch.setattr(prebuild, "toolchain", lambda: _node(libaio=False))
    report = doctor.diagnose(smoke=False)
    assert report["toolchain"] == {
        "cuda_home": "/usr/local/cuda",
        "nvcc": shutil.which("nvcc"),
        "nvcc_release": "12.8",
        "torch_cuda": "12.8",
        "visible_gpus": 1,
        "libaio": False,
    }
    ops = report["deepspeed_ops"]
    assert ops["cuda_ops"] == {"async_io": "unbuildable", "quantizer": "built"}
    assert ops["cuda_extensions_dir"] == str(tmp_path / prebuild.CUDA_SUBDIR) and not ops["ready"]
    [line] = [p for p in report["problems"] if "CUDA op" in p]
    assert line.startswith(
        "DeepSpeed's CUDA op async_io cannot be built on this node (libaio is not installed)"
    )
    table = doctor.format_report(report)
    assert "deepspeed cuda ops  async_io unbuildable, quantizer built" in table
    assert "CUDA_HOME           /usr/local/cuda" in table


def test_on_this_machine_the_doctor_plans_what_it_reports(cli_json):
    _, report = cli_json
    tc = report["toolchain"]
    assert tc["torch_cuda"] == torch.version.cuda and tc["visible_gpus"] == cluster.visible_gpus()
    assert ("cuda_ops" in report["deepspeed_ops"]) == bool(tc["torch_cuda"] and tc["visible_gpus"])


# ----------------------------------------------------------------------- where each notebook's ranks run


@pytest.mark.parametrize("gpus", [0, 1, 8])
def test_the_doctor_says_where_each_notebooks_ranks_run(gpus, monkeypatch):
    """A made-up CPU-only, 1-GPU and 8-GPU server: NCCL needs one GPU per rank, so a notebook is on GPUs only
    where the server has at least its ranks; on a machine with no GPU, CPU ranks are no shortfall."""
    monkeypatch.setattr("labkit.placement.visible_gpus", lambda: gpus)
    report = doctor.diagnose(smoke=False)
    needs = {n.notebook: n.ranks for n in classroom.notebook_needs()}
    rows = {r["notebook"]: r for r in report["notebooks"]}
    assert {name: r["ranks"] for name, r in rows.items()} == needs
    table = doctor.format_report(report)
    for name, ranks in needs.items():
        row = rows[name]
        assert row["gpus_needed"] == ranks
        if gpus >= ranks:
            assert (row["device"], row["why"]) == (
                "cuda",
                f"one GPU per rank: {ranks} of the server's {gpus}",
            )
        elif gpus == 0:
            assert (row["device"], row["why"]) == (
                "cpu",
                "no GPU here: the ranks are CPU processes over gloo",
            )
        else:
            assert row["device"] == "cpu"
            assert (
                row["why"] == f"{ranks} ranks need {ranks} GPUs (one each, for NCCL), the server has {gpus}"
            )
        assert f"  {name:<24} {ranks} ranks on {row['device']:<4} {row['why']}" in table.splitlines()
    if gpus == 1:
        assert {r["device"] for r in rows.values()} == {"cpu"}, (
            "a 1-GPU server runs every notebook on CPU ranks"
        )


def test_doctor_class_30_on_an_8_gpu_node_says_the_gpus_go_unused(monkeypatch, capsys):
    node = {"cpu_cores": 64, "memory_bytes": 512 * 10**9, "gpus": 8}
    monkeypatch.setattr(classroom, "node_capacity", lambda: node)
    main(["doctor", "--skip-smoke", "--class", "30"])
    out = capsys.readouterr().out
    needs = classroom.notebook_needs()
    assert "30 student(s) fit on CPU ranks, the node's 8 GPUs unused: each may use" in out
    assert (
        "GPUs: each student server gets 0 (8 // 30 students), and NCCL needs one per rank: every notebook runs "
        "on CPU ranks: the 8 GPUs go unused"
    ) in out
    for k in sorted({n.ranks for n in needs}):
        named = [n.notebook for n in needs if n.ranks <= k]
        what = "every notebook" if len(named) == len(needs) else ", ".join(named)
        assert (
            f"{k} GPUs per student server would put {what} on GPUs ({8 // k} such servers fit this node)"
            in out
        )
    # Two students get 4 GPUs each: every notebook (2 to 4 ranks) on GPUs.
    two = classroom.class_report(2, needs, node)
    assert {r["device"] for r in two["notebooks"]} == {"cuda"} and two["advice"][0].startswith(
        "2 student(s) fit:"
    )
    assert two["gpu_advice"] == [
        "GPUs: each student server gets 4 (8 // 2 students), and NCCL needs one per rank: every notebook runs on "
        "GPUs (8 of the 8 in use)"
    ]


def test_a_small_dev_shm_is_a_problem(monkeypatch):
    monkeypatch.setattr(limits, "_shm_bytes", lambda path: (64 * 2**20, 64 * 2**20))  # Docker's default
    report = doctor.diagnose(smoke=False)
    ranks = max(r["ranks"] for r in report["notebooks"] if r["device"] == "cpu")
    assert report["limits"]["shm_free_bytes"] == report["limits"]["shm_total_bytes"] == 64 * 2**20
    assert (
        f"the notebooks' {ranks} CPU ranks: DeepSpeed's CPU comm maps 66 MiB per rank into /dev/shm and "
        f"/dev/shm free=0.1 GB holds 0; give the server a larger /dev/shm ({limits.SHM_ADVICE})"
    ) in report["problems"]
    assert not report["ok"]


def test_container_limits_bound_the_doctors_ranks(monkeypatch):
    monkeypatch.setenv("MEM_LIMIT", "1500000000")
    report = doctor.diagnose(smoke=False)
    assert report["limits"]["memory_source"] == "MEM_LIMIT" and report["max_ranks_by_device"]["cpu"] == 2
    assert report["limits"]["ranks_bound_by"] == (
        "the memory limit MEM_LIMIT=1.5 GB allows 2 cpu ranks of about 500 MiB each"
    )


def test_a_hubs_own_torch_2_11_runs_and_the_doctor_says_what_it_changes(monkeypatch):
    """The H200 hub had torch 2.11: not a problem, one row saying what labkit does for it; 2.9 is one."""
    import torch

    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    report = doctor.diagnose(smoke=False)
    assert report["torch"]["runs"] and not any(p.startswith("torch ") for p in report["problems"])
    assert "all_gather_single / reduce_scatter_single names" in report["torch"]["note"]
    assert "torch support" in doctor.format_report(report)
    old = doctor.torch_support("2.9.0", "2.13.0")
    assert not old["runs"] and old["note"] == "torch 2.9.0: the lab runs on 2.11 to 2.13"
    assert doctor.torch_support("2.13.0+cpu", "2.13.0")["note"].endswith("the release requirements.txt pins")


# ----------------------------------------------------------------------- the Jupyter server of the page

# Stands in for a hub's server: named like one, run by the Python of its shebang, it starts `labkit doctor`'s
# server check as its child (as a JupyterLab terminal or kernel would) and prints what the child found.
FAKE_SERVER = """#!{python}
import os, subprocess, sys
child = "import json; from labkit import doctor; problems = []; " \\
    "server = doctor._server(problems, doctor._pins()); print(json.dumps([server, problems]))"
done = subprocess.run([{labkit_python!r}, "-c", child], capture_output=True, text=True, check=True)
print(os.getpid(), done.stdout)
"""


def _fake_server(folder: Path, python: str, name: str = "jupyterhub-singleuser") -> Path:
    """An executable script `name` in `folder`, run by `python`, that reports its child's server check."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / name
    script.write_text(FAKE_SERVER.format(python=python, labkit_python=sys.executable))
    script.chmod(0o755)
    return script


def _check_under(script: Path, **env) -> tuple[int, dict, list[str]]:
    """(the fake server's pid, the server its child found, the child's problems)."""
    base = {k: v for k, v in os.environ.items() if k != page_server.HUB_ENV}  # this session may run on a hub
    done = subprocess.run([str(script)], capture_output=True, text=True, timeout=120, env={**base, **env})
    assert done.returncode == 0, done.stderr
    pid, found = done.stdout.split(" ", 1)
    server, problems = json.loads(found)
    return int(pid), server, problems


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """The Python of an empty virtual environment: a server environment without JupyterLab, RISE or widgets."""
    env = tmp_path_factory.mktemp("bare") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    return str(env / "bin" / "python")


@pytest.mark.parametrize(
    ("cmdline", "server"),
    [
        (["/opt/conda/bin/python", "/opt/conda/bin/jupyterhub-singleuser", "--ip=0.0.0.0"], True),
        (["/v/bin/python", "/v/bin/jupyter-lab", "--no-browser"], True),
        (["python", "/v/bin/jupyter", "lab"], True),
        (["python3", "-m", "jupyterlab"], True),
        (["/usr/bin/python3", "-m", "ipykernel_launcher", "-f", "k.json"], False),
        (["/bin/bash", "-l"], False),
        (["python", "/v/bin/jupyter", "nbconvert", "--execute"], False),
    ],
)
def test_a_jupyter_server_is_known_by_its_command_line(cmdline, server):
    assert page_server.is_jupyter_server(cmdline) is server


def test_the_server_checked_is_the_one_the_doctor_runs_under(tmp_path):
    pid, server, problems = _check_under(
        _fake_server(tmp_path, sys.executable), JUPYTERHUB_API_URL="http://hub"
    )
    assert (server["found"], server["pid"], server["python"], server["hub"]) == (
        True,
        pid,
        sys.executable,
        True,
    )
    started = f"{os.path.basename(sys.executable)} jupyterhub-singleuser"
    assert server["how"] == f"the Jupyter server this runs under (pid {pid}: {started})"
    assert server["prefix"] == sys.prefix
    for name in doctor.SERVER_PACKAGES:  # read by that server's Python: here this environment's
        assert server["packages"][name] == importlib.metadata.version(name)
    assert problems == []


def test_a_server_without_rise_or_widgets_is_a_problem_that_names_its_python(tmp_path, bare_python):
    pid, server, problems = _check_under(_fake_server(tmp_path, bare_python))
    assert (server["pid"], server["python"], server["hub"]) == (pid, bare_python, False)
    assert server["packages"] == dict.fromkeys(doctor.SERVER_PACKAGES)
    pins = doctor._pins()
    assert problems == [
        f"the Jupyter server that serves the page ({server['prefix']}) has no {name}, so {why}: install it "
        f'there, `{bare_python} -m pip install "{spec}"`, and restart the server'
        for name, why, spec in [
            ("jupyterlab", doctor.SERVER_NEEDS["jupyterlab"], f"jupyterlab=={pins['jupyterlab']}"),
            (
                "jupyterlab-rise",
                "live slides (RISE) do not open",
                f"jupyterlab-rise=={pins['jupyterlab-rise']}",
            ),
            (
                "jupyterlab_widgets",
                doctor.SERVER_NEEDS["jupyterlab_widgets"],
                f"ipywidgets=={pins['ipywidgets']}",
            ),
        ]
    ]  # nbgitpuller is asked for only under JupyterHub:
    _, _, under_hub = _check_under(_fake_server(tmp_path, bare_python), JUPYTERHUB_API_URL="http://hub")
    assert (
        under_hub[:3] == problems
        and "has no nbgitpuller, so the students' nbgitpuller links fail" in under_hub[3]
    )


def test_outside_any_server_the_doctor_checks_the_jupyter_lab_on_path(tmp_path, bare_python):
    _fake_server(tmp_path / "bin", bare_python, name="jupyter-lab")
    child = (  # as a shell outside Jupyter runs it, whatever runs this test
        "import json; from labkit import page_server; page_server.find_server = lambda pid=None: None; "
        "print(json.dumps(page_server.jupyter_server()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": str(tmp_path / "bin")},
        check=True,
    )
    server = json.loads(done.stdout)
    assert (server["found"], server["pid"], server["python"]) == (True, None, bare_python)
    assert server["how"].startswith(f"the jupyter-lab on PATH ({tmp_path / 'bin' / 'jupyter-lab'})")
