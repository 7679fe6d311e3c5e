"""What notebooks 04-07 run that the engines do not expose on their own: several runs in one launch, and
rank-side inspections of FSDP2 and DeepSpeed measured by labkit's probes.

Parent-side: `run_many` (several engine runs in one launch: one start-up of the ranks, one import of
DeepSpeed), `records_table` (the head-to-head numbers of a set of records), `offload_table`, `node_rows`
(a scale model row per scenario), `self_check_html`. Rank-side (call them through `labkit.launch`):
`fsdp2_placements`, `mixed_precision_by_block`, `hsdp_measured`, `replicate_vs_shard`, `compile_explain`,
`fsdp_first_step_logs`, `deepspeed_inspect`. Every byte is counted by `labkit.probes` or read off a real
tensor; every formula comes from `labkit.budget`. Units are in the names: `_bytes`, `_s`.
"""

from __future__ import annotations

import html
import logging
import statistics
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import labkit
from labkit import budget
from labkit.engines.base import RunConfig, adamw
from labkit.engines.loop import merge_ranks, rank_info, ranks_for, train_rank, train_steps, validate
from labkit.model import batch, build_model, count_params, loss_fn
from labkit.probes import Probes

# ------------------------------------------------------------------------------------------ many runs


def _train_runs(runs: Sequence[tuple[str, RunConfig]]) -> list[dict[str, Any]]:
    """Rank side of `run_many`: `train_rank` once per run, in order, on this rank."""
    out = []
    for engine, cfg in runs:
        out.append(train_rank(engine, cfg))
        dist.barrier()
    return out


