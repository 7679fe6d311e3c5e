"""The `deepspeed` engine: `deepspeed.initialize` with ZeRO stage 3 around the lab's model.

In one sentence: DeepSpeed replaces each parameter's data with a flat 1/n partition (`param.ds_tensor`),
gathers a module's parameters in a forward/backward pre-hook and releases them after, and reduce-scatters
gradients into one flat fp32 buffer on which the optimizer updates a flat fp32 master copy of the partition.
The engine passes its own `torch.optim.AdamW` (the run's hyper-parameters), so the arithmetic is the one
`single` does. The config comes from `labkit.engines.ds_config` (read it for why the ZeRO-3 knobs are set).

It runs under `labkit.launch` (DeepSpeed finds the process group already initialised and uses it) and under
the `deepspeed`/`torchrun` launchers alike. Options are `RunConfig` fields plus `cfg.options` (see
`ds_config.ds_config`).
"""

from __future__ import annotations

import os
import re
import warnings
from collections import Counter
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch import nn

from labkit.budget import collective_wire_bytes, padded_flat_numel
from labkit.engines.base import RankInfo, RunConfig, adamw
from labkit.engines.ds_config import ds_config
from labkit.engines.registry import DEEPSPEED
from labkit.model import loss_fn
from labkit.names import ALL_GATHER, NVME, REDUCE_SCATTER
from labkit.probes.memory import STEP_SCALAR_BYTES, STEP_SCALARS, storages

NAME = DEEPSPEED

# ZeRO++ flags that DeepSpeed accepts in the config but whose kernels exist only for CUDA, and what DeepSpeed
# itself then does on CPU ranks (the qgZ no-op seen by tests/test_deepspeed.py's probe run).
_FAILS = "DeepSpeed itself fails with 'This op had not been implemented on CPU backend'"
_CUDA_ONLY_FLAGS = {
    "zero_quantized_weights": f"its weight quantizer is a CUDA kernel ({_FAILS})",
    "zero_quantized_gradients": f"its gradient quantizer is a CUDA kernel ({_FAILS} under torchrun, and under "
    "the deepspeed launcher on one node it silently runs the plain reduce-scatter: the probes see the same "
    "collectives and bytes)",
}


def refuse_cuda_only_flags(cfg: RunConfig) -> None:
    """Raise one sentence, before DeepSpeed starts, for a ZeRO++ flag that cannot run on this accelerator."""
    if get_accelerator().device_name() != "cpu":
        return
    for flag, why in _CUDA_ONLY_FLAGS.items():
        if cfg.options.get(flag):
            raise ValueError(
                f"{flag}=True does not run on CPU ranks: {why}; run it on GPUs, or use the notebook's scale "
                "model of it"
            )


def refuse_unbuilt_quantizer(
    cfg: RunConfig, accelerator: str | None = None, ext_dir: str | None = None
) -> None:
    """On GPU ranks, raise one sentence for qwZ / qgZ when DeepSpeed's quantizer op is neither installed with
    DeepSpeed (`DS_BUILD_QUANTIZER=1`, the hub image) nor built at set-up (`labkit.prebuild`'s CUDA folder,
    or `ext_dir`): DeepSpeed would compile it for minutes inside the student's cell, or fail without nvcc."""
    flags = [flag for flag in _CUDA_ONLY_FLAGS if cfg.options.get(flag)]
    if not flags or (accelerator or get_accelerator().device_name()) == "cpu":
        return
    from deepspeed.git_version_info import installed_ops

    from labkit import prebuild

    if installed_ops.get("quantizer"):
        return
    status = prebuild.op_status("quantizer", ext_dir or prebuild.extensions_dir("cuda")).status
    if status != "built":
        raise ValueError(
            f"{flags[0]}=True needs DeepSpeed's CUDA quantizer op, and it is {status} on this node (it would "
            "compile now, inside this run): run `python -m labkit.prebuild` here, with nvcc and CUDA_HOME "
            "(`labkit doctor` says which is missing)"
        )


