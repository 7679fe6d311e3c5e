"""The collectives of one step (`STEP_COLLECTIVES`), each priced as a typed `Term` in wire bytes and seconds,
with the options applied: no reshard, ZeRO++'s hpZ and its quantised qwZ / qgZ payloads.
"""

from __future__ import annotations

from typing import NamedTuple

from labkit.names import ALL_GATHER, ALL_REDUCE, DATA_PARALLEL, HSDP, REDUCE_SCATTER, ZERO1, ZERO2, ZERO3

from .inputs import PRECISIONS, PlanInputs
from .machine import machine_collective_s
from .ring import collective_wire_bytes, padded_flat_numel, ring_bytes_all_ranks

TRAFFIC_KEYS = (
    "all_gather_forward",
    "all_gather_backward",
    "all_gather_after_step",
    REDUCE_SCATTER,
    ALL_REDUCE,
)
LINKS = ("intra_node", "inter_node")
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb: one all-reduce per 25 MiB of gradients


_SCALE_BYTES = 4  # one fp32 scale per quantization block (ZeRO++ qwZ / qgZ)
# ZeRO++ switch -> (bytes per element on the wire, what the term's name adds): int8 weights, int4 gradients
_QUANTISED = {"qwz": (1.0, " (qwZ int8)"), "qgz": (0.5, " (qgZ int4)")}


class StepCollective(NamedTuple):
    """One collective of a strategy's step, as the table below names it."""

    key: str  # its entry in TRAFFIC_KEYS
    name: str
    kind: str  # a collective kind (`labkit.names`)
    phase: str  # "forward", "backward" or "step"
    moves: str  # "weights" or "grads": whose bytes per element it moves
    over: str  # "group" (the shard group; every rank unless hsdp), "node" (hpZ) or "replicas" (hsdp)
    quantised_by: str = ""  # the ZeRO++ switch that quantises it


_GATHER_FORWARD = StepCollective(
    "all_gather_forward",
    "forward all-gather of weights",
    ALL_GATHER,
    "forward",
    "weights",
    "group",
    quantised_by="qwz",
)
_GATHER_BACKWARD = StepCollective(
    "all_gather_backward",
    "backward all-gather of weights",
    ALL_GATHER,
    "backward",
    "weights",
    "group",
    quantised_by="qwz",
)
_GATHER_BACKWARD_HPZ = StepCollective(
    "all_gather_backward",
    "backward all-gather from the node's secondary copy (hpZ)",
    ALL_GATHER,
    "backward",
    "weights",
    "node",
    quantised_by="qwz",
)
_REDUCE_SCATTER = StepCollective(
    REDUCE_SCATTER,
    "gradient reduce-scatter",
    REDUCE_SCATTER,
    "backward",
    "grads",
    "group",
    quantised_by="qgz",
)
_GATHER_AFTER_STEP = StepCollective(
    "all_gather_after_step", "all-gather of updated weights", ALL_GATHER, "step", "weights", "group"
)
_ALL_REDUCE = StepCollective(ALL_REDUCE, "gradient all-reduce", ALL_REDUCE, "backward", "grads", "group")
_REPLICA_ALL_REDUCE = StepCollective(
    ALL_REDUCE,
    "all-reduce of gradient shards across {replicas} groups",
    ALL_REDUCE,
    "backward",
    "grads",
    "replicas",
)

# strategy -> the collectives one rank takes part in each step, in the order they run. The options change
# them in `traffic_terms`: reshard_after_forward=False drops the backward all-gather, hpZ swaps it for
# _GATHER_BACKWARD_HPZ, qwZ / qgZ quantise the collectives marked `quantised_by`.
# qwZ marks every weight all-gather, as DeepSpeed 0.19.8 does: `PartitionedParameterCoordinator.__all_gather_params`
# passes `quantize=self.zero_quantized_weights` whatever its `forward` flag, and the hpZ gather from the secondary
# copy quantises too (the `all_gather_coalesced` of `Init._convert_to_deepspeed_param`). The ZeRO++ paper (Wang et al. 2023, arXiv 2306.10209) counts
# qwZ on the forward all-gather only, because there hpZ already keeps the backward one inside the node: alone,
# qwZ halves both gathers (3 M -> 2 M cross-node, 1.5x); with hpZ and qgZ the cross-node bytes are the paper's.
STEP_COLLECTIVES: dict[str, tuple[StepCollective, ...]] = {
    DATA_PARALLEL: (_ALL_REDUCE,),
    ZERO1: (_REDUCE_SCATTER, _GATHER_AFTER_STEP),
    ZERO2: (_REDUCE_SCATTER, _GATHER_AFTER_STEP),
    ZERO3: (_GATHER_FORWARD, _GATHER_BACKWARD, _REDUCE_SCATTER),
    HSDP: (_GATHER_FORWARD, _GATHER_BACKWARD, _REDUCE_SCATTER, _REPLICA_ALL_REDUCE),
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
        ring = ring_bytes_all_ranks(c.kind, payload, p.world_size, size, p.gpus_per_node, strided)
        calls = -(-payload // DDP_BUCKET_BYTES) if p.strategy == DATA_PARALLEL else p.layers + p.root_units
        backend_s = machine_collective_s(machine, c.kind, size, wire, calls) if machine and size > 1 else 0.0
        link_s = wire / bandwidth[link]
        terms.append(
            Term(
                name,
                c.key,
                c.kind,
                c.phase,
                size,
                link,
                payload,
                wire,
                ring,
                calls,
                backend_s,
                max(link_s, backend_s),
            )
        )
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
            t.payload_bytes * (2 if t.collective == ALL_REDUCE else 1) for t in terms if t.group_size > 1
        ),
        "traffic_bytes_by_collective": by_collective,
        "traffic_bytes_by_link": by_link,
        "ring_bytes_all_ranks_by_link": ring_by_link,
        "traffic_terms": [t._asdict() for t in terms],
    }
