"""The CUDA path's logic, exercised on CPU: where ranks go for made-up GPU counts, the backend string they
get, one shared placement of every rank-side helper's model and batches, host pinning decided by the
tensor, checkpoints written on GPU ranks read on CPU ranks, a closure's GPU tensor refused before spawning.

What needs a GPU to run is `benchmarks/gpu_smoke.py`; these tests hold everywhere (no mock collectives:
the multi-rank ones run real gloo ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import labkit
from labkit import cluster, prebuild
from labkit.engines import loop, on_rank
from labkit.engines.base import RunConfig
from labkit.placement import CPU_BACKEND, GPU_BACKEND, Placement, choose_placement
from labkit.zero import ShardedAdamW

ROOT = Path(__file__).resolve().parents[1]
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


def test_a_comparison_on_a_1_gpu_hub_puts_single_on_cpu_too(monkeypatch):
    """`single` is one rank, which alone would take the GPU; the comparison's world size decides for it."""
    monkeypatch.setattr("labkit.placement.visible_gpus", lambda: 1)
    assert cluster.placement(1).device_type == "cuda"
    assert loop.comparison_device_type(RunConfig(world_size=2)) == "cpu"
    assert loop.comparison_device_type(RunConfig(world_size=1)) == "cuda"
    monkeypatch.setattr("labkit.placement.visible_gpus", lambda: 4)
    assert loop.comparison_device_type(RunConfig(world_size=4)) == "cuda"


def test_run_launches_single_with_the_comparisons_device_kind(monkeypatch):
    """A pretend 1-GPU hub in the parent: run("single") at world_size 2 must start a CPU rank (spawned, as
    with a GPU present). Had it picked the GPU placement, the rank would call CUDA and fail on this build."""
    monkeypatch.setattr("labkit.placement.visible_gpus", lambda: 1)
    record = loop.run("single", RunConfig(world_size=2, steps=1))
    assert set(record["state_bytes_by_device"]) == {"cpu"}
    with pytest.raises(ValueError, match="device_type='cuda' for 2 ranks"):
        labkit.launch(_info, 2, device_type="cuda")


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
    return on_rank.rank_info()


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


# ----------------------------------------------------------------- one shared placement of model and batch


class _BatchInputs(TorchFunctionMode):
    """Records, for each token embedding and each loss, whether its index tensor holds the memory of a
    tensor in `placed` ({storage address: weak ref}): a view, a detached alias (DeepSpeed wraps a module's
    inputs), or the tensor itself. A copy made anywhere else (a stray `.to(device)`) is not one."""

    def __init__(self, placed: dict):
        super().__init__()
        self.placed = placed
        self.seen: list[tuple[str, bool]] = []

    def _mine(self, t) -> bool:
        ref = self.placed.get(t.untyped_storage().data_ptr())
        return ref is not None and ref() is not None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.embedding and args[0].dim() == 2:  # tokens (pos takes an arange)
            self.seen.append(("tokens", self._mine(args[0])))
        elif func is torch.nn.functional.cross_entropy:
            self.seen.append(("targets", self._mine(args[1])))
        return func(*args, **kwargs)


def _helpers_under_watch() -> dict[str, dict]:
    """Each rank-side helper under a spy on `on_rank.to_rank_device`: how many models it placed, and whether
    every tokens / targets tensor its model and loss saw came out of that one function."""
    import weakref

    from labkit.buildalong import checks
    from labkit.buildalong.cells import pieces_from_notebook
    from labkit.lessons import deepspeed_inspect, engine_inspect, fsdp2_features, fsdp2_inspect

    placed: dict[int, weakref.ref] = {}  # storage address -> the tensor the function returned
    models = [0]
    original = on_rank.to_rank_device

    def spy(x, device=None):
        out = original(x, device)
        if isinstance(out, torch.nn.Module):
            models[0] += 1
        elif isinstance(out, torch.Tensor):
            placed[out.untyped_storage().data_ptr()] = weakref.ref(out)
        return out

    on_rank.to_rank_device = spy
    cfg = RunConfig(model="tiny", world_size=dist.get_world_size(), steps=2)
    helpers = {
        "engine_inspect.hook_trace": lambda: engine_inspect.hook_trace("tiny", steps=1),
        "fsdp2_inspect.mixed_precision_by_block": lambda: fsdp2_inspect.mixed_precision_by_block(cfg),
        "fsdp2_inspect.first_step_logs": lambda: fsdp2_inspect.first_step_logs(cfg),
        "fsdp2_features.ignored_params": lambda: fsdp2_features.ignored_params(cfg),
        "deepspeed_inspect.own_accounting_beside_probe": lambda: (
            deepspeed_inspect.own_accounting_beside_probe(cfg)
        ),
        "build checks (forward)": lambda: checks._rank_forward(pieces_from_notebook(), "tiny_uneven", 1),
    }
    out = {}
    try:
        for name, helper in helpers.items():
            models[0] = 0
            mode = _BatchInputs(placed)
            with mode:
                helper()
            out[name] = {"models": models[0], "seen": mode.seen}
    finally:
        on_rank.to_rank_device = original
    return out