def refuse_nvme_without_async_io(cfg: RunConfig) -> None:
    """Raise one sentence for NVMe offload when DeepSpeed's async_io op was not built at set-up."""
    if cfg.offload != NVME:
        return
    from labkit import prebuild

    status = prebuild.op_status("async_io").status
    if status != "built":
        why = "libaio is not installed" if status == "skipped" else f"the async_io op is {status}"
        raise ValueError(
            f"offload='nvme' needs DeepSpeed's async_io op, and {why}: run "
            "`scripts/install-debian-packages binder/apt.txt` (libaio-dev), then `python -m labkit.prebuild`"
        )


class DeepSpeedEngine:
    """One rank of the deepspeed engine: the `DeepSpeedEngine` DeepSpeed returned, driven step by step."""

    name = NAME

    def __init__(self, engine: Any, swap_dir: str | None = None):
        self.engine = engine
        self.device = engine.device
        self.swap_dir = swap_dir  # NVMe offload's folder (`nvme_path`), None without it

    def forward_loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.engine(tokens.to(self.device))
        return loss_fn(logits.float(), targets.to(self.device))

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def optimizer_step(self) -> None:
        self.engine.step()  # also zeroes the gradients DeepSpeed holds

    def swap_file_bytes(self) -> dict[str, int]:
        """Bytes this rank keeps in NVMe-offload swap files, per kind ("optimizer", "params"); {} without NVMe.

        DeepSpeed writes `<nvme_path>/zero_stage_3/<kind>/rank<r>/*.swp`: "optimizer" holds the flat fp32
        master partition with AdamW's moments (and gradient pieces of at least one aio block), the params
        folder (named after the parameter dtype) the partitions of parameters of at least one block.
        """
        if self.swap_dir is None:
            return {}
        root, rank = os.path.join(self.swap_dir, "zero_stage_3"), f"rank{dist.get_rank()}"
        out: dict[str, int] = {}
        for kind in sorted(os.listdir(root)) if os.path.isdir(root) else []:
            folder = os.path.join(root, kind, rank)
            files = [os.path.join(folder, f) for f in os.listdir(folder)] if os.path.isdir(folder) else []
            out["optimizer" if kind == "optimizer" else "params"] = sum(os.path.getsize(f) for f in files)
        return out

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What this rank keeps between steps; see `itemise_state_bytes` for the bytes of each entry."""
        return {key: [t for _, t in entries] for key, entries in self.state_entries().items()}

    def state_entries(self) -> dict[str, list[tuple[str, torch.Tensor]]]:
        """(what, tensor) pairs per key, local tensors only (a storage several entries share counts once).

        "params": each parameter's partition `ds_tensor` (the compute dtype; views into one flat buffer),
        plus the full tensor of every parameter DeepSpeed keeps gathered ("persistent"), plus, with
        `zero_hpz_partition_size` = h, the secondary 1/h partition backward gathers from (ZeRO++ hpZ) while
        it exists: built in forward, gone after the optimizer step, so absent between steps.
        "grads": the flat gradient-partition buffer (the gradient dtype: fp32, or bf16 in bf16 runs), the
        flat reduce bucket the gradients are copied into before each reduce-scatter (both stay allocated)
        and, under optimizer offload, the fp32 gradient the host optimizer reads (the master partition's
        `.grad`, kept between steps; without offload DeepSpeed drops it after each step).
        "optimizer": the flat fp32 master partition (an extra copy even in float32 runs), AdamW's two
        moments over it and its step counter. `state_bytes_accounting` predicts each entry's bytes.
        """
        zero = self.engine.optimizer
        params = [p for p in self.engine.module.parameters()]
        entries: dict[str, list[tuple[str, torch.Tensor]]] = {"params": [], "grads": [], "optimizer": []}
        entries["params"] = [("parameter partition", p.ds_tensor) for p in params]
        entries["params"] += [("persistent full copy", p.data) for p in params if p.ds_persist]
        entries["params"] += [
            ("hpZ secondary partition", p.ds_secondary_tensor)
            for p in params
            if getattr(p, "ds_secondary_tensor", None) is not None
        ]
        entries["grads"] = [("gradient partitions (flat)", zero.grad_partitions_flat_buffer)]
        entries["grads"] += [
            ("reduce bucket (flat)", b.buffer) for b in zero.ipg_buckets.values() if b.buffer is not None
        ]
        entries["grads"] += [
            ("fp32 gradient of the master partition (offload)", t.grad)
            for t in zero.fp32_partitioned_groups_flat
            if t.grad is not None
        ]
        entries["optimizer"] = [
            ("fp32 master partition (flat)", t) for t in zero.fp32_partitioned_groups_flat
        ]
        for state in zero.optimizer.state.values():
            entries["optimizer"] += [
                (STEP_SCALARS if k == "step" else f"AdamW {k}", v)
                for k, v in state.items()
                if torch.is_tensor(v)
            ]
        return entries


def itemise_state_bytes(engine: DeepSpeedEngine, n_params: int) -> list[dict[str, Any]]:
    """Each kind of state this rank keeps: its bytes and bytes per model parameter x world size.

    Bytes are counted as `labkit.probes.state_bytes` counts them (each storage once, whole, under the first
    entry that holds it), so the rows sum to the probe's state bytes exactly. A row with
    `bytes_per_param_times_n` = 4 costs 4 B per parameter / n, so the ZeRO-3 paper's 16 B/param (fp32
    AdamW: param, grad, two moments) appears as 4 + 4 + 8; DeepSpeed adds the fp32 master partition (4 more,
    even when the parameters are already fp32), its reduce bucket and AdamW's step. `n_params` counts the
    unsharded model's elements.
    """
    n = dist.get_world_size()
    rows: dict[tuple[str, str], int] = {}
    seen: set[int] = set()
    for key, entries in engine.state_entries().items():
        for what, t in entries:
            rows.setdefault((key, what), 0)
            for st in storages([t]):
                if id(st) not in seen:
                    seen.add(id(st))
                    rows[(key, what)] += st.nbytes()
    return [
        {"state": key, "what": what, "bytes": b, "bytes_per_param_times_n": b * n / n_params}
        for (key, what), b in rows.items()
    ]


def state_bytes_accounting(model: nn.Module, cfg: RunConfig, world_size: int) -> dict[str, int]:
    """Bytes per rank between steps, term by term (the `what` of `itemise_state_bytes`), from the config.

    `model` is the unsharded lab model. DeepSpeed 0.19 pads each flattened parameter to a multiple of n, so
    a rank's partition holds S = sum of ceil(numel / n) elements: parameter partition e x S (e = 2 B in
    bf16, else 4 B); persistent full copy e x the padded numel of each parameter with numel <=
    `stage3_param_persistence_threshold` (a view of the padded buffer it was gathered into); gradient
    partitions e x S; reduce bucket e x `reduce_bucket_size`; fp32 master partition 4 x S; AdamW exp_avg
    and exp_avg_sq 4 x S each and one 4-byte step scalar (one flat parameter group); with optimizer offload the
    master partition's fp32 gradient, 4 x S more.
    """
    if cfg.offload == NVME:
        raise ValueError(
            "offload='nvme' keeps the master partition and moments in swap files: read swap_file_bytes() "
            "for them; this accounting covers offload='none' and 'cpu'"
        )
    zero = ds_config(cfg, world_size)["zero_optimization"]
    threshold = zero_knob(zero, "stage3_param_persistence_threshold")
    elem_bytes = cfg.compute_bytes
    numels = [p.numel() for p in model.parameters()]
    part = sum(padded_flat_numel(numel, world_size) // world_size for numel in numels)
    terms = {
        "parameter partition": elem_bytes * part,
        "persistent full copy": elem_bytes
        * sum(padded_flat_numel(numel, world_size) for numel in numels if is_persistent(numel, threshold)),
        "gradient partitions (flat)": elem_bytes * part,
        "reduce bucket (flat)": elem_bytes * int(zero.get("reduce_bucket_size", 500_000_000)),
        "fp32 gradient of the master partition (offload)": 4 * part if cfg.offload == "cpu" else 0,
        "fp32 master partition (flat)": 4 * part,
        "AdamW exp_avg": 4 * part,
        "AdamW exp_avg_sq": 4 * part,
        STEP_SCALARS: STEP_SCALAR_BYTES,  # one flat parameter group: one step scalar
    }
    return {term: b for term, b in terms.items() if b}


# The probe's category (`DeepSpeedEngine.state_entries`' keys) of each term of `state_bytes_accounting`.
STATE_OF_TERM = {
    "parameter partition": "params",
    "persistent full copy": "params",
    "hpZ secondary partition": "params",
    "gradient partitions (flat)": "grads",
    "reduce bucket (flat)": "grads",
    "fp32 gradient of the master partition (offload)": "grads",
    "fp32 master partition (flat)": "optimizer",
    "AdamW exp_avg": "optimizer",
    "AdamW exp_avg_sq": "optimizer",
    STEP_SCALARS: "optimizer",
}


def accounted_state_bytes(model: nn.Module, cfg: RunConfig, world_size: int) -> dict[str, int]:
    """`state_bytes_accounting` summed into the probe's three categories: params, grads, optimizer (bytes)."""
    out = {"params": 0, "grads": 0, "optimizer": 0}
    for term, b in state_bytes_accounting(model, cfg, world_size).items():
        out[STATE_OF_TERM[term]] += b
    return out


