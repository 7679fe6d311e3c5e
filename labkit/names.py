"""The lab's shared names, each spelled once: every other module imports them from here.

Collective kinds say what a collective does, whatever torch function runs it (`labkit.collectives` maps
the functions onto them); the probes' records, the budget's terms and the tables are keyed by them.
Strategies are `labkit.budget`'s ways of splitting the training state over ranks: replicas (DDP), ZeRO's
three stages, and HSDP (ZeRO-3 inside a group, replicas across groups). Offload targets are where a
sharded engine may keep its state. Engine names are `labkit.engines.registry`'s.
"""

from __future__ import annotations

ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, BROADCAST = "all_gather", "reduce_scatter", "all_reduce", "broadcast"
STEP_KINDS = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE)  # what a data-parallel training step runs
RING_KINDS = (*STEP_KINDS, BROADCAST)  # the kinds `labkit.budget.ring` has a ring formula for

DATA_PARALLEL, ZERO1, ZERO2, ZERO3, HSDP = "ddp", "zero1", "zero2", "zero3", "hsdp"
STRATEGIES = (DATA_PARALLEL, ZERO1, ZERO2, ZERO3, HSDP)
WEIGHTS_SHARDED = (ZERO3, HSDP)  # the strategies that shard the weights (and gather them to compute)

NO_OFFLOAD, HOST, NVME = "none", "cpu", "nvme"
OFFLOAD_TARGETS = (NO_OFFLOAD, HOST, NVME)
