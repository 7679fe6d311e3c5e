"""The DeepSpeed JSON config for a `RunConfig`: ZeRO stage 3, with the knobs that make the comparison fair.

DeepSpeed's ZeRO-3 defaults are tuned for billion-parameter models and quietly stop sharding a small one:
every parameter under `stage3_param_persistence_threshold` (1e5 elements) stays gathered on every rank, and
`stage3_max_live_parameters` / `stage3_max_reuse_distance` (1e9 elements each) let gathered parameters
stay alive for reuse. The lab's tiny model is all small tensors, so with the defaults DeepSpeed gathers it
once and keeps it (no all-gather per step; only the reduce-scatters remain). `mode="fair"` turns those
caches off so DeepSpeed does what the formula and the other engines do: gather each block before use,
release it after, every step. `mode="defaults"` leaves DeepSpeed's own values, to show the contrast.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import itertools
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from labkit.engines.base import RunConfig
from labkit.model import build_model
from labkit.names import NVME

# The four ZeRO-3 knobs `mode="fair"` sets, each in parameter elements, and why.
FAIR_ZERO3_KNOBS: dict[str, int] = {
    # Partition every parameter, however small (default 1e5 elements: smaller ones stay whole on every rank).
    "stage3_param_persistence_threshold": 0,
    # At most 1 element live (default 1e9). DeepSpeed's prefetch budget is max live minus the elements gathered
    # now, so it prefetches one parameter only when nothing is gathered (docs/measured.md).
    "stage3_max_live_parameters": 1,
    # Never keep a parameter for reuse "soon" (default: anything reused within 1e9 elements stays).
    "stage3_max_reuse_distance": 0,
    # A bucket of one element (default 5e7: the whole tiny model at once); the live budget above caps it anyway.
    "stage3_prefetch_bucket_size": 1,
}

# The ZeRO++ flags a run may set through `cfg.options`, with what each does.
ZERO_PLUS_PLUS_FLAGS = {
    "zero_hpz_partition_size": "ranks in the secondary (hierarchical) weight partition used in backward",
    "zero_quantized_weights": "all-gather int8-quantized weights instead of full-precision ones",
    "zero_quantized_gradients": "reduce gradients with a quantized all-to-all instead of a reduce-scatter",
}


def quantized_weight_fetches() -> list[str]:
    """The `quantize=` arguments of the installed DeepSpeed's weight fetch (`__all_gather_params` of its
    `PartitionedParameterCoordinator`), read from its source: the quantizer is a CUDA kernel, nothing runs it here.

    DeepSpeed 0.19.8 gives ["True", "self.zero_quantized_weights"]: parameters stored quantised, then every
    other one as the config's flag says, for forward and backward fetches alike (its `forward` argument only
    names the profiler event). So qwZ quantises both weight all-gathers, and `labkit.budget` prices it so.
    """
    root = Path(importlib.util.find_spec("deepspeed").origin).parent
    tree = ast.parse((root / "runtime" / "zero" / "partitioned_param_coordinator.py").read_text())
    fetch = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__all_gather_params"
    )
    calls = [n for n in ast.walk(fetch) if isinstance(n, ast.Call)]
    return [ast.unparse(k.value) for call in calls for k in call.keywords if k.arg == "quantize"]


# The config's "activation_checkpointing" section alone leaves the step's peak unchanged (docs/measured.md).
ACTIVATION_CHECKPOINTING_REFUSAL = (
    "activation_checkpointing=True: the deepspeed engine refuses it, because DeepSpeed's activation "
    "checkpointing needs model code (the model's forward must call deepspeed.checkpointing.checkpoint; the "
    "config's activation_checkpointing section alone recomputes nothing), so it is not 'turned on from a "
    "config without touching the model'; run it on the scratch or fsdp2 engine"
)

# The cfg.options keys the deepspeed engine reads (`ds_config`'s docstring says what each does);
# activation_checkpointing is read to be refused with its own sentence.
OPTIONS = (
    *ZERO_PLUS_PLUS_FLAGS,
    "ds_mode",
    "offload_param",
    "nvme_path",
    "zero_overrides",
    "comms_logger",
    "z3_leaf_blocks",
    "activation_checkpointing",
)
MODES = ("fair", "defaults")


def block_numel(model: str) -> int:
    """Parameter elements of one block of `model`: the size `mode="fair"` gives DeepSpeed's reduce bucket.

    DeepSpeed keeps one flat gradient bucket of `reduce_bucket_size` elements allocated for the whole run
    (default 5e8: 2 GB in fp32, 4000x the tiny model) and reduce-scatters whenever it fills. One block's
    worth makes it reduce-scatter about once per block, as FSDP2 does, and keeps the bucket in proportion.
    """
    return sum(p.numel() for p in build_model(model).blocks[0].parameters())


@functools.cache
def gradient_ready_numels(model: str) -> tuple[int, ...]:
    """Elements of each parameter of `model`, in the order backward finishes their gradients.

    The order DeepSpeed adds gradients to its reduce bucket (one backward of the plain model on one
    sequence: the order does not depend on the batch).
    """
    from labkit.model import batch, loss_fn

    net, order = build_model(model), []
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(lambda p: order.append(p.numel()))
    tokens, targets = batch(0, model)
    loss_fn(net(tokens[:1]), targets[:1]).backward()
    return tuple(order)


def reduce_scatters_per_step(numels: Sequence[int], bucket_numel: int) -> int:
    """How many reduce-scatters DeepSpeed 0.19 issues per step for gradients arriving as `numels`.

    Its rule (`reduce_independent_p_g_buckets_and_remove_grads`): before adding a gradient, flush the
    bucket if it is not empty and the gradient would overflow it; flush what is left at the end.
    """
    calls, filled = 0, 0
    for numel in numels:
        if filled and filled + numel > bucket_numel:
            calls, filled = calls + 1, 0
        filled += numel
    return calls + (filled > 0)


def reduce_bucket_for_calls(model: str, calls: int) -> int:
    """The smallest `reduce_bucket_size` (elements) with which DeepSpeed reduce-scatters `calls` times a step.

    Candidates are the sums of consecutive gradients (only those change the count); a ValueError in a
    sentence when no bucket size gives exactly `calls`.
    """
    numels = gradient_ready_numels(model)
    prefix = [0, *itertools.accumulate(numels)]
    sums = sorted({prefix[j] - prefix[i] for i in range(len(numels)) for j in range(i + 1, len(prefix))})
    for bucket in sums:
        if reduce_scatters_per_step(numels, bucket) == calls:
            return bucket
    raise ValueError(
        f"no reduce_bucket_size makes DeepSpeed reduce-scatter {calls} times a step on {model!r}"
    )


def module_units(model: str) -> int:
    """Units when every module that holds parameters directly is one: each block plus each root module
    (tok, pos, ln_f, head on the lab's GPT). DeepSpeed's with its blocks as leaves; FSDP2's in
    `labkit.lessons.parity`."""
    net = build_model(model)
    in_blocks = {id(m) for b in net.blocks for m in b.modules()}
    root = [
        m for m in net.modules() if id(m) not in in_blocks and any(True for _ in m.parameters(recurse=False))
    ]
    return len(net.blocks) + len(root)


def matched_to_fsdp2(model: str) -> dict[str, Any]:
    """`cfg.options` under which DeepSpeed's collectives per step equal FSDP2's at module units.

    With the fair knobs DeepSpeed gathers every sub-module separately (64 all-gathers a step on tiny, where
    FSDP2's per-block units take 2 x blocks + 1 = 9). Each block a leaf module makes it one gather per
    block and direction; the root's four modules stay four units (DeepSpeed cannot merge siblings without
    a change to the model), so FSDP2 meets it there (`parity.Fsdp2ModuleUnits`): 2 x units all-gathers.
    Its reduce bucket is sized so that it reduce-scatters once per unit, as FSDP2 does (same bytes; the
    bucket's boundaries are not the units'). DeepSpeed keeps one all-reduce of 8 B, its gradient norm.
    """
    bucket = reduce_bucket_for_calls(model, module_units(model))
    return {"z3_leaf_blocks": True, "zero_overrides": {"reduce_bucket_size": bucket}}


def offload_section(cfg: RunConfig) -> dict[str, Any]:
    """One `offload_optimizer` / `offload_param` section: to host memory, or to files (ZeRO-Infinity).

    "nvme" swaps through DeepSpeed's async_io op into `cfg.options["nvme_path"]` (default:
    `default_nvme_path()`), a folder DeepSpeed fills with swap files per rank; any file system works, a real
    NVMe drive only makes it fast.
    Pinned host buffers need an accelerator, so they are off (CPU ranks; on GPUs DeepSpeed pins anyway).
    """
    section: dict[str, Any] = {"device": cfg.offload, "pin_memory": False}
    if cfg.offload == NVME:
        section["nvme_path"] = str(cfg.options.get("nvme_path") or default_nvme_path())
    return section


def nvme_aio_block_bytes(model: str, world_size: int) -> int:
    """The async-I/O block size (bytes) the lab gives NVMe runs: a power of two above every gradient piece.

    DeepSpeed swaps a tensor to its files only when it is at least one block (minimum 1 MiB). On CPU ranks,
    swapping the fp32 gradient of each parameter partition separately gives some parameters another's
    gradient (docs/measured.md). A block larger than the largest parameter partition keeps those gradient
    pieces in memory, and the losses then match `single`; the optimizer state (master copy and moments,
    one flat partition per rank) still lives in the files.
    """
    largest = max(p.numel() for p in build_model(model).parameters())
    piece = 4 * -(-largest // world_size)  # fp32 gradient of the largest partition (bytes)
    return max(2**20, 1 << piece.bit_length())


def default_nvme_path() -> str:
    """The swap folder when none is given: inside `labkit.launch`'s run folder (removed with it), else tmp."""
    return os.path.join(os.environ.get("LABKIT_LAUNCH_DIR") or tempfile.gettempdir(), "labkit-nvme-swap")


