"""Can a class share this node? What each course notebook needs, against this node divided by N students.

A notebook's ranks are read from its papermill `parameters` cell: the largest `*world_size` it sets
(`world_size`, `hpz_world_size`). Its memory is one process for the kernel plus one per rank, each
`placement.RANK_BYTES_ESTIMATE` (an idle rank with torch imported, measured), plus on every rank the state of
an unsharded fp32 AdamW replica of the largest model the notebook names (`budget.plan(n, 1, "ddp")`: the
most any engine in it holds). The node's capacity follows `placement.max_ranks`: `placement.RANKS_PER_CORE`
CPU ranks per CPU of the CPU limit and the memory limit (`labkit.limits`: a container's are its cgroup's);
a GPU rank needs its own GPU, else the notebook runs on CPU ranks (`placement.choose_placement`, the rule
`labkit.launch` follows): `notebook_placement` says which, and why. `labkit doctor --class N` prints
`class_report(N)`.
"""

from __future__ import annotations

import ast
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import nbformat

from labkit import budget
from labkit.names import DATA_PARALLEL
from labkit.placement import RANK_BYTES_ESTIMATE, RANKS_PER_CORE, choose_placement


@dataclass(frozen=True)
class NotebookNeed:
    """What one student running `notebook` with its default parameters uses at its peak."""

    notebook: str
    ranks: int  # processes `labkit.launch` starts at once (the largest *world_size parameter)
    models: tuple[str, ...]  # the lab models it trains (its `model` parameter and `model="..."` in cells)
    state_bytes_per_rank: int  # an unsharded fp32 AdamW replica of the largest of them
    memory_bytes: int  # (ranks + 1 kernel) x RANK_BYTES_ESTIMATE + ranks x state_bytes_per_rank


def parameters(nb: nbformat.NotebookNode) -> dict[str, Any]:
    """The literal assignments of the notebook's cell tagged `parameters` (papermill's), by name."""
    found: dict[str, Any] = {}
    for cell in nb.cells:
        if cell.cell_type == "code" and "parameters" in cell.metadata.get("tags", []):
            for node in ast.parse(cell.source).body:
                if (
                    isinstance(node, ast.Assign)
                    and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                ):
                    try:
                        found[node.targets[0].id] = ast.literal_eval(node.value)
                    except ValueError:
                        pass  # not a literal (an expression): not a default papermill can show
    return found


def _models_named(nb: nbformat.NotebookNode, params: dict[str, Any]) -> tuple[str, ...]:
    from labkit.model import CONFIGS

    names = {params["model"]} if isinstance(params.get("model"), str) else set()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:  # IPython magics
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "model" and isinstance(node.value, ast.Constant):
                names.add(node.value.value)
    return tuple(sorted(n for n in names if n in CONFIGS))


def _replica_state_bytes(model: str) -> int:
    from labkit.model import build_model, count_params

    return int(
        budget.plan(count_params(build_model(model)), 1, DATA_PARALLEL, precision="fp32")[
            "state_bytes_per_rank"
        ]
    )


def notebook_need(path: Path) -> NotebookNeed:
    """Ranks and memory of one notebook at its default parameters (see the module docstring)."""
    nb = nbformat.read(path, as_version=4)
    params = parameters(nb)
    sizes = [v for k, v in params.items() if k.endswith("world_size") and isinstance(v, int)]
    if not sizes:
        raise ValueError(
            f"{path.name}: its parameters cell sets no world_size; add one (e.g. world_size = 2)"
        )
    ranks = max(sizes)
    models = _models_named(nb, params)
    state = max((_replica_state_bytes(m) for m in models), default=0)
    memory = (ranks + 1) * RANK_BYTES_ESTIMATE + ranks * state
    return NotebookNeed(path.stem, ranks, models, state, memory)


def notebook_needs(notebooks_dir: str | Path | None = None) -> list[NotebookNeed]:
    """`notebook_need` of every course notebook (default: the checkout's `notebooks/`)."""
    from labkit.slides import NOTEBOOK_PATTERN, default_notebooks_dir

    folder = Path(notebooks_dir) if notebooks_dir is not None else default_notebooks_dir()
    paths = sorted(p for p in folder.glob("*.ipynb") if NOTEBOOK_PATTERN.match(p.name))
    if not paths:
        raise ValueError(
            f"no course notebooks in {folder} to size the class by: run `labkit doctor --class` from a checkout"
        )
    return [notebook_need(p) for p in paths]


