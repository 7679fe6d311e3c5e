"""Run one untrusted child process with a hard wall-clock limit, contained, and leave nothing of it behind.

The child starts in its own session (so its process group can be killed at once) with a random token in
its environment. The token is inherited by everything it starts, including the Jupyter kernel (which
jupyter_client puts in yet another session) and any ranks or daemons the student's code forks off; when
the child ends or its time is up, every process carrying the token is killed with SIGKILL.

`Limits` contains it further, each by the strongest mechanism this machine offers (the outcome says which):
    memory     a cgroup (v2, or v1's memory controller) caps all its processes together: the kernel kills
               one when they exceed it; and RLIMIT_AS caps each process's address space, so an allocation
               past it fails with MemoryError first (not where a GPU is visible: CUDA reserves far more
               address space than it uses)
    processes  a cgroup's pids controller (every thread counts); else, not as root, RLIMIT_NPROC
    CPU        RLIMIT_CPU per process (wall time x cores), against a process that outlives the sweep
    files      RLIMIT_FSIZE per file written; RLIMIT_CORE 0
    sandbox    bubblewrap (`bwrap`): a view of the file system made of the system, the Python installation,
               the virtual environment and the labkit package, read-only, plus the child's own working
               folder; a private /tmp, /dev and process table; a network namespace of its own (a loopback
               for its ranks, nothing else); the environment cleared to what Python and torch need
Every process the child starts is also in its cgroups, so the sweep finds those that shed the token too.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

TOKEN_VAR = "LABKIT_GRADE_TOKEN"
_SWEEPS = 5
_CONTAIN = Path(__file__).with_name("_contain.py")
CONTAIN_FAILED = 125  # _contain.py's exit status when a limit could not be applied
FILE_BYTES_LIMIT = 2**30  # largest file a submission may write (bytes)
SANDBOXES = ("auto", "bwrap", "none")
_SIZE = re.compile(r"^\s*(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>[KMGT]?i?B?)?\s*$", re.IGNORECASE)
# Variables a sandboxed child keeps (prefixes); everything else of the grader's environment stays outside.
_KEEP_ENV = (
    "PATH",
    "LANG",
    "LANGUAGE",
    "LC_",
    "TZ",
    "TERM",
    "CUDA_",
    "NVIDIA_",
    "NCCL_",
    "LD_LIBRARY_PATH",
    "OMP_",
    "MKL_",
    "OPENBLAS_",
    "TORCH_",
    "DS_",
    "LABKIT_",
    "VIRTUAL_ENV",
    "MPLBACKEND",
    "PYDEVD_",
)
_MASKED_FILES = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-", "/etc/sudoers")
_MASKED_DIRS = ("/etc/ssh", "/etc/ssl/private", "/etc/sudoers.d")


def parse_size(text: str) -> int:
    """'2G', '1.5GB', '512M', '2GiB', '1000000' -> bytes (K, M, G, T are powers of 1024)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"{text!r} is not a size; write it like 2G, 512M or 1500000000")
    power = "KMGT".find((m["unit"] or " ")[0].upper()) + 1
    return int(float(m["number"]) * 1024**power)


@dataclass(frozen=True)
class Limits:
    """What contains each child: bytes of memory for all its processes together, processes (threads count),
    and the sandbox: "bwrap", "none", or "auto" (bwrap where it works here)."""

    memory_bytes: int | None = None
    max_processes: int | None = None
    sandbox: str = "none"