def zero_knob(zero: dict[str, Any], key: str) -> int:
    """The ZeRO knob `key` of a `zero_optimization` section (elements): its value there, else DeepSpeed's own
    default for it (the field of `DeepSpeedZeroConfig` with that name, read from DeepSpeed, not retyped)."""
    if key in zero:
        return int(zero[key])
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    field = next(f for name, f in DeepSpeedZeroConfig.model_fields.items() if key in (name, f.alias))
    return int(field.default)


def is_persistent(numel: int, threshold: int) -> bool:
    """DeepSpeed 0.19's rule (`DeepSpeedZeRoOffload.mark_persistent_parameters`): a parameter of at most
    `stage3_param_persistence_threshold` elements is persistent, kept whole on every rank."""
    return numel <= threshold


def gather_size_rows(model: nn.Module, world_size: int, elem_bytes: int = 4) -> list[dict[str, Any]]:
    """The model's parameters grouped by name across blocks ("blocks.*.attn.qkv.weight"), in model order:
    how many, elements each, and the wire bytes one rank sends to all-gather one of them once (flattened and
    padded to a multiple of `world_size`, `elem_bytes` per element). What a persistence threshold decides on."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for name, p in model.named_parameters():
        group = re.sub(r"^blocks\.\d+\.", "blocks.*.", name)
        payload_bytes = padded_flat_numel(p.numel(), world_size) * elem_bytes
        row = rows.setdefault(
            (group, p.numel()),
            {
                "parameter": group,
                "count": 0,
                "elements": p.numel(),
                "all_gather_wire_bytes": collective_wire_bytes(ALL_GATHER, payload_bytes, world_size),
            },
        )
        row["count"] += 1
    return list(rows.values())


def predicted_wire_bytes(model: nn.Module, cfg: RunConfig, world_size: int) -> dict[str, int]:
    """Per rank per step (steady state), the all-gather and reduce-scatter wire bytes of the engine's config
    (`ds_config`) for `cfg`: `zero3_wire_bytes` of its `zero_optimization` section, in the run's dtype."""
    zero = ds_config(cfg, world_size)["zero_optimization"]
    return zero3_wire_bytes(model, zero, world_size, cfg.compute_bytes)


