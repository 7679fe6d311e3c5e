"""The Jupyter server that serves the page, and what its own environment holds.

On a hub the server runs from another environment than the `labkit` kernel's. `jupyter_server()` finds it
(the server this process runs under, from its parent processes, else the `jupyter-lab` on PATH) and reads
its packages with that server's own Python; `labkit doctor` turns what is missing into advice.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

# What the server that serves the page needs in its own environment (a hub's server runs from another
# environment than the `labkit` kernel): JupyterLab, RISE (live slides), the widgets' JupyterLab side
# (sliders draw) and, under JupyterHub, nbgitpuller (the students' links).
SERVER_PACKAGES = ("jupyterlab", "jupyterlab-rise", "jupyterlab_widgets", "nbgitpuller")
SERVER_NEEDS = {
    "jupyterlab": "the course's notebooks do not open in JupyterLab",
    "jupyterlab-rise": "live slides (RISE) do not open",
    "jupyterlab_widgets": "the notebooks' sliders and buttons do not draw",
    "nbgitpuller": "the students' nbgitpuller links fail",
}
SERVER_SCRIPTS = frozenset(
    {"jupyterhub-singleuser", "jupyter-lab", "jupyter-labhub", "jupyter-server", "jupyter-notebook"}
)
SERVER_MODULES = frozenset({"jupyterlab", "jupyter_server", "jupyterhub.singleuser", "notebook"})
JUPYTER_SUBCOMMANDS = frozenset({"lab", "labhub", "server", "notebook"})
HUB_ENV = "JUPYTERHUB_API_URL"  # set by JupyterHub in every server it spawns (and inherited by its kernels)
PROBE_TIMEOUT_S = 60.0
PROC = Path("/proc")
SERVER_PROBE = """\
import importlib.metadata, json, sys
def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
print(json.dumps({"prefix": sys.prefix, "packages": {n: version(n) for n in sys.argv[1:]}}))
"""


def is_jupyter_server(cmdline: list[str]) -> bool:
    """Whether a process's argv starts a Jupyter server: `jupyterhub-singleuser`, `jupyter-lab`, `jupyter lab`,
    `python -m jupyterlab` and their kin."""
    names = [os.path.basename(arg) for arg in cmdline[:3]]
    if any(name in SERVER_SCRIPTS for name in names[:2]):
        return True
    for i, name in enumerate(names[:-1]):
        if (name == "jupyter" and cmdline[i + 1] in JUPYTER_SUBCOMMANDS) or (
            name == "-m" and cmdline[i + 1] in SERVER_MODULES
        ):
            return True
    return False


def _proc_fields(pid: int, name: str) -> list[str] | None:
    """/proc/PID/NAME split at its NUL bytes (cmdline, environ), or None where it cannot be read."""
    try:
        return (PROC / str(pid) / name).read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return None


def _parent_pid(pid: int) -> int:
    """The parent of `pid` (0 where it cannot be read): the field after the state in /proc/PID/stat."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def _resolve_program(program: str, pid: int, environ: dict[str, str]) -> str | None:
    """The path of `program` (a process's argv[0]) as that process found it: absolute as it is, relative to
    its working directory, or a bare name searched on its PATH."""
    if os.path.isabs(program):
        return program
    if os.sep in program:
        try:
            return os.path.join(os.readlink(PROC / str(pid) / "cwd"), program)
        except OSError:
            return None
    return shutil.which(program, path=environ.get("PATH", os.defpath))


def find_server(pid: int | None = None) -> dict[str, Any] | None:
    """The Jupyter server that process `pid` (default: this one) runs under, from its parent processes:
    {pid, cmdline, python (the interpreter it runs on, as it was started), hub}; None when there is none."""
    pid = os.getpid() if pid is None else pid
    while (pid := _parent_pid(pid)) > 1:
        cmdline = _proc_fields(pid, "cmdline") or []
        if cmdline and is_jupyter_server(cmdline):
            environ = dict(f.split("=", 1) for f in _proc_fields(pid, "environ") or [] if "=" in f)
            return {
                "pid": pid,
                "cmdline": cmdline,
                "python": _resolve_program(cmdline[0], pid, environ),
                "hub": HUB_ENV in environ,
            }
    return None


def _shebang_python(script: str) -> str | None:
    """The interpreter a script's `#!` line names (`/usr/bin/env python3` looked up on PATH)."""
    try:
        with open(script, "rb") as f:
            first = f.readline().decode(errors="replace")
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    words = first[2:].split()
    if words and os.path.basename(words[0]) == "env" and len(words) > 1:
        return shutil.which(words[1])
    return words[0] if words else None


def probe_server_python(python: str) -> dict[str, Any]:
    """{prefix, packages: {name: version or None}} of SERVER_PACKAGES, read by `python` itself (the
    server's environment, not this one's); {"error": sentence} when that Python does not answer."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    try:
        done = subprocess.run(
            [python, "-c", SERVER_PROBE, *SERVER_PACKAGES],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            env=env,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{python} did not run ({type(e).__name__}: {e})"}
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        return {"error": f"{python} exited with status {done.returncode} ({last})"}
    return json.loads(done.stdout)


NO_SERVER = (
    "none: this runs under no Jupyter server and no jupyter-lab is on PATH; run `labkit doctor` in a JupyterLab "
    "terminal (or `!labkit doctor` in a notebook) to check the server that serves the page"
)


def _server_candidate() -> tuple[str | None, int | None, bool, str]:
    """(its Python, its pid, whether JupyterHub started it, how it was found) of the server to check: the one
    this process runs under, else the `jupyter-lab` on PATH (a shell's `labkit doctor` outside Jupyter)."""
    running = find_server()
    if running is not None:
        started = " ".join(os.path.basename(arg) for arg in running["cmdline"][:3])
        how = f"the Jupyter server this runs under (pid {running['pid']}: {started})"
        return running["python"], running["pid"], running["hub"], how
    script = shutil.which("jupyter-lab")
    if script is None:
        return None, None, HUB_ENV in os.environ, NO_SERVER
    how = f"the jupyter-lab on PATH ({script}): this runs under no Jupyter server"
    return _shebang_python(script), None, HUB_ENV in os.environ, how


def jupyter_server() -> dict[str, Any]:
    """Which Jupyter server serves the page (`_server_candidate`) and what its environment holds: {found, how,
    pid, python, hub, prefix, packages}, and `error` when its Python did not answer."""
    python, pid, hub, how = _server_candidate()
    report = {"found": python is not None, "how": how, "pid": pid, "python": python, "hub": hub}
    report |= {"prefix": None, "packages": {}}
    return report | probe_server_python(python) if python is not None else report
