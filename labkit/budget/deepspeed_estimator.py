"""DeepSpeed's own ZeRO-2/3 model-state estimator, restated without torch, and the keys of a plan that
accounting="deepspeed" replaces with it.
"""

from __future__ import annotations

from labkit.names import ZERO3

from .inputs import PlanInputs, _deepspeed_nodes


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


def _deepspeed_accounting(p: PlanInputs, paper_state_bytes_per_rank: int) -> dict:
    """The keys accounting="deepspeed" replaces: DeepSpeed's estimate of the state and its own itemisation."""
    n, n_params = p.world_size, p.params
    per_node, nodes = _deepspeed_nodes(n, p.gpus_per_node)
    stage = 3 if p.strategy == ZERO3 else 2
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
