"""DeepSpeed's own accounting beside labkit's: rank-side runs that return both (notebooks 06 and 07).

DeepSpeed reports on itself (its comms logger, its memory estimator); labkit measures it from outside (the
probe's collectives, the state tensors `deepspeed.itemise_state_bytes` lists). The engine file
stays an engine that only trains; this one sets the views side by side, and `state_terms` names every
term of DeepSpeed's state with its size, summing to what the probe measures.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from labkit.engines import deepspeed as ds_engine
from labkit.engines.base import RunConfig
from labkit.engines.on_rank import rank_info, rank_model, train_steps
from labkit.model import build_model, count_params
from labkit.names import ALL_GATHER, REDUCE_SCATTER
from labkit.probes import Probes, state_bytes
from labkit.probes.memory import storages

PAPER_BYTES_PER_PARAM = 16  # fp32 AdamW in the ZeRO paper: param 4 + grad 4 + exp_avg 4 + exp_avg_sq 4
# Tensors DeepSpeed's optimizer holds that are not state carried from step to step, and why.
NOT_CARRIED = {
    "_global_grad_norm": "the last step's global gradient norm, recomputed every step",
    "inf_or_nan_tracker": "the last step's overflow flag, recomputed every step",
}


def own_accounting_beside_probe(cfg: RunConfig) -> dict[str, Any]:
    """A deepspeed engine with its comms logger on, trained `cfg.steps` steps under labkit's probe.

    Returns DeepSpeed's own view (comms logger calls and message bytes since init, its memory estimator)
    beside labkit's (the probe's calls and payload bytes since the probe was installed, before init; the
    itemised state bytes of this rank; `state_terms`) and the losses.
    """
    cfg = replace(cfg, options={**cfg.options, "comms_logger": True})
    info = rank_info()
    model = rank_model(cfg.model, cfg.seed, info.device)
    estimate = ds_engine.memory_estimate(build_model(cfg.model, cfg.seed), info.world_size)
    with Probes(info.rank, info.device) as probes:
        engine = ds_engine.build(cfg, model, info)
        losses = train_steps(engine, cfg, probes=probes)
    probe: dict[str, dict[str, int]] = {}
    for c in probes.comm.calls:
        if c.kind in (ALL_GATHER, REDUCE_SCATTER):
            row = probe.setdefault(c.kind, {"calls": 0, "payload_bytes": 0})
            row["calls"] += 1
            row["payload_bytes"] += c.payload_bytes
    return {
        "comms_logger": ds_engine.comms_logger_summary(),
        "probe": probe,
        "itemised": ds_engine.itemise_state_bytes(engine, count_params(build_model(cfg.model, cfg.seed))),
        "state": state_terms(engine, cfg),
        "estimate": estimate,
        "losses": losses,
    }


def state_terms(engine: ds_engine.DeepSpeedEngine, cfg: RunConfig) -> dict[str, Any]:
    """This rank's DeepSpeed state, term by term, beside the probe's total and the paper's 16 B/param / n.

    "terms": {what: bytes} as measured (`itemise_state_bytes`); "accounting": the same terms predicted from
    the config (`deepspeed.state_bytes_accounting`); "measured_bytes": the probe's state bytes (the sum of
    the terms, exactly); "paper_bytes": 16 B x params / n; "estimate_bytes": DeepSpeed's own estimator
    (18 B/param / n + 4 B x the largest layer); both ratios; "outside_state": {path: bytes} of every other
    tensor found by walking DeepSpeed's optimizer, with `NOT_CARRIED`'s reason in "outside_state_why".
    """
    model = build_model(cfg.model, cfg.seed)
    n, n_params = dist.get_world_size(), count_params(model)
    rows = ds_engine.itemise_state_bytes(engine, n_params)
    measured = sum(state_bytes(engine.state_tensors()).values())
    paper = PAPER_BYTES_PER_PARAM * n_params / n
    estimate = ds_engine.memory_estimate(model, n)["gpu_bytes_per_rank"]
    outside = tensors_outside_state(engine)
    return {
        "terms": {r["what"]: r["bytes"] for r in rows if r["bytes"]},
        "accounting": ds_engine.state_bytes_accounting(model, cfg, n),
        "measured_bytes": measured,
        "paper_bytes": paper,
        "ratio_to_paper": measured / paper,
        "estimate_bytes": estimate,
        "ratio_to_estimate": measured / estimate,
        "outside_state": outside,
        "outside_state_why": {
            path: next((why for name, why in NOT_CARRIED.items() if path.endswith(name)), "not identified")
            for path in outside
        },
    }


def tensors_outside_state(engine: ds_engine.DeepSpeedEngine) -> dict[str, int]:
    """{attribute path: bytes} of every non-empty tensor reachable from DeepSpeed's ZeRO-3 optimizer object
    (its attributes, containers, a tensor's `.grad` / `ds_tensor`) whose storage is not in the state.

    Parameters' released full tensors (0 bytes between uses) are skipped. What remains is what the state
    leaves out; in DeepSpeed 0.19.8 that is two scalars (`NOT_CARRIED`).
    """
    listed = {id(st) for ts in engine.state_tensors().values() for st in storages(ts)}
    found: dict[int, tuple[str, int]] = {}
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("optimizer", engine.engine.optimizer)]
    while stack:
        path, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            for st in storages([obj]):
                if st.nbytes() and id(st) not in listed and id(st) not in found:
                    found[id(st)] = (path, st.nbytes())
            stack += [(f"{path}.{a}", getattr(obj, a, None)) for a in ("grad", "ds_tensor")]
        elif isinstance(obj, dict):
            stack += [(f"{path}[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set)):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif type(obj).__module__.startswith(("deepspeed", "torch.optim")) and hasattr(obj, "__dict__"):
            stack += [(f"{path}.{k}", v) for k, v in vars(obj).items()]
    return dict(sorted(found.values()))


def itemise_state(cfg: RunConfig) -> dict[str, Any]:
    """Rank side, for `labkit.launch`: build the deepspeed engine, train `cfg.steps` steps, `state_terms`."""
    engine = ds_engine.build(cfg, rank_model(cfg.model, cfg.seed), rank_info())
    losses = train_steps(engine, cfg)
    return {**state_terms(engine, cfg), "losses": losses}
