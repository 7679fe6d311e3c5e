"""Container limits: fake cgroup v2 and v1 trees, JupyterHub's CPU_LIMIT / MEM_LIMIT and a small /dev/shm change
what `labkit.limits` reads, what `cluster.max_ranks` allows, and what `launch` and the deepspeed engine refuse."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import labkit
from labkit import cluster, limits, placement
from labkit.engines.base import RunConfig
from labkit.engines.validation import validate

GB = 10**9


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _meminfo(available_bytes: int) -> str:
    return f"MemTotal:       99999999 kB\nMemAvailable:   {available_bytes // 1024} kB\n"


V2_MOUNT = "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
POD = "sys/fs/cgroup/kubepods/pod1/jupyter-alice"


def _v2_tree(tmp_path: Path, **overrides: str) -> Path:
    """A Kubernetes pod's cgroup v2: 1.5 CPUs, 2 GB of which 0.6 GB in use (0.1 GB of it inactive page cache)."""
    files = {
        "proc/self/cgroup": "0::/kubepods/pod1/jupyter-alice\n",
        "proc/self/mountinfo": "24 1 8:1 / / rw - ext4 /dev/sda1 rw\n" + V2_MOUNT,
        "proc/meminfo": _meminfo(16 * GB),
        f"{POD}/cpu.max": "150000 100000\n",
        f"{POD}/memory.max": f"{2 * GB}\n",
        f"{POD}/memory.current": f"{600_000_000}\n",
        f"{POD}/memory.stat": "anon 500000000\nfile 100000000\ninactive_file 100000000\n",
        "sys/fs/cgroup/kubepods/pod1/cpu.max": "max 100000\n",
        "sys/fs/cgroup/kubepods/pod1/memory.max": "max\n",
        "sys/fs/cgroup/kubepods/cpu.max": "max 100000\n",
        "sys/fs/cgroup/cpu.max": "max 100000\n",
        "dev/shm/.keep": "",
    }
    return _write(tmp_path, files | overrides)


def test_cgroup_v2_limits_win_over_the_machine(tmp_path):
    found = limits.read_limits(_v2_tree(tmp_path), environ={})
    assert found.cpus == limits.Limit(1.5, "cgroup v2 cpu.max", "cpus")  # 150000 / 100000
    # 2 GB less what is in use and cannot be reclaimed first (600 MB current - 100 MB inactive page cache)
    assert found.memory == limits.Limit(2 * GB - 500_000_000, "cgroup v2 memory.max", "bytes")
    st = os.statvfs(tmp_path / "dev" / "shm")
    assert (found.shm.value, found.shm_total_bytes) == (st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)


def test_a_tighter_ancestor_cgroup_decides(tmp_path):
    root = _v2_tree(
        tmp_path,
        **{
            "sys/fs/cgroup/kubepods/pod1/memory.max": f"{GB}\n",
            "sys/fs/cgroup/kubepods/pod1/memory.current": f"{300_000_000}\n",
            "sys/fs/cgroup/kubepods/cpu.max": "50000 100000\n",
        },
    )
    found = limits.read_limits(root, environ={})
    assert found.memory.value == GB - 300_000_000 and found.cpus.value == 0.5


def test_without_cgroup_limits_the_machine_decides(tmp_path):
    root = _v2_tree(tmp_path, **{f"{POD}/cpu.max": "max 100000\n", f"{POD}/memory.max": "max\n"})
    found = limits.read_limits(root, environ={})
    assert found.memory == limits.Limit(16 * GB, "/proc/meminfo MemAvailable", "bytes")
    assert found.cpus == limits.Limit(len(os.sched_getaffinity(0)), "sched_getaffinity", "cpus")


@pytest.mark.parametrize("namespaced", [True, False])
def test_cgroup_v1_limits(tmp_path, namespaced):
    """Docker on cgroup v1: with a cgroup namespace the container's cgroup is the mount's root (`/`);
    without one the mount's root is the container's folder, which /proc/self/cgroup names in full."""
    mount_root = "/" if namespaced else "/docker/abc"
    files = {
        "proc/self/cgroup": "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n",
        "proc/self/mountinfo": (
            f"40 31 0:35 {mount_root} /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n"
            f"41 31 0:36 {mount_root} /sys/fs/cgroup/cpu,cpuacct ro,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
        ),
        "proc/meminfo": _meminfo(16 * GB),
        # The host's own root cgroup: no limit (2**63 - 1 rounded down to a page).
        "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    }
    folder = "docker/abc/" if namespaced else ""
    files |= {
        f"sys/fs/cgroup/memory/{folder}memory.limit_in_bytes": f"{2**30}\n",
        f"sys/fs/cgroup/memory/{folder}memory.usage_in_bytes": f"{2**28}\n",
        f"sys/fs/cgroup/memory/{folder}memory.stat": "cache 0\ntotal_inactive_file 16777216\n",
        f"sys/fs/cgroup/cpu,cpuacct/{folder}cpu.cfs_quota_us": "50000\n",
        f"sys/fs/cgroup/cpu,cpuacct/{folder}cpu.cfs_period_us": "100000\n",
    }
    found = limits.read_limits(_write(tmp_path, files), environ={})
    assert found.memory == limits.Limit(2**30 - (2**28 - 2**24), "cgroup v1 memory.limit_in_bytes", "bytes")
    assert found.cpus == limits.Limit(0.5, "cgroup v1 cpu.cfs_quota_us", "cpus")


def test_jupyterhub_env_limits_win_when_smaller(tmp_path):
    root = _v2_tree(tmp_path)
    found = limits.read_limits(root, environ={"CPU_LIMIT": "1.0", "MEM_LIMIT": "1200000000"})
    assert found.cpus == limits.Limit(1.0, "CPU_LIMIT", "cpus") and str(found.cpus) == "CPU_LIMIT=1 CPU"
    assert found.memory == limits.Limit(1_200_000_000, "MEM_LIMIT", "bytes")  # below the cgroup's 1.5 GB free
    assert str(found.memory) == "MEM_LIMIT=1.2 GB"
    larger = limits.read_limits(root, environ={"CPU_LIMIT": "8", "MEM_LIMIT": "64G"})
    assert larger.cpus.source == "cgroup v2 cpu.max" and larger.memory.source == "cgroup v2 memory.max"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1500000000", 1_500_000_000), ("1.5G", 3 * 2**29), ("512M", 2**29), ("2Gi", 2**31), ("4096K", 2**22)],
)
def test_mem_limit_as_jupyterhub_writes_it(text, expected):
    assert limits.parse_bytes(text) == expected