def zero3_wire_bytes(
    model: nn.Module, zero: dict[str, Any], world_size: int, elem_bytes: int = 4
) -> dict[str, int]:
    """Per rank per step (steady state), the all-gather and reduce-scatter wire bytes of a ZeRO-3 section.

    `model` is the unsharded lab model, `zero` a `zero_optimization` dict (a knob it leaves out has DeepSpeed's
    default). DeepSpeed flattens each parameter and pads it to a multiple of the world size. A persistent
    parameter (`is_persistent`) is kept whole on every rank: never gathered for forward or backward, but
    gathered once per step after the optimizer step has changed its partition. Every other parameter is
    gathered before the forward of each module that registers it (twice for a tied embedding) and again
    before each one's backward (with `zero_hpz_partition_size` = h,
    inside a group of h ranks, from the secondary partition) when nothing keeps it gathered in between
    (`unmodelled_reuse`; else this raises). Gradients are reduce-scattered once, in the parameter dtype
    (`elem_bytes`: bf16 in bf16 runs, where FSDP2 reduces in fp32). (The first two steps differ: DeepSpeed
    traces its order.)
    """
    threshold = zero_knob(zero, "stage3_param_persistence_threshold")
    hpz = int(zero.get("zero_hpz_partition_size", 1))
    backward_group = hpz if hpz > 1 else world_size
    n = world_size
    gathered, reduced = 0, 0
    uses = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
    for p in model.parameters():
        payload_bytes = padded_flat_numel(p.numel(), n) * elem_bytes
        reduced += collective_wire_bytes(REDUCE_SCATTER, payload_bytes, n)
        if is_persistent(p.numel(), threshold):
            gathered += collective_wire_bytes(ALL_GATHER, payload_bytes, n)
            continue
        reuse = unmodelled_reuse(zero)
        if reuse:
            raise ValueError(f"{reuse}; no formula here predicts which gathers that saves")
        # gathered for each module that registers it (a tied embedding: the embedding's and the head's),
        # before that module's forward and again before its backward
        gathered += uses[id(p)] * collective_wire_bytes(ALL_GATHER, payload_bytes, n)
        gathered += uses[id(p)] * collective_wire_bytes(ALL_GATHER, payload_bytes, backward_group)
    return {ALL_GATHER: gathered, REDUCE_SCATTER: reduced}


