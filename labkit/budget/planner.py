"""`plan()`: the one entry point. It checks its inputs into a `PlanInputs`, then composes memory, traffic,
activations, step time and the fit verdict into one dict; `model_options` reads a model's shape.
"""

from __future__ import annotations

from .activations import activation_bytes
from .deepspeed_estimator import _deepspeed_accounting
from .inputs import DEFAULTS, INPUTS, PlanInputs
from .machine import check_machine_profile, machine_summary
from .memory import _memory_summary, fit_verdict, memory_terms
from .timing import host_optimizer_time_s, offload_io_bytes, step_time
from .traffic import _traffic_summary, traffic_terms

# the inputs a result echoes under "options", in this order
_ECHOED = (
    "reshard_after_forward",
    "prefetch",
    "qwz",
    "hpz",
    "qgz",
    "quant_block_elems",
    "offload_optimizer",
    "offload_params",
    "largest_layer_params",
    "layers",
    "root_units",
    "tokens_per_rank",
    "peak_tflops",
    "mfu",
    "link_gbytes",
    "intra_gbytes",
    "host_gbytes",
    "nvme_gbytes",
    "host_adam_params_per_s",
    "gpu_memory_bytes",
    "host_memory_bytes",
    "hidden_size",
    "attention_heads",
    "seq_len",
    "micro_batch",
    "vocab_size",
    "activation_checkpointing",
)


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
