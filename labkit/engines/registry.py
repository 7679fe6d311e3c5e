"""The engines, each named once: its module, the budget strategy its step follows, the settings it reads.

Torch-free, so the CLI lists and checks engine names without loading torch. Adding an engine is one row of
`ENGINES` and its module, whose `build(cfg, model, rank_info)` returns an `Engine` (`base.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

# The RunConfig settings (`labkit.engines.run_config.SETTINGS`) that only a sharded engine reads.
SHARDED_SETTINGS = ("prefetch", "prefetch_depth", "reshard_after_forward", "offload")


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

    @property
    def checks_module(self) -> str:
        """The module holding `OPTIONS` and `check_run`."""
        return self.checks or self.module


ENGINES: dict[str, EngineSpec] = {
    spec.name: spec
    for spec in (
        EngineSpec("single", "labkit.engines.single", "ddp", single_rank=True),
        EngineSpec("ddp", "labkit.engines.ddp", "ddp"),
        EngineSpec("scratch", "labkit.engines.scratch", "zero3", SHARDED_SETTINGS),
        EngineSpec("fsdp1", "labkit.engines.fsdp1", "zero3", SHARDED_SETTINGS),
        EngineSpec("fsdp2", "labkit.engines.fsdp2", "zero3", SHARDED_SETTINGS),
        # Prefetch and resharding are DeepSpeed's own ZeRO-3 knobs (options["zero_overrides"]), not settings.
        EngineSpec(
            "deepspeed", "labkit.engines.deepspeed", "zero3", ("offload",), checks="labkit.engines.ds_config"
        ),
    )
}