def unmodelled_reuse(zero: dict[str, Any]) -> str | None:
    """Why DeepSpeed may keep a gathered parameter from forward to backward under `zero`, or None.

    DeepSpeed 0.19.8 (`PartitionedParameterCoordinator`) releases a parameter after use unless it is used again
    within `stage3_max_reuse_distance` elements of its traced order, and prefetches up to
    `stage3_prefetch_bucket_size` elements when `stage3_max_live_parameters` leaves room (its budget is max
    live minus the elements gathered now: with max live 1, one parameter at most, and the bytes stay the
    formula's); a prefetched parameter still gathered at its next use is kept (docs/measured.md).
    """
    reuse = zero_knob(zero, "stage3_max_reuse_distance")
    if reuse:
        return f"stage3_max_reuse_distance={reuse:,} keeps a parameter gathered for a reuse within that many elements"
    prefetch, live = (
        zero_knob(zero, "stage3_prefetch_bucket_size"),
        zero_knob(zero, "stage3_max_live_parameters"),
    )
    if prefetch and live > 1:
        return (
            f"stage3_prefetch_bucket_size={prefetch:,} with stage3_max_live_parameters={live:,} prefetches, and a "
            "prefetched parameter still gathered at its next use is kept"
        )
    return None


def comms_logger_summary() -> dict[str, dict[str, Any]]:
    """What DeepSpeed's own comms logger recorded on this rank so far: calls and message bytes per op.

    Needs `cfg.options["comms_logger"] = True`. Its "message size" is not labkit's payload: for an
    all-gather it is the input shard (1/n of labkit's payload), for a reduce-scatter the full input (equal
    to labkit's payload); it logs from DeepSpeed's init on, while labkit's probe counts per step.
    `calls_by_size` is {message bytes: calls}, the logger's own histogram.
    """
    from deepspeed.comm import comms_logger

    return {
        op: {
            "calls": sum(v[0] for v in sizes.values()),
            "message_bytes": sum(k * v[0] for k, v in sizes.items()),
            "calls_by_size": {k: v[0] for k, v in sizes.items()},
        }
        for op, sizes in comms_logger.comms_dict.items()
    }


