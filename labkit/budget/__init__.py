"""Closed-form arithmetic of data parallelism: state bytes per rank, bytes per collective per step, step time.

`plan(params, world_size, strategy, **options)` is the one entry point (`planner`): it checks its inputs into
a `PlanInputs` (`inputs`: the one place of their units, defaults and checks; the CLI flags and the
calculator's controls are made from it), then composes `memory_terms` (`memory`), `activation_bytes`
(`activations`), `traffic_terms` (`traffic`: typed `Term`s from the `STEP_COLLECTIVES` table) and
`step_time` (`timing`), priced on a calibrated `machine` when given. `ring` is the same arithmetic applied
to one tensor (`collective_wire_bytes`, `padded_numel`, ...), so the probes can predict what they measure;
`search` asks many plans (`fewest_ranks`), `roofline` the tokens per rank above which prefetch hides the
link (`critical_tokens`, `largest_useful_world_size`), `rows` reads one plan as text, `quantities` parses
and prints sizes, `deepspeed_estimator` restates DeepSpeed's own estimate. Imports point one way: ring,
quantities, machine <- inputs <- memory, activations, traffic <- timing <- planner <- search <- roofline.
Pure Python: no torch, no numpy.
Bytes are bytes (1 GB = 1e9 B), times are seconds; docs/budget.md states every formula in prose.
"""

from .activations import ACTIVATION_PARTS, activation_bytes, activation_elem_bytes, layer_activation_bytes
from .deepspeed_estimator import deepspeed_zero_estimate
from .inputs import (
    ACCOUNTINGS,
    DEFAULTS,
    HOST_ADAM_PARAMS_PER_S,
    INPUTS,
    MEMORY_TERMS,
    OFFLOAD_TARGETS,
    PRECISIONS,
    STRATEGIES,
    Input,
    PlanInputs,
)
from .machine import (
    COLLECTIVE_FIT_KEYS,
    MACHINE_KEYS,
    check_machine_profile,
    load_machine_profile,
    machine_collective_s,
    machine_flops_per_s,
    machine_summary,
    machine_sync_s,
)
from .memory import Memory, fit_verdict, host_bytes_per_node, memory_terms, transient_bytes
from .planner import model_options, plan
from .quantities import format_bytes, format_count, parse_quantity
from .ring import (
    collective_wire_bytes,
    padded_flat_numel,
    padded_numel,
    padded_rows,
    ring_link_bytes,
    shard_numel,
    shard_rows,
)
from .roofline import closed_form_critical_tokens, critical_tokens, largest_useful_world_size
from .rows import assumption_rows, summary_rows
from .search import MAX_RANKS, fewest_ranks, needs_offload
from .timing import (
    UnitCost,
    collective_time_s,
    exposed_floor,
    gathered_peak_bytes,
    host_optimizer_time_s,
    model_flops_utilisation,
    offload_io_bytes,
    step_time,
)
from .traffic import (
    DDP_BUCKET_BYTES,
    LINKS,
    STEP_COLLECTIVES,
    TRAFFIC_KEYS,
    StepCollective,
    Term,
    quantised_payload_bytes,
    traffic_terms,
)

__all__ = [
    # the entry point and the searches over it
    "plan",
    "model_options",
    "fewest_ranks",
    "needs_offload",
    "MAX_RANKS",
    # when the link stops hiding behind compute
    "critical_tokens",
    "closed_form_critical_tokens",
    "largest_useful_world_size",
    # the inputs
    "PlanInputs",
    "Input",
    "INPUTS",
    "DEFAULTS",
    "STRATEGIES",
    "MEMORY_TERMS",
    "PRECISIONS",
    "OFFLOAD_TARGETS",
    "ACCOUNTINGS",
    "HOST_ADAM_PARAMS_PER_S",
    # one tensor in a ring
    "collective_wire_bytes",
    "ring_link_bytes",
    "shard_rows",
    "padded_rows",
    "padded_numel",
    "shard_numel",
    "padded_flat_numel",
    # memory
    "Memory",
    "memory_terms",
    "transient_bytes",
    "host_bytes_per_node",
    "fit_verdict",
    # activations
    "ACTIVATION_PARTS",
    "activation_elem_bytes",
    "layer_activation_bytes",
    "activation_bytes",
    # traffic
    "TRAFFIC_KEYS",
    "LINKS",
    "DDP_BUCKET_BYTES",
    "StepCollective",
    "STEP_COLLECTIVES",
    "Term",
    "quantised_payload_bytes",
    "traffic_terms",
    # time
    "offload_io_bytes",
    "UnitCost",
    "exposed_floor",
    "collective_time_s",
    "gathered_peak_bytes",
    "host_optimizer_time_s",
    "step_time",
    "model_flops_utilisation",
    # a calibrated machine
    "MACHINE_KEYS",
    "COLLECTIVE_FIT_KEYS",
    "check_machine_profile",
    "load_machine_profile",
    "machine_flops_per_s",
    "machine_collective_s",
    "machine_summary",
    "machine_sync_s",
    # DeepSpeed's estimator
    "deepspeed_zero_estimate",
    # reading and writing sizes, reading a plan
    "parse_quantity",
    "format_bytes",
    "format_count",
    "summary_rows",
    "assumption_rows",
]
