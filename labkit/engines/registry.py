"""The engines, each named once: its module, the budget strategy its step follows, the settings it reads.

Torch-free, so the CLI lists and checks engine names without loading torch. Adding an engine is its name
below, one row of `ENGINES` and its module, whose `build(cfg, model, rank_info)` returns an `Engine`
(`base.py`). Code elsewhere names an engine only through these constants.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.names import DATA_PARALLEL, ZERO3

# Each engine's name, spelled here once: everything else that picks an engine by name imports it.
SINGLE, DDP, SCRATCH, FSDP1, FSDP2, DEEPSPEED = "single", "ddp", "scratch", "fsdp1", "fsdp2", "deepspeed"
ORACLE = SINGLE  # the engine every other is held to: one rank, the global batch

# The RunConfig settings (`labkit.engines.run_config.SETTINGS`) that only a sharded engine reads.
SHARDED_SETTINGS = ("prefetch", "prefetch_depth", "reshard_after_forward", "offload")


# A sharded engine's own accounting, functions of its module: each (model, cfg, world_size) -> {key: bytes}, the
# wire bytes one rank sends per step by collective kind, and its training state per rank by the probe's category.
ACCOUNTING = ("predicted_wire_bytes", "state_bytes_accounting")


@dataclass(frozen=True)
class EngineSpec:
    """One engine's facts. `module` holds its `build`; `checks` holds its `OPTIONS` (the `cfg.options` keys it
    honours) and optional `check_run`: `module` itself, unless that imports a library the parent should not
    load just to validate arguments. `strategy` is the `labkit.budget` strategy its step follows."""

    name: str
    module: str
    strategy: str
    settings: tuple[str, ...] = ()  # the RunConfig settings it reads that not every engine does
    single_rank: bool = False  # runs on one rank with the global batch (the oracle)
    checks: str = ""  # a module name; empty: `module`
    accounts: bool = False  # `module` prices its own step: the ACCOUNTING functions

    @property
    def checks_module(self) -> str:
        """The module holding `OPTIONS` and `check_run`."""
        return self.checks or self.module


ENGINES: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec(SINGLE, "labkit.engines.single", DATA_PARALLEL, single_rank=True),
        EngineSpec(DDP, "labkit.engines.ddp", DATA_PARALLEL),
        EngineSpec(SCRATCH, "labkit.engines.scratch", ZERO3, SHARDED_SETTINGS, accounts=True),
        EngineSpec(FSDP1, "labkit.engines.fsdp1", ZERO3, SHARDED_SETTINGS, accounts=True),
        EngineSpec(FSDP2, "labkit.engines.fsdp2", ZERO3, SHARDED_SETTINGS, accounts=True),
        # Prefetch and resharding are DeepSpeed's own ZeRO-3 knobs (options["zero_overrides"]), not settings.
        EngineSpec(
            DEEPSPEED,
            "labkit.engines.deepspeed",
            ZERO3,
            ("offload",),
            checks="labkit.engines.ds_config",
            accounts=True,
        ),
    )
}
