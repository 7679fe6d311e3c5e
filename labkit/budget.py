"""Closed-form arithmetic of data parallelism: state bytes per rank, bytes per collective per step, step time.

`plan(params, world_size, strategy, **options)` is the one entry point: it checks its inputs into a
`PlanInputs` (the one place of their units, defaults and checks; the CLI flags and the calculator's controls
are made from it), then composes the stages `memory_terms`, `traffic_terms` (typed `Term`s from the
`STEP_COLLECTIVES` table) and `step_time`. The helpers at the top (`collective_wire_bytes`, `padded_numel`,
...) are the same arithmetic applied to one tensor, so the probes can predict what they measure.
Pure Python: no torch, no numpy. Bytes are bytes (1 GB = 1e9 B), times are seconds.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from functools import cached_property
from typing import NamedTuple

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


def collective_wire_bytes(kind: str, payload_bytes: int, world_size: int) -> int:
    """Bytes one rank sends for one collective in a bandwidth-optimal ring of `world_size` ranks.

    `payload_bytes` is the full tensor: the gathered output of an all-gather, the unreduced input of a
    reduce-scatter or all-reduce, the tensor a broadcast delivers. A ring moves it in `world_size` chunks:
    all-gather and reduce-scatter send (n-1)/n x payload per rank, all-reduce (a reduce-scatter then an
    all-gather) 2(n-1)/n x payload. A broadcast is counted as a pipelined chain: every rank but the last
    forwards the whole tensor once, so the mean per rank is (n-1)/n x payload. Results are rounded down to
    whole bytes (exact whenever n divides the payload, as it does for a padded shard). One rank sends 0.
    """
    if kind not in COLLECTIVES:
        raise ValueError(
            f"collective kind {kind!r} has no ring formula here; use one of {', '.join(COLLECTIVES)}."
        )
    n = int(world_size)
    if n < 1:
        raise ValueError(f"world_size must be a positive number of ranks; got {world_size!r}.")
    payload = int(payload_bytes)
    if payload < 0:
        raise ValueError(f"payload_bytes must be zero or more; got {payload_bytes!r}.")
    factor = 2 if kind == "all_reduce" else 1
    return factor * (n - 1) * payload // n


def ring_link_bytes(kind: str, payload_bytes: int, group_nodes: Sequence) -> dict[str, int]:
    """Wire bytes one ring collective puts on intra- and inter-node links, summed over the group's ranks.

    `group_nodes` is the node of each rank of the group, in ring order (the group's rank order). In each
    of the ring's n-1 steps (2(n-1) for an all-reduce) every rank sends one chunk to its successor only,
    so each rank's whole `collective_wire_bytes` goes over one link, which crosses a node boundary when
    the successor is on another node. A group over k > 1 nodes in node blocks has k crossing links; inside
    one node it has none. This is the rule `labkit.probes.comm` measures by.
    """
    nodes = list(group_nodes)
    n = len(nodes)
    wire = collective_wire_bytes(kind, payload_bytes, n)
    crossing = sum(nodes[i] != nodes[(i + 1) % n] for i in range(n))
    return {"intra_node": (n - crossing) * wire, "inter_node": crossing * wire}


def _ring_bytes_all_ranks(kind: str, payload_bytes: int, n: int, size: int, gpn: int, strided: bool) -> dict:
    """`ring_link_bytes` summed over every group of one collective, rank r on node r // gpn.

    The groups partition the n ranks: consecutive blocks of `size` ranks, or (`strided`, HSDP's replicate
    groups) ranks i, i + n/size, i + 2n/size, ... Members are in ascending order, so a group visits its nodes
    in blocks and crosses as many links as it has distinct nodes, when more than one.
    """
    wire = collective_wire_bytes(kind, payload_bytes, size)
    stride = n // size if strided else 1
    starts = range(stride) if strided else range(0, n, size)
    crossing = 0
    for first in starts:
        last = first + (size - 1) * stride
        # a step under gpn ranks cannot skip a node; a larger one puts every member on its own node
        distinct = size if stride >= gpn else last // gpn - first // gpn + 1
        crossing += distinct if distinct > 1 else 0
    return {"intra_node": (n - crossing) * wire, "inter_node": crossing * wire}


def shard_rows(rows: int, world_size: int) -> int:
    """Rows of dim 0 each rank holds when a tensor is split on dim 0 across `world_size` ranks: ceil(rows/n)."""
    return -(-int(rows) // int(world_size))


def padded_rows(rows: int, world_size: int) -> int:
    """Dim 0 after padding to a multiple of `world_size`, so every rank's shard has the same shape."""
    return shard_rows(rows, world_size) * int(world_size)


def padded_numel(shape: Sequence[int], world_size: int) -> int:
    """Elements of a tensor of `shape` once dim 0 is padded to a multiple of `world_size` (dim-0 sharding).

    This is the size of the gathered buffer an all-gather fills (FSDP2's per-parameter layout); a 0-d
    tensor counts as one row.
    """
    dims = [int(d) for d in shape] or [1]
    rest = 1
    for d in dims[1:]:
        rest *= d
    return padded_rows(dims[0], world_size) * rest


def shard_numel(shape: Sequence[int], world_size: int) -> int:
    """Elements of one rank's dim-0 shard of a tensor of `shape` (padding included)."""
    return padded_numel(shape, world_size) // int(world_size)


def padded_flat_numel(numel: int, world_size: int) -> int:
    """Elements of a flattened tensor padded to a multiple of `world_size` (the flat layout of DeepSpeed/FSDP1)."""
    n = int(world_size)
    return -(-int(numel) // n) * n


# --------------------------------------------------------------------------------------------------------
# The model of one training step. Every number `plan()` returns is built from the tables and functions
# below; docs/budget.md states the same formulas in prose.
# --------------------------------------------------------------------------------------------------------

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "hsdp")
MEMORY_TERMS = ("weights", "grads", "master", "adam_m", "adam_v")
OFFLOAD_TARGETS = ("none", "cpu", "nvme")
ACCOUNTINGS = ("paper", "deepspeed")
TRAFFIC_KEYS = (
    "all_gather_forward",
    "all_gather_backward",
    "all_gather_after_step",
    "reduce_scatter",
    "all_reduce",
)
LINKS = ("intra_node", "inter_node")
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb: one all-reduce per 25 MiB of gradients

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

# Terms a strategy shards across the data-parallel ranks (hsdp: across its shard group only).
_SHARDED_TERMS = {
    "ddp": (),
    "zero1": ("master", "adam_m", "adam_v"),
    "zero2": ("grads", "master", "adam_m", "adam_v"),
    "zero3": MEMORY_TERMS,
    "hsdp": MEMORY_TERMS,
}
_OPTIMIZER_TERMS = ("master", "adam_m", "adam_v")
_HOST_GRAD_BYTES = 4  # the CPU optimizer works on an fp32 copy of the gradient shard
_SCALE_BYTES = 4  # one fp32 scale per quantization block (ZeRO++ qwZ / qgZ)
# ZeRO++ switch -> (bytes per element on the wire, what the term's name adds): int8 weights, int4 gradients
_QUANTISED = {"qwz": (1.0, " (qwZ int8)"), "qgz": (0.5, " (qgZ int4)")}


# ---- the inputs --------------------------------------------------------------------------------------------


class InputSpec(NamedTuple):
    """How one input of `plan()` is checked, and what the CLI and the calculator say about it.

    kind: "count" (a whole number, at least `low`; a `rounded` one takes a float such as 1.5e9 / 7),
    "number" (more than 0, at most `upper`), "choice" (one of `choices`) or "switch" (on or off). A count
    whose default is None may be None. `example` is what an error message suggests. `assumption` marks an
    input the step time rests on (printed with every plan and listed by `labkit budget --help`); `flag` is
    the CLI's name for it when not `--` + the name with dashes.
    """

    kind: str
    unit: str
    help: str
    example: str = ""
    choices: tuple[str, ...] = ()
    upper: float | None = None
    low: int = 1
    rounded: bool = False
    assumption: bool = False
    flag: str = ""


_REQUIRED = MISSING


def _count(default, unit: str, help: str, example: str = "", **spec):
    example = example or f"{default}"
    return field(default=default, metadata={"spec": InputSpec("count", unit, help, example, **spec)})


def _number(default: float, unit: str, help: str, **spec):
    return field(default=default, metadata={"spec": InputSpec("number", unit, help, f"{default:g}", **spec)})


def _choice(default: str, choices: tuple[str, ...], help: str):
    return field(default=default, metadata={"spec": InputSpec("choice", "", help, choices=choices)})


def _switch(default: bool, help: str):
    return field(default=default, metadata={"spec": InputSpec("switch", "", help)})


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

    params: int = _count(_REQUIRED, "parameters", "size of the model", "30e9", rounded=True)
    world_size: int = _count(_REQUIRED, "ranks", "data-parallel ranks", "256")
    strategy: str = _choice(
        "zero3",
        STRATEGIES,
        "ddp: all replicated; zero1: optimizer state sharded; zero2: + gradients; zero3: + weights; "
        "hsdp: zero3 inside groups of group_size ranks, replicated across the groups",
    )
    group_size: int | None = _count(None, "ranks", "hsdp shard group; default one node (gpus_per_node)", "8")
    trainable_params: int | None = _count(
        None, "parameters", "parameters that train, the rest frozen (fine-tuning): a frozen one keeps only its "
        "weights, no gradient, master or Adam moments, and is never reduce-scattered; default: all", "7e9",
        rounded=True, low=0,
    )  # fmt: skip
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
        80_000_000_000, "bytes", "memory of one GPU, for the verdict (an H100: 80 GB)", "80GB", rounded=True,
        flag="--gpu-memory",
    )  # fmt: skip
    host_memory_bytes: int = _count(
        2_000_000_000_000, "bytes", "host RAM of one node, for the offload verdict (a DGX H100: 2 TB)", "2TB",
        rounded=True, flag="--host-memory",
    )  # fmt: skip
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
        for name, check, spec, default, checked_default in _CHECKS:
            value = values[name]
            if value is default:  # checked once, at import (None: not given)
                values[name] = checked_default
            else:
                values[name] = check(name, value, spec)
        self._check_combination()

    @cached_property
    def trained_params(self) -> int:
        """Parameters that train: `trainable_params`, or every one."""
        return self.params if self.trainable_params is None else self.trainable_params

    @cached_property
    def shard_group(self) -> int:
        """Ranks each sharded term is split over: the hsdp group (default one node), else every rank."""
        if self.strategy != "hsdp":
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
        if zeropp and strategy != "zero3":
            raise ValueError(
                f"{', '.join(zeropp)} (ZeRO++) apply to strategy zero3; got strategy={strategy!r}."
            )
        if self.offload_params != "none" and strategy not in ("zero3", "hsdp"):
            raise ValueError(
                f"offload_params needs sharded weights (strategy zero3 or hsdp); got strategy={strategy!r}."
            )
        if self.offload_optimizer != "none" and strategy == "ddp":
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
        if self.strategy not in ("zero2", "zero3"):
            raise ValueError(
                f"accounting='deepspeed' follows DeepSpeed's ZeRO-2/3 estimators; use strategy zero2 or zero3, not {self.strategy!r}."
            )
        per_node, nodes = _deepspeed_nodes(self.world_size, self.gpus_per_node)
        if per_node * nodes != self.world_size:
            raise ValueError(
                f"accounting='deepspeed' needs whole nodes: world_size={self.world_size} is not a multiple of gpus_per_node={self.gpus_per_node}."
            )
        if "nvme" in (self.offload_optimizer, self.offload_params):
            raise ValueError(
                "accounting='deepspeed' covers offload to cpu only (DeepSpeed's estimator has no NVMe case); pass 'cpu' or 'none'."
            )


