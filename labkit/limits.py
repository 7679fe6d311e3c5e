"""What this process may use: CPUs, memory and /dev/shm, with where each figure was read.

A container's limits live in its cgroup, not in `/proc/meminfo` or the host's core count: `read_limits()`
takes the smallest of the cgroup's (v2 `cpu.max`, `memory.max` less `memory.current`; v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`, `memory.limit_in_bytes` less `memory.usage_in_bytes`), the
spawner's (JupyterHub sets `CPU_LIMIT` and `MEM_LIMIT` in the server's environment) and the kernel's
(`sched_getaffinity`, MemAvailable), and reads `/dev/shm`'s size. `root` moves every path (tests use a
fake tree); the process's cgroup is found as the kernel names it, through /proc/self/cgroup and
/proc/self/mountinfo.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# DeepSpeed's CPU comm op (ShareMemCommBuilder, csrc/cpu/comm/shm.cpp) maps one `allreduce_workspace` per
# rank into /dev/shm: 2 x NAIVE_ALLREDUCE_THRESHOLD (1 MiB) + 2 x MAX_BUF_SIZE (32 MiB), 66 MiB (bytes).
DEEPSPEED_SHM_BYTES_PER_RANK = 2 * 2**20 + 2 * 32 * 2**20
# NCCL puts its intra-node segments in /dev/shm too; its troubleshooting guide asks containers for
# `--shm-size=1g` (bytes).
NCCL_SHM_BYTES = 2**30
# Suffixes of JupyterHub's ByteSpecification (the type of `Spawner.mem_limit`), powers of 1024.
_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
SHM_ADVICE = "`docker run --shm-size=1g`; on Kubernetes a memory-backed emptyDir mounted at /dev/shm"
_UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1 (bytes)


@dataclass(frozen=True)
class Limit:
    """One effective limit: `value` (CPUs, or bytes) and `source`, where it was read, in the words a user
    would look for (`MEM_LIMIT`, `cgroup v2 memory.max`, ...); `str()` gives `source=value` with its unit."""

    value: float
    source: str
    unit: str  # "cpus" or "bytes"

    def __str__(self) -> str:
        if self.unit == "bytes":
            return f"{self.source}={self.value / 1e9:.1f} GB"
        return f"{self.source}={self.value:g} CPU" + ("" if self.value == 1 else "s")


@dataclass(frozen=True)
class Limits:
    """The smallest CPU and memory limit that applies to this process, and /dev/shm's free and total bytes."""

    cpus: Limit
    memory: Limit  # bytes this process and its children may still use
    shm: Limit  # free bytes on /dev/shm
    shm_total_bytes: int


def read_limits(root: str | Path = "/", environ: Mapping[str, str] | None = None) -> Limits:
    """The effective limits of this process (see the module docstring); `root` prefixes every path read."""
    root = Path(root)
    env = os.environ if environ is None else environ
    cgroups = _cgroup_dirs(root)
    cpus = [_affinity(), *_cpu_limits(cgroups), *_env_limit(env, "CPU_LIMIT", "cpus")]
    memory = [_mem_available(root), *_memory_limits(cgroups), *_env_limit(env, "MEM_LIMIT", "bytes")]
    free, total = _shm_bytes(root / "dev" / "shm")
    return Limits(
        cpus=min(cpus, key=lambda limit: limit.value),
        memory=min(memory, key=lambda limit: limit.value),
        shm=Limit(free, "/dev/shm free", "bytes"),
        shm_total_bytes=total,
    )