def run_many(runs: Sequence[tuple[str, RunConfig]], timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Several (engine, cfg) runs in ONE launch; a record per run, in order.

    Every run is measured by the loop's own `train_rank` (the same probes as `loop.run`); sharing the
    ranks saves a start-up and a DeepSpeed import per run (seconds each on a laptop). All runs need the
    same number of ranks (`single` cannot share a launch with multi-rank engines: use `loop.run` for it),
    and a DeepSpeed hpZ run must be alone (DeepSpeed keeps its hpZ groups for the process; measured: the
    next run in the same ranks gathered inside them too). A deepspeed run turns single ZeRO-3 knobs with
    `cfg.options["zero_overrides"]` (see `labkit.engines.ds_config.ds_config`).
    """
    runs = list(runs)
    if not runs:
        return []
    hpz = [cfg.options.get("zero_hpz_partition_size", 1) for _, cfg in runs]
    if len(runs) > 1 and any(int(h) > 1 for h in hpz):
        raise ValueError(
            "a run with zero_hpz_partition_size > 1 needs a launch of its own: DeepSpeed keeps its hpZ process "
            "groups across deepspeed.initialize calls, so the runs after it in the same ranks would use them"
        )
    sizes = {ranks_for(engine, cfg) for engine, cfg in runs}
    if len(sizes) != 1:
        raise ValueError(f"run_many needs runs on one number of ranks; these need {sorted(sizes)}")
    for engine, cfg in runs:
        validate([engine], cfg)
    per_rank = labkit.launch(_train_runs, sizes.pop(), runs, timeout=timeout_s)
    return [merge_ranks([r[i] for r in per_rank], cfg.steps) for i, (_, cfg) in enumerate(runs)]


def median_step_s(record: dict[str, Any]) -> float:
    """Median step time of a record, leaving out step 0 when there are more (warm-up; seconds)."""
    times = record["step_time_s"]
    return statistics.median(times[1:] if len(times) > 1 else times)


def phase_s(record: dict[str, Any], name: str, rank: int = 0) -> float:
    """Mean seconds of one loop phase ("forward", "backward", "optimizer") on `rank` over the kept steps."""
    spans = [
        e["end_s"] - e["start_s"]
        for e in record["timeline"]
        if e["kind"] == "compute" and e["name"] == name and e["rank"] == rank
    ]
    return statistics.fmean(spans) if spans else 0.0


def wire_bytes(record: dict[str, Any]) -> int:
    """Wire bytes one rank sent in the record's last step, all collectives together (bytes)."""
    return sum(v["wire_bytes"] for v in record["comm"].values())


def records_table(records: dict[str, dict[str, Any]], reference: str = "single") -> str:
    """A fixed-width table of records: last loss, largest relative loss difference to `reference`,
    wire bytes per collective, state bytes and peak memory per rank, median step time."""
    ref = records.get(reference, {}).get("losses")
    head = (
        f"{'engine':<22}{'last loss':>10}{'max rel diff':>13}{'all-gather B':>14}{'reduce-scat B':>14}"
        f"{'all-reduce B':>13}{'state B/rank':>14}{'peak B/rank':>13}{'step ms':>9}"
    )
    lines = [head, "-" * len(head)]
    for name, rec in records.items():
        diff = max(abs(a - b) / abs(b) for a, b in zip(rec["losses"], ref, strict=True)) if ref else 0.0
        comm = rec["comm"]
        lines.append(
            f"{name:<22}{rec['losses'][-1]:>10.6f}{diff:>13.1e}"
            f"{comm.get('all_gather', {}).get('wire_bytes', 0):>14,}"
            f"{comm.get('reduce_scatter', {}).get('wire_bytes', 0):>14,}"
            f"{comm.get('all_reduce', {}).get('wire_bytes', 0):>13,}"
            f"{sum(rec['state_bytes'].values()):>14,}{max(rec['peak_mem_bytes']):>13,}"
            f"{median_step_s(rec) * 1e3:>9.0f}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ offload


def offload_rows(records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per record: state bytes the engine keeps as device tensors, the optimizer phase and step (seconds).

    `device_state_bytes` sums the engine's "params", "grads" and "optimizer" tensors, which is what stays on
    the accelerator; an engine that offloads keeps its host buffers out of those keys (the scratch engine
    lists them as "host_optimizer"), so the difference between a run and its offloaded twin is what moved.
    """
    rows = []
    for name, rec in records.items():
        rows.append(
            {
                "run": name,
                "device_state_bytes": sum(rec["state_bytes"].values()),
                "optimizer_state_bytes": rec["state_bytes"].get("optimizer", 0),
                "peak_mem_bytes": max(rec["peak_mem_bytes"]),
                "optimizer_phase_s": phase_s(rec, "optimizer"),
                "step_s": median_step_s(rec),
            }
        )
    return rows


def scale_rows(scenarios: dict[str, dict[str, Any]]) -> str:
    """A table of `plan()` results, one row per scenario: GPU, host and NVMe bytes per rank, step time."""
    head = f"{'scenario':<34}{'GPU/rank':>11}{'host/rank':>11}{'NVMe/rank':>11}{'offload s':>10}{'step s':>9}"
    lines = [head, "-" * len(head)]
    for name, p in scenarios.items():
        lines.append(
            f"{name:<34}{budget.format_bytes(p['gpu_bytes_per_rank']):>11}"
            f"{budget.format_bytes(sum(p['host_bytes_per_rank'].values())):>11}"
            f"{budget.format_bytes(sum(p['nvme_bytes_per_rank'].values())):>11}"
            f"{p['offload_time_s']:>10.2f}{p['step_time_s']:>9.2f}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ FSDP2, rank side


def _fsdp2_engine(cfg: RunConfig, mesh=None):
    from torch.distributed.device_mesh import init_device_mesh

    from labkit.engines import fsdp2

    info = rank_info()
    mesh = mesh or init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("shard",))
    model = build_model(cfg.model, cfg.seed)
    fsdp2.shard_model(model, cfg, mesh)
    return fsdp2.Fsdp2Engine(model, adamw(model.parameters(), cfg), info.device)


def fsdp2_placements(cfg: RunConfig, names: Sequence[str] = ("blocks.0.qkv.weight", "blocks.0.ln1.bias",
                                                              "tok.weight")) -> dict[str, Any]:  # fmt: skip
    """What `fully_shard` turned each named parameter into on this rank: type, mesh, placements, shapes."""
    from torch.distributed.tensor import DTensor

    engine = _fsdp2_engine(cfg)
    params = dict(engine.model.named_parameters())
    out = {}
    for name in names:
        p = params[name]
        out[name] = {
            "type": type(p).__name__,
            "is_dtensor": isinstance(p, DTensor),
            "mesh": str(p.device_mesh) if isinstance(p, DTensor) else None,
            "placements": str(p.placements) if isinstance(p, DTensor) else None,
            "global_shape": tuple(p.shape),
            "local_shape": tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape),
        }
    return out


def mixed_precision_by_block(cfg: RunConfig, bf16_blocks: Sequence[int] = (0, 1)) -> dict[str, Any]:
    """One `MixedPrecisionPolicy` per block: bf16 weights for `bf16_blocks`, fp32 for the rest.

    Returns per block the dtype its weights had while it ran forward, the all-gather payload measured for
    it by the probe in the last step (bytes), and the losses. Gradients are reduced in fp32 everywhere.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    info = rank_info()
    mesh = init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("shard",))
    model = build_model(cfg.model, cfg.seed)
    policies = {
        True: MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        # float32 named explicitly, so the block casts a bf16 input from the block before it back up.
        False: MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32),
    }
    seen: dict[int, str] = {}
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, mp_policy=policies[i in bf16_blocks])
    fully_shard(model, mesh=mesh)
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda mod, _a, i=i: seen.__setitem__(i, str(mod.fc.weight.dtype)))
    optimizer = adamw(model.parameters(), cfg)

    class _Engine:
        def forward_loss(self, tokens, targets):
            return loss_fn(model(tokens).float(), targets)

        def backward(self, loss):
            loss.backward()

        def optimizer_step(self):
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

    with Probes(info.rank, info.device) as probes:
        losses = train_steps(_Engine(), cfg, probes=probes)
    gathers = [c for c in probes.comm.calls if c.kind == "all_gather" and c.step == cfg.steps - 1]
    numel = {i: sum(p.numel() for p in b.parameters()) for i, b in enumerate(model.blocks)}
    return {
        "param_dtype": {i: seen.get(i) for i in range(len(model.blocks))},
        "block_numel": numel,
        "all_gather_payload_bytes": [c.payload_bytes for c in gathers],
        "losses": losses,
    }