def hpz_node_size(world_size: int) -> int:
    """`zero_hpz_partition_size="node"`: the ranks of one node (LOCAL_WORLD_SIZE; all ranks on one machine).

    DeepSpeed 0.19 forms the hpZ groups from consecutive ranks ([0..h-1], [h..2h-1], ...:
    `deepspeed.utils.groups._create_zero_param_parallel_group`), and launchers number ranks node by node,
    so h = ranks per node puts each secondary partition on one node.
    """
    from labkit.cluster import ranks_per_node

    return ranks_per_node(world_size)


def check_run(cfg: RunConfig) -> None:
    """What the deepspeed engine cannot run, refused in the parent: the config's own checks, and CPU ranks
    whose comm workspaces /dev/shm cannot hold (`limits.deepspeed_shm_refusal`; a launcher's ranks exist
    already, each with its own workspace in /dev/shm, so there it is not asked)."""
    ds_config(cfg, cfg.world_size)
    from labkit import cluster, limits

    if not cluster.under_launcher() and cluster.placement(cfg.world_size).device_type == "cpu":
        refusal = limits.deepspeed_shm_refusal(cfg.world_size)
        if refusal:
            raise ValueError(refusal)


def ds_config(cfg: RunConfig, world_size: int, mode: str = "fair") -> dict[str, Any]:
    """DeepSpeed's config dict for `cfg` on `world_size` ranks (micro batch = global batch / world size).

    Recognised `cfg.options`: the keys of `ZERO_PLUS_PLUS_FLAGS` (`zero_hpz_partition_size` may be "node":
    `hpz_node_size`), "ds_mode" ("fair" or "defaults",
    overriding `mode`), "offload_param" (True: the parameter shards go where `cfg.offload` sends the
    optimizer state and its step: "cpu" or "nvme"), "nvme_path" (the swap folder of "nvme"),
    "zero_overrides" (a dict merged last into `zero_optimization`: one ZeRO-3 knob turned at a time),
    "comms_logger" (True: DeepSpeed's own comms logger records every collective, for
    `deepspeed.comms_logger_summary`) and "z3_leaf_blocks" (True: each block is a ZeRO-3 leaf module,
    gathered in one call; read by the engine's `build`, see `matched_to_fsdp2`).
    """
    mode = cfg.options.get("ds_mode", mode)
    if mode not in MODES:
        raise ValueError(
            f"ds_mode={mode!r}: choose 'fair' (formula-faithful knobs) or 'defaults' (DeepSpeed's)"
        )
    if cfg.options.get("activation_checkpointing"):
        raise ValueError(ACTIVATION_CHECKPOINTING_REFUSAL)
    per_rank = cfg.sequences_per_rank(world_size)  # the one check that world_size divides the batch
    zero: dict[str, Any] = {"stage": 3}
    if mode == "fair":
        zero.update(FAIR_ZERO3_KNOBS)
        zero["reduce_bucket_size"] = block_numel(cfg.model)
    if cfg.offload != "none":
        zero["offload_optimizer"] = offload_section(cfg)
    if cfg.options.get("offload_param"):
        zero["offload_param"] = offload_section(cfg)
    for flag in ZERO_PLUS_PLUS_FLAGS:
        if flag in cfg.options:
            zero[flag] = cfg.options[flag]
    if zero.get("zero_hpz_partition_size") == "node":
        zero["zero_hpz_partition_size"] = hpz_node_size(world_size)
    zero.update(cfg.options.get("zero_overrides") or {})
    return {
        "train_batch_size": per_rank * world_size,
        "train_micro_batch_size_per_gpu": per_rank,
        "gradient_accumulation_steps": 1,
        # DeepSpeed 0.19 clips the global gradient norm to 1.0 unless told otherwise; `single` and the other
        # engines do not clip, and the lab's first gradients have norm ~1.3, so clipping would bend the curve.
        "gradient_clipping": 0.0,
        "bf16": {"enabled": cfg.dtype == "bfloat16"},
        "zero_optimization": zero,
        # The engine passes its own torch.optim.AdamW (the same optimizer `single` uses); these two let
        # DeepSpeed accept it, also under optimizer offload where it would otherwise insist on its CPU Adam.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        **(
            {"aio": {"block_size": nvme_aio_block_bytes(cfg.model, world_size)}}
            if cfg.offload == NVME
            else {}
        ),
        "steps_per_print": 2**31 - 1,
        "comms_logger": {
            "enabled": bool(cfg.options.get("comms_logger")),
            "prof_all": True,
            "verbose": False,
        },
    }
