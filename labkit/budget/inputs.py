"""`PlanInputs`: every input of `plan()` with its unit, default, help and check, and the tables they name.

The CLI flags and the calculator's controls are made from `INPUTS`; a bad input raises one sentence.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from functools import cached_property
from typing import NamedTuple

from labkit.fields import REQUIRED, Spec, check, setting, spec_of
from labkit.names import DATA_PARALLEL, HSDP, NVME, OFFLOAD_TARGETS, STRATEGIES, WEIGHTS_SHARDED, ZERO2, ZERO3

MEMORY_TERMS = ("weights", "grads", "master", "adam_m", "adam_v")
ACCOUNTINGS = ("paper", "deepspeed")

# Bytes per parameter of each state term, by precision recipe.
PRECISIONS: dict[str, dict[str, float]] = {
    # bf16 weights and grads for compute, fp32 master copy and fp32 Adam moments: the paper's 2+2+12 = 16.
    "bf16_mixed": {"weights": 2, "grads": 2, "master": 4, "adam_m": 4, "adam_v": 4},
    # fp16 mixed precision has the same byte split as bf16.
    "fp16_mixed": {"weights": 2, "grads": 2, "master": 4, "adam_m": 4, "adam_v": 4},
    # Plain fp32 AdamW: the weights are the master copy, so also 16 B/param, split 4+4+4+4.
    "fp32": {"weights": 4, "grads": 4, "master": 0, "adam_m": 4, "adam_v": 4},
    # Everything in bf16, no master copy (not numerically safe for long runs, but people do it): 8 B/param.
    "bf16_pure": {"weights": 2, "grads": 2, "master": 0, "adam_m": 2, "adam_v": 2},
}


def _count(default, unit: str, help: str, example: str = "", low: int = 1, **spec):
    return setting(default, "count", help, unit=unit, example=example or f"{default}", low=low, **spec)


def _number(default: float, unit: str, help: str, upper: float | None = None, **spec):
    """An input above 0 (at most `upper`)."""
    return setting(default, "rate", help, unit=unit, example=f"{default:g}", high=upper, **spec)


def _choice(default: str, choices: tuple[str, ...], help: str):
    return setting(default, "choice", help, choices=choices)


def _switch(default: bool, help: str):
    return setting(default, "switch", help)


# CPU Adam's updates per second on one rank, measured (benchmarks/results.md, "CPU Adam throughput"):
# DeepSpeedCPUAdam does 0.9-1.1e9 params/s on one core of this machine. Each rank of a node has at least one
# core, and a node's memory bandwidth (CPU Adam streams about 28 B per parameter) holds 8 ranks above that
# on a current host (600 GB/s / 28 B / 8 = 2.7e9 each), so one core's rate is the default. DeepSpeed's own
# older report (deepspeedai/DeepSpeed#735: 11.6B params in 8.2 s on a whole host) is 1.8e8 per rank of 8.
HOST_ADAM_PARAMS_PER_S = 1.0e9


@dataclass(frozen=True)
class PlanInputs:
    """Everything `plan()` takes: the one place its inputs, units, defaults and checks are written.

    Building one checks every field and stores it normalised (`params=30e9` becomes the int 30000000000);
    an impossible input or combination raises ValueError with one sentence naming the argument. The CLI's
    flags and the calculator's controls are made from these fields (`INPUTS`).
    """

    params: int = _count(REQUIRED, "parameters", "size of the model", "30e9", rounded=True)
    world_size: int = _count(REQUIRED, "ranks", "data-parallel ranks", "256")
    strategy: str = _choice(
        ZERO3,
        STRATEGIES,
        "ddp: all replicated; zero1: optimizer state sharded; zero2: + gradients; zero3: + weights; "
        "hsdp: zero3 inside groups of group_size ranks, replicated across the groups",
    )
    group_size: int | None = _count(None, "ranks", "hsdp shard group; default one node (gpus_per_node)", "8")
    trainable_params: int | None = _count(
        None,
        "parameters",
        "parameters that train, the rest frozen (fine-tuning): a frozen one keeps only its "
        "weights, no gradient, master or Adam moments, and is never reduce-scattered; default: all",
        "7e9",
        rounded=True,
        low=0,
    )
    gpus_per_node: int = _count(8, "ranks", "ranks per node: a collective inside one is on intra-node links")
    precision: str = _choice("bf16_mixed", tuple(PRECISIONS), "bytes per parameter of each state term")
    offload_optimizer: str = _choice(
        "none",
        OFFLOAD_TARGETS,
        "where master and Adam m, v live (zero2/zero3/hsdp: and the gradient shard, as fp32 on the host)",
    )
    offload_params: str = _choice("none", OFFLOAD_TARGETS, "where the weight shard lives (zero3/hsdp only)")
    reshard_after_forward: bool = _switch(
        True, "free gathered weights after forward, all-gather again in backward"
    )
    prefetch: bool = _switch(True, "all-gather one layer ahead, so comm overlaps compute")
    qwz: bool = _switch(False, "ZeRO++ (zero3): int8 weight all-gathers, forward and backward")
    hpz: bool = _switch(False, "ZeRO++ (zero3): backward all-gather inside the node, from a secondary copy")
    qgz: bool = _switch(False, "ZeRO++ (zero3): int4 gradient reduce-scatter")
    quant_block_elems: int | None = _count(
        None, "elements", "block of one fp32 scale in ZeRO++'s quantized collectives; default: none", "2048"
    )
    largest_layer_params: int = _count(
        0, "parameters", "largest layer, for the gathered-buffer memory", "50e6", low=0
    )
    layers: int = _count(32, "layers", "transformer layers: the prefetch overlap model, the activations")
    root_units: int = _count(
        1, "units", "zero3/hsdp units besides the layers (the root; 2 when split into input and output units)"
    )
    tokens_per_rank: float = _number(16384, "tokens", "tokens one rank trains on per step", assumption=True)
    peak_tflops: float = _number(989.0, "TFLOP/s", "peak compute per rank", assumption=True)
    mfu: float = _number(0.4, "fraction", "model FLOP utilisation, 0 < mfu <= 1", upper=1.0, assumption=True)
    link_gbytes: float = _number(50.0, "GB/s", "inter-node bandwidth per rank (NIC)", assumption=True)
    intra_gbytes: float = _number(450.0, "GB/s", "intra-node bandwidth per rank (NVLink)", assumption=True)
    host_gbytes: float = _number(25.0, "GB/s", "GPU <-> host bandwidth (PCIe)", assumption=True)
    nvme_gbytes: float = _number(5.0, "GB/s", "host <-> NVMe bandwidth", assumption=True)
    host_adam_params_per_s: float = _number(
        HOST_ADAM_PARAMS_PER_S,
        "params/s",
        "CPU Adam's updates per second on one rank (its share of the node's host); default: "
        "DeepSpeedCPUAdam on one core, measured in benchmarks/results.md",
        assumption=True,
    )
    gpu_memory_bytes: int = _count(
        80_000_000_000,
        "bytes",
        "memory of one GPU, for the verdict (an H100: 80 GB)",
        "80GB",
        rounded=True,
        flag="--gpu-memory",
    )
    host_memory_bytes: int = _count(
        2_000_000_000_000,
        "bytes",
        "host RAM of one node, for the offload verdict (a DGX H100: 2 TB)",
        "2TB",
        rounded=True,
        flag="--host-memory",
    )
    hidden_size: int = _count(
        0, "elements", "model width h, for the activations (0: activations left out)", "8192", low=0
    )
    attention_heads: int = _count(32, "heads", "attention heads (each saves a logsumexp per token)")
    seq_len: int = _count(4096, "tokens", "tokens per sequence, for the activations")
    micro_batch: int = _count(1, "sequences", "sequences per forward on one rank, for the activations")
    vocab_size: int = _count(32000, "tokens", "vocabulary: the logits and the loss's activations")
    activation_checkpointing: bool = _switch(
        False,
        "keep only each block's input; recompute a block in backward (one more forward: 8N FLOPs/token)",
    )
    accounting: str = _choice(
        "paper",
        ACCOUNTINGS,
        "paper: the state terms of docs/budget.md; deepspeed: DeepSpeed's estimator (zero2/zero3, offload none or cpu)",
    )
    zero_init: bool = _switch(True, "accounting=deepspeed: weights built sharded (deepspeed.zero.Init)")
    additional_buffer_factor: float = _number(
        1.5, "", "accounting=deepspeed: the estimator's host-memory factor"
    )

    def __post_init__(self) -> None:
        values = self.__dict__  # frozen: the checked values are stored past __setattr__, as __init__ does
        for name, spec, default, checked_default in _CHECKS:
            value = values[name]
            values[name] = checked_default if value is default else check(name, value, spec)
        self._check_combination()

    @cached_property
    def trained_params(self) -> int:
        """Parameters that train: `trainable_params`, or every one."""
        return self.params if self.trainable_params is None else self.trainable_params

    @cached_property
    def shard_group(self) -> int:
        """Ranks each sharded term is split over: the hsdp group (default one node), else every rank."""
        if self.strategy != HSDP:
            return self.world_size
        return self.group_size if self.group_size is not None else min(self.gpus_per_node, self.world_size)

    def _check_combination(self) -> None:
        n, gpn, strategy = self.world_size, self.gpus_per_node, self.strategy
        if self.trained_params > self.params:
            raise ValueError(
                f"trainable_params must be between 0 and params={self.params}; got {self.trainable_params!r}."
            )
        if self.largest_layer_params > self.params:
            raise ValueError(
                f"largest_layer_params must be between 0 and params={self.params}; got {self.largest_layer_params!r}."
            )
        if self.group_size is not None and n % self.group_size:
            divisors = [d for d in (gpn, 8, 4, 2, 1) if n % d == 0 and d <= n]
            raise ValueError(
                f"group_size={self.group_size} does not divide world_size={n}; pass a divisor such as {divisors[0]}."
            )
        if n % self.shard_group:
            raise ValueError(
                f"hsdp needs a group_size that divides world_size={n}; the default {self.shard_group} does not, pass one."
            )
        zeropp = [name for name in ("qwz", "hpz", "qgz") if getattr(self, name)]
        if zeropp and strategy != ZERO3:
            raise ValueError(
                f"{', '.join(zeropp)} (ZeRO++) apply to strategy zero3; got strategy={strategy!r}."
            )
        if self.offload_params != "none" and strategy not in WEIGHTS_SHARDED:
            raise ValueError(
                f"offload_params needs sharded weights (strategy zero3 or hsdp); got strategy={strategy!r}."
            )
        if self.offload_optimizer != "none" and strategy == DATA_PARALLEL:
            raise ValueError(
                "offload_optimizer needs a ZeRO strategy (zero1, zero2, zero3 or hsdp); got strategy='ddp'."
            )
        if self.accounting == "deepspeed":
            self._check_deepspeed_accounting()

    def _check_deepspeed_accounting(self) -> None:
        if self.trained_params != self.params:
            raise ValueError(
                "accounting='deepspeed' follows DeepSpeed's estimators, which train every parameter; pass "
                "trainable_params only with accounting='paper'."
            )
        if self.strategy not in (ZERO2, ZERO3):
            raise ValueError(
                f"accounting='deepspeed' follows DeepSpeed's ZeRO-2/3 estimators; use strategy zero2 or zero3, not {self.strategy!r}."
            )
        per_node, nodes = _deepspeed_nodes(self.world_size, self.gpus_per_node)
        if per_node * nodes != self.world_size:
            raise ValueError(
                f"accounting='deepspeed' needs whole nodes: world_size={self.world_size} is not a multiple of gpus_per_node={self.gpus_per_node}."
            )
        if NVME in (self.offload_optimizer, self.offload_params):
            raise ValueError(
                "accounting='deepspeed' covers offload to cpu only (DeepSpeed's estimator has no NVMe case); pass 'cpu' or 'none'."
            )


class Input(NamedTuple):
    """One field of `PlanInputs`, for the faces that are made from it (CLI flags, calculator controls)."""

    name: str
    default: object  # None where `required`
    required: bool
    spec: Spec


INPUTS = tuple(
    Input(f.name, None if f.default is MISSING else f.default, f.default is MISSING, spec_of(f))
    for f in fields(PlanInputs)
)
DEFAULTS = {i.name: i.default for i in INPUTS if not i.required}


def _field_checks() -> tuple:
    """(name, spec, default, the default checked) per field: a default is checked once, here."""
    out = []
    for f in fields(PlanInputs):
        spec = spec_of(f)
        unchecked = f.default is MISSING or f.default is None
        out.append((f.name, spec, f.default, f.default if unchecked else check(f.name, f.default, spec)))
    return tuple(out)


_CHECKS = _field_checks()


def _deepspeed_nodes(world_size: int, gpus_per_node: int) -> tuple[int, int]:
    """(GPUs per node, nodes) as DeepSpeed's estimator takes them; fewer ranks than a node are one node."""
    return (gpus_per_node, world_size // gpus_per_node) if world_size >= gpus_per_node else (world_size, 1)