def hsdp_measured(cfg: RunConfig, replicas: int = 2) -> dict[str, Any]:
    """HSDP on a (replicate, shard) mesh, its collectives counted by the probe per step, by group size.

    Returns `fsdp2_features.hsdp`'s facts plus `comm`: {(kind, group_size): wire bytes per step} from the
    last step (the loss all-reduce outside the step is not counted).
    """
    from torch.distributed.device_mesh import init_device_mesh

    from labkit.engines import fsdp2

    info = rank_info()
    n = info.world_size
    mesh = init_device_mesh(
        info.device.type, (replicas, n // replicas), mesh_dim_names=("replicate", "shard")
    )
    engine = _fsdp2_engine(cfg, mesh)
    fsdp2.assert_sharded(engine.model, mesh)
    with Probes(info.rank, info.device) as probes:
        losses = train_steps(engine, cfg, probes=probes)
    comm: dict[str, int] = {}
    for c in probes.comm.calls:
        if c.step == cfg.steps - 1:
            key = f"{c.kind} over {c.group_size} ranks"
            comm[key] = comm.get(key, 0) + c.wire_bytes
    weight = engine.model.blocks[0].qkv.weight
    return {
        "placements": str(weight.placements),
        "shard_group_ranks": dist.get_process_group_ranks(mesh.get_group("shard")),
        "replicate_group_ranks": dist.get_process_group_ranks(mesh.get_group("replicate")),
        "local_shape": tuple(weight.to_local().shape),
        "full_shape": tuple(weight.shape),
        "comm": comm,
        "losses": losses,
    }


def replicate_vs_shard(cfg: RunConfig, name: str = "pos.weight") -> dict[str, Any]:
    """One parameter as a DTensor placed `Replicate()` and `Shard(0)` on the 1-D mesh: local shape and bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    info = rank_info()
    mesh = init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("shard",))
    full = dict(build_model(cfg.model, cfg.seed).named_parameters())[name].detach()
    out = {}
    for placement in (Replicate(), Shard(0)):
        d = distribute_tensor(full, mesh, [placement])
        local = d.to_local()
        out[repr(placement)] = {
            "local_shape": tuple(local.shape),
            "local_bytes": local.numel() * local.element_size(),
        }
    return out


def compile_explain(cfg: RunConfig, backend: str = "aot_eager") -> dict[str, Any]:
    """`torch.compile(model, backend=backend)` on the FSDP2-sharded model: what Dynamo traced, and losses.

    `torch._dynamo.explain` reports the graphs and graph breaks of one forward; the run then trains
    `cfg.steps` compiled steps (first step: tracing and compiling; seconds). `collectives_in_forward_graphs`
    names the FSDP2 collective and copy ops Dynamo put into its forward graphs (empty: the hooks ran eagerly,
    outside the graphs).
    """
    import torch._dynamo

    info = rank_info()
    engine = _fsdp2_engine(cfg)
    tokens, _ = batch(0, cfg.model, cfg.seed, info.world_size, info.rank)
    explained = torch._dynamo.explain(engine.model)(tokens)
    collectives = sorted(
        {
            str(node.target)
            for graph in explained.graphs
            for node in graph.graph.nodes
            if any(k in str(node.target) for k in ("all_gather", "reduce_scatter", "fsdp"))
        }
    )
    torch._dynamo.reset()
    engine.model = torch.compile(engine.model, backend=backend)
    start_s = time.perf_counter()
    first = train_steps(engine, RunConfig(**{**cfg.to_dict(), "steps": 1}))
    first_step_s = time.perf_counter() - start_s
    start_s = time.perf_counter()
    more = RunConfig(**{**cfg.to_dict(), "steps": cfg.steps - 1})
    rest = train_steps(engine, more, first_step=1) if cfg.steps > 1 else []
    later_step_s = (time.perf_counter() - start_s) / max(1, cfg.steps - 1)
    return {
        "backend": backend,
        "collectives_in_forward_graphs": collectives,
        "graph_count": explained.graph_count,
        "graph_break_count": explained.graph_break_count,
        "break_reasons": [str(b.reason).splitlines()[0] for b in explained.break_reasons],
        "ops_traced": sorted(
            {getattr(op, "__name__", str(op)) for ops in explained.ops_per_graph for op in ops}
        ),
        "first_step_s": first_step_s,
        "later_step_s": later_step_s,
        "losses": first + rest,
    }


def fsdp_first_step_logs(cfg: RunConfig, per_block: bool = True) -> dict[str, Any]:
    """The `fsdp` log of a first step (what `TORCH_LOGS=+fsdp` prints), with or without per-block wraps.

    `per_block=False` is the classic misconfigured shard: `fully_shard` on the root only, so the whole
    model is one group, gathered in one all-gather before the first layer runs. `torch._logging.set_logs`
    is the in-process form of the environment variable (ranks forked from a notebook have imported torch
    already, so the variable would be read too late). Returns the log lines, the all-gather calls of the
    step and the largest one's payload (bytes) against the model's parameter bytes.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    info = rank_info()
    mesh = init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("shard",))
    model = build_model(cfg.model, cfg.seed)
    if per_block:
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = adamw(model.parameters(), cfg)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    torch._logging.set_logs(fsdp=logging.DEBUG)
    logger = logging.getLogger("torch.distributed.fsdp")
    saved = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [handler], False  # returned to the notebook, not printed per rank
    try:
        with Probes(info.rank, info.device) as probes, probes.step(0):
            tokens, targets = batch(0, cfg.model, cfg.seed, info.world_size, info.rank)
            loss_fn(model(tokens), targets).backward()
            optimizer.step()
    finally:
        logger.handlers, logger.propagate = saved
        torch._logging.set_logs()
    gathers = [c.payload_bytes for c in probes.comm.calls if c.kind == "all_gather"]
    return {
        "log": lines,
        "all_gather_calls": len(gathers),
        "largest_all_gather_payload_bytes": max(gathers, default=0),
        "model_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


# ------------------------------------------------------------------------------------------ DeepSpeed, rank side


def deepspeed_inspect(cfg: RunConfig) -> dict[str, Any]:
    """A deepspeed engine with its comms logger on, trained `cfg.steps` steps under labkit's probe.

    Returns DeepSpeed's own view (comms logger calls and message bytes since init, its memory estimator)
    beside labkit's (the probe's calls and payload bytes since the probe was installed, before init; the
    itemised state bytes of this rank) and the losses.
    """
    from labkit.engines import deepspeed as ds_engine

    # DeepSpeed still calls torch.distributed's deprecated collective names (the loop silences this too).
    warnings.filterwarnings(
        "ignore", message=r".*is deprecated\. Please use `torch\.distributed\.", category=FutureWarning
    )
    cfg = RunConfig(**{**cfg.to_dict(), "options": {**cfg.options, "comms_logger": True}})
    info = rank_info()
    model = build_model(cfg.model, cfg.seed)
    estimate = ds_engine.memory_estimate(build_model(cfg.model, cfg.seed), info.world_size)
    with Probes(info.rank, info.device) as probes:
        engine = ds_engine.build(cfg, model, info)
        losses = train_steps(engine, cfg, probes=probes)
    probe = {}
    for c in probes.comm.calls:
        if c.kind in ("all_gather", "reduce_scatter"):
            row = probe.setdefault(c.kind, {"calls": 0, "payload_bytes": 0})
            row["calls"] += 1
            row["payload_bytes"] += c.payload_bytes
    return {
        "comms_logger": ds_engine.comms_logger_summary(),
        "probe": probe,
        "itemised": ds_engine.itemise_state_bytes(engine, count_params(build_model(cfg.model, cfg.seed))),
        "estimate": estimate,
        "losses": losses,
    }


# ------------------------------------------------------------------------------------------ 07


def strategy_rows(plans: dict[str, dict[str, Any]]) -> str:
    """A table of `plan()` results: state per rank, copies of the weights, traffic by link, comm time."""
    head = (
        f"{'scenario':<28}{'state/rank':>12}{'copies':>8}{'intra-node B':>14}{'inter-node B':>14}"
        f"{'comm s':>8}{'exposed s':>10}"
    )
    lines = [head, "-" * len(head)]
    for name, p in plans.items():
        links = p["traffic_bytes_by_link"]
        lines.append(
            f"{name:<28}{budget.format_bytes(p['state_bytes_per_rank']):>12}"
            f"{p['copies_in_cluster']['weights']:>8}"
            f"{budget.format_bytes(links.get('intra_node', 0)):>14}"
            f"{budget.format_bytes(links.get('inter_node', 0)):>14}"
            f"{p['comm_time_s']:>8.2f}{p['exposed_comm_s']:>10.2f}"
        )
    return "\n".join(lines)


def needs_offload(params: float, max_ranks: int, gpu_bytes: float, **plan_options: Any) -> dict[str, Any]:
    """The first reversal condition: does ZeRO-3 fit at the largest world size you can have?

    Returns the state per rank at `max_ranks` (bytes), whether it exceeds `gpu_bytes`, and the smallest
    offload (optimizer to cpu, then params too) under which it fits, or None.
    """
    full = budget.plan(params, max_ranks, "zero3", **plan_options)
    fits = full["gpu_bytes_per_rank"] <= gpu_bytes
    remedy = None
    if not fits:
        for opt, par in (("cpu", "none"), ("cpu", "cpu"), ("nvme", "cpu"), ("nvme", "nvme")):
            p = budget.plan(
                params, max_ranks, "zero3", offload_optimizer=opt, offload_params=par, **plan_options
            )
            if p["gpu_bytes_per_rank"] <= gpu_bytes:
                remedy = {
                    "offload_optimizer": opt,
                    "offload_params": par,
                    "gpu_bytes_per_rank": p["gpu_bytes_per_rank"],
                }
                break
    return {"gpu_bytes_per_rank": full["gpu_bytes_per_rank"], "fits_without_offload": fits, "offload": remedy}


def self_check_html(items: Sequence[tuple[str, str]]) -> str:
    """(question, answer) pairs as HTML `<details>` blocks: the answer shows when its question is clicked."""
    blocks = [
        f"<details style='margin:4px 0'><summary><b>{html.escape(q)}</b></summary>"
        f"<div style='margin:4px 0 8px 16px'>{html.escape(a)}</div></details>"
        for q, a in items
    ]
    return "\n".join(blocks)


def block_params(model: nn.Module) -> int:
    """Parameters of the model's largest block (elements): the `largest_layer_params` of its plans."""
    return max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