@dataclass(frozen=True)
class Outcome:
    """How the child ended: `returncode` (negative: killed by that signal; None: stopped at the limit).

    `out_of_memory`: its cgroup's memory limit killed a process; `containment`: what contained it, by name."""

    returncode: int | None
    timed_out: bool
    wall_s: float
    out_of_memory: bool = False
    containment: dict = field(default_factory=dict)

    def describe(self) -> str:
        """'exited with status 1' / 'was killed by SIGSEGV' / 'ran past its time limit' / 'ran out of memory'."""
        if self.timed_out:
            return "ran past its time limit"
        if self.out_of_memory:
            return "ran out of memory (a process was killed at the --memory-limit)"
        if self.returncode == CONTAIN_FAILED:
            return "could not be started inside its limits"
        if self.returncode is not None and self.returncode < 0:
            return f"was killed by {signal_name(-self.returncode)}"
        return f"exited with status {self.returncode}"


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def run(
    cmd: list[str],
    cwd: Path,
    timeout_s: float,
    log_path: Path,
    env: dict | None = None,
    limits: Limits | None = None,
    writable: Path | None = None,
) -> Outcome:
    """Run `cmd` in `cwd` for at most `timeout_s` seconds (wall clock), stdout and stderr to `log_path`,
    inside `limits`; `writable` (default `cwd`) is the one folder a sandboxed child may write.

    Returns once the child and everything it started are gone (the sweep takes milliseconds).
    """
    limits = limits or Limits()
    token = secrets.token_hex(16)
    child_env = {**os.environ, **(env or {}), TOKEN_VAR: token}
    groups = Cgroups.create(token, limits)
    containment = dict(groups.mechanisms)
    spec: dict = {
        "cgroups": groups.procs_files,
        "rlimits": {"core": 0, "fsize": FILE_BYTES_LIMIT, "cpu": int(timeout_s * (os.cpu_count() or 1)) + 60},
    }
    if limits.memory_bytes and not gpu_visible():
        spec["rlimits"]["as"] = limits.memory_bytes
        containment["memory"] = (containment.get("memory", "") + " + RLIMIT_AS per process").lstrip(" +")
    elif limits.memory_bytes and "memory" not in containment:
        containment["memory"] = "not limited (no writable cgroup, and a GPU is visible)"
    if limits.max_processes and "processes" not in containment:
        if os.geteuid() != 0:
            spec["rlimits"]["nproc"] = _user_processes() + limits.max_processes
            containment["processes"] = "RLIMIT_NPROC (counts all this user's processes)"
        else:
            containment["processes"] = (
                "not limited (no writable pids cgroup; RLIMIT_NPROC does not bind root)"
            )
    inner = list(cmd)
    sandbox = resolve_sandbox(limits.sandbox)
    if sandbox == "bwrap":
        home = Path(writable or cwd) / ".home"
        _prepare_home(home)
        if inner and inner[0] == sys.executable:
            inner[0] = _interpreter_path()
        inner = bwrap_argv(Path(writable or cwd), cwd, _sandbox_env(child_env, home)) + inner
        containment["sandbox"] = (
            "bwrap: read-only system and labkit, own folder, no network, own /tmp and pids"
        )
    else:
        why = "" if limits.sandbox == "none" else " (bwrap is not usable here)"
        containment["sandbox"] = f"none{why}: the child runs with the grader's file access and network"
    wrapped = [sys.executable, "-I", "-S", str(_CONTAIN), json.dumps(spec), "--", *inner]
    start = time.monotonic()
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                wrapped,
                cwd=cwd,
                env=child_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                returncode, timed_out = proc.wait(timeout=timeout_s), False
            except subprocess.TimeoutExpired:
                returncode, timed_out = None, True
            finally:
                _kill_group(proc.pid)
                kill_marked(token)
                groups.kill_all()
                proc.wait()
        out_of_memory = groups.out_of_memory()
        if sandbox == "bwrap" and returncode is not None and 128 < returncode < 128 + signal.NSIG:
            returncode = 128 - returncode  # bwrap exits 128 + N when its child is killed by signal N
    finally:
        groups.remove()
    return Outcome(returncode, timed_out, time.monotonic() - start, out_of_memory, containment)


def _kill_group(pgid: int) -> None:
    if pgid == os.getpgrp():
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def marked(token: str) -> list[int]:
    """Pids of live processes whose environment carries `token` (Linux /proc; empty elsewhere)."""
    needle = f"{TOKEN_VAR}={token}".encode()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return pids


def kill_marked(token: str) -> None:
    """SIGKILL every process carrying `token`, and its process group, until none is left."""
    for _ in range(_SWEEPS):
        pids = [p for p in marked(token) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                _kill_group(os.getpgid(pid))
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.05)


def _user_processes() -> int:
    uid = os.getuid()
    count = 0
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            count += entry.stat().st_uid == uid
        except OSError:
            continue
    return count


def gpu_visible() -> bool:
    """True when an NVIDIA device node exists (CUDA would reserve address space beyond any RLIMIT_AS)."""
    return bool(glob.glob("/dev/nvidia[0-9]*"))


# ------------------------------------------------------------------------------------------------ cgroups