def _check_count(name: str, value, spec: InputSpec) -> int:
    if spec.rounded and isinstance(value, float) and 1 <= value < math.inf:
        value = round(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not spec.low <= value < math.inf:
        what = "a positive whole number" if spec.low else "a whole number, 0 or more"
        raise ValueError(f"{name} must be {what} (for example {spec.example}); got {value!r}.")
    if int(value) != value:
        raise ValueError(f"{name} must be a whole number (for example {spec.example}); got {value!r}.")
    return int(value)


def _check_number(name: str, value, spec: InputSpec) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value <= 0:
        raise ValueError(f"{name} must be a positive number (for example {spec.example}); got {value!r}.")
    if spec.upper is not None and value > spec.upper:
        raise ValueError(
            f"{name} must be at most {spec.upper:g} (for example {spec.example}); got {value!r}."
        )
    return float(value)


def _check_choice(name: str, value, spec: InputSpec) -> str:
    if value not in spec.choices:
        raise ValueError(f"{name} {value!r} is not known; use one of {', '.join(spec.choices)}.")
    return value


def _check_switch(name: str, value, spec: InputSpec) -> bool:
    return bool(value)


_CHECK_OF_KIND = {
    "count": _check_count,
    "number": _check_number,
    "choice": _check_choice,
    "switch": _check_switch,
}


class Input(NamedTuple):
    """One field of `PlanInputs`, for the faces that are made from it (CLI flags, calculator controls)."""

    name: str
    default: object  # None where `required`
    required: bool
    spec: InputSpec


INPUTS = tuple(
    Input(f.name, None if f.default is MISSING else f.default, f.default is MISSING, f.metadata["spec"])
    for f in fields(PlanInputs)
)
DEFAULTS = {i.name: i.default for i in INPUTS if not i.required}


def _field_checks() -> tuple:
    """(name, check, spec, default, the default checked) per field: a default is checked once, here."""
    out = []
    for f in fields(PlanInputs):
        spec = f.metadata["spec"]
        check = _CHECK_OF_KIND[spec.kind]
        unchecked = f.default is MISSING or f.default is None
        out.append(
            (f.name, check, spec, f.default, f.default if unchecked else check(f.name, f.default, spec))
        )
    return tuple(out)


_CHECKS = _field_checks()


# ---- sizes as typed ----------------------------------------------------------------------------------------

# suffix -> scale, by what a unit counts. Decimal prefixes (1 GB = 1e9 B; k, M, G, T, P in either case) and
# binary ones (GiB = 2**30 B); a byte is a capital B, as a small b is a bit (a 400 Gb/s NIC moves 50 GB/s).
_PREFIXES = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BYTE_SCALES = {
    "": 1, "B": 1,
    **{c + end: v for p, v in _PREFIXES.items() for c in {p.lower(), p.upper()} for end in ("", "B")},
    **{c + "iB": 2 ** (10 * (i + 1)) for i, p in enumerate("KMGT") for c in {p, p.lower()}},
}  # fmt: skip
_BANDWIDTH_SCALES = {"": 1, "MB/s": 1e-3, "GB/s": 1, "TB/s": 1e3}  # in GB/s
_COUNT_SCALES = {"": 1, "k": 1e3, "K": 1e3, "m": 1e6, "M": 1e6, "b": 1e9, "B": 1e9, "t": 1e12, "T": 1e12}
_COUNTED = ("parameters", "ranks", "tokens", "elements", "layers", "heads", "sequences")
_QUANTITY = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-z/]*)\s*")


def _scales(unit: str) -> tuple[dict[str, float], str]:
    """The suffixes a quantity of `unit` may carry, and how an error message shows them."""
    if unit == "bytes":
        return _BYTE_SCALES, "such as 80GB, 80e9 or 512GiB (decimal: 1 GB = 1e9 B; a capital B for bytes)"
    if unit == "GB/s":
        return (
            _BANDWIDTH_SCALES,
            "in bytes per second, such as 50, 50GB/s or 1.6TB/s (400 Gb/s of bits is 50GB/s)",
        )
    if unit in _COUNTED:
        return _COUNT_SCALES, "such as 70B, 125M, 16k or 7e9 (k, M, B, T: decimal)"
    if unit == "params/s":
        return {**_COUNT_SCALES, **{k + "/s": v for k, v in _COUNT_SCALES.items()}}, "such as 150M or 1.5e8"
    return {"": 1, unit: 1}, f"a plain number{f' of {unit}' if unit else ''}"


def parse_quantity(text: str, unit: str) -> float:
    """`text` as typed for an input measured in `unit`, its size suffix applied: the one parser of the CLI.

    Bytes take decimal prefixes (`80GB` = 8e10, `2TB`) or binary ones (`512GiB` = 512 x 2**30); counts
    (parameters, tokens, ...) take k, M, B, T (`70B` = 7e10 parameters); bandwidths are GB/s (`50GB/s`,
    `1.6TB/s` = 1600). Raises ValueError with one sentence that says what would do.
    """
    scales, examples = _scales(unit)
    match = _QUANTITY.fullmatch(str(text))
    if match is None or match.group(2) not in scales:
        raise ValueError(f"{text!r} is not a number of {unit or 'this input'}; write one {examples}.")
    return float(match.group(1)) * scales[match.group(2)]


# ---- memory ------------------------------------------------------------------------------------------------


class Memory(NamedTuple):
    """One rank's training state: how each of the five terms is split, and where its bytes live."""

    shard: dict[str, int]  # ranks each term is split over
    elems: dict[str, int]  # elements of each term on one rank (flat padding included)
    resident: dict[str, int]  # bytes of each term at its training precision, wherever it lives
    gpu: dict[str, int]
    host: dict[str, int]
    nvme: dict[str, int]