def memory_estimate(model: nn.Module, world_size: int) -> dict[str, Any]:
    """DeepSpeed's own ZeRO-3 estimate for `model` on one node of `world_size` GPUs, no offload (bytes).

    `estimate_zero3_model_states_mem_needs` (what `..._all_live` prints, in GiB) charges 18 B/param / n
    plus 4 B per element of the largest layer. Measured here in float32 the engine keeps 20 B/param / n
    (4 param partition + 4 fp32 master copy + 4 gradient partitions + 8 AdamW) plus its reduce bucket; in
    bf16 16 B/param / n (2 + 4 + 2 + 8) plus the bucket: `itemise_state_bytes` shows each term.
    """
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs, model_to_params

    total_params, largest_layer_params = model_to_params(model)
    _, gpu_bytes, largest_layer_bytes = estimate_zero3_model_states_mem_needs(
        total_params,
        largest_layer_params,
        num_gpus_per_node=world_size,
        cpu_offload=False,
        cpu_offload_params=False,
    )
    return {
        "params": total_params,
        "largest_layer_params": largest_layer_params,
        "gpu_bytes_per_rank": gpu_bytes,
        "largest_layer_bytes": largest_layer_bytes,
        "bytes_per_param_times_n": (gpu_bytes - largest_layer_bytes) * world_size / total_params,
    }


def build(cfg: RunConfig, model: nn.Module, rank_info: RankInfo) -> DeepSpeedEngine:
    """`deepspeed.initialize` the model with ZeRO-3 and the run's AdamW, in the existing process group.

    DeepSpeed re-points the AdamW at its flat fp32 partition, so the optimizer's state is 1/n of the model.
    With `options["z3_leaf_blocks"]` each block is a ZeRO-3 leaf module: one all-gather per block and
    direction instead of one per sub-module (`ds_config.matched_to_fsdp2`).
    """
    refuse_cuda_only_flags(cfg)
    refuse_unbuilt_quantizer(cfg)
    refuse_nvme_without_async_io(cfg)
    config = ds_config(cfg, rank_info.world_size)
    if cfg.options.get("z3_leaf_blocks"):
        # DeepSpeed's own switch for coarser units: a leaf module's parameters are gathered in one call
        # when it starts (and released when it ends), its sub-modules get no hooks of their own.
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, [type(model.blocks[0])])
    return initialize(model, config, adamw(model.parameters(), cfg))


def initialize(
    model: nn.Module, config: dict[str, Any], optimizer: torch.optim.Optimizer | None = None
) -> DeepSpeedEngine:
    """`deepspeed.initialize(model, config)` in the existing process group, as the engine the loop steps.

    Without `optimizer` DeepSpeed builds the one `config`'s "optimizer" section names ("AdamW": its own
    FusedAdam op, built for CPU ranks too; `torch.optim.AdamW` with `"torch_adam": True`). `build` passes the
    run's AdamW; `labkit.buildalong.deepspeed_check` passes the learner's config alone.
    """
    # DeepSpeed still calls torch.distributed's deprecated collective names, a warning per call: not the
    # lesson. Every DeepSpeed engine of the lab starts here, so this is the one place that silences them.
    warnings.filterwarnings(
        "ignore", message=r".*is deprecated\. Please use `torch\.distributed\.", category=FutureWarning
    )
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    swap_dir = config.get("zero_optimization", {}).get("offload_optimizer", {}).get("nvme_path")
    return DeepSpeedEngine(engine, swap_dir)