def test_every_rank_side_helper_places_its_model_and_every_batch_through_one_function():
    """On a GPU a tensor left behind fails (FSDP2 moves the forward's inputs, not the targets, and never its
    ignored parameters); on CPU the same rule is checked by where each tensor the model reads came from."""
    for rank in labkit.launch(_helpers_under_watch, 2, timeout=240):
        for name, facts in rank.items():
            assert facts["models"] >= 1, f"{name} built its model without on_rank.to_rank_device"
            kinds = {kind for kind, _ in facts["seen"]}
            assert kinds == {"tokens", "targets"}, (name, facts["seen"])
            strays = [kind for kind, mine in facts["seen"] if not mine]
            assert not strays, f"{name} fed its model {strays} that on_rank.to_rank_device did not place"


# --------------------------------------------------------------------------------------- host pinning


def test_host_buffers_are_pinned_for_cuda_shards_only_and_cuda_is_never_asked(monkeypatch):
    assert ShardedAdamW.pins_host_buffers(torch.device("cuda", 0))
    assert not ShardedAdamW.pins_host_buffers(torch.device("cpu"))

    def asked():
        raise AssertionError(
            "torch.cuda.is_available() was called: on a forked CPU rank that initialises CUDA"
        )

    monkeypatch.setattr(torch.cuda, "is_available", asked)
    shard = torch.nn.Parameter(torch.ones(6))
    shard.grad = torch.full((6,), 0.5)
    opt = ShardedAdamW([shard], offload=True)
    opt.step()
    assert not any(t.is_pinned() for t in opt.state_tensors())
    assert opt.master[0].device.type == "cpu" and shard[0].item() < 1.0  # stepped, on the host copy


# ---------------------------------------------------------------------------------------- checkpoints


def _save(path: str) -> list[float]:
    from labkit.engines import scratch
    from labkit.zero import checkpoint

    cfg = RunConfig(model="tiny", world_size=2, steps=1)
    engine = scratch.build(cfg, on_rank.rank_model("tiny", 0, torch.device("cpu")), on_rank.rank_info())
    on_rank.train_steps(engine, cfg)
    checkpoint.save(path, engine.zero, engine.optimizer)
    return [s.sum().item() for s in engine.zero.shards()]


def _load(path: str) -> list[float]:
    from labkit.engines import scratch
    from labkit.zero import checkpoint

    cfg = RunConfig(model="tiny", world_size=2, steps=1)
    engine = scratch.build(cfg, on_rank.rank_model("tiny", 0, torch.device("cpu")), on_rank.rank_info())
    checkpoint.load(path, engine.zero, engine.optimizer)
    return [s.sum().item() for s in engine.zero.shards()]


def _retag_as_cuda(path: Path) -> None:
    """Rewrite each rank file as CUDA rank r would have written it: every storage tagged "cuda:r"."""
    registry = torch.serialization._package_registry
    for r in range(2):
        file = path / f"rank{r}.pt"
        state = torch.load(file)
        tag = (-1, lambda storage, r=r: f"cuda:{r}", lambda storage, location: None)
        registry.insert(0, tag)
        try:
            torch.save(state, file)
        finally:
            registry.remove(tag)


def test_a_checkpoint_written_on_cuda_ranks_loads_on_cpu_ranks(tmp_path):
    saved = labkit.launch(_save, 2, str(tmp_path))
    _retag_as_cuda(tmp_path)
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(tmp_path / "rank1.pt")  # what `load` did before it passed map_location
    assert labkit.launch(_load, 2, str(tmp_path)) == saved


def test_a_tensor_off_the_cpu_sent_to_spawned_ranks_is_refused_in_one_sentence():
    """A notebook cell's closure holding a GPU tensor would land on the parent's GPU in every rank; the
    meta device stands in for CUDA here (the pickler refuses any device but the CPU)."""
    import cloudpickle

    weights = torch.empty(3, 4, device="meta")
    with pytest.raises(ValueError, match=r"hold a tensor on meta \(shape \(3, 4\)\): every rank would load"):
        cluster.dumps_for_ranks((lambda: weights.sum(), (), {}))
    ones = torch.ones(2)
    fn, args, kwargs = cloudpickle.loads(cluster.dumps_for_ranks((lambda k: ones.sum() * k, (3,), {})))
    assert fn(*args, **kwargs) == 6


@pytest.mark.parametrize(
    "env, gpus, expected",
    [
        ("9.0a", [], "9.0"),  # a Hopper image's arch-specific entry: DeepSpeed's int() refused "0a"
        ("8.0 9.0a;7.5+PTX", [], "7.5+PTX;8.0;9.0"),
        ("9.0;9.0a+PTX", [], "9.0+PTX"),
        (None, [(9, 0), (9, 0)], "9.0"),  # no list: the visible GPUs'
        ("", [(8, 0), (9, 0)], "8.0;9.0"),
    ],
)
def test_the_cuda_arch_list_is_one_deepspeed_parses(env, gpus, expected):
    from labkit.prebuild import deepspeed_arch_list

    assert deepspeed_arch_list(env, gpus) == expected
    for entry in expected.split(";"):  # what DeepSpeed's CUDAOpBuilder.compute_capability_args does with it
        major, minor = entry.removesuffix("+PTX").split(".")
        int(major), int(minor)


def test_a_cuda_arch_list_entry_that_is_no_capability_is_refused_in_one_sentence():
    from labkit.prebuild import deepspeed_arch_list

    with pytest.raises(ValueError, match="^TORCH_CUDA_ARCH_LIST entry 'sm_90' is not a compute capability"):
        deepspeed_arch_list("sm_90", [])
