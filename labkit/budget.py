"""Closed-form arithmetic of data parallelism: state bytes per rank, bytes per collective per step, step time.

`plan(params, world_size, strategy)` is the one entry point; the helpers below it (`collective_wire_bytes`,
`padded_numel`, ...) are the same arithmetic applied to one tensor, so the probes can predict what they
measure. Pure Python: no torch, no numpy. Bytes are bytes (1 GB = 1e9 B), times are seconds.
"""

from __future__ import annotations

from collections.abc import Sequence

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
TRAFFIC_KEYS = (
    "all_gather_forward",
    "all_gather_backward",
    "all_gather_after_step",
    "reduce_scatter",
    "all_reduce",
)
LINKS = ("intra_node", "inter_node")

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
_QUANT_BYTES = {"qwz": 1.0, "qgz": 0.5}  # int8 weights, int4 gradients


def _positive_int(name: str, value, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 1:
        raise ValueError(f"{name} must be a positive whole number (for example {example}); got {value!r}.")
    if int(value) != value:
        raise ValueError(f"{name} must be a whole number (for example {example}); got {value!r}.")
    return int(value)


def _positive_float(name: str, value, example: str, upper: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value <= 0:
        raise ValueError(f"{name} must be a positive number (for example {example}); got {value!r}.")
    if upper is not None and value > upper:
        raise ValueError(f"{name} must be at most {upper:g} (for example {example}); got {value!r}.")
    return float(value)


def _choice(name: str, value, options: Sequence[str]) -> str:
    if value not in options:
        raise ValueError(f"{name} {value!r} is not known; use one of {', '.join(options)}.")
    return value


def _link(span: int, gpus_per_node: int) -> str:
    """Which link a ring over `span` consecutive ranks crosses (groups are assumed to start on a node boundary)."""
    return "intra_node" if span <= gpus_per_node else "inter_node"


def _term(name, key, kind, phase, payload_bytes, group, link, strided=False) -> dict:
    return {
        "name": name,
        "key": key,
        "collective": kind,
        "phase": phase,
        "group_size": group,
        "link": link,
        "payload_bytes": int(payload_bytes),
        "wire_bytes": collective_wire_bytes(kind, int(payload_bytes), group),
        "strided_groups": strided,  # HSDP's replicate groups: one rank from each shard group
    }


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


def plan(
    params: float,
    world_size: int,
    strategy: str = "zero3",
    *,
    group_size: int | None = None,
    gpus_per_node: int = 8,
    precision: str = "bf16_mixed",
    offload_optimizer: str = "none",
    offload_params: str = "none",
    reshard_after_forward: bool = True,
    prefetch: bool = True,
    qwz: bool = False,
    hpz: bool = False,
    qgz: bool = False,
    quant_block_elems: int | None = None,
    largest_layer_params: int = 0,
    layers: int = 32,
    tokens_per_rank: float = 16384,
    peak_tflops: float = 989.0,
    mfu: float = 0.4,
    link_gbytes: float = 50.0,
    intra_gbytes: float = 450.0,
    host_gbytes: float = 25.0,
    nvme_gbytes: float = 5.0,
    accounting: str = "paper",
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> dict:
    """Memory, traffic and time of one training step per rank, for `params` parameters on `world_size` ranks.

    Units: bytes (1 GB = 1e9 B), seconds, GB/s for bandwidths, TFLOP/s for `peak_tflops`.

    strategy: `ddp` (everything replicated), `zero1` (optimizer state sharded), `zero2` (+ gradients),
      `zero3` (+ weights), `hsdp` (zero3 inside shard groups of `group_size` ranks, replicated across the
      world_size / group_size groups; default group: one node, `gpus_per_node`).
    precision: a key of `PRECISIONS` (bytes per parameter of each state term); collectives move weights
      and gradients at their training precision.
    offload_optimizer / offload_params: "none", "cpu" or "nvme". The optimizer offload moves master, Adam m
      and v off the GPU, and the gradient shard too for zero2/zero3/hsdp (it streams to the host as it is
      reduced); the host keeps that shard as fp32. The params offload (zero3/hsdp only) moves the weight shard.
    reshard_after_forward=False keeps gathered weights from forward to backward (no backward all-gather).
    prefetch: one-layer-ahead all-gathers (the overlap model is `_overlap_exposed_s`); the result carries the
      exposed comm both ways.
    qwz / hpz / qgz: ZeRO++ (zero3 only): int8 forward all-gather (+ one fp32 scale per
      `quant_block_elems` elements if given), backward all-gather inside the node from a secondary weight
      copy sharded over `gpus_per_node`, int4 gradient reduce-scatter.
    largest_layer_params: parameters of the largest layer, for the gathered-buffer (transient) term.
    layers: how many equal layers the overlap model splits compute and comm into.
    compute: 6 x params x tokens_per_rank FLOP at peak_tflops x mfu.
    link_gbytes: each rank's inter-node bandwidth (its NIC); intra_gbytes: within a node (NVLink).
    Links: `traffic_bytes_by_link` files each term's per-rank bytes under the slowest link its ring
      crosses (what paces it: a ring that spans nodes runs at NIC speed). `ring_bytes_all_ranks_by_link`
      (and each term's `ring_bytes_all_ranks`) counts the bytes actually sent on each kind of link, summed
      over all ranks, with rank r on node r // gpus_per_node and the ring rule of `ring_link_bytes`: the
      figure `labkit compare` measures as `comm_by_link`.
    accounting: "paper" (the terms above) or "deepspeed" (DeepSpeed's estimator: `deepspeed_zero_estimate`;
      zero2/zero3 only); the other keys are the same either way.

    Raises ValueError with one sentence naming the argument when an input is impossible.
    """
    n_params = _positive_int(
        "params", round(params) if isinstance(params, float) and params >= 1 else params, "30e9"
    )
    n = _positive_int("world_size", world_size, "256")
    strategy = _choice("strategy", strategy, STRATEGIES)
    gpn = _positive_int("gpus_per_node", gpus_per_node, "8")
    bytes_of = PRECISIONS[_choice("precision", precision, tuple(PRECISIONS))]
    _choice("offload_optimizer", offload_optimizer, OFFLOAD_TARGETS)
    _choice("offload_params", offload_params, OFFLOAD_TARGETS)
    _choice("accounting", accounting, ("paper", "deepspeed"))
    layers = _positive_int("layers", layers, "32")
    tokens = _positive_float("tokens_per_rank", tokens_per_rank, "16384")
    peak = _positive_float("peak_tflops", peak_tflops, "989")
    mfu = _positive_float("mfu", mfu, "0.4", upper=1.0)
    bandwidth = {
        "inter_node": _positive_float("link_gbytes", link_gbytes, "50") * 1e9,
        "intra_node": _positive_float("intra_gbytes", intra_gbytes, "450") * 1e9,
    }
    host_bw = _positive_float("host_gbytes", host_gbytes, "25") * 1e9
    nvme_bw = _positive_float("nvme_gbytes", nvme_gbytes, "5") * 1e9
    largest = int(largest_layer_params)
    if largest < 0 or largest > n_params:
        raise ValueError(
            f"largest_layer_params must be between 0 and params={n_params}; got {largest_layer_params!r}."
        )
    if group_size is not None:
        group_size = _positive_int("group_size", group_size, "8")
        if n % group_size:
            divisors = [d for d in (gpn, 8, 4, 2, 1) if n % d == 0 and d <= n]
            raise ValueError(
                f"group_size={group_size} does not divide world_size={n}; pass a divisor such as {divisors[0]}."
            )
    if strategy == "hsdp":
        g = group_size if group_size is not None else min(gpn, n)
        if n % g:
            raise ValueError(
                f"hsdp needs a group_size that divides world_size={n}; the default {g} does not, pass one."
            )
    else:
        g = n
    zeropp = [name for name, on in (("qwz", qwz), ("hpz", hpz), ("qgz", qgz)) if on]
    if zeropp and strategy != "zero3":
        raise ValueError(f"{', '.join(zeropp)} (ZeRO++) apply to strategy zero3; got strategy={strategy!r}.")
    if offload_params != "none" and strategy not in ("zero3", "hsdp"):
        raise ValueError(
            f"offload_params needs sharded weights (strategy zero3 or hsdp); got strategy={strategy!r}."
        )
    if offload_optimizer != "none" and strategy == "ddp":
        raise ValueError(
            "offload_optimizer needs a ZeRO strategy (zero1, zero2, zero3 or hsdp); got strategy='ddp'."
        )
    if quant_block_elems is not None:
        quant_block_elems = _positive_int("quant_block_elems", quant_block_elems, "2048")
    if accounting == "deepspeed" and strategy not in ("zero2", "zero3"):
        raise ValueError(
            f"accounting='deepspeed' follows DeepSpeed's ZeRO-2/3 estimators; use strategy zero2 or zero3, not {strategy!r}."
        )

    # ---- memory: each term is replicated or split over `shard` ranks (flat padding to a multiple of it)
    shard = {t: (g if t in _SHARDED_TERMS[strategy] else 1) for t in MEMORY_TERMS}
    elems = {t: padded_flat_numel(n_params, shard[t]) // shard[t] for t in MEMORY_TERMS}
    resident = {t: int(elems[t] * bytes_of[t]) for t in MEMORY_TERMS}
    gpu = dict(resident)
    host = dict.fromkeys(MEMORY_TERMS, 0)
    nvme = dict.fromkeys(MEMORY_TERMS, 0)
    moved = []
    if offload_optimizer != "none":
        moved += [(t, offload_optimizer) for t in _OPTIMIZER_TERMS]
        if shard["grads"] > 1:
            moved.append(("grads", "cpu"))
    if offload_params != "none":
        moved.append(("weights", offload_params))
    for t, target in moved:
        gpu[t] = 0
        size = elems[t] * _HOST_GRAD_BYTES if t == "grads" else resident[t]
        (host if target == "cpu" else nvme)[t] = size

    bytes_per_param = sum(bytes_of.values())
    static_bytes_total = int(n_params * bytes_per_param)
    replication = {t: n // shard[t] for t in MEMORY_TERMS}

    # ---- traffic: one dict per collective a rank takes part in each step
    w_b, g_b = bytes_of["weights"], bytes_of["grads"]
    flat = padded_flat_numel(n_params, n)
    terms: list[dict] = []
    if strategy == "ddp":
        terms.append(
            _term("gradient all-reduce", "all_reduce", "all_reduce", "backward", flat * g_b, n, _link(n, gpn))
        )
    elif strategy in ("zero1", "zero2"):
        terms.append(
            _term(
                "gradient reduce-scatter",
                "reduce_scatter",
                "reduce_scatter",
                "backward",
                flat * g_b,
                n,
                _link(n, gpn),
            )
        )
        terms.append(
            _term(
                "all-gather of updated weights",
                "all_gather_after_step",
                "all_gather",
                "step",
                flat * w_b,
                n,
                _link(n, gpn),
            )
        )
    else:
        group_link = "intra_node" if (g <= gpn and gpn % g == 0) or n <= gpn else "inter_node"
        gflat = padded_flat_numel(n_params, g)
        fwd_payload = gflat * w_b
        if qwz:
            fwd_payload = gflat * _QUANT_BYTES["qwz"]
            if quant_block_elems:
                fwd_payload += -(-gflat // quant_block_elems) * _SCALE_BYTES
        terms.append(
            _term(
                "forward all-gather of weights" + (" (qwZ int8)" if qwz else ""),
                "all_gather_forward",
                "all_gather",
                "forward",
                fwd_payload,
                g,
                group_link,
            )
        )
        if reshard_after_forward:
            if hpz:
                h = min(gpn, n)
                terms.append(
                    _term(
                        "backward all-gather from the node's secondary copy (hpZ)",
                        "all_gather_backward",
                        "all_gather",
                        "backward",
                        padded_flat_numel(n_params, h) * w_b,
                        h,
                        "intra_node",
                    )
                )
            else:
                terms.append(
                    _term(
                        "backward all-gather of weights",
                        "all_gather_backward",
                        "all_gather",
                        "backward",
                        gflat * w_b,
                        g,
                        group_link,
                    )
                )
        rs_payload = gflat * g_b
        if qgz:
            rs_payload = gflat * _QUANT_BYTES["qgz"]
            if quant_block_elems:
                rs_payload += -(-gflat // quant_block_elems) * _SCALE_BYTES
        terms.append(
            _term(
                "gradient reduce-scatter" + (" (qgZ int4)" if qgz else ""),
                "reduce_scatter",
                "reduce_scatter",
                "backward",
                rs_payload,
                g,
                group_link,
            )
        )
        if strategy == "hsdp":
            replicas = n // g
            terms.append(
                _term(
                    f"all-reduce of gradient shards across {replicas} groups",
                    "all_reduce",
                    "all_reduce",
                    "backward",
                    elems["grads"] * g_b,
                    replicas,
                    _link(n, gpn),
                    strided=True,
                )
            )

    traffic_by_collective = dict.fromkeys(TRAFFIC_KEYS, 0)
    traffic_by_link = dict.fromkeys(LINKS, 0)
    ring_by_link = dict.fromkeys(LINKS, 0)
    for t in terms:
        strided = t.pop("strided_groups")
        t["ring_bytes_all_ranks"] = _ring_bytes_all_ranks(
            t["collective"], t["payload_bytes"], n, t["group_size"], gpn, strided
        )
        for link in LINKS:
            ring_by_link[link] += t["ring_bytes_all_ranks"][link]
    comm_time_by_link = dict.fromkeys(LINKS, 0.0)
    comm_s_by_phase = {"forward": 0.0, "backward_gather": 0.0, "backward_reduce": 0.0, "step": 0.0}
    for t in terms:
        traffic_by_collective[t["key"]] += t["wire_bytes"]
        traffic_by_link[t["link"]] += t["wire_bytes"]
        t["time_s"] = t["wire_bytes"] / bandwidth[t["link"]]
        comm_time_by_link[t["link"]] += t["time_s"]
        phase = (
            t["phase"]
            if t["phase"] != "backward"
            else ("backward_gather" if t["collective"] == "all_gather" else "backward_reduce")
        )
        comm_s_by_phase[phase] += t["time_s"]
    traffic = sum(traffic_by_collective.values())
    traffic_large_n = sum(
        t["payload_bytes"] * (2 if t["collective"] == "all_reduce" else 1)
        for t in terms
        if t["group_size"] > 1
    )

    # ---- offload traffic over PCIe and to NVMe, per rank per step
    host_io = nvme_io = 0
    if offload_optimizer != "none":
        sh = elems["master"]
        grad_shard = elems["grads"] if shard["grads"] > 1 else sh
        host_io += grad_shard * g_b + sh * w_b  # gradient shard down, updated weight shard back up
        if offload_optimizer == "nvme":
            nvme_io += 2 * sum(resident[t] for t in _OPTIMIZER_TERMS)  # read and write back master, m, v
    if offload_params != "none":
        host_io += 2 * resident["weights"]  # the shard goes up for the forward and the backward all-gather
        if offload_params == "nvme":
            nvme_io += 3 * resident["weights"]  # two reads, one write of the updated shard
    offload_time_s = host_io / host_bw + nvme_io / nvme_bw

    # ---- time
    flops = 6.0 * n_params * tokens
    compute_time_s = flops / (peak * 1e12 * mfu)
    fwd_k, bwd_k = compute_time_s / 3, 2 * compute_time_s / 3
    comm_time_s = sum(comm_time_by_link.values())
    reduce_hidden = _overlap_exposed_s(comm_s_by_phase["backward_reduce"], bwd_k, layers)
    exposed_prefetch = (
        _overlap_exposed_s(comm_s_by_phase["forward"], fwd_k, layers)
        + _overlap_exposed_s(
            comm_s_by_phase["backward_gather"] + comm_s_by_phase["backward_reduce"], bwd_k, layers
        )
        + comm_s_by_phase["step"]
    )
    exposed_no_prefetch = (
        comm_s_by_phase["forward"]
        + comm_s_by_phase["backward_gather"]
        + reduce_hidden
        + comm_s_by_phase["step"]
    )
    exposed = exposed_prefetch if prefetch else exposed_no_prefetch

    # ---- transient buffers on the GPU (gathered layers, weights kept for backward)
    transient = {
        "gathered_weights": 0,
        "unsharded_layer_grads": 0,
        "weights_kept_for_backward": 0,
        "hpz_secondary_weights": 0,
    }
    if strategy in ("zero3", "hsdp"):
        transient["gathered_weights"] = int((2 if prefetch else 1) * largest * w_b)
        transient["unsharded_layer_grads"] = int(largest * g_b)
        if not reshard_after_forward:
            transient["weights_kept_for_backward"] = int(n_params * w_b) - resident["weights"]
        if hpz:
            transient["hpz_secondary_weights"] = int(
                padded_flat_numel(n_params, min(gpn, n)) // min(gpn, n) * w_b
            )

    state_bytes_per_rank = sum(gpu.values())
    result = {
        "params": n_params,
        "world_size": n,
        "strategy": strategy,
        "group_size": g,
        "replica_groups": n // g,
        "gpus_per_node": gpn,
        "nodes": -(-n // gpn),
        "precision": precision,
        "bytes_per_param": bytes_per_param,
        "accounting": accounting,
        "static_bytes_total": static_bytes_total,
        "state_bytes_per_rank": state_bytes_per_rank,
        "state_fraction_per_rank": state_bytes_per_rank / static_bytes_total,
        "memory_bytes_per_rank": gpu,
        "shard_ways": shard,
        "copies_in_cluster": replication,
        "state_bytes_all_ranks": state_bytes_per_rank * n,
        "host_bytes_per_rank": host,
        "nvme_bytes_per_rank": nvme,
        "host_bytes_total": sum(host.values()) * n,
        "nvme_bytes_total": sum(nvme.values()) * n,
        "transient_bytes_per_rank": transient,
        "gpu_bytes_per_rank": state_bytes_per_rank + sum(transient.values()),
        "traffic_bytes_per_rank": traffic,
        "traffic_bytes_per_rank_large_n": traffic_large_n,
        "traffic_bytes_by_collective": traffic_by_collective,
        "traffic_bytes_by_link": traffic_by_link,
        "ring_bytes_all_ranks_by_link": ring_by_link,
        "traffic_terms": terms,
        "host_io_bytes_per_rank": host_io,
        "nvme_io_bytes_per_rank": nvme_io,
        "flops_per_rank": flops,
        "compute_time_s": compute_time_s,
        "comm_time_s": comm_time_s,
        "comm_time_by_link_s": comm_time_by_link,
        "comm_to_compute": comm_time_s / compute_time_s,
        "exposed_comm_s": exposed,
        "exposed_comm_prefetch_s": exposed_prefetch,
        "exposed_comm_no_prefetch_s": exposed_no_prefetch,
        "offload_time_s": offload_time_s,
        "step_time_s": compute_time_s + exposed + offload_time_s,
        "options": {
            "reshard_after_forward": bool(reshard_after_forward),
            "prefetch": bool(prefetch),
            "qwz": bool(qwz),
            "hpz": bool(hpz),
            "qgz": bool(qgz),
            "quant_block_elems": quant_block_elems,
            "offload_optimizer": offload_optimizer,
            "offload_params": offload_params,
            "largest_layer_params": largest,
            "layers": layers,
            "tokens_per_rank": tokens,
            "peak_tflops": peak,
            "mfu": mfu,
            "link_gbytes": link_gbytes,
            "intra_gbytes": intra_gbytes,
            "host_gbytes": host_gbytes,
            "nvme_gbytes": nvme_gbytes,
        },
    }
    if accounting == "deepspeed":
        result.update(
            _deepspeed_accounting(
                result, strategy, offload_optimizer, offload_params, zero_init, additional_buffer_factor
            )
        )
    return result


def _deepspeed_accounting(
    result: dict,
    strategy: str,
    offload_optimizer: str,
    offload_params: str,
    zero_init: bool,
    buffer_factor: float,
) -> dict:
    n, gpn, n_params = result["world_size"], result["gpus_per_node"], result["params"]
    per_node, nodes = (gpn, n // gpn) if n >= gpn else (n, 1)
    if per_node * nodes != n:
        raise ValueError(
            f"accounting='deepspeed' needs whole nodes: world_size={n} is not a multiple of gpus_per_node={gpn}."
        )
    if "nvme" in (offload_optimizer, offload_params):
        raise ValueError(
            "accounting='deepspeed' covers offload to cpu only (DeepSpeed's estimator has no NVMe case); pass 'cpu' or 'none'."
        )
    stage = 3 if strategy == "zero3" else 2
    est = deepspeed_zero_estimate(
        n_params,
        result["options"]["largest_layer_params"],
        stage=stage,
        num_gpus_per_node=per_node,
        num_nodes=nodes,
        cpu_offload=offload_optimizer == "cpu",
        cpu_offload_params=offload_params == "cpu",
        zero_init=zero_init,
        additional_buffer_factor=buffer_factor,
    )
    # DeepSpeed's itemisation of its 18 B/param (its ZeRO-2 source comment), sharded over all GPUs.
    itemised = {
        "grads": 2 * n_params // n,
        "grads_fp32": 4 * n_params // n,
        "master": 4 * n_params // n,
        "adam_m": 4 * n_params // n,
        "adam_v": 4 * n_params // n,
    }
    if offload_optimizer == "cpu":
        itemised = dict.fromkeys(itemised, 0)
        if stage == 3 and offload_params == "none":
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
        "paper_state_bytes_per_rank": result["state_bytes_per_rank"],
    }


def format_bytes(n_bytes: float) -> str:
    """`n_bytes` in decimal units with four significant digits: 1875000000 -> '1.875 GB'."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:.4g} {unit}"
    return f"{n_bytes:.0f} B"


def summary_rows(result: dict) -> list[tuple[str, str, str]]:
    """The numbers of a `plan()` result as (section, quantity, value) rows, for tables in the CLI and widgets."""
    rows = []
    mem = result["memory_bytes_per_rank"]
    for term, value in mem.items():
        rows.append(("memory per rank", term, format_bytes(value)))
    rows.append(("memory per rank", "state total", format_bytes(result["state_bytes_per_rank"])))
    if "state_gib_per_rank" in result:
        rows.append(
            ("memory per rank", "state total (GiB, DeepSpeed)", f"{result['state_gib_per_rank']:.2f} GiB")
        )
    transient = sum(result["transient_bytes_per_rank"].values())
    if transient:
        rows.append(("memory per rank", "transient buffers", format_bytes(transient)))
    for where in ("host", "nvme"):
        held = sum(result[f"{where}_bytes_per_rank"].values())
        if held:
            rows.append(("memory per rank", f"on {where} (offloaded)", format_bytes(held)))
    rows.append(("memory per rank", "whole model's state, once", format_bytes(result["static_bytes_total"])))
    copies = result["copies_in_cluster"]["weights"]
    rows.append(("memory per rank", "copies of the weights in the cluster", f"{copies}"))
    for t in result["traffic_terms"]:
        where = "intra-node" if t["link"] == "intra_node" else "inter-node"
        rows.append(
            (
                "traffic per rank per step",
                f"{t['name']} ({t['group_size']} ranks, {where})",
                format_bytes(t["wire_bytes"]),
            )
        )
    rows.append(("traffic per rank per step", "total", format_bytes(result["traffic_bytes_per_rank"])))
    rows.append(
        (
            "traffic per rank per step",
            "total as n grows (no (n-1)/n)",
            format_bytes(result["traffic_bytes_per_rank_large_n"]),
        )
    )
    for link, value in result["traffic_bytes_by_link"].items():
        rows.append(("traffic per rank per step", f"on {link.replace('_', '-')} links", format_bytes(value)))
    if result["host_io_bytes_per_rank"] or result["nvme_io_bytes_per_rank"]:
        rows.append(
            (
                "traffic per rank per step",
                "to/from host (PCIe)",
                format_bytes(result["host_io_bytes_per_rank"]),
            )
        )
        rows.append(
            ("traffic per rank per step", "to/from NVMe", format_bytes(result["nvme_io_bytes_per_rank"]))
        )
    rows.append(("time per step", "compute", f"{result['compute_time_s']:.3f} s"))
    rows.append(("time per step", "communication (serial)", f"{result['comm_time_s']:.3f} s"))
    rows.append(
        ("time per step", "exposed comm, one-layer prefetch", f"{result['exposed_comm_prefetch_s']:.3f} s")
    )
    rows.append(
        ("time per step", "exposed comm, no prefetch", f"{result['exposed_comm_no_prefetch_s']:.3f} s")
    )
    if result["offload_time_s"]:
        rows.append(("time per step", "offload transfers", f"{result['offload_time_s']:.3f} s"))
    rows.append(("time per step", "step", f"{result['step_time_s']:.3f} s"))
    return rows
