"""What tests/test_browser.py stands on: the lab's own JupyterLab on a free loopback port, Debian's Chromium
driven by Playwright, and the slide count a notebook's `slideshow` metadata promises.

JupyterLab is started with the command `make lab` runs, read from the Makefile by a dry run (`make -n lab
PORT=... ARGS=...`): the port is a free one, and ARGS adds a token, a loopback address and settings and
workspaces in the test's own folder. Both it and Chromium are context managers that stop what they started,
kernels included, whatever happens inside them.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from labkit import KERNEL_NAME

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
ARTIFACTS = ROOT / "test-artifacts" / "browser"
CHROMIUM = Path("/usr/bin/chromium")
INSTALL_HINT = "scripts/install-debian-packages binder/apt.txt tests/apt.txt"
# The machine's network may be closed: without these Chromium keeps dialling Google's services.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
KERNEL = KERNEL_NAME  # registered by the set-up (`make lab` / binder/postBuild)
STEP_TIMEOUT_MS = 60_000  # one browser step (a loaded 2-core machine is slow, not stuck)
START_TIMEOUT_S = 90.0
DROP_TAG = "notebook-only"  # labkit.slides drops these cells from the decks


def require_chromium() -> str:
    """The path of Debian's Chromium, or a failed test whose one sentence says how to install it."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(
            f"Debian's Chromium is not installed at {CHROMIUM}; run `{INSTALL_HINT}` (as root or with sudo), "
            "which `make test` does before pytest, and run the browser tests again.",
            pytrace=False,
        )
    return str(CHROMIUM)


def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_lab_command(port: int, args: list[str]) -> list[str]:
    """The command `make lab PORT=port ARGS=args` runs in the checkout, from a dry run (`make -n`); its
    program resolved against the checkout, its other arguments (the notebook folder) left as make gives them.
    A set-up that is not done, or out of date, fails the test: `make lab` would redo it first."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "PORT", "ARGS", "VENV", "PYTHON")
    }
    quoted = " ".join(shlex.quote(a) for a in args)
    assert "$" not in quoted, f"make would expand the $ in ARGS={quoted}"
    dry = subprocess.run(
        ["make", "--no-print-directory", "-n", "lab", f"PORT={port}", f"ARGS={quoted}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dry.returncode == 0, f"`make -n lab` failed:\n{dry.stderr}"
    lines = [ln for ln in dry.stdout.splitlines() if ln.strip()]
    if len(lines) != 1:
        pytest.fail(
            "`make -n lab` would run more than JupyterLab (the set-up is not done or is out of date); "
            "run `make setup`, then the browser tests again:\n" + dry.stdout,
            pytrace=False,
        )
    argv = shlex.split(lines[0])
    assert Path(argv[0]).name == "jupyter" and argv[1] == "lab", f"`make lab` runs {lines[0]!r}"
    return [str(ROOT / argv[0]), *argv[1:]]


def lab_command(port: int, token: str, state_dir: Path) -> list[str]:
    """`make lab`'s command with ARGS: no browser, on loopback only (and that port or none), a token, and
    its settings and workspaces kept under `state_dir`."""
    return make_lab_command(
        port,
        [
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
            f"--LabApp.user_settings_dir={state_dir / 'user-settings'}",
            f"--LabApp.workspaces_dir={state_dir / 'workspaces'}",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
    )


def _quiet_settings(settings_dir: Path) -> None:
    """No news or update toasts over the notebook (they would also dial out)."""
    target = settings_dir / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def _kernel_pids(runtime_dir: Path) -> list[int]:
    """Processes whose command line names a connection file in `runtime_dir`: this lab's kernels only."""
    pids = []
    marker = str(runtime_dir).encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


@contextmanager
def running_lab(workdir: Path, state_dir: Path) -> Iterator[tuple[str, str]]:
    """Start JupyterLab as `make lab` does, but in `workdir`, so that the notebook folder it names (`notebooks`)
    is `workdir`'s; yield (base URL, token); stop it and its kernels on the way out."""
    port, token = free_port(), os.urandom(16).hex()
    command = lab_command(port, token, state_dir)
    served = command[command.index("--notebook-dir") + 1]
    assert (workdir / served).is_dir(), (
        f"`make lab` serves {served}/: put the notebooks in {workdir / served}"
    )
    runtime_dir = state_dir / "runtime"
    runtime_dir.mkdir(parents=True, exist_ok=True)
    _quiet_settings(state_dir / "user-settings")
    log_path = state_dir / "jupyterlab.log"
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(runtime_dir), PYTHONUNBUFFERED="1")
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command,
            cwd=workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"JupyterLab exited with status {proc.returncode}:\n{_tail(log_path)}", pytrace=False
                )
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"JupyterLab did not answer in {START_TIMEOUT_S:.0f} s:\n{_tail(log_path)}", pytrace=False
                )
            time.sleep(0.25)  # polling a port that is not open yet: there is nothing to wait on
        yield base, token
    finally:
        if proc.poll() is None:
            proc.terminate()  # the server's SIGTERM handler shuts its kernels down, then exits
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for pid in _kernel_pids(runtime_dir):  # a kernel the server failed to stop (each leads its session)
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        print(f"JupyterLab log: {log_path}")


@contextmanager
def chromium(profile_dir: Path, **context_options) -> Iterator:
    """A Playwright browser context on Debian's Chromium with a fresh user-data-dir; closed on the way out."""
    executable = require_chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(
            "Playwright for Python is not installed; run `make test`, or "
            "`.venv/bin/pip install -r requirements.txt` (its pin), and run the browser tests again.",
            pytrace=False,
        )

    if profile_dir.exists():
        shutil.rmtree(profile_dir)
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile_dir),
            executable_path=executable,
            headless=True,
            args=CHROMIUM_ARGS,
            **context_options,
        )
        try:
            context.set_default_timeout(STEP_TIMEOUT_MS)
            yield context
        finally:
            context.close()


def notebook_copy(source: Path, dest_dir: Path, until: str) -> Path:
    """A copy of `source` in `dest_dir` with its cells up to the first code cell containing `until` and the
    `labkit` kernel: a browser run of "all cells" shows the cell of interest without the slow ones after."""
    nb = json.loads(source.read_text())
    last = next(
        i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and until in "".join(c["source"])
    )
    nb["cells"] = nb["cells"][: last + 1]
    nb["metadata"]["kernelspec"] = {"name": KERNEL, "display_name": KERNEL, "language": "python"}
    dest = dest_dir / source.name
    dest.write_text(json.dumps(nb, indent=1))
    return dest


def expected_slide_count(nb: dict) -> int:
    """Leaf slides of the deck nbconvert builds from `nb`, from its cells' `slideshow.slide_type`:
    the first visible cell starts a slide, each later `slide` or `subslide` cell starts another;
    `skip` and `notes` cells start nothing, and cells tagged notebook-only are not in the deck."""
    cells = [c for c in nb["cells"] if DROP_TAG not in c.get("metadata", {}).get("tags", [])]
    types = [c.get("metadata", {}).get("slideshow", {}).get("slide_type", "-") for c in cells]
    first = next(i for i, t in enumerate(types) if t not in ("skip", "notes"))
    return 1 + sum(t in ("slide", "subslide") for t in types[first + 1 :])