def _own_cgroups() -> dict[str, Path]:
    """{controller or "unified": this process's cgroup folder}, for every mounted hierarchy."""
    paths = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for name in controllers.split(",") if controllers else ["unified"]:
                paths[name] = path
    except (OSError, ValueError):
        return {}
    found = {}
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return {}
    for line in mounts:
        left, _, right = line.partition(" - ")
        fields, kinds = left.split(), right.split()
        if len(fields) < 5 or len(kinds) < 3:
            continue
        root, mount_point, fstype, options = fields[3], fields[4], kinds[0], kinds[2].split(",")
        names = ["unified"] if fstype == "cgroup2" else [o for o in options if o in ("memory", "pids")]
        for name in names if fstype in ("cgroup", "cgroup2") else []:
            if name in paths:
                relative = os.path.relpath(paths[name], root) if paths[name] != root else "."
                found[name] = Path(mount_point) / relative
    return found


class Cgroups:
    """The cgroups one child runs in (possibly none): created with its limits, emptied and removed after."""

    def __init__(self) -> None:
        self.dirs: list[Path] = []
        self.procs_files: list[str] = []
        self.mechanisms: dict[str, str] = {}
        self._memory_events: Path | None = None
        self._v1_oom: Path | None = None

    @classmethod
    def create(cls, token: str, limits: Limits) -> Cgroups:
        groups = cls()
        if not (limits.memory_bytes or limits.max_processes):
            return groups
        own = _own_cgroups()
        name = f"labkit-grade-{token[:12]}"
        unified = own.get("unified")
        if unified is not None and groups._try_v2(unified / name, limits):
            return groups
        if limits.memory_bytes and "memory" in own:
            groups._try_v1(own["memory"] / name, "memory.limit_in_bytes", limits.memory_bytes, "memory")
        if limits.max_processes and "pids" in own:
            groups._try_v1(own["pids"] / name, "pids.max", limits.max_processes, "processes")
        return groups

    def _try_v2(self, path: Path, limits: Limits) -> bool:
        try:
            enabled = (path.parent / "cgroup.subtree_control").read_text().split()
            if (limits.memory_bytes and "memory" not in enabled) or (
                limits.max_processes and "pids" not in enabled
            ):
                return False
            path.mkdir()
        except OSError:
            return False
        self.dirs.append(path)
        try:
            if limits.memory_bytes:
                (path / "memory.max").write_text(str(limits.memory_bytes))
                (path / "memory.swap.max").write_text("0") if (path / "memory.swap.max").exists() else None
                self._memory_events = path / "memory.events"
                self.mechanisms["memory"] = "cgroup v2 memory.max (all its processes together)"
            if limits.max_processes:
                (path / "pids.max").write_text(str(limits.max_processes))
                self.mechanisms["processes"] = "cgroup v2 pids.max"
        except OSError:
            self.remove()
            self.mechanisms.clear()
            return False
        self.procs_files.append(str(path / "cgroup.procs"))
        return True

    def _try_v1(self, path: Path, knob: str, value: int, what: str) -> None:
        try:
            path.mkdir()
        except OSError:
            return
        self.dirs.append(path)
        try:
            (path / knob).write_text(str(value))
            swap = path / "memory.memsw.limit_in_bytes"
            if what == "memory" and swap.exists():
                swap.write_text(str(value))
        except OSError:
            return
        if what == "memory":
            self._v1_oom = path / "memory.oom_control"
        self.mechanisms[what] = f"cgroup v1 {knob}" + (
            " (all its processes together)" if what == "memory" else ""
        )
        self.procs_files.append(str(path / "cgroup.procs"))

    def out_of_memory(self) -> bool:
        """Whether the kernel killed a process of this child for exceeding its memory limit."""
        source = self._memory_events or self._v1_oom
        if source is None:
            return False
        try:
            for line in source.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill" and int(value) > 0:
                    return True
        except (OSError, ValueError):
            pass
        return False

    def kill_all(self) -> None:
        """SIGKILL every process in these cgroups, including any that shed the token, until none is left."""
        for _ in range(50):
            pids = set()
            for d in self.dirs:
                try:
                    pids |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
                except (OSError, ValueError):
                    continue
            pids.discard(os.getpid())
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.02)

    def remove(self) -> None:
        for d in reversed(self.dirs):
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)  # the last processes are still being reaped
        self.dirs.clear()


