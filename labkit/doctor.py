"""Is this machine ready for the lab? `diagnose()` answers with a dict; `labkit doctor` prints it.

It reads versions, devices, the backend and rank limit `labkit.launch` will use, the CUDA toolchain
(CUDA_HOME, nvcc), whether DeepSpeed's ops are built (CPU ops, and on a GPU node the CUDA ops
`prebuild.plan_ops` plans: by looking at their build folders, never by building them) and whether the
`labkit` Jupyter kernel is registered, then runs one all-reduce on 2 ranks and times it. Each thing that is missing
becomes one line of advice in `problems`. It checks the Jupyter server that serves the page, which on a hub runs
from another environment than the kernel's: the server this process runs under (its parent processes), else the
`jupyter-lab` on PATH; the packages that server needs (JupyterLab, RISE for live slides, the widgets' JupyterLab
side, and nbgitpuller under JupyterHub) are read with that server's own Python. It reports the limits that bound the ranks (a container's cgroup,
the spawner's CPU_LIMIT / MEM_LIMIT, `labkit.limits`), whether /dev/shm holds what DeepSpeed's CPU comm
(or NCCL) needs for the notebooks' ranks, and where each course notebook's ranks run on this server (GPUs
or CPU ranks, and why). With `students=N` (`labkit doctor --class N`) it also says whether N students
running the course notebooks at once fit on this node (`labkit.classroom`).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import time
from typing import Any

from labkit import KERNEL_NAME
from labkit.names import ALL_REDUCE
from labkit.page_server import SERVER_NEEDS, SERVER_PACKAGES, jupyter_server

SMOKE_WORLD_SIZE = 2
SMOKE_TIMEOUT_S = 60.0
PACKAGES = ("deepspeed", "ipywidgets")  # the kernel's, besides python and torch (JupyterLab is the server's)
SETUP_ADVICE = "run `make lab` (or `make test`) in the labkit checkout"


def diagnose(smoke: bool = True, students: int | None = None) -> dict[str, Any]:
    """Check this machine and return a JSON-ready dict; `problems` lists one line of advice per gap.

    Keys: versions (the kernel's environment), pinned, devices, backend, limits, max_ranks,
    max_ranks_by_device, notebooks (where each course notebook's ranks run here:
    `classroom.notebook_placement`), toolchain, deepspeed_ops, ninja, kernel, server (`jupyter_server`),
    smoke_test, problems, ok, and `class` when `students` is given (`classroom.class_report`; each
    notebook that does not fit that class adds its line of advice to `problems`). `smoke=False` skips the
    2-rank all-reduce (about 3 s on 2 cores).
    """
    import torch

    from labkit import limits, prebuild

    problems: list[str] = []
    versions = _versions(torch.__version__)
    pinned = _pins()
    torch_note = torch_support(torch.__version__, pinned.get("torch"))
    _check_versions(problems, versions, pinned, torch_note)
    backend = _backend()
    found = limits.read_limits()
    max_ranks, why, by_device = _rank_limits(problems, found)
    notebooks = _notebook_placements()
    _shm(problems, found, notebooks)
    tc = prebuild.toolchain()
    ops = _ops(problems, tc)
    ninja = _ninja(problems)
    kernel = _kernel()
    server = _server(problems, pinned)
    if not kernel["registered"]:
        problems.append(
            f"the Jupyter kernel `{KERNEL_NAME}` is not registered: {SETUP_ADVICE} "
            f'(or `python -m ipykernel install --sys-prefix --name {KERNEL_NAME} --display-name "labkit"`)'
        )
    smoke_test = _smoke_test(problems) if smoke and max_ranks >= SMOKE_WORLD_SIZE else {"ran": False}
    devices = _devices(torch)  # after the smoke test: naming GPUs initialises CUDA, which forbids fork
    extra = {} if students is None else _class(problems, students)
    return {
        "versions": versions,
        "pinned": pinned,
        "torch": torch_note,
        "devices": devices,
        "backend": backend,
        "limits": _limits(found, why),
        "max_ranks": max_ranks,
        "max_ranks_by_device": by_device,
        "notebooks": notebooks,
        "toolchain": _toolchain(tc),
        "deepspeed_ops": ops,
        "ninja": ninja,
        "kernel": kernel,
        "server": server,
        "smoke_test": smoke_test,
        "problems": problems,
        "ok": not problems,
        **extra,
    }


def _check_versions(problems: list[str], versions: dict, pinned: dict[str, str], torch_note: dict) -> None:
    """One line of advice per package missing, or installed at another release than requirements.txt pins
    (a hub's own torch that the lab runs on is said in `torch_note`, not here)."""
    for name, version in versions.items():
        if version is None:
            problems.append(f"{name} is not installed: {SETUP_ADVICE}")
        elif name == "torch" and torch_note["runs"]:
            continue
        elif name in pinned and _release(version) != _release(pinned[name]):
            problems.append(
                f"{name} {version} is installed but requirements.txt pins {pinned[name]}: {SETUP_ADVICE}"
            )


def _backend() -> dict[str, Any]:
    """The backend, device and start method `labkit.launch` uses for the smoke test's ranks."""
    from labkit.placement import placement

    where = placement(SMOKE_WORLD_SIZE)
    return {
        "world_size": SMOKE_WORLD_SIZE,
        "backend": where.backend,
        "device_type": where.device_type,
        "start_method": where.start_method,
    }


def _rank_limits(problems: list[str], found) -> tuple[int, str, dict[str, int]]:
    """(ranks this machine runs at once, the limit that decides it, ranks by device type); advice when
    neither kind of rank reaches the smoke test's world size."""
    from labkit.placement import rank_limit, visible_gpus

    max_ranks, why = rank_limit(None, found)
    by_device = {"cpu": rank_limit("cpu", found)[0]}
    if visible_gpus():
        by_device["cuda"] = rank_limit("cuda", found)[0]
    if max(by_device.values()) < SMOKE_WORLD_SIZE:
        problems.append(f"{why}; the lab needs at least {SMOKE_WORLD_SIZE}: raise that limit")
    return max_ranks, why, by_device


def _limits(found, why: str) -> dict[str, Any]:
    """The limits that bound the ranks (`labkit.limits.read_limits`: CPUs, bytes) and the one that decides."""
    return {
        "cpus": found.cpus.value,
        "cpus_source": found.cpus.source,
        "memory_bytes": int(found.memory.value),
        "memory_source": found.memory.source,
        "shm_free_bytes": int(found.shm.value),
        "shm_total_bytes": found.shm_total_bytes,
        "ranks_bound_by": why,
    }


def _toolchain(tc) -> dict[str, Any]:
    """What `prebuild.toolchain` found, with the nvcc on PATH."""
    return {
        "cuda_home": tc.cuda_home,
        "nvcc": shutil.which("nvcc"),
        "nvcc_release": tc.nvcc_release,
        "torch_cuda": tc.torch_cuda,
        "visible_gpus": tc.gpus,
        "libaio": tc.libaio,
    }


def _ninja(problems: list[str]) -> str | None:
    """The ninja on PATH (DeepSpeed loads its ops with it), or None and a line of advice."""
    ninja = shutil.which("ninja")
    if ninja is None:
        problems.append(
            "ninja is not on PATH, and DeepSpeed needs it to load its ops: activate the environment "
            "(`source .venv/bin/activate`) or `pip install ninja`"
        )
    return ninja


def _class(problems: list[str], students: int) -> dict[str, Any]:
    """{"class": `classroom.class_report(students)`}, its advice added to `problems` when the class does not
    fit; {} and the reason as a problem where there are no course notebooks to size it by."""
    from labkit import classroom

    try:
        report = classroom.class_report(students)
    except ValueError as e:  # no notebooks beside this labkit (installed without a checkout)
        problems.append(str(e))
        return {}
    if not report["fits"]:
        problems.extend(report["advice"])
    return {"class": report}


def _notebook_placements() -> list[dict[str, Any]]:
    """Where each course notebook's ranks run on this server, and why (none without a course checkout)."""
    from labkit import classroom
    from labkit.placement import CPU_BACKEND, visible_gpus

    try:
        needs = classroom.notebook_needs()
    except ValueError:
        return []
    gpus = visible_gpus()
    rows = [classroom.notebook_placement(need, gpus) for need in needs]
    if gpus == 0:  # a CPU machine: CPU ranks are how the lab runs here, not GPUs it lacks
        for row in rows:
            row["why"] = f"no GPU here: the ranks are CPU processes over {CPU_BACKEND}"
    return rows


def _shm(problems: list[str], found, notebooks: list[dict[str, Any]]) -> None:
    """One line of advice when /dev/shm cannot hold the largest notebook's ranks: DeepSpeed's CPU comm
    workspaces on CPU ranks, NCCL's segments (its guide's 1 GiB) on GPU ranks."""
    from labkit import limits

    cpu = [r["ranks"] for r in notebooks if r["device"] == "cpu"] if notebooks else [SMOKE_WORLD_SIZE]
    refusal = cpu and limits.deepspeed_shm_refusal(max(cpu), found, f"the notebooks' {max(cpu)} CPU ranks")
    if refusal:
        problems.append(refusal)
    if any(r["device"] == "cuda" for r in notebooks) and found.shm_total_bytes < limits.NCCL_SHM_BYTES:
        problems.append(
            f"/dev/shm is {found.shm_total_bytes / 1e9:.2f} GB and NCCL's troubleshooting guide asks for 1 GiB for "
            f"the notebooks' GPU ranks: give the server a larger /dev/shm ({limits.SHM_ADVICE})"
        )


TORCH_RUNS = ((2, 11), (2, 13))  # the torch releases the lab runs on (a hub's own); the set-up pins one


def torch_support(version: str, pin: str | None) -> dict[str, Any]:
    """Whether the lab runs on torch `version` (`runs`), and a sentence of what that torch changes (`note`)."""
    release = tuple(int(x) for x in _release(version).split(".")[:2])
    low, high = TORCH_RUNS
    if pin is not None and _release(version) == _release(pin):
        return {"runs": True, "note": f"torch {version}: the release requirements.txt pins"}
    if not low <= release <= high:
        return {
            "runs": False,
            "note": f"torch {version}: the lab runs on {low[0]}.{low[1]} to {high[0]}.{high[1]}",
        }
    note = f"torch {version}, not the pinned {pin or 'release'}: the lab runs on it"
    if release < (2, 13):
        note += (
            "; labkit gives it torch 2.13's all_gather_single / reduce_scatter_single names (the older "
            "all_gather_into_tensor / reduce_scatter_tensor under them), and its probes rebind the ones "
            "DeepSpeed's comm backend holds by reference, which 2.13's deprecated names reach anyway"
        )
    return {"runs": True, "note": note}


def _versions(torch_version: str) -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version(), "torch": torch_version}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions["labkit"] = importlib.metadata.version("labkit") if _installed("labkit") else None
    return versions


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _pins() -> dict[str, str]:
    """The `name==version` pins of the course's requirements.txt (a checkout's, or the copy a wheel carries)."""
    from labkit import course

    try:
        path = course.course_path("requirements.txt")
    except ValueError:  # no course folder: nothing to compare with
        return {}
    pins = {}
    if path.exists():
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if "==" in line:
                name, version = line.split("==", 1)
                if name.strip().lower() in ("torch", *PACKAGES, *SERVER_PACKAGES):
                    pins[name.strip().lower()] = version.strip()
    return pins


def _release(version: str) -> str:
    """`2.13.0+cpu` -> `2.13.0`: a CUDA and a CPU build of one release are the same pin."""
    return version.split("+", 1)[0]


def _ops(problems: list[str], tc) -> dict[str, Any]:
    """CPU ops by their build folders; `cuda_ops` (GPU nodes) by `plan_ops`: unbuildable, or their folders."""
    from labkit import prebuild

    ext_dir = prebuild.extensions_dir()
    statuses = [prebuild.op_status(name, ext_dir) for _, name in prebuild.CPU_OPS]
    ops = {s.name: s.status for s in statuses}
    not_built = [s.name for s in statuses if s.status in ("missing", "out of date")]
    if not_built:
        problems.append(
            f"DeepSpeed CPU ops not built ({', '.join(not_built)}): run `make lab` or `python -m labkit.prebuild`"
        )
    for s in statuses:
        if s.status == "interrupted":
            problems.append(
                f"an interrupted build of DeepSpeed op {s.name} left {s.build_dir}/lock, which makes the next "
                "DeepSpeed run wait forever: run `python -m labkit.prebuild` (it removes the lock and rebuilds)"
            )
        elif s.status == "building":
            problems.append(
                f"DeepSpeed op {s.name} is being built now by process {s.lock_holders or '?'}: "
                "wait for it to finish, then run `labkit doctor` again"
            )
    cuda_dir = prebuild.extensions_dir("cuda")
    cuda_ops = {}
    for op in (op for op in prebuild.plan_ops(tc) if op.accelerator == "cuda"):
        if op.action == "skip":
            cuda_ops[op.name] = "unbuildable"
            problems.append(op.refusal(tc.torch_cuda))
        else:
            cuda_ops[op.name] = prebuild.op_status(op.name, cuda_dir).status
    not_built = [
        name for name, status in cuda_ops.items() if status in ("missing", "out of date", "interrupted")
    ]
    if not_built:
        problems.append(
            f"DeepSpeed CUDA ops not built ({', '.join(not_built)}): run `python -m labkit.prebuild` here"
        )
    ready = all(status in ("built", "skipped") for status in [*ops.values(), *cuda_ops.values()])
    out = {"extensions_dir": ext_dir, "ops": ops, "ready": ready}
    return out | ({"cuda_extensions_dir": cuda_dir, "cuda_ops": cuda_ops} if cuda_ops else {})


def _kernel() -> dict[str, Any]:
    try:
        from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    except ImportError:
        return {"name": KERNEL_NAME, "registered": False, "path": None, "python": None}
    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        return {"name": KERNEL_NAME, "registered": False, "path": None, "python": None}
    python = spec.argv[0] if spec.argv else None
    return {
        "name": KERNEL_NAME,
        "registered": True,
        "path": spec.resource_dir,
        "python": python,
        "display_name": spec.display_name,
    }


def _install_spec(name: str, pinned: dict[str, str]) -> str:
    """What to pip install for one of SERVER_PACKAGES, at requirements.txt's pin where there is one (the
    widgets' JupyterLab side comes with ipywidgets, at the kernel's ipywidgets pin)."""
    package = "ipywidgets" if name == "jupyterlab_widgets" else name
    return f"{package}=={pinned[package]}" if package in pinned else package


def _server(problems: list[str], pinned: dict[str, str]) -> dict[str, Any]:
    """`jupyter_server()`, with one line of advice per package the page's server lacks (nbgitpuller only
    under JupyterHub)."""
    server = jupyter_server()
    if not server["found"]:
        return server
    if "error" in server:
        problems.append(f"the Jupyter server's Python could not say what it holds: {server['error']}")
        return server
    needed = [n for n in SERVER_PACKAGES if n != "nbgitpuller" or server["hub"]]
    for name in (n for n in needed if server["packages"].get(n) is None):
        problems.append(
            f"the Jupyter server that serves the page ({server['prefix']}) has no {name}, so "
            f"{SERVER_NEEDS[name]}: install it there, `{server['python']} -m pip install "
            f'"{_install_spec(name, pinned)}"`, and restart the server'
        )
    return server


def _server_line(server: dict[str, Any]) -> str:
    """The doctor table's row for the page's Jupyter server."""
    if not server["found"] or "error" in server:
        return server.get("error") or server["how"]
    names = {
        "jupyterlab": "JupyterLab",
        "jupyterlab-rise": "RISE",
        "jupyterlab_widgets": "widgets",
        "nbgitpuller": "nbgitpuller",
    }
    held = ", ".join(f"{label} {server['packages'].get(n) or 'missing'}" for n, label in names.items())
    return f"{held} in {server['prefix']}, {server['how']}"


def _all_reduce_rank() -> dict[str, float]:
    """Body of the smoke test on each rank: all-reduce rank+1, so every rank ends with n(n+1)/2."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(dist.get_rank() + 1)])
    start = time.perf_counter()
    dist.all_reduce(value)
    return {"value": float(value.item()), "collective_s": time.perf_counter() - start}


def _smoke_test(problems: list[str]) -> dict[str, Any]:
    from labkit import launch

    n = SMOKE_WORLD_SIZE
    expected = n * (n + 1) / 2
    start = time.perf_counter()
    try:
        results = launch(_all_reduce_rank, n, timeout=SMOKE_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 (reported as a problem, with the rank's own message)
        wall_s = time.perf_counter() - start
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        problems.append(
            f"the {n}-rank all_reduce smoke test failed after {wall_s:.1f} s ({first_line}): "
            "check that processes can fork and talk over 127.0.0.1"
        )
        return {
            "ran": True,
            "ok": False,
            "world_size": n,
            "collective": ALL_REDUCE,
            "expected": expected,
            "values": None,
            "wall_s": wall_s,
            "collective_s": None,
            "error": first_line,
        }
    wall_s = time.perf_counter() - start
    values = [r["value"] for r in results]
    ok = all(v == expected for v in values)
    if not ok:
        problems.append(f"the {n}-rank all_reduce returned {values}, expected {expected} on every rank")
    return {
        "ran": True,
        "ok": ok,
        "world_size": n,
        "collective": ALL_REDUCE,
        "expected": expected,
        "values": values,
        "wall_s": wall_s,
        "collective_s": max(r["collective_s"] for r in results),
        "error": None,
    }


def _devices(torch) -> dict[str, Any]:
    from labkit.placement import visible_gpus

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if visible_gpus() == 0 or not torch.cuda.is_available():
        return {"summary": "cpu only", "cuda_count": 0, "cuda_names": [], "cpu_cores": cores}
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "summary": f"{len(names)} cuda: {', '.join(names)}",
        "cuda_count": len(names),
        "cuda_names": names,
        "cpu_cores": cores,
    }


def format_report(report: dict[str, Any]) -> str:
    """The human table of `labkit doctor`, then one line per problem."""
    v, b, ops, k, s, t = (
        report["versions"],
        report["backend"],
        report["deepspeed_ops"],
        report["kernel"],
        report["smoke_test"],
        report["toolchain"],
    )
    lim = report["limits"]
    rows = [(name, version or "not installed") for name, version in v.items()]
    rows += [
        ("torch support", report["torch"]["note"]),
        ("devices", f"{report['devices']['summary']} ({report['devices']['cpu_cores']} cpu cores)"),
        (
            "backend",
            f"{b['backend']} on {b['device_type']}, {b['start_method']} (for {b['world_size']} ranks)",
        ),
        (
            "limits",
            f"{lim['cpus']:g} CPUs ({lim['cpus_source']}), {lim['memory_bytes'] / 1e9:.1f} GB of memory "
            f"({lim['memory_source']}), /dev/shm {lim['shm_free_bytes'] / 1e9:.2f} GB free of "
            f"{lim['shm_total_bytes'] / 1e9:.2f} GB",
        ),
        ("max ranks", f"{report['max_ranks']} {report['max_ranks_by_device']}: {lim['ranks_bound_by']}"),
        ("deepspeed ops", ", ".join(f"{n} {st}" for n, st in ops["ops"].items())),
        ("extensions dir", ops["extensions_dir"]),
        ("CUDA_HOME", t["cuda_home"] or "not found"),
        (
            "nvcc",
            f"{t['nvcc'] or 'not on PATH'}" + (f" (CUDA {t['nvcc_release']})" if t["nvcc_release"] else ""),
        ),
        ("ninja", report["ninja"] or "not on PATH"),
        (
            "jupyter kernel",
            f"{k['name']} -> {k['python']}" if k["registered"] else f"{k['name']} not registered",
        ),
        ("jupyter server", _server_line(report["server"])),
    ]
    if "cuda_ops" in ops:
        rows.insert(-5, ("deepspeed cuda ops", ", ".join(f"{n} {st}" for n, st in ops["cuda_ops"].items())))
    if not s["ran"]:
        rows.append(("smoke test", "skipped"))
    elif s["ok"]:
        rows.append(
            (
                "smoke test",
                f"all_reduce on {s['world_size']} ranks -> {s['values']} in {s['wall_s']:.2f} s "
                f"(the collective itself {s['collective_s'] * 1e3:.1f} ms)",
            )
        )
    else:
        rows.append(("smoke test", f"FAILED: {s['error'] or s['values']}"))
    width = max(len(name) for name, _ in rows)
    lines = [f"  {name:<{width}}  {value}" for name, value in rows]
    if report["notebooks"]:
        gpus = report["toolchain"]["visible_gpus"]
        lines.append(f"notebooks on this server ({gpus or 0} GPUs):")
        lines += [
            f"  {r['notebook']:<24} {r['ranks']} ranks on {r['device']:<4} {r['why']}"
            for r in report["notebooks"]
        ]
    if "class" in report:
        from labkit.classroom import format_class

        lines.append(format_class(report["class"]))
        if report["class"]["fits"]:
            lines += [f"  {line}" for line in report["class"]["advice"]]
    lines.append("ready for the lab" if report["ok"] else f"{len(report['problems'])} problem(s):")
    lines += [f"  - {p}" for p in report["problems"]]
    return "\n".join(lines)
