"""Where ranks run, decided before any starts: each rank's device, backend and start method, and its node.

`choose_placement` is a pure function of the world size and the GPU count: CUDA ranks on the device-mapped
backend `"cpu:gloo,cuda:nccl"` (NCCL for CUDA tensors, gloo for the CPU ones a notebook or a check hands a
collective) when every rank gets a GPU of its own, else CPU ranks on gloo. `fork` on a machine without a
GPU; `spawn` wherever a GPU is visible, even for CPU ranks, because fork is unsafe once anything in the
parent has initialised the CUDA driver (`torch.cuda.is_available()`, DeepSpeed's import or
`torch.utils.cpp_extension` all do). GPUs are counted through NVML, which does not initialise CUDA
(`visible_gpus`). `rank_limit` says how many ranks this machine holds. Under torchrun or the DeepSpeed
launcher the ranks already exist (`under_launcher`); `ranks_per_node` and `rank_nodes` say which node each
is on. `labkit.cluster` starts the ranks this module places.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from labkit.limits import Limits, read_limits

RANK_BYTES_ESTIMATE = 500 * 2**20  # resident memory of one idle rank with torch imported (bytes)
RANKS_PER_CORE = 4  # CPU ranks per core `max_ranks` allows: the lab's ranks mostly wait on each other
CPU_BACKEND = "gloo"
GPU_BACKEND = "cpu:gloo,cuda:nccl"  # CUDA tensors over NCCL, CPU tensors over gloo, in one process group


@dataclass(frozen=True)
class Placement:
    """Where ranks run: the process-group `backend`, the `device_type` of each rank, the start method."""

    backend: str
    device_type: str
    start_method: str


def max_ranks(device_type: str | None = None) -> int:
    """How many ranks this machine can run at once (ranks); `rank_limit` says which limit decides it."""
    return rank_limit(device_type)[0]


def rank_limit(device_type: str | None = None, limits: Limits | None = None) -> tuple[int, str]:
    """How many `device_type` ranks fit at once (ranks), and a phrase naming the limit that decides it.

    Four ranks per CPU of the CPU limit (the lab's models are tiny and the ranks spend most of their time
    waiting on each other), and as many ~500 MiB ranks as the memory limit holds: the container's or the
    spawner's where they are smaller than the machine's (`labkit.limits.read_limits`). CUDA ranks also need
    a visible GPU each. At least 1 CPU rank: one process always runs.
    """
    device_type = device_type or _default_placement().device_type
    limits = limits or read_limits()
    by_cpus = math.floor(RANKS_PER_CORE * limits.cpus.value + 1e-9)
    by_memory = int(limits.memory.value // RANK_BYTES_ESTIMATE)
    gpus = (visible_gpus() or 0) if device_type == "cuda" else None
    n = min(by_cpus, by_memory) if gpus is None else min(gpus, by_cpus, by_memory)
    n = n if device_type == "cuda" else max(1, n)
    ranks = f"{n} {device_type} rank" + ("" if n == 1 else "s")
    if gpus == n:
        return n, f"this machine shows {gpus} GPUs, which allows {ranks} (one GPU per rank)"
    if by_memory < by_cpus:
        return (
            n,
            f"the memory limit {limits.memory} allows {ranks} of about {RANK_BYTES_ESTIMATE >> 20} MiB each",
        )
    return n, f"the CPU limit {limits.cpus} allows {ranks} ({RANKS_PER_CORE} per CPU)"


def visible_gpus() -> int | None:
    """CUDA devices this process may use (CUDA_VISIBLE_DEVICES honoured), counted without initialising CUDA.

    Through NVML, as `torch.cuda.device_count()` does before CUDA starts (`torch.cuda._device_count_nvml`);
    `torch.cuda.is_available()` would call `cudaGetDeviceCount`, which initialises the driver and makes a
    later fork unsafe. 0: a CPU build of torch, or no NVIDIA driver (no NVML library); None: NVML could
    not count them (e.g. MIG devices named in CUDA_VISIBLE_DEVICES).
    """
    if torch.version.cuda is None:
        return 0
    if torch.cuda.is_initialized():
        return torch.cuda.device_count()
    import ctypes

    try:
        ctypes.CDLL("libnvidia-ml.so.1")  # the library torch's NVML count loads
    except OSError:
        return 0
    count = torch.cuda._device_count_nvml()
    return count if count >= 0 else None


def choose_placement(world_size: int, gpus: int | None, device_type: str | None = None) -> Placement:
    """Where `world_size` ranks run on a machine with `gpus` visible GPUs (None: some, uncounted).

    CUDA ranks on the device-mapped backend when every rank gets a GPU of its own (NCCL cannot put two
    ranks on one GPU), else CPU ranks on gloo: a 1-GPU hub runs its 2 to 4 ranks on CPU. `spawn` whenever
    a GPU may exist, `fork` only where none does. `device_type` ("cpu" or "cuda") asks for one kind, so that
    every launch of one comparison (`single`'s one rank too) runs on the same kind of device.
    """
    if device_type not in (None, "cpu", "cuda"):
        raise ValueError(f"device_type={device_type!r}: pass 'cpu', 'cuda' or None (this machine decides)")
    enough = gpus is not None and gpus >= world_size
    if device_type == "cuda" and not enough:
        raise ValueError(
            f"device_type='cuda' for {world_size} ranks but this machine shows {gpus or 0} GPUs; "
            f"pass world_size<={gpus or 0} or device_type='cpu'"
        )
    if enough and device_type != "cpu":
        return Placement(GPU_BACKEND, "cuda", "spawn")
    return Placement(CPU_BACKEND, "cpu", "fork" if gpus == 0 else "spawn")


def placement(world_size: int, device_type: str | None = None) -> Placement:
    """The backend, device and start method `launch` uses for `world_size` ranks on this machine."""
    return choose_placement(world_size, visible_gpus(), device_type)


def backend_devices(backend: str) -> dict[str, str]:
    """{device type: backend} of a process-group backend string.

    "gloo" -> {"cpu": "gloo"}, "nccl" -> {"cuda": "nccl"}, "cpu:gloo,cuda:nccl" -> both. `dist.get_backend()`
    returns the device-mapped form whole, so a test for `== "nccl"` never holds on GPU ranks.
    """
    if ":" not in backend:
        return {"cuda" if backend == "nccl" else "cpu": backend}
    return dict(pair.split(":", 1) for pair in backend.split(","))


def rank_device(backend: str, local_rank: int) -> torch.device:
    """This rank's device for its process group's `backend`: `cuda:<local_rank>` when CUDA tensors go over
    NCCL, else the CPU. The index counts within CUDA_VISIBLE_DEVICES (as a hub sets it per kernel), so two
    students' 2-rank launches on GPUs 0,1 and 2,3 each use their own two."""
    if backend_devices(backend).get("cuda") == "nccl":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def under_launcher() -> bool:
    """True when this process is a rank started by torchrun or the DeepSpeed launcher."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LABKIT_LAUNCH_DIR" not in os.environ
    )


def launcher_world_size() -> int | None:
    """The number of ranks the torchrun / DeepSpeed launcher started, or None when not under one (ranks)."""
    return int(os.environ["WORLD_SIZE"]) if under_launcher() else None


def ranks_per_node(world_size: int) -> int:
    """Ranks on this process's node: what "one node" means for HSDP shard groups and hpZ partitions (ranks).

    torchrun and `labkit.launch` set LOCAL_WORLD_SIZE, the DeepSpeed launcher LOCAL_SIZE; anywhere else
    (a parent process on one machine) every one of `world_size` ranks is on this node.
    """
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(name):
            return int(os.environ[name])
    return world_size


def node_key() -> str:
    """Which node this rank is on, as its launcher numbers nodes.

    torchrun: the agent (`GROUP_RANK`), so two agents on one host are two nodes; the DeepSpeed launcher:
    its `CROSS_RANK` (`--node_rank`); otherwise the host name. `labkit.launch` is one node (GROUP_RANK=0).
    """
    for name in ("GROUP_RANK", "CROSS_RANK"):
        if os.environ.get(name):
            return f"node {os.environ[name]}"
    import socket

    return socket.gethostname()


def rank_nodes() -> list[int]:
    """Every rank's node, in rank order, numbered 0, 1, ... by each node's lowest rank.

    One `all_gather_object` over the default group: call it on every rank, outside any measured step.
    """
    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, node_key())
    number = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    return [number[key] for key in keys]


def _default_placement() -> Placement:
    return placement(1)
