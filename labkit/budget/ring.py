"""Ring arithmetic on one tensor: the wire bytes of a collective and the padding of a sharded tensor.

The probes predict what they measure with these; `plan()` applies them to the whole model.
"""

from __future__ import annotations

from collections.abc import Sequence

from labkit.names import ALL_REDUCE, RING_KINDS


def collective_wire_bytes(kind: str, payload_bytes: int, world_size: int) -> int:
    """Bytes one rank sends for one collective in a bandwidth-optimal ring of `world_size` ranks.

    `payload_bytes` is the full tensor: the gathered output of an all-gather, the unreduced input of a
    reduce-scatter or all-reduce, the tensor a broadcast delivers. A ring moves it in `world_size` chunks:
    all-gather and reduce-scatter send (n-1)/n x payload per rank, all-reduce (a reduce-scatter then an
    all-gather) 2(n-1)/n x payload. A broadcast is counted as a pipelined chain: every rank but the last
    forwards the whole tensor once, so the mean per rank is (n-1)/n x payload. Results are rounded down to
    whole bytes (exact whenever n divides the payload, as it does for a padded shard). One rank sends 0.
    """
    if kind not in RING_KINDS:
        raise ValueError(
            f"collective kind {kind!r} has no ring formula here; use one of {', '.join(RING_KINDS)}."
        )
    n = int(world_size)
    if n < 1:
        raise ValueError(f"world_size must be a positive number of ranks; got {world_size!r}.")
    payload = int(payload_bytes)
    if payload < 0:
        raise ValueError(f"payload_bytes must be zero or more; got {payload_bytes!r}.")
    factor = 2 if kind == ALL_REDUCE else 1
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


def ring_bytes_all_ranks(kind: str, payload_bytes: int, n: int, size: int, gpn: int, strided: bool) -> dict:
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