def node_capacity() -> dict[str, Any]:
    """This node's CPUs and memory as limited for this process (`labkit.limits.read_limits`: CPUs, bytes
    available now), its visible GPUs, and in `sources` where each limit was read."""
    from labkit.limits import read_limits
    from labkit.placement import visible_gpus

    limits = read_limits()
    cpus = limits.cpus.value
    return {
        "cpu_cores": int(cpus) if float(cpus).is_integer() else cpus,
        "memory_bytes": int(limits.memory.value),
        "gpus": visible_gpus() or 0,
        "sources": {"cpu_cores": str(limits.cpus), "memory_bytes": str(limits.memory)},
    }


def notebook_placement(need: NotebookNeed, gpus: int | None) -> dict[str, Any]:
    """Where `need`'s ranks run on a server with `gpus` GPUs, and why: {notebook, ranks, device,
    gpus_needed (the GPUs per server that put it on GPUs: one per rank), why}. `placement.choose_placement`
    decides, as it does for `labkit.launch`."""
    device = choose_placement(need.ranks, gpus).device_type
    if device == "cuda":
        why = f"one GPU per rank: {need.ranks} of the server's {gpus}"
    elif gpus is None:
        why = "NVML could not count this server's GPUs (MIG devices?)"
    elif gpus == 0:
        why = "no GPU here: the ranks are CPU processes over gloo"
    else:
        why = f"{need.ranks} ranks need {need.ranks} GPUs (one each, for NCCL), the server has {gpus}"
    return {
        "notebook": need.notebook,
        "ranks": need.ranks,
        "device": device,
        "gpus_needed": need.ranks,
        "why": why,
    }