def memory_terms(p: PlanInputs) -> Memory:
    """Each state term is replicated or split over the shard group (flat padding to a multiple of it).

    The weights cover every parameter; the gradient, master and Adam terms only the trained ones. The
    optimizer offload moves master, m, v (and a sharded gradient, held as fp32 on the host); the params
    offload moves the weight shard.
    """
    bytes_of = PRECISIONS[p.precision]
    shard = {t: (p.shard_group if t in _SHARDED_TERMS[p.strategy] else 1) for t in MEMORY_TERMS}
    count = {t: p.params if t == "weights" else p.trained_params for t in MEMORY_TERMS}
    elems = {t: padded_flat_numel(count[t], shard[t]) // shard[t] for t in MEMORY_TERMS}
    resident = {t: int(elems[t] * bytes_of[t]) for t in MEMORY_TERMS}
    gpu = dict(resident)
    host = dict.fromkeys(MEMORY_TERMS, 0)
    nvme = dict.fromkeys(MEMORY_TERMS, 0)
    moved = []
    if p.offload_optimizer != "none":
        moved += [(t, p.offload_optimizer) for t in _OPTIMIZER_TERMS]
        if shard["grads"] > 1:
            moved.append(("grads", "cpu"))
    if p.offload_params != "none":
        moved.append(("weights", p.offload_params))
    for t, target in moved:
        gpu[t] = 0
        size = elems[t] * _HOST_GRAD_BYTES if t == "grads" else resident[t]
        (host if target == "cpu" else nvme)[t] = size
    return Memory(shard, elems, resident, gpu, host, nvme)


def transient_bytes(p: PlanInputs, mem: Memory) -> dict[str, int]:
    """GPU buffers beyond the state (zero3/hsdp): gathered layers, weights kept for backward, hpZ's copy."""
    w_b, g_b = PRECISIONS[p.precision]["weights"], PRECISIONS[p.precision]["grads"]
    transient = dict.fromkeys(
        ("gathered_weights", "unsharded_layer_grads", "weights_kept_for_backward", "hpz_secondary_weights"), 0
    )
    if p.strategy in ("zero3", "hsdp"):
        largest = p.largest_layer_params
        transient["gathered_weights"] = int((2 if p.prefetch else 1) * largest * w_b)
        transient["unsharded_layer_grads"] = int(largest * g_b)
        if not p.reshard_after_forward:
            transient["weights_kept_for_backward"] = int(p.params * w_b) - mem.resident["weights"]
        if p.hpz:
            h = min(p.gpus_per_node, p.world_size)
            transient["hpz_secondary_weights"] = int(padded_flat_numel(p.params, h) // h * w_b)
    return transient


def _memory_summary(p: PlanInputs, mem: Memory) -> dict:
    bytes_per_param = sum(PRECISIONS[p.precision].values())
    frozen_saves = bytes_per_param - PRECISIONS[p.precision]["weights"]  # per frozen parameter
    static_bytes_total = int(p.params * bytes_per_param - (p.params - p.trained_params) * frozen_saves)
    state_bytes_per_rank = sum(mem.gpu.values())
    transient = transient_bytes(p, mem)
    n = p.world_size
    return {
        "bytes_per_param": bytes_per_param,
        "accounting": p.accounting,
        "static_bytes_total": static_bytes_total,
        "state_bytes_per_rank": state_bytes_per_rank,
        "state_fraction_per_rank": state_bytes_per_rank / static_bytes_total,
        "memory_bytes_per_rank": mem.gpu,
        "shard_ways": mem.shard,
        "copies_in_cluster": {t: n // mem.shard[t] for t in MEMORY_TERMS},
        "state_bytes_all_ranks": state_bytes_per_rank * n,
        "host_bytes_per_rank": mem.host,
        "nvme_bytes_per_rank": mem.nvme,
        "host_bytes_total": sum(mem.host.values()) * n,
        "nvme_bytes_total": sum(mem.nvme.values()) * n,
        "transient_bytes_per_rank": transient,
        "gpu_bytes_per_rank": state_bytes_per_rank + sum(transient.values()),
    }


# ---- activations --------------------------------------------------------------------------------------------

ACTIVATION_PARTS = (
    "layers",
    "recomputed_layer",
    "block_gradients",
    "weight_gradient",
    "head",
    "loss_gradients",
    "inputs",
)
_INDEX_BYTES = 8  # int64 token ids, targets and positions
_LOSS_BYTES = 4  # the lab's loss runs in fp32 (`loss_fn(logits.float(), ...)`), so do the logits' gradients


def activation_elem_bytes(precision: str) -> int:
    """Bytes of one activation in the compute dtype: 4 for fp32, 2 for the bf16/fp16 recipes."""
    return 4 if precision == "fp32" else 2


def layer_activation_bytes(tokens: int, hidden_size: int, heads: int, elem_bytes: int) -> int:
    """Bytes one block of `labkit.model.Block` saves for backward, for `tokens` = micro-batch x seq_len.

    Per token: 16 h-wide tensors in the compute dtype (the block's input, ln1's output, the q|k|v
    projection (3 h, one storage), the attention's output (h, which proj reads as a view), the residual after
    attention, ln2's output, the MLP's hidden before and after GELU (4 h each)), the two LayerNorms' fp32
    mean and rstd (16 B), and SDPA's fp32 logsumexp per head (4 a B). No s x s matrix: torch's CPU SDPA
    (flash kernel) and the GPU's flash / memory-efficient kernels save only the logsumexp.
    """
    return tokens * (16 * hidden_size * elem_bytes + 16 + 4 * heads)


def activation_bytes(p: PlanInputs) -> tuple[dict[str, int], str]:
    """The activation peak of one micro-batch on one rank, by part (bytes), and the moment it is reached.

    Two moments compete, each on top of the L layers' saved activations (with checkpointing only each
    block's input, T x h): the loss's backward (the head's saved tensors: the last block's output, ln_f's
    output and its stats, the fp32 log-softmax; and two fp32 logits gradients, T x V each), or the last
    block's backward (its gradient in and its MLP's hidden gradient, 5 T x h; with checkpointing the block
    recomputed whole; and the MLP's output-weight gradient, 4 h x h, computed before autograd adds it into
    `.grad`, except under zero3/hsdp, whose unsharded layer gradients `transient_bytes` counts). Plus the
    batch's int64 ids. All zero with hidden_size=0 (not modelled).
    """
    parts = dict.fromkeys(ACTIVATION_PARTS, 0)
    if not p.hidden_size:
        return parts, ""
    e, h, s = activation_elem_bytes(p.precision), p.hidden_size, p.seq_len
    tokens = p.micro_batch * s
    full = layer_activation_bytes(tokens, h, p.attention_heads, e)
    kept = tokens * h * e if p.activation_checkpointing else full
    common = {"layers": p.layers * kept, "inputs": (2 * tokens + s) * _INDEX_BYTES}
    at_loss = {
        "head": tokens * (2 * h * e + 8 + p.vocab_size * _LOSS_BYTES),
        "loss_gradients": 2 * tokens * p.vocab_size * _LOSS_BYTES,
    }
    in_transient = p.strategy in ("zero3", "hsdp")
    at_block = {
        "recomputed_layer": full - kept if p.activation_checkpointing else 0,
        "block_gradients": 5 * tokens * h * e,
        "weight_gradient": 0 if in_transient else int(4 * h * h * PRECISIONS[p.precision]["grads"]),
    }
    if sum(at_loss.values()) >= sum(at_block.values()):
        return {**parts, **common, **at_loss}, "loss backward"
    return {**parts, **common, **at_block}, "last block's backward"


# ---- does it fit? ----------------------------------------------------------------------------------------


def host_bytes_per_node(p: PlanInputs, mem: Memory) -> int:
    """Host RAM one node needs for its ranks' offloaded state (bytes): the ranks of a node share it."""
    return sum(mem.host.values()) * min(p.gpus_per_node, p.world_size)


def _to_nvme(p: PlanInputs) -> PlanInputs:
    """The same plan with every host offload sent to NVMe instead (what is left in host RAM then)."""
    swap = {name: "nvme" for name in ("offload_optimizer", "offload_params") if getattr(p, name) == "cpu"}
    return dataclasses.replace(p, **swap)


def _host_verdict(p: PlanInputs, host: int) -> str:
    """One sentence: does the node's offloaded state (`host` bytes) fit its RAM, and if not, would NVMe?"""
    fmt, ram = format_bytes, f"{format_bytes(p.host_memory_bytes)} of host RAM"
    if host <= p.host_memory_bytes:
        return f"fits: {fmt(host)} per node of {ram}, {fmt(p.host_memory_bytes - host)} to spare"
    over = f"does not fit: {fmt(host)} per node is {fmt(host - p.host_memory_bytes)} more than {ram}"
    if "cpu" not in (p.offload_optimizer, p.offload_params):
        return f"{over}, even with the optimizer on NVMe"
    left = host_bytes_per_node(p, memory_terms(_to_nvme(p)))  # the fp32 gradient shards stay in RAM
    if left <= p.host_memory_bytes:
        return f"{over}; only NVMe fits (offload to nvme leaves {fmt(left)} per node in host RAM)"
    return f"{over}; not even NVMe does ({fmt(left)} per node stays in host RAM)"


def fit_verdict(p: PlanInputs, mem: Memory, gpu_bytes_per_rank: int, activations: int) -> dict:
    """Does one rank fit its GPU (state + transient buffers + activations), and one node's offload its RAM?"""
    gpu, host, fmt = p.gpu_memory_bytes, host_bytes_per_node(p, mem), format_bytes
    needed = gpu_bytes_per_rank + activations
    fits_gpu = needed <= gpu
    held = f"{fmt(gpu_bytes_per_rank)} state and buffers" + (
        f" + {fmt(activations)} activations" if activations else ""
    )
    if fits_gpu:
        spare = "to spare" if p.hidden_size else "left for activations"
        gpu_verdict = f"fits: {held} per rank of {fmt(gpu)}, {fmt(gpu - needed)} {spare}"
    else:
        before = "" if p.hidden_size else ", before activations"
        gpu_verdict = f"does not fit: {held} per rank is {fmt(needed - gpu)} more than {fmt(gpu)}{before}"
    fits_host = host <= p.host_memory_bytes
    return {
        "gpu_memory_bytes": gpu,
        "gpu_needed_bytes_per_rank": needed,
        "gpu_left_for_activations_bytes": gpu - gpu_bytes_per_rank,
        "gpu_headroom_bytes": gpu - needed,
        "fits_gpu_memory": fits_gpu,
        "gpu_verdict": gpu_verdict,
        "host_memory_bytes": p.host_memory_bytes,
        "host_bytes_per_node": host,
        "host_headroom_bytes": p.host_memory_bytes - host,
        "fits_host_memory": fits_host,
        "host_verdict": _host_verdict(p, host) if host else "",
        "fits": fits_gpu and fits_host,
    }


# ---- traffic -----------------------------------------------------------------------------------------------


class Collective(NamedTuple):
    """One collective of a strategy's step, as the table below names it."""

    key: str  # its entry in TRAFFIC_KEYS
    name: str
    kind: str  # its entry in COLLECTIVES
    phase: str  # "forward", "backward" or "step"
    moves: str  # "weights" or "grads": whose bytes per element it moves
    over: str  # "group" (the shard group; every rank unless hsdp), "node" (hpZ) or "replicas" (hsdp)
    quantised_by: str = ""  # the ZeRO++ switch that quantises it


# fmt: off
_GATHER_FORWARD = Collective("all_gather_forward", "forward all-gather of weights", "all_gather", "forward",
                             "weights", "group", quantised_by="qwz")
_GATHER_BACKWARD = Collective("all_gather_backward", "backward all-gather of weights", "all_gather", "backward",
                              "weights", "group", quantised_by="qwz")
_GATHER_BACKWARD_HPZ = Collective("all_gather_backward", "backward all-gather from the node's secondary copy (hpZ)",
                                  "all_gather", "backward", "weights", "node", quantised_by="qwz")
_REDUCE_SCATTER = Collective("reduce_scatter", "gradient reduce-scatter", "reduce_scatter", "backward",
                             "grads", "group", quantised_by="qgz")
_GATHER_AFTER_STEP = Collective("all_gather_after_step", "all-gather of updated weights", "all_gather", "step",
                                "weights", "group")
_ALL_REDUCE = Collective("all_reduce", "gradient all-reduce", "all_reduce", "backward", "grads", "group")
_REPLICA_ALL_REDUCE = Collective("all_reduce", "all-reduce of gradient shards across {replicas} groups",
                                 "all_reduce", "backward", "grads", "replicas")
# fmt: on

# strategy -> the collectives one rank takes part in each step, in the order they run. The options change
# them in `traffic_terms`: reshard_after_forward=False drops the backward all-gather, hpZ swaps it for
# _GATHER_BACKWARD_HPZ, qwZ / qgZ quantise the collectives marked `quantised_by`.
# qwZ marks every weight all-gather, as DeepSpeed 0.19.8 does: `PartitionedParameterCoordinator.__all_gather_params`
# passes `quantize=self.zero_quantized_weights` whatever its `forward` flag, and the hpZ gather from the secondary
# copy quantises too (the `all_gather_coalesced` of `Init._convert_to_deepspeed_param`). The ZeRO++ paper (Wang et al. 2023, arXiv 2306.10209) counts
# qwZ on the forward all-gather only, because there hpZ already keeps the backward one inside the node: alone,
# qwZ halves both gathers (3 M -> 2 M cross-node, 1.5x); with hpZ and qgZ the cross-node bytes are the paper's.
STEP_COLLECTIVES: dict[str, tuple[Collective, ...]] = {
    "ddp": (_ALL_REDUCE,),
    "zero1": (_REDUCE_SCATTER, _GATHER_AFTER_STEP),
    "zero2": (_REDUCE_SCATTER, _GATHER_AFTER_STEP),
    "zero3": (_GATHER_FORWARD, _GATHER_BACKWARD, _REDUCE_SCATTER),
    "hsdp": (_GATHER_FORWARD, _GATHER_BACKWARD, _REDUCE_SCATTER, _REPLICA_ALL_REDUCE),
}


class Term(NamedTuple):
    """One collective of the step with its bytes and time; `plan()` returns each as a dict (`_asdict`)."""

    name: str
    key: str
    collective: str
    phase: str
    group_size: int
    link: str  # "intra_node" or "inter_node"
    payload_bytes: int  # the full tensor (see collective_wire_bytes)
    wire_bytes: int  # what one rank sends
    ring_bytes_all_ranks: dict[str, int]  # wire bytes of every rank by link, by the ring rule
    calls: int  # collectives of this term per step: one per unit (ddp: one per gradient bucket)
    backend_s: (
        float  # the backend's own seconds (a machine profile's calls x latency + wire / bandwidth), or 0
    )
    time_s: float  # wire_bytes at the link's bandwidth, or the backend's own time when that is longer


def quantised_payload_bytes(numel: int, bytes_per_elem: float, block_elems: int | None) -> float:
    """Bytes of `numel` elements quantised to `bytes_per_elem`, plus one fp32 scale per `block_elems` if given."""
    payload = numel * bytes_per_elem
    if block_elems:
        payload += -(-numel // block_elems) * _SCALE_BYTES
    return payload


def _link(span: int, gpus_per_node: int) -> str:
    """Which link a ring over `span` consecutive ranks crosses (groups are assumed to start on a node boundary)."""
    return "intra_node" if span <= gpus_per_node else "inter_node"


def _span(p: PlanInputs, over: str) -> tuple[int, str, bool]:
    """(ranks, link, strided) of the groups a collective runs `over`; groups start on a node boundary."""
    n, gpn, g = p.world_size, p.gpus_per_node, p.shard_group
    if over == "node":
        return min(gpn, n), "intra_node", False
    if over == "replicas":  # HSDP's replicate groups: one rank from each shard group
        return n // g, _link(n, gpn), True
    return g, "intra_node" if (g <= gpn and gpn % g == 0) or n <= gpn else "inter_node", False


def traffic_terms(p: PlanInputs, machine: dict | None = None) -> list[Term]:
    """The step's collectives (STEP_COLLECTIVES) with the options applied, each priced in bytes and seconds.

    reshard_after_forward=False drops the backward all-gather; hpZ moves it inside the node; qwZ quantises
    both weight all-gathers (DeepSpeed's code; the ZeRO++ paper names the forward one), qgZ the reduce-scatter. With a `machine` profile each term also pays the
    backend's own cost (`machine_collective_s`), and lasts the longer of that and the link's time.
    """
    bandwidth = {"inter_node": p.link_gbytes * 1e9, "intra_node": p.intra_gbytes * 1e9}
    elem_bytes = PRECISIONS[p.precision]
    g = p.shard_group
    terms = []
    for c in STEP_COLLECTIVES[p.strategy]:
        if c.key == "all_gather_backward":
            if not p.reshard_after_forward:
                continue
            if p.hpz:
                c = _GATHER_BACKWARD_HPZ
        size, link, strided = _span(p, c.over)
        # a replica all-reduce moves one rank's gradient shard; the others the whole padded flat tensor;
        # gradients exist for the trained parameters only
        count = p.trained_params if c.moves == "grads" else p.params
        numel = padded_flat_numel(count, g) // g if c.over == "replicas" else padded_flat_numel(count, size)
        name = c.name.format(replicas=size) if c.over == "replicas" else c.name
        if c.quantised_by and getattr(p, c.quantised_by):
            bytes_per_elem, suffix = _QUANTISED[c.quantised_by]
            payload = int(quantised_payload_bytes(numel, bytes_per_elem, p.quant_block_elems))
            name += suffix
        else:
            payload = int(numel * elem_bytes[c.moves])
        wire = collective_wire_bytes(c.kind, payload, size)
        ring = _ring_bytes_all_ranks(c.kind, payload, p.world_size, size, p.gpus_per_node, strided)
        calls = -(-payload // DDP_BUCKET_BYTES) if p.strategy == "ddp" else p.layers + p.root_units
        backend_s = machine_collective_s(machine, c.kind, size, wire, calls) if machine and size > 1 else 0.0
        link_s = wire / bandwidth[link]
        terms.append(Term(name, c.key, c.kind, c.phase, size, link, payload, wire, ring, calls, backend_s,
                          max(link_s, backend_s)))  # fmt: skip
    return terms


def _traffic_summary(terms: list[Term]) -> dict:
    by_collective = dict.fromkeys(TRAFFIC_KEYS, 0)
    by_link = dict.fromkeys(LINKS, 0)
    ring_by_link = dict.fromkeys(LINKS, 0)
    for t in terms:
        for link in LINKS:
            ring_by_link[link] += t.ring_bytes_all_ranks[link]
        by_collective[t.key] += t.wire_bytes
        by_link[t.link] += t.wire_bytes
    return {
        "traffic_bytes_per_rank": sum(by_collective.values()),
        # the n -> infinity value: no (n-1)/n factors
        "traffic_bytes_per_rank_large_n": sum(
            t.payload_bytes * (2 if t.collective == "all_reduce" else 1) for t in terms if t.group_size > 1
        ),
        "traffic_bytes_by_collective": by_collective,
        "traffic_bytes_by_link": by_link,
        "ring_bytes_all_ranks_by_link": ring_by_link,
        "traffic_terms": [t._asdict() for t in terms],
    }


# ---- offload and time --------------------------------------------------------------------------------------


def offload_io_bytes(p: PlanInputs, mem: Memory) -> tuple[int, int]:
    """(PCIe, NVMe) bytes one rank moves per step for its offloaded state."""
    w_b, g_b = PRECISIONS[p.precision]["weights"], PRECISIONS[p.precision]["grads"]
    host_io = nvme_io = 0
    if p.offload_optimizer != "none":
        sh = mem.elems["master"]
        grad_shard = mem.elems["grads"] if mem.shard["grads"] > 1 else sh
        host_io += grad_shard * g_b + sh * w_b  # gradient shard down, updated weight shard back up
        if p.offload_optimizer == "nvme":
            nvme_io += 2 * sum(mem.resident[t] for t in _OPTIMIZER_TERMS)  # read and write back master, m, v
    if p.offload_params != "none":
        # the shard goes up for the forward and the backward all-gather
        host_io += 2 * mem.resident["weights"]
        if p.offload_params == "nvme":
            nvme_io += 3 * mem.resident["weights"]  # two reads, one write of the updated shard
    return host_io, nvme_io


def _overlap_exposed_s(comm_s: float, compute_s: float, layers: int) -> float:
    """Exposed seconds of `comm_s` hidden behind `compute_s`, both split evenly over `layers` layers.

    With one layer of look-ahead, layer i's compute runs while layer i+1's collective is in flight, so the
    phase takes c + (L-1) max(c, k) + k for per-layer comm c and compute k; the exposed part is that minus
    the compute: c + (L-1) max(0, c - k).
    """
    if comm_s <= 0:
        return 0.0
    c, k = comm_s / layers, compute_s / layers
    return c + (layers - 1) * max(0.0, c - k)


class UnitCost(NamedTuple):
    """One unit of a ZeRO-3 unit plan, in forward order, as `exposed_floor` weighs it (wire bytes, one rank)."""

    name: str
    gather_wire_bytes: int  # one all-gather of its weights
    reduce_wire_bytes: int  # its reduce-scatter
    backward_gather: bool  # gathered again before its backward (False: kept since its forward)
    computes: bool  # has compute of its own beside which a collective can run (an embedding lookup has none)


def exposed_floor(
    units: Sequence[UnitCost],
    prefetch_depth: int = 1,
    collective_s: Callable[[str, int], float] | None = None,
) -> dict:
    """What no prefetch of `prefetch_depth` units can hide: the collectives with no compute beside them.

    Forward, in unit order: a unit's gather runs beside the compute of the `depth` units before it (the first
    unit's beside none). Backward, in reverse order: a unit's gather beside the `depth` units after it in
    that order began, its reduce-scatter beside every unit whose backward follows. A collective whose units
    beside it have no compute is exposed at any link speed. Returns the exposed (unit, collective) pairs,
    their wire bytes, the step's, and the share: the floor of exposed / unprefetched comm, by bytes.

    `collective_s(kind, wire_bytes)`: one collective's seconds ("all_gather" or "reduce_scatter"), e.g.
    `collective_time_s` on a calibrated machine; with it the result also has "floor_s" and "comm_s", the
    same sums in seconds, where a collective's fixed cost (gloo's latency) weighs too.
    """
    order, exposed = list(units), []
    back = order[::-1]
    for i, u in enumerate(order):
        if not any(v.computes for v in order[max(0, i - prefetch_depth) : i]):
            exposed.append((u.name, "forward all-gather", "all_gather", u.gather_wire_bytes))
    for i, u in enumerate(back):
        if u.backward_gather and not any(v.computes for v in back[max(0, i - prefetch_depth) : i]):
            exposed.append((u.name, "backward all-gather", "all_gather", u.gather_wire_bytes))
        if not any(v.computes for v in back[i + 1 :]):
            exposed.append((u.name, "reduce-scatter", "reduce_scatter", u.reduce_wire_bytes))
    every = [c for u in order for c in (("all_gather", u.gather_wire_bytes),) * (1 + u.backward_gather)]
    every += [("reduce_scatter", u.reduce_wire_bytes) for u in order]
    total = sum(b for _, b in every)
    floor = sum(b for *_, b in exposed)
    out = {"exposed": [(name, what) for name, what, *_ in exposed], "floor_wire_bytes": floor,
           "comm_wire_bytes": total, "floor_share": floor / total if total else 0.0}  # fmt: skip
    if collective_s is not None:
        out["floor_s"] = sum(collective_s(kind, b) for *_, kind, b in exposed)
        out["comm_s"] = sum(collective_s(kind, b) for kind, b in every)
    return out


def collective_time_s(
    kind: str, wire_bytes: int, world_size: int, link_gbytes: float | None = None, machine: dict | None = None
) -> float:
    """Seconds of one collective on one rank: the longer of the link's time (wire bytes / `link_gbytes`
    GB/s) and the backend's own on a calibrated `machine` (`machine_collective_s`, one call); 0 with neither."""
    link_s = wire_bytes / (link_gbytes * 1e9) if link_gbytes else 0.0
    backend_s = machine_collective_s(machine, kind, world_size, wire_bytes, 1) if machine else 0.0
    return max(link_s, backend_s)


def gathered_peak_bytes(unit_bytes: Sequence[int], prefetch_depth: int = 1, prefetch: bool = True) -> int:
    """The most gathered weight bytes held at once: a unit computing and the `prefetch_depth` gathered ahead
    of it, the largest such run of consecutive units (forward order; the backward's runs are the same). A
    last unit kept across the forward/backward turn adds nothing: it is freed once its gradients are
    reduced, before the unit before it computes its backward."""
    window = prefetch_depth + 1 if prefetch else 1
    return max(sum(unit_bytes[i : i + window]) for i in range(len(unit_bytes)))


def host_optimizer_time_s(p: PlanInputs, mem: Memory) -> float:
    """CPU Adam's own seconds per step when the optimizer is offloaded: this rank's params / its rate.

    The host updates this rank's optimizer shard (`mem.elems["master"]` parameters) at
    `host_adam_params_per_s` after the gradients have come down; the GPU waits (no one-step-delayed update).
    """
    if p.offload_optimizer == "none":
        return 0.0
    return mem.elems["master"] / p.host_adam_params_per_s


def step_time(
    p: PlanInputs,
    terms: list[Term],
    offload_time_s: float,
    host_adam_s: float = 0.0,
    machine: dict | None = None,
) -> dict:
    """Compute time, serial and exposed comm (with and without prefetch) and the step, in seconds.

    Compute is 6 N tokens / (peak x MFU), or / a `machine` profile's rate per rank
    (`machine_flops_per_s`); a third forward and two thirds backward (activation checkpointing adds a
    forward inside the backward: 8 N tokens). Each phase's link time overlaps its compute by
    `_overlap_exposed_s`; the backend's own time (`Term.backend_s`: on a CPU its copies run on the cores
    that compute), the after-step all-gather, the offload transfers and CPU Adam do not overlap.
    """
    per_token = 8.0 if p.activation_checkpointing else 6.0
    flops = per_token * p.params * p.tokens_per_rank
    rate = machine_flops_per_s(machine, p.world_size) if machine else p.peak_tflops * 1e12 * p.mfu
    compute_time_s = flops / rate
    fwd_k = 2 * compute_time_s / per_token
    bwd_k = compute_time_s - fwd_k
    by_phase = {"forward": 0.0, "backward_gather": 0.0, "backward_reduce": 0.0, "step": 0.0}
    time_by_link = dict.fromkeys(LINKS, 0.0)
    for t in terms:
        phase = t.phase
        if phase == "backward":
            phase = "backward_gather" if t.collective == "all_gather" else "backward_reduce"
        by_phase[phase] += t.time_s - t.backend_s
        time_by_link[t.link] += t.time_s
    comm_time_s = sum(time_by_link.values())
    backend_s = sum(t.backend_s for t in terms)
    exposed_prefetch = backend_s + (
        _overlap_exposed_s(by_phase["forward"], fwd_k, p.layers)
        + _overlap_exposed_s(by_phase["backward_gather"] + by_phase["backward_reduce"], bwd_k, p.layers)
        + by_phase["step"]
    )
    exposed_no_prefetch = backend_s + (
        by_phase["forward"]
        + by_phase["backward_gather"]
        + _overlap_exposed_s(by_phase["backward_reduce"], bwd_k, p.layers)
        + by_phase["step"]
    )
    exposed = exposed_prefetch if p.prefetch else exposed_no_prefetch
    return {
        "flops_per_rank": flops,
        "compute_time_s": compute_time_s,
        "comm_time_s": comm_time_s,
        "comm_time_by_link_s": time_by_link,
        "backend_comm_time_s": backend_s,
        "comm_to_compute": comm_time_s / compute_time_s,
        "exposed_comm_s": exposed,
        "exposed_comm_prefetch_s": exposed_prefetch,
        "exposed_comm_no_prefetch_s": exposed_no_prefetch,
        "offload_time_s": offload_time_s,
        "host_optimizer_time_s": host_adam_s,
        "step_time_s": compute_time_s + exposed + offload_time_s + host_adam_s,
    }


# ---- a calibrated machine ---------------------------------------------------------------------------------

MACHINE_KEYS = ("compute_flops_per_s", "core_share", "collectives")
COLLECTIVE_FIT_KEYS = ("latency_s", "gbytes")


def model_flops_utilisation(params: float, tokens: float, step_time_s: float, peak_flops: float) -> float:
    """MFU: the 6 x params x tokens FLOPs a training step needs (forward 2, backward 4 per parameter and
    token), over the step's time, over the device's peak FLOP/s (a fraction; attention's FLOPs left out)."""
    if min(params, tokens, step_time_s, peak_flops) <= 0:
        raise ValueError("params, tokens, step_time_s and peak_flops must all be positive")
    return 6 * params * tokens / step_time_s / peak_flops


def check_machine_profile(profile: dict) -> dict:
    """`profile` (what `labkit calibrate` writes) if it has what a plan prices a step with, else ValueError.

    Keys: compute_flops_per_s (one rank alone, FLOP/s at 6 x params x tokens), core_share {"n": share of
    that rate each of n ranks keeps}, collectives {kind: {"n": {latency_s, gbytes, ...}}}; others are kept.
    """
    if not isinstance(profile, dict) or any(k not in profile for k in MACHINE_KEYS):
        raise ValueError(
            f"a machine profile needs the keys {', '.join(MACHINE_KEYS)}; write one with labkit calibrate."
        )
    values = [profile["compute_flops_per_s"], *profile["core_share"].values()]
    values += [
        fit[k] for by_n in profile["collectives"].values() for fit in by_n.values() for k in ("gbytes",)
    ]
    if not all(isinstance(v, (int, float)) and v > 0 for v in values):
        raise ValueError("a machine profile's rates, shares and bandwidths must be positive numbers; "
                         "write it again with labkit calibrate.")  # fmt: skip
    return profile


def load_machine_profile(path: str) -> dict:
    """The machine profile in the JSON file `path` (checked); ValueError in one sentence when it is not one."""
    import json

    try:
        with open(path) as f:
            return check_machine_profile(json.load(f))
    except OSError as e:
        raise ValueError(
            f"cannot read the machine profile {path!r} ({e.strerror}); pass the file labkit calibrate wrote."
        ) from None
    except json.JSONDecodeError:
        raise ValueError(f"{path!r} is not JSON; pass the file labkit calibrate --out wrote.") from None


def _measured_at(profile_part: dict, world_size: int, what: str) -> dict | float:
    if str(world_size) not in profile_part:
        have = ", ".join(sorted(profile_part, key=int))
        raise ValueError(
            f"the machine profile has no {what} at world_size={world_size} (it has {have}); "
            f"calibrate there: labkit calibrate --world-sizes {world_size}."
        )
    return profile_part[str(world_size)]


def machine_flops_per_s(machine: dict, world_size: int) -> float:
    """FLOP/s one of `world_size` ranks computes at on the profiled machine: the one-rank rate x its core share."""
    return machine["compute_flops_per_s"] * _measured_at(machine["core_share"], world_size, "core share")


def machine_collective_s(machine: dict, kind: str, world_size: int, wire_bytes: int, calls: int) -> float:
    """The backend's own seconds for `calls` collectives of `kind` sending `wire_bytes` in all (one rank):
    calls x latency_s + wire_bytes / (gbytes x 1e9), the profile's fit at that world size."""
    if kind not in machine["collectives"]:
        raise ValueError(
            f"the machine profile has no fit for {kind}; it has {', '.join(machine['collectives'])}."
        )
    fit = _measured_at(machine["collectives"][kind], world_size, f"{kind} fit")
    return calls * fit["latency_s"] + wire_bytes / (fit["gbytes"] * 1e9)


def machine_summary(machine: dict, world_size: int) -> dict:
    """What a plan's result says of the profile it used: the rates at this world size and where it was measured."""
    share = _measured_at(machine["core_share"], world_size, "core share")
    return {"compute_flops_per_s": machine["compute_flops_per_s"], "core_share": share,
            "flops_per_s_per_rank": machine["compute_flops_per_s"] * share,
            "calibrated_on": machine.get("machine", {})}  # fmt: skip


# ---- the plan ----------------------------------------------------------------------------------------------

# the inputs a result echoes under "options", in this order
_ECHOED = (
    "reshard_after_forward", "prefetch", "qwz", "hpz", "qgz", "quant_block_elems", "offload_optimizer",
    "offload_params", "largest_layer_params", "layers", "root_units", "tokens_per_rank", "peak_tflops", "mfu",
    "link_gbytes", "intra_gbytes", "host_gbytes", "nvme_gbytes", "host_adam_params_per_s", "gpu_memory_bytes",
    "host_memory_bytes", "hidden_size", "attention_heads", "seq_len", "micro_batch", "vocab_size",
    "activation_checkpointing",
)  # fmt: skip


def plan(params: float, world_size: int, strategy: str = DEFAULTS["strategy"], **options) -> dict:
    """Memory, traffic and time of one training step per rank, for `params` parameters on `world_size` ranks.

    Units: bytes (1 GB = 1e9 B), seconds, GB/s for bandwidths, TFLOP/s for `peak_tflops`. `options` are
    the other fields of `PlanInputs` (their meaning, units and defaults are there), and `machine`: a profile
    of `labkit calibrate` (`check_machine_profile`), whose measured compute rate and collective costs then
    price the step instead of peak x MFU and the datasheet links; docs/budget.md states every formula. With accounting="deepspeed" the state is DeepSpeed's estimate; the other keys are the same.
    The verdict (`fits`, `gpu_verdict`, `host_verdict`) weighs the GPU bytes against `gpu_memory_bytes`.
    Raises ValueError with one sentence naming the argument when an input is impossible.
    """
    machine = options.pop("machine", None)
    if machine is not None:
        check_machine_profile(machine)
    p = PlanInputs(params, world_size, strategy, **options)
    mem = memory_terms(p)
    terms = traffic_terms(p, machine)
    host_io, nvme_io = offload_io_bytes(p, mem)
    offload_s = host_io / (p.host_gbytes * 1e9) + nvme_io / (p.nvme_gbytes * 1e9)
    times = step_time(p, terms, offload_s, host_optimizer_time_s(p, mem), machine)
    activations, peak_at = activation_bytes(p)
    result = {
        "params": p.params,
        "trained_params": p.trained_params,
        "world_size": p.world_size,
        "strategy": p.strategy,
        "group_size": p.shard_group,
        "replica_groups": p.world_size // p.shard_group,
        "gpus_per_node": p.gpus_per_node,
        "nodes": -(-p.world_size // p.gpus_per_node),
        "precision": p.precision,
        **_memory_summary(p, mem),
        "activation_bytes_per_rank": sum(activations.values()),
        "activation_bytes_by_part": activations,
        "activation_peak_at": peak_at,
        **_traffic_summary(terms),
        "host_io_bytes_per_rank": host_io,
        "nvme_io_bytes_per_rank": nvme_io,
        **times,
        "assumptions": {i.name: getattr(p, i.name) for i in INPUTS if i.spec.assumption},
        "options": {name: getattr(p, name) for name in _ECHOED},
        "machine": None if machine is None else machine_summary(machine, p.world_size),
    }
    if p.accounting == "deepspeed":
        result.update(_deepspeed_accounting(p, result["state_bytes_per_rank"]))
    # against the GPU bytes as the result counts them (DeepSpeed's estimate, with its accounting)
    transient = sum(result["transient_bytes_per_rank"].values())
    result.update(fit_verdict(p, mem, result["state_bytes_per_rank"] + transient, sum(activations.values())))
    return result


def model_options(cfg, world_size: int = 1) -> dict:
    """The activation inputs of `plan()` for a `labkit.model.ModelConfig` (any object with its fields).

    Each of `world_size` ranks takes global_batch / world_size sequences, as `labkit.model.batch` slices them.
    """
    return {
        "hidden_size": cfg.d_model,
        "attention_heads": cfg.n_heads,
        "layers": cfg.n_layers,
        "seq_len": cfg.seq_len,
        "micro_batch": cfg.global_batch // world_size,
        "vocab_size": cfg.vocab_size,
    }


# ---- searches over plans -----------------------------------------------------------------------------------

MAX_RANKS = 2**20  # the fewest-ranks search gives up beyond a million ranks


def fewest_ranks(
    params: float, strategy: str = DEFAULTS["strategy"], *, max_ranks: int = MAX_RANKS, **options
) -> dict:
    """The smallest world size at which `strategy` with `options` fits (`plan()["fits"]`: GPU and host RAM).

    Memory per rank never grows with n, so the search is a bisection over the world sizes the plan accepts
    (a multiple of the hsdp group; whole nodes for accounting="deepspeed"). Returns `world_size` (None when
    nothing fits at `max_ranks`), its `plan`, `one_fewer` (the largest accepted size below it, which does not
    fit) and `reason`, one sentence.
    """
    options.pop("world_size", None)
    gpn = _checked("gpus_per_node", options.get("gpus_per_node", DEFAULTS["gpus_per_node"]))
    step = 1  # the accepted world sizes from one node up are the multiples of `step`
    if strategy == "hsdp":
        step = gpn if options.get("group_size") is None else _checked("group_size", options["group_size"])
    if options.get("accounting") == "deepspeed":
        step = math.lcm(step, gpn)
    first = -(-gpn // step) * step
    top = plan(params, max(first, max_ranks // step * step), strategy, **options)  # a bad input raises here
    small = [r for n in range(1, first) if (r := _plan_or_none(params, n, strategy, options))]
    fitting = [r for r in small if r["fits"]]
    if fitting:
        found, below = (
            fitting[0],
            ([r for r in small if r["world_size"] < fitting[0]["world_size"]] or [None])[-1],
        )
    elif not top["fits"]:
        return {"world_size": None, "max_ranks": top["world_size"], "plan": None, "one_fewer": None,
                "reason": _nothing_fits(top)}  # fmt: skip
    else:
        lo, hi = first // step, top["world_size"] // step  # hi fits; find the smallest k that does
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if plan(params, mid * step, strategy, **options)["fits"] else (mid + 1, hi)
        found = plan(params, lo * step, strategy, **options)
        below = (
            plan(params, (lo - 1) * step, strategy, **options)
            if lo > first // step
            else (small or [None])[-1]
        )
    return _fewest_ranks_answer(found, below, top["world_size"])


def _checked(name: str, value):
    """`value` checked as the field `name` of PlanInputs checks it (a bad one raises ValueError)."""
    spec = next(i.spec for i in INPUTS if i.name == name)
    return _CHECK_OF_KIND[spec.kind](name, value, spec)


def _plan_or_none(params: float, n: int, strategy: str, options: dict) -> dict | None:
    try:
        return plan(params, n, strategy, **options)
    except ValueError:  # a world size this strategy does not accept (a group that does not divide it)
        return None


def _fewest_ranks_answer(found: dict, below: dict | None, max_ranks: int) -> dict:
    n, fmt = found["world_size"], format_bytes
    reason = (
        f"{n} ranks are the fewest at which {found['strategy']} fits: "
        f"{fmt(found['gpu_needed_bytes_per_rank'])} per rank of {fmt(found['gpu_memory_bytes'])}"
    )
    one_fewer = None
    if below is not None:
        one_fewer = {
            k: below[k] for k in ("world_size", "gpu_needed_bytes_per_rank", "host_bytes_per_node", "fits")
        }
        reason += f"; at {below['world_size']} ranks it needs {fmt(below['gpu_needed_bytes_per_rank'])}"
    return {
        "world_size": n,
        "max_ranks": max_ranks,
        "plan": found,
        "one_fewer": one_fewer,
        "reason": reason + ".",
    }


def _nothing_fits(top: dict) -> str:
    """Why no world size fits: the plan at the largest one tried, in one sentence."""
    fmt = format_bytes
    n, strategy = top["world_size"], top["strategy"]
    if not top["fits_gpu_memory"]:
        parts = [f"state {fmt(top['state_bytes_per_rank'])}"]
        transient = sum(top["transient_bytes_per_rank"].values())
        if transient:
            parts.append(f"transient buffers {fmt(transient)}")
        if top["activation_bytes_per_rank"]:
            parts.append(f"activations {fmt(top['activation_bytes_per_rank'])}")
        return (
            f"nothing fits in gpu_memory_bytes={fmt(top['gpu_memory_bytes'])}: even at {n:,} ranks {strategy} needs "
            f"{fmt(top['gpu_needed_bytes_per_rank'])} per rank ({', '.join(parts)}); shard more (zero3), offload, "
            "or checkpoint activations."
        )
    return (
        f"nothing fits in host_memory_bytes={fmt(top['host_memory_bytes'])}: even at {n:,} ranks the offloaded "
        f"state needs {fmt(top['host_bytes_per_node'])} per node; offload to nvme or add host RAM."
    )


_REMEDIES = (("cpu", "none"), ("cpu", "cpu"), ("nvme", "cpu"), ("nvme", "nvme"))  # smallest offload first


def needs_offload(params: float, max_ranks: int, gpu_memory_bytes: float, **options) -> dict:
    """The first reversal condition: does ZeRO-3 fit at the largest world size you can have?

    Returns the GPU bytes per rank at `max_ranks`, whether they fit `gpu_memory_bytes`, and the smallest
    offload (optimizer to cpu, then params too, then NVMe) under which the GPU and the node's host RAM
    (`host_memory_bytes`, an option) both fit, or None; `tried` says how each offload fared.
    """
    options = {**options, "gpu_memory_bytes": gpu_memory_bytes}
    full = plan(params, max_ranks, "zero3", **options)
    remedy, tried = None, []
    for opt, par in () if full["fits_gpu_memory"] else _REMEDIES:
        p = plan(params, max_ranks, "zero3", offload_optimizer=opt, offload_params=par, **options)
        tried.append({"offload_optimizer": opt, "offload_params": par,
                      **{k: p[k] for k in ("gpu_bytes_per_rank", "host_bytes_per_node", "fits_gpu_memory",
                                           "fits_host_memory", "host_verdict")}})  # fmt: skip
        if p["fits"]:
            remedy = {"offload_optimizer": opt, "offload_params": par, "gpu_bytes_per_rank": p["gpu_bytes_per_rank"],
                      "host_bytes_per_node": p["host_bytes_per_node"]}  # fmt: skip
            break
    return {
        "gpu_bytes_per_rank": full["gpu_bytes_per_rank"],
        "fits_without_offload": full["fits_gpu_memory"],
        "offload": remedy,
        "tried": tried,
    }


# ---- DeepSpeed's accounting --------------------------------------------------------------------------------


def deepspeed_zero_estimate(
    total_params: int,
    largest_layer_params: int = 0,
    *,
    stage: int = 3,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = False,
    cpu_offload_params: bool = False,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> dict:
    """DeepSpeed's own ZeRO-2/ZeRO-3 model-state estimator, restated without torch (bytes and GiB).

    The same arithmetic as `estimate_zero2_model_states_mem_needs` / `estimate_zero3_model_states_mem_needs`
    in DeepSpeed 0.19: 18 B/param sharded over all GPUs (2 fp16 grads + 4 fp32 grads + 4 fp32 master
    + 8 Adam), plus, for ZeRO-3, 4 B per parameter of the largest layer, or for ZeRO-2 the full fp16
    weights (2 B/param). Returns per-GPU and per-node-CPU bytes, and both in GiB (2**30 B) as it prints them.
    """
    total_gpus = num_nodes * num_gpus_per_node
    largest_layer_memory = 4 * largest_layer_params
    if stage == 2:
        if cpu_offload:
            gpu = 2 * total_params
            cpu = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
        else:
            gpu = 2 * total_params + int(18 * total_params / total_gpus)
            cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
        largest_layer_memory = 0
    elif stage == 3:
        gpus_factor = 1 / num_nodes
        if cpu_offload and cpu_offload_params:
            gpu = largest_layer_memory
            per_param = 18 * gpus_factor if zero_init else max(4 * num_gpus_per_node, 18 * gpus_factor)
            cpu = total_params * per_param * additional_buffer_factor
        elif cpu_offload:
            gpu = largest_layer_memory + int(2 * total_params / total_gpus)
            per_param = 16 * gpus_factor if zero_init else max(4 * num_gpus_per_node, 16 * gpus_factor)
            cpu = total_params * per_param * additional_buffer_factor
        else:
            gpu = largest_layer_memory + int(18 * total_params / total_gpus)
            held = largest_layer_params if zero_init else total_params
            cpu = held * 4 * num_gpus_per_node * additional_buffer_factor
    else:
        raise ValueError(f"DeepSpeed's estimator exists for ZeRO stages 2 and 3; got stage={stage!r}.")
    return {
        "gpu_bytes_per_rank": int(gpu),
        "cpu_bytes_per_node": int(cpu),
        "largest_layer_bytes": int(largest_layer_memory),
        "gpu_gib_per_rank": int(gpu) / 2**30,
        "cpu_gib_per_node": int(cpu) / 2**30,
    }


def _deepspeed_nodes(world_size: int, gpus_per_node: int) -> tuple[int, int]:
    """(GPUs per node, nodes) as DeepSpeed's estimator takes them; fewer ranks than a node are one node."""
    return (gpus_per_node, world_size // gpus_per_node) if world_size >= gpus_per_node else (world_size, 1)


def _deepspeed_accounting(p: PlanInputs, paper_state_bytes_per_rank: int) -> dict:
    """The keys accounting="deepspeed" replaces: DeepSpeed's estimate of the state and its own itemisation."""
    n, n_params = p.world_size, p.params
    per_node, nodes = _deepspeed_nodes(n, p.gpus_per_node)
    stage = 3 if p.strategy == "zero3" else 2
    est = deepspeed_zero_estimate(
        n_params,
        p.largest_layer_params,
        stage=stage,
        num_gpus_per_node=per_node,
        num_nodes=nodes,
        cpu_offload=p.offload_optimizer == "cpu",
        cpu_offload_params=p.offload_params == "cpu",
        zero_init=p.zero_init,
        additional_buffer_factor=p.additional_buffer_factor,
    )
    # DeepSpeed's itemisation of its 18 B/param (its ZeRO-2 source comment), sharded over all GPUs.
    itemised = {
        "grads": 2 * n_params // n,
        "grads_fp32": 4 * n_params // n,
        "master": 4 * n_params // n,
        "adam_m": 4 * n_params // n,
        "adam_v": 4 * n_params // n,
    }
    if p.offload_optimizer == "cpu":
        itemised = dict.fromkeys(itemised, 0)
        if stage == 3 and p.offload_params == "none":
            itemised["weights"] = int(2 * n_params / n)
    if stage == 2:
        itemised["weights"] = 2 * n_params
    else:
        itemised["largest_layer_buffer"] = est["largest_layer_bytes"]
    return {
        "state_bytes_per_rank": est["gpu_bytes_per_rank"],
        "state_gib_per_rank": est["gpu_gib_per_rank"],
        "memory_bytes_per_rank": itemised,
        "deepspeed_estimate": est,
        "paper_state_bytes_per_rank": paper_state_bytes_per_rank,
    }


# ---- reading a plan ----------------------------------------------------------------------------------------


def format_bytes(n_bytes: float) -> str:
    """`n_bytes` in decimal units with four significant digits: 1875000000 -> '1.875 GB'."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:.4g} {unit}"
    return f"{n_bytes:.0f} B"


def summary_rows(result: dict) -> list[tuple[str, str, str]]:
    """The numbers of a `plan()` result as (section, quantity, value) rows, for tables in the CLI and widgets."""
    return (
        _memory_rows(result) + _traffic_rows(result) + _time_rows(result) + assumption_rows(result)
        + _fit_rows(result)
    )  # fmt: skip


def format_count(n: float) -> str:
    """A count with a decimal suffix and four significant digits: 30000000000 -> '30B', 1.5e8 -> '150M'."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return f"{n:g}"


def _unit_value(value: float, unit: str) -> str:
    if unit == "bytes":
        return format_bytes(value)
    if unit == "params/s":
        return f"{format_count(value)} params/s"
    return f"{value:g} {unit}".rstrip() if unit != "fraction" else f"{value:g}"


def assumption_rows(result: dict) -> list[tuple[str, str, str]]:
    """The inputs the step time rests on (`InputSpec.assumption`), each with its unit."""
    specs = {i.name: i.spec for i in INPUTS}
    return [
        ("assumptions", specs[name].help.split(";")[0], _unit_value(value, specs[name].unit))
        for name, value in result["assumptions"].items()
    ]


def _fit_rows(result: dict) -> list[tuple[str, str, str]]:
    section = "does it fit?"
    rows = [
        (section, "GPU memory", format_bytes(result["gpu_memory_bytes"])),
        (section, "needed per rank", format_bytes(result["gpu_needed_bytes_per_rank"])),
        (section, "left for activations", format_bytes(result["gpu_left_for_activations_bytes"])),
        (section, "verdict, GPU", result["gpu_verdict"]),
    ]
    if result["host_bytes_per_node"]:
        rows.append((section, "host RAM per node", format_bytes(result["host_memory_bytes"])))
        rows.append((section, "offloaded state per node", format_bytes(result["host_bytes_per_node"])))
        rows.append((section, "verdict, host", result["host_verdict"]))
    return rows


def _memory_rows(result: dict) -> list[tuple[str, str, str]]:
    section = "memory per rank"
    rows = [(section, term, format_bytes(value)) for term, value in result["memory_bytes_per_rank"].items()]
    rows.append((section, "state total", format_bytes(result["state_bytes_per_rank"])))
    if "state_gib_per_rank" in result:
        rows.append((section, "state total (GiB, DeepSpeed)", f"{result['state_gib_per_rank']:.2f} GiB"))
    transient = sum(result["transient_bytes_per_rank"].values())
    if transient:
        rows.append((section, "transient buffers", format_bytes(transient)))
    if result["activation_bytes_per_rank"]:
        kept = (
            "block inputs, one block recomputed"
            if result["options"]["activation_checkpointing"]
            else "all saved"
        )
        rows.append((section, f"activations ({kept}; peak at the {result['activation_peak_at']})",
                     format_bytes(result["activation_bytes_per_rank"])))  # fmt: skip
    for where in ("host", "nvme"):
        held = sum(result[f"{where}_bytes_per_rank"].values())
        if held:
            rows.append((section, f"on {where} (offloaded)", format_bytes(held)))
    rows.append((section, "whole model's state, once", format_bytes(result["static_bytes_total"])))
    rows.append(
        (section, "copies of the weights in the cluster", f"{result['copies_in_cluster']['weights']}")
    )
    return rows


def _traffic_rows(result: dict) -> list[tuple[str, str, str]]:
    section = "traffic per rank per step"
    rows = []
    for t in result["traffic_terms"]:
        where = "intra-node" if t["link"] == "intra_node" else "inter-node"
        rows.append(
            (section, f"{t['name']} ({t['group_size']} ranks, {where})", format_bytes(t["wire_bytes"]))
        )
    rows.append((section, "total", format_bytes(result["traffic_bytes_per_rank"])))
    rows.append(
        (section, "total as n grows (no (n-1)/n)", format_bytes(result["traffic_bytes_per_rank_large_n"]))
    )
    for link, value in result["traffic_bytes_by_link"].items():
        rows.append((section, f"on {link.replace('_', '-')} links", format_bytes(value)))
    if result["host_io_bytes_per_rank"] or result["nvme_io_bytes_per_rank"]:
        rows.append((section, "to/from host (PCIe)", format_bytes(result["host_io_bytes_per_rank"])))
        rows.append((section, "to/from NVMe", format_bytes(result["nvme_io_bytes_per_rank"])))
    return rows


def _time_rows(result: dict) -> list[tuple[str, str, str]]:
    rows = [
        ("compute" + (" (calibrated rate)" if result["machine"] else ""), result["compute_time_s"]),
        ("communication (serial)", result["comm_time_s"]),
        *(
            [("of which the backend's own (calibrated)", result["backend_comm_time_s"])]
            if result["machine"]
            else []
        ),
        ("exposed comm, one-layer prefetch", result["exposed_comm_prefetch_s"]),
        ("exposed comm, no prefetch", result["exposed_comm_no_prefetch_s"]),
    ]
    if result["offload_time_s"]:
        rows.append(("offload transfers", result["offload_time_s"]))
    if result["host_optimizer_time_s"]:
        rows.append(("host optimizer (CPU Adam)", result["host_optimizer_time_s"]))
    rows.append(("step", result["step_time_s"]))
    return [("time per step", quantity, f"{seconds:.3f} s") for quantity, seconds in rows]
