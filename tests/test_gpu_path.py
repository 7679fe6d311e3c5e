"""The CUDA path's logic, exercised on CPU: where ranks go for made-up GPU counts and the backend string
they get.

What needs a GPU to run is `benchmarks/gpu_smoke.py`; these tests hold everywhere (no mock collectives:
the multi-rank ones run real gloo ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import labkit
from labkit import cluster, prebuild
from labkit.cluster import CPU_BACKEND, GPU_BACKEND, Placement, choose_placement
from labkit.engines import loop

CUDA = Placement(GPU_BACKEND, "cuda", "spawn")

# ------------------------------------------------------------------------------------- where ranks go


@pytest.mark.parametrize(
    ("gpus", "world_size", "expected"),
    [
        (0, 1, Placement("gloo", "cpu", "fork")),  # no GPU at all: fork, as on a laptop
        (0, 4, Placement("gloo", "cpu", "fork")),
        (4, 4, CUDA),  # a GPU per rank: CUDA ranks, CPU tensors still over gloo
        (8, 2, CUDA),
        (1, 1, CUDA),  # the 1-GPU hub's one-rank runs
        (1, 2, Placement("gloo", "cpu", "spawn")),  # the 1-GPU hub at world_size 2-4: CPU ranks, spawned
        (1, 3, Placement("gloo", "cpu", "spawn")),
        (1, 4, Placement("gloo", "cpu", "spawn")),
        (3, 4, Placement("gloo", "cpu", "spawn")),
        (None, 1, Placement("gloo", "cpu", "spawn")),  # NVML could not count: maybe a GPU, so no fork
    ],
)
def test_placement_for_made_up_gpu_counts(gpus, world_size, expected):
    assert choose_placement(world_size, gpus) == expected


def test_one_device_kind_can_be_asked_for_and_an_impossible_one_is_refused_in_one_sentence():
    assert choose_placement(1, 1, "cpu") == Placement("gloo", "cpu", "spawn")  # single beside CPU ranks
    assert choose_placement(2, 4, "cpu") == Placement("gloo", "cpu", "spawn")
    assert choose_placement(2, 0, "cpu") == Placement("gloo", "cpu", "fork")
    assert choose_placement(2, 4, "cuda") == CUDA
    with pytest.raises(ValueError, match=r"^device_type='cuda' for 2 ranks but this machine shows 1 GPUs; "):
        choose_placement(2, 1, "cuda")
    with pytest.raises(ValueError, match="pass 'cpu', 'cuda' or None"):
        choose_placement(2, 1, "gpu")


def test_this_cpu_build_counts_no_gpu_and_forks_cpu_ranks():
    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch: the count comes from NVML (benchmarks/gpu_smoke.py checks it)")
    assert cluster.visible_gpus() == 0
    assert cluster.placement(2) == Placement("gloo", "cpu", "fork")
    assert not torch.cuda.is_initialized()


# ---------------------------------------------------------------------------------------- backend strings


def test_backend_strings_name_each_devices_backend():
    assert cluster.backend_devices("gloo") == {"cpu": "gloo"}
    assert cluster.backend_devices("nccl") == {"cuda": "nccl"}
    assert cluster.backend_devices(GPU_BACKEND) == {"cpu": "gloo", "cuda": "nccl"}
    assert cluster.rank_device(GPU_BACKEND, 3) == torch.device("cuda", 3)
    assert cluster.rank_device("nccl", 1) == torch.device("cuda", 1)
    assert cluster.rank_device(CPU_BACKEND, 3) == torch.device("cpu")
    assert cluster.rank_device("cpu:gloo", 0) == torch.device("cpu")


def _info():
    return loop.rank_info()


def test_a_gloo_launch_reports_the_cpu_device_and_the_whole_backend_string():
    infos = labkit.launch(_info, 2)
    assert [(i.rank, i.local_rank, i.device, i.backend) for i in infos] == [
        (r, r, torch.device("cpu"), "gloo") for r in range(2)
    ]


def _device_mapped_group_info():
    """`get_backend()` of a group made with a device-mapped string (gloo only: this build has no NCCL)."""
    group = dist.new_group(backend="cpu:gloo")
    backend = str(dist.get_backend(group))
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    return backend, cluster.rank_device(backend, 0), t.tolist()


def test_a_device_mapped_backend_comes_back_whole_and_still_carries_cpu_tensors():
    for backend, device, total in labkit.launch(_device_mapped_group_info, 2):
        assert backend == "cpu:gloo" != "gloo"  # why no code may test the backend by equality
        assert device == torch.device("cpu") and total == [2.0] * 3


def test_cuda_ranks_keep_the_hubs_visible_devices_and_cpu_ranks_see_none(monkeypatch, tmp_path):
    """A hub gives each kernel its GPUs in CUDA_VISIBLE_DEVICES; a rank's index counts within them."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    gpu_env = cluster._Run(_info, (), {}, 2, CUDA, 10.0)._env(1, 29500)
    assert "CUDA_VISIBLE_DEVICES" not in gpu_env  # inherited as the hub set it: ranks 0, 1 -> GPUs 2, 3
    assert gpu_env["LOCAL_RANK"] == "1" and cluster.rank_device(GPU_BACKEND, 1) == torch.device("cuda", 1)
    assert gpu_env["DS_ACCELERATOR"] == "cuda"
    assert gpu_env["TORCH_EXTENSIONS_DIR"] == str(tmp_path / prebuild.CUDA_SUBDIR)
    cpu_env = cluster._Run(_info, (), {}, 2, Placement("gloo", "cpu", "spawn"), 10.0)._env(1, 29500)
    assert cpu_env["CUDA_VISIBLE_DEVICES"] == "" and cpu_env["DS_ACCELERATOR"] == "cpu"
    assert "TORCH_EXTENSIONS_DIR" not in cpu_env