def class_report(
    students: int, needs: list[NotebookNeed] | None = None, node: dict[str, int] | None = None
) -> dict[str, Any]:
    """Whether `students` students, each running the notebooks' defaults at once, fit on this node.

    Each student gets 1/N of the node: `ranks_per_core` x cores // N CPU ranks, and as many ~500 MiB ranks
    as memory / N holds beside the kernel's process; GPUs // N GPUs, so a notebook runs on `cuda` when that
    is at least its ranks, else on CPU ranks (`notebook_placement`). A notebook fits when N x its ranks <=
    ranks_per_core x cores and N x its memory <= the node's memory; `max_students` is the largest N for
    which it fits.

    Keys: students, node {cpu_cores, memory_bytes, gpus, ranks_per_core, rank_bytes, ...}, per_student
    {cpu_cores, memory_bytes, gpus, ranks}, notebooks [{notebook, ranks, models, memory_bytes, device,
    gpus_needed, why, fits_cores, fits_memory, fits, max_students}], fits, advice (one line per notebook
    that does not fit, or one line saying the class fits), gpu_advice (on a node with GPUs: where they go,
    and the GPUs per student server that would put the CPU-rank notebooks on them).
    """
    if students < 1:
        raise ValueError(f"--class must be 1 or more students; got {students}")
    needs = notebook_needs() if needs is None else needs
    node = node_capacity() if node is None else node
    cores, memory, gpus = node["cpu_cores"], node["memory_bytes"], node["gpus"]
    slots = math.floor(RANKS_PER_CORE * cores + 1e-9)  # CPU ranks the node runs at once
    mem_each = memory / students
    ranks_each = max(0, min(slots // students, int((mem_each - RANK_BYTES_ESTIMATE) // RANK_BYTES_ESTIMATE)))
    gpus_each = gpus // students
    rows = []
    for need in needs:
        fits_cores = need.ranks * students <= slots
        fits_memory = need.memory_bytes * students <= memory
        # The most students for whom both hold (on GPUs while each has enough of them, on CPU ranks beyond):
        # a class of N fits exactly when N <= most.
        most = min(slots // need.ranks, memory // need.memory_bytes)
        rows.append(
            {
                **asdict(need),
                "models": list(need.models),
                **notebook_placement(need, gpus_each),
                "fits_cores": fits_cores,
                "fits_memory": fits_memory,
                "fits": fits_cores and fits_memory,
                "max_students": int(most),
            }
        )
    report = {
        "students": students,
        "node": {**node, "ranks_per_core": RANKS_PER_CORE, "rank_bytes": RANK_BYTES_ESTIMATE},
        "per_student": {
            "cpu_cores": cores / students,
            "memory_bytes": int(mem_each),
            "gpus": gpus_each,
            "ranks": ranks_each,
        },
        "notebooks": rows,
        "fits": all(r["fits"] for r in rows),
    }
    report["advice"] = _advice(report)
    report["gpu_advice"] = _gpu_advice(report)
    return report


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def _advice(report: dict[str, Any]) -> list[str]:
    n, node, each = report["students"], report["node"], report["per_student"]
    rows = report["notebooks"]
    if report["fits"]:
        big = max(rows, key=lambda r: r["ranks"])
        idle = node["gpus"] and all(r["device"] == "cpu" for r in rows)
        return [
            f"{n} student(s) fit"
            + (f" on CPU ranks, the node's {_count(node['gpus'], 'GPU')} unused" if idle else "")
            + f": each may use {each['ranks']} ranks ({each['cpu_cores']:.2g} cores, "
            f"{_gb(each['memory_bytes'])}); the largest default is {big['ranks']} ranks ({big['notebook']})"
        ]
    lines = []
    for r in rows:
        if r["fits"]:
            continue
        short = []
        if not r["fits_cores"]:
            short.append(
                f"{r['ranks'] * n} ranks on {node['cpu_cores']} cores ({node['ranks_per_core']} per core)"
            )
        if not r["fits_memory"]:
            short.append(f"{_gb(r['memory_bytes'] * n)} of {_gb(node['memory_bytes'])} available")
        if r["max_students"] == 0:
            fix = "it does not fit even one student here: use a larger node"
        else:
            nodes = math.ceil(n / r["max_students"])
            fix = (
                f"at most {r['max_students']} at once here: stagger it, pair students on one server, "
                f"or spread the class over {nodes} such nodes"
            )
        lines.append(
            f"{r['notebook']} needs {r['ranks']} ranks and {_gb(r['memory_bytes'])} per student; "
            f"{n} students need {' and '.join(short)}: {fix}"
        )
    return lines


def _gpu_advice(report: dict[str, Any]) -> list[str]:
    """Where a GPU node's GPUs go, and the GPUs per student server that put each CPU-rank notebook on them."""
    n, rows = report["students"], report["notebooks"]
    gpus, each = report["node"]["gpus"], report["per_student"]["gpus"]
    if not gpus:
        return []
    on_gpus = [r["notebook"] for r in rows if r["device"] == "cuda"]
    if not on_gpus:
        where = f"every notebook runs on CPU ranks: the {_count(gpus, 'GPU')} {'goes' if gpus == 1 else 'go'} unused"
    elif len(on_gpus) == len(rows):
        where = f"every notebook runs on GPUs ({each * n} of the {gpus} in use)"
    else:
        where = f"{', '.join(on_gpus)} run on GPUs, the others on CPU ranks"
    share = (
        f"this server has {gpus}" if n == 1 else f"each student server gets {each} ({gpus} // {n} students)"
    )
    lines = [f"GPUs: {share}, and NCCL needs one per rank: {where}"]
    for k in sorted({r["gpus_needed"] for r in rows if r["device"] == "cpu"}):
        named = [r["notebook"] for r in rows if r["ranks"] <= k]
        what = "every notebook" if len(named) == len(rows) else ", ".join(named)
        room = f"{gpus // k} such servers fit this node" if gpus >= k else f"this node has {gpus}"
        lines.append(f"  {k} GPUs per student server would put {what} on GPUs ({room})")
    return lines


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}" + ("" if n == 1 else "s")


def format_class(report: dict[str, Any]) -> str:
    """The `--class` section of `labkit doctor`: a row per notebook, then the advice."""
    n, node, each = report["students"], report["node"], report["per_student"]
    lines = [
        f"class of {n}: this node has {node['cpu_cores']} cpu cores, {_gb(node['memory_bytes'])} available, "
        f"{node['gpus']} gpus; each student gets {each['cpu_cores']:.2g} cores, {_gb(each['memory_bytes'])}, "
        f"{each['gpus']} gpus, {each['ranks']} ranks",
        f"  {'notebook':<24} {'ranks':>5} {'memory':>8}  {'on':<4} {'fits':<4} {'most at once':>12}  why there",
    ]
    for r in report["notebooks"]:
        lines.append(
            f"  {r['notebook']:<24} {r['ranks']:>5} {_gb(r['memory_bytes']):>8}  {r['device']:<4} "
            f"{'yes' if r['fits'] else 'no':<4} {r['max_students']:>12}  {r['why']}"
        )
    lines += [f"  {line}" for line in report["gpu_advice"]]
    return "\n".join(lines)