def test_a_mem_limit_that_is_not_a_size_is_one_sentence():
    with pytest.raises(
        ValueError, match=r"^MEM_LIMIT='lots': set it to a number of bytes, or a number with a K"
    ):
        limits.parse_bytes("lots")


# ---------------------------------------------------------------------------------- what the cluster allows


def _rank() -> int:
    return 0


def test_fake_cgroup_changes_max_ranks(tmp_path, monkeypatch):
    root = _v2_tree(tmp_path)
    monkeypatch.setattr(placement, "read_limits", lambda: limits.read_limits(root, environ={}))
    # 1.5 CPUs x 4 = 6 ranks; 1.5 GB free // 500 MiB = 2 ranks: memory decides.
    assert cluster.RANKS_PER_CORE == 4 and cluster.RANK_BYTES_ESTIMATE == 500 * 2**20
    assert cluster.max_ranks("cpu") == 2
    assert cluster.rank_limit("cpu")[1] == (
        "the memory limit cgroup v2 memory.max=1.5 GB allows 2 cpu ranks of about 500 MiB each"
    )
    with pytest.raises(
        ValueError, match=r"^world_size=3: the memory limit cgroup v2 memory\.max=1\.5 GB allows 2 "
    ):
        labkit.launch(_rank, 3, device_type="cpu")
    monkeypatch.setattr(
        placement, "read_limits", lambda: limits.read_limits(root, environ={"CPU_LIMIT": "0.25"})
    )
    assert cluster.rank_limit("cpu") == (1, "the CPU limit CPU_LIMIT=0.25 CPUs allows 1 cpu rank (4 per CPU)")


def test_mem_limit_refuses_a_launch_that_cannot_fit_before_any_rank_starts(monkeypatch):
    monkeypatch.setenv("MEM_LIMIT", "1500000000")
    monkeypatch.delenv("CPU_LIMIT", raising=False)
    assert cluster.max_ranks("cpu") == 2  # 1.5e9 // 524,288,000 (unless this machine has less memory)
    start = time.perf_counter()
    with pytest.raises(ValueError) as refused:
        labkit.launch(_rank, 3, device_type="cpu")
    assert time.perf_counter() - start < 1.0, "refused before any rank starts"
    assert str(refused.value) == (
        "world_size=3: the memory limit MEM_LIMIT=1.5 GB allows 2 cpu ranks of about 500 MiB each; "
        "pass world_size<=2"
    )


# ---------------------------------------------------------------------------------------------- /dev/shm


def _small_shm(monkeypatch, free_bytes: int) -> None:
    monkeypatch.setattr(limits, "_shm_bytes", lambda path: (free_bytes, free_bytes))


def test_deepspeed_cpu_ranks_need_66_mib_each_of_dev_shm(monkeypatch):
    # shm.cpp: struct allreduce_workspace holds 2 x 1 MiB + 2 x 32 MiB of buffers per rank.
    assert limits.DEEPSPEED_SHM_BYTES_PER_RANK == 66 * 2**20
    _small_shm(monkeypatch, 64 * 2**20)  # Docker's and Kubernetes' default /dev/shm
    assert limits.deepspeed_shm_refusal(2) == (
        "world_size=2: DeepSpeed's CPU comm maps 66 MiB per rank into /dev/shm and /dev/shm free=0.1 GB holds 0; "
        f"give the server a larger /dev/shm ({limits.SHM_ADVICE})"
    )
    _small_shm(monkeypatch, 3 * 66 * 2**20)
    assert limits.deepspeed_shm_refusal(3) is None
    assert "holds 3; pass world_size<=3, or give the server" in limits.deepspeed_shm_refusal(4)


def test_the_deepspeed_engine_refuses_in_the_parent_when_dev_shm_is_too_small(monkeypatch):
    _small_shm(monkeypatch, 64 * 2**20)
    with pytest.raises(ValueError, match=r"^world_size=2: DeepSpeed's CPU comm maps 66 MiB per rank"):
        validate(["deepspeed"], RunConfig(world_size=2))
    validate(["fsdp2"], RunConfig(world_size=2))  # the other engines do not use it