def parse_bytes(text: str) -> int:
    """`MEM_LIMIT`'s value in bytes: a whole number of bytes (what JupyterHub writes) or a number with a
    K, M, G or T suffix (powers of 1024, as in JupyterHub's `mem_limit = "1.5G"`; `Gi` is accepted too)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if m is None:
        raise ValueError(
            f"MEM_LIMIT={text!r}: set it to a number of bytes, or a number with a K, M, G or T suffix (e.g. 1.5G)"
        )
    return int(float(m[1]) * _SUFFIXES.get(m[2].upper(), 1))


def deepspeed_shm_refusal(world_size: int, limits: Limits | None = None, what: str = "") -> str | None:
    """The sentence refusing `world_size` DeepSpeed CPU ranks whose comm workspaces (66 MiB each) do not fit
    in /dev/shm's free bytes, or None when they fit. `what` names the request (default `world_size=N`)."""
    if not sys.platform.startswith("linux"):
        return None  # DeepSpeed builds its shm comm op on Linux only
    limits = limits or read_limits()
    fit = int(limits.shm.value // DEEPSPEED_SHM_BYTES_PER_RANK)
    if world_size <= fit:
        return None
    retry = f"pass world_size<={fit}, or " if fit else ""
    return (
        f"{what or f'world_size={world_size}'}: DeepSpeed's CPU comm maps {DEEPSPEED_SHM_BYTES_PER_RANK >> 20} MiB "
        f"per rank into /dev/shm and {limits.shm} holds {fit}; {retry}give the server a larger /dev/shm "
        f"({SHM_ADVICE})"
    )


# ---------------------------------------------------------------------------------------------- sources


def _affinity() -> Limit:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return Limit(cores, "sched_getaffinity", "cpus")


def _env_limit(env: Mapping[str, str], name: str, unit: str) -> list[Limit]:
    text = env.get(name, "").strip()
    if not text:
        return []
    if unit == "bytes":
        return [Limit(parse_bytes(text), name, unit)]
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: set it to a number of CPUs (e.g. 2 or 1.5)") from None
    return [Limit(value, name, unit)] if value > 0 else []


def _mem_available(root: Path) -> Limit:
    try:
        info = dict(line.split(":", 1) for line in (root / "proc" / "meminfo").read_text().splitlines())
        return Limit(int(info["MemAvailable"].split()[0]) * 1024, "/proc/meminfo MemAvailable", "bytes")
    except (OSError, KeyError, ValueError):
        return Limit(8 * 2**30, "no /proc/meminfo: assumed", "bytes")


def _shm_bytes(path: Path) -> tuple[int, int]:
    """(free, total) bytes of the file system at `path`; (0, 0) where there is none."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0, 0
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _cpu_limits(cgroups: dict[str, list[Path]]) -> list[Limit]:
    """The CPU quota of this cgroup and each of its ancestors (CPUs): v2 `cpu.max`, v1 CFS quota/period."""
    found = []
    for folder in cgroups.get("v2", []):
        quota, _, period = (_read(folder / "cpu.max") or "max").partition(" ")
        if quota != "max":
            found.append(Limit(int(quota) / int(period or 100_000), "cgroup v2 cpu.max", "cpus"))
    for folder in cgroups.get("cpu", []):
        quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
        if quota and period and int(quota) > 0:
            found.append(Limit(int(quota) / int(period), "cgroup v1 cpu.cfs_quota_us", "cpus"))
    return found


def _memory_limits(cgroups: dict[str, list[Path]]) -> list[Limit]:
    """Limit less usage of this cgroup and each ancestor with a limit (bytes). Usage counts the page cache
    the kernel would reclaim first, so its inactive file pages are left out (as the kubelet's working set)."""
    found = []
    for version, limit_file, usage_file, inactive in (
        ("v2", "memory.max", "memory.current", "inactive_file"),
        ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    ):
        for folder in cgroups.get(version, []):
            limit = _read(folder / limit_file)
            if not limit or limit == "max" or int(limit) >= _UNLIMITED:
                continue
            stat = dict(line.split() for line in (_read(folder / "memory.stat") or "").splitlines())
            usage = int(_read(folder / usage_file) or 0) - int(stat.get(inactive, 0))
            name = f"cgroup {'v2' if version == 'v2' else 'v1'} {limit_file}"
            found.append(Limit(max(0, int(limit) - max(0, usage)), name, "bytes"))
    return found


def _cgroup_dirs(root: Path) -> dict[str, list[Path]]:
    """For "v2" and each v1 controller ("cpu", "memory"): this process's cgroup folder and its ancestors
    up to the mount, deepest first.

    /proc/self/cgroup names the cgroup as a path in its hierarchy; /proc/self/mountinfo says where that
    hierarchy is mounted and which of its folders the mount shows (a container sees its own cgroup as `/`).
    """
    mounts: dict[str, tuple[str, str]] = {}  # "v2" or a v1 controller -> (mount root, mount point)
    for line in (_read(root / "proc" / "self" / "mountinfo") or "").splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        fstype, options = fields[dash + 1], fields[-1].split(",")
        if fstype == "cgroup2":
            mounts.setdefault("v2", (fields[3], fields[4]))
        elif fstype == "cgroup":
            for controller in ("cpu", "memory"):
                if controller in options:
                    mounts.setdefault(controller, (fields[3], fields[4]))
    found: dict[str, list[Path]] = {}
    for line in (_read(root / "proc" / "self" / "cgroup") or "").splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        keys = ["v2"] if hierarchy == "0" and not controllers else controllers.split(",")
        for key in (k for k in keys if k in mounts):
            mount_root, mount_point = mounts[key]
            inside = os.path.relpath(path, mount_root) if _under(path, mount_root) else "."
            top = root / mount_point.lstrip("/")
            folder = top / inside if (top / inside).is_dir() else top
            found[key] = [folder, *[p for p in folder.parents if _under(str(p), str(top))]]
    return found


def _under(path: str, top: str) -> bool:
    return os.path.commonpath([path, top]) == os.path.normpath(top)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