# ------------------------------------------------------------------------------------------------ bwrap


@functools.cache
def bwrap_usable() -> bool:
    """Whether bubblewrap is installed and can build a sandbox here (user namespaces, or root)."""
    exe = shutil.which("bwrap")
    if exe is None:
        return False
    try:
        done = subprocess.run(
            [
                exe,
                "--ro-bind",
                "/",
                "/",
                "--dev",
                "/dev",
                "--proc",
                "/proc",
                "--unshare-net",
                "--unshare-pid",
                "true",
            ],
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def resolve_sandbox(choice: str) -> str:
    """ "auto" -> "bwrap" where it works here, else "none"; "bwrap" and "none" as they are."""
    if choice not in SANDBOXES:
        raise ValueError(f"sandbox {choice!r}: use one of {', '.join(SANDBOXES)}")
    if choice == "auto":
        return "bwrap" if bwrap_usable() else "none"
    return choice


def _interpreter_path() -> str:
    """This interpreter at a path the sandbox has: its folder's symlinks resolved (the sandbox binds real
    paths only), its own name kept (a venv's `bin/python` link must stay the venv's, not the base Python)."""
    return os.path.join(os.path.realpath(os.path.dirname(sys.executable)), os.path.basename(sys.executable))


def _read_only_roots() -> list[str]:
    """What a sandboxed Python needs to see: the system, the interpreter, the environment, labkit itself."""
    import labkit

    roots = [
        "/usr",
        "/etc",
        "/sys",
        "/opt",
        sys.base_prefix,
        sys.base_exec_prefix,
        sys.prefix,
        sys.exec_prefix,
        str(Path(sys.executable).resolve().parents[1]),
        str(Path(labkit.__file__).resolve().parent),
    ]
    return [r for r in dict.fromkeys(os.path.realpath(r) for r in roots) if os.path.isdir(r)]


def _solutions_in(roots: list[str]) -> list[str]:
    """The course's solutions/ where a sandbox would see it (inside a read-only root: the copy a wheel carries
    in labkit/_course, or a checkout under /opt), to be hidden under an empty tmpfs."""
    from labkit.course import course_path

    try:
        solutions = os.path.realpath(course_path("solutions"))
    except ValueError:  # no course folder at all
        return []
    return [solutions] if any(solutions.startswith(root.rstrip("/") + "/") for root in roots) else []


def bwrap_argv(writable: Path, cwd: Path, env: dict[str, str]) -> list[str]:
    """The bubblewrap command line that runs a child in the sandbox the module docstring describes."""
    argv = [
        "bwrap",
        "--die-with-parent",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--clearenv",
    ]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    # The private /dev and /tmp first: an environment or a checkout under /tmp is bound on top of it.
    argv += ["--dev", "/dev", "--tmpfs", "/dev/shm", "--proc", "/proc", "--tmpfs", "/tmp"]
    roots = _read_only_roots()
    for root in roots:
        argv += ["--ro-bind", root, root]
    argv += [arg for f in _MASKED_FILES if os.path.exists(f) for arg in ("--ro-bind", "/dev/null", f)]
    argv += [
        arg for d in (*_MASKED_DIRS, *_solutions_in(roots)) if os.path.isdir(d) for arg in ("--tmpfs", d)
    ]
    argv += [arg for dev in sorted(glob.glob("/dev/nvidia*")) for arg in ("--dev-bind", dev, dev)]
    argv += ["--bind", str(writable), str(writable), "--chdir", str(cwd)]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    return [shutil.which("bwrap") or "bwrap", *argv[1:], "--"]


def _sandbox_env(env: dict[str, str], home: Path) -> dict[str, str]:
    kept = {k: v for k, v in env.items() if k == TOKEN_VAR or k.startswith(_KEEP_ENV)}
    return {**kept, "HOME": str(home), "TMPDIR": "/tmp", "JUPYTER_RUNTIME_DIR": str(home / "jupyter-runtime")}


def _prepare_home(home: Path) -> None:
    """A fresh HOME inside the writable folder, with matplotlib's font cache copied in (else rebuilt: seconds)."""
    home.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "matplotlib"
    if cache.is_dir():
        shutil.copytree(cache, home / ".cache" / "matplotlib", dirs_exist_ok=True)
