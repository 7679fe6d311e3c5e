"""One rank's memory: the five state terms (sharded or replicated, on GPU, host or NVMe), the transient
buffers of zero3/hsdp, and the verdict on whether a rank fits its GPU and a node's offload its RAM.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from labkit.names import DATA_PARALLEL, HSDP, NVME, WEIGHTS_SHARDED, ZERO1, ZERO2, ZERO3

from .inputs import MEMORY_TERMS, PRECISIONS, PlanInputs
from .quantities import format_bytes
from .ring import padded_flat_numel

_SHARDED_TERMS = {
    DATA_PARALLEL: (),
    ZERO1: ("master", "adam_m", "adam_v"),
    ZERO2: ("grads", "master", "adam_m", "adam_v"),
    ZERO3: MEMORY_TERMS,
    HSDP: MEMORY_TERMS,
}
_OPTIMIZER_TERMS = ("master", "adam_m", "adam_v")
_HOST_GRAD_BYTES = 4  # the CPU optimizer works on an fp32 copy of the gradient shard


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
    if p.strategy in WEIGHTS_SHARDED:
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


# ---- does it fit? ----------------------------------------------------------------------------------------


def host_bytes_per_node(p: PlanInputs, mem: Memory) -> int:
    """Host RAM one node needs for its ranks' offloaded state (bytes): the ranks of a node share it."""
    return sum(mem.host.values()) * min(p.gpus_per_node, p.world_size)


def _to_nvme(p: PlanInputs) -> PlanInputs:
    """The same plan with every host offload sent to NVMe instead (what is left in host RAM then)."""
    swap = {name: NVME for name in ("offload_optimizer", "offload_params") if getattr(p, name) == "cpu"}
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
