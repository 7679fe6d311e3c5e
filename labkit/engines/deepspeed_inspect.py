"""DeepSpeed's own accounting beside labkit's: a rank-side run that returns both (notebook 06).

DeepSpeed reports on itself (its comms logger, its memory estimator); labkit measures it from outside (the
probe's collectives, the state tensors `deepspeed.itemise_state_bytes` lists). The engine file
stays an engine that only trains; this one sets the two views side by side.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

from labkit.engines import deepspeed as ds_engine
from labkit.engines.base import RunConfig
from labkit.engines.loop import rank_info, train_steps
from labkit.model import build_model, count_params
from labkit.probes import Probes


def own_accounting_beside_probe(cfg: RunConfig) -> dict[str, Any]:
    """A deepspeed engine with its comms logger on, trained `cfg.steps` steps under labkit's probe.

    Returns DeepSpeed's own view (comms logger calls and message bytes since init, its memory estimator)
    beside labkit's (the probe's calls and payload bytes since the probe was installed, before init; the
    itemised state bytes of this rank) and the losses.
    """
    # DeepSpeed still calls torch.distributed's deprecated collective names (the loop silences this too).
    warnings.filterwarnings(
        "ignore", message=r".*is deprecated\. Please use `torch\.distributed\.", category=FutureWarning
    )
    cfg = replace(cfg, options={**cfg.options, "comms_logger": True})
    info = rank_info()
    model = build_model(cfg.model, cfg.seed)
    estimate = ds_engine.memory_estimate(build_model(cfg.model, cfg.seed), info.world_size)
    with Probes(info.rank, info.device) as probes:
        engine = ds_engine.build(cfg, model, info)
        losses = train_steps(engine, cfg, probes=probes)
    probe: dict[str, dict[str, int]] = {}
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
