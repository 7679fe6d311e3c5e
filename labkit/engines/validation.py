"""What a run may ask, checked in the parent before any rank starts: the engines, and what each makes of the
settings and options. Torch-free, so the CLI refuses a bad request in one sentence without loading torch.

An engine is named by its row of `labkit.engines.registry.ENGINES`, or given as an object with a `build`
method (`EngineBuilder`: the build-along's `labkit.buildalong.Learner`). A single-rank engine (`single`) runs on
one rank with the global batch; every other engine on `cfg.world_size` ranks.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from labkit.engines.registry import DEEPSPEED, ENGINES
from labkit.engines.run_config import SETTINGS, RunConfig
from labkit.names import NVME

if TYPE_CHECKING:
    import torch

    from labkit.engines.base import Engine, RankInfo


class EngineBuilder(Protocol):
    """An engine given as an object instead of a name: it builds the engine on each rank, as a module would."""

    def build(self, cfg: RunConfig, model: torch.nn.Module, rank_info: RankInfo) -> Engine: ...


def engine_module_name(name: str) -> str:
    """The module that builds engine `name` (its registry row's `module`)."""
    return ENGINES[name].module


def single_rank(engine: str | EngineBuilder) -> bool:
    """Whether `engine` runs on one rank with the global batch (an engine object, or a name `validate`
    refuses, does not)."""
    spec = ENGINES.get(engine) if isinstance(engine, str) else None
    return spec is not None and spec.single_rank


def ranks_for(engine: str, cfg: RunConfig) -> int:
    """How many ranks `engine` runs on for `cfg` (ranks)."""
    return 1 if single_rank(engine) else cfg.world_size


def validate(engines: Sequence[str], cfg: RunConfig) -> None:
    """Raise ValueError, one sentence naming the argument, for anything these engines could not do under `cfg`.

    The settings themselves were checked when `cfg` was built (`RunConfig`); here: the engines, and what
    each engine makes of the settings and options.
    """
    for name in engines:
        if not isinstance(name, str):
            if not callable(getattr(name, "build", None)):
                raise ValueError(
                    f"engine {name!r}: pass an engine name or an object with build(cfg, model, info)"
                )
            continue
        if name not in ENGINES:
            raise ValueError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
    if cfg.offload == NVME and any(e != DEEPSPEED and not single_rank(e) for e in engines):
        raise ValueError(
            "offload='nvme' is DeepSpeed's ZeRO-Infinity: only the deepspeed engine swaps to files; "
            "run the others with offload='cpu'"
        )
    check_options([e for e in engines if isinstance(e, str)], cfg)


def check_options(engines: Sequence[str], cfg: RunConfig) -> None:
    """Refuse, in the parent and in one sentence, an option that no engine of the run honours, and each
    engine's own impossible settings (its `check_run`), so that no flag is accepted and then ignored.

    Each engine is given only the options it honours (`options_for`), and its record says which; an option
    that none of the engines honours is refused. The checks are read from each engine's light module
    (its registry row's `checks_module`), so validating imports neither DeepSpeed nor FSDP1.
    """
    honoured: set[str] = set()
    for name in engines:
        checks = importlib.import_module(ENGINES[name].checks_module)
        honoured |= set(checks.OPTIONS)
        if hasattr(checks, "check_run"):
            checks.check_run(options_for(name, cfg))
    check_settings(engines, cfg)
    unknown = sorted(set(cfg.options) - honoured)
    if unknown:
        owners = [
            f"{k} is {' and '.join(e for e in ENGINES if k in engine_options(e)) or 'no engine'}'s"
            + (f" (as an option; the run's own setting is {k}={cfg.options[k]!r})" if k in SETTINGS else "")
            for k in unknown
        ]
        raise ValueError(
            f"options {unknown}: the engines of this run ({', '.join(engines)}) have no such setting, so it "
            f"would be ignored; {'; '.join(owners)}"
        )


# The RunConfig settings that only some engines read: those a registry row names, in the schema's order.
ENGINE_SETTINGS = tuple(s for s in SETTINGS if any(s in spec.settings for spec in ENGINES.values()))


def check_settings(engines: Sequence[str], cfg: RunConfig) -> None:
    """Refuse, in one sentence naming the setting and its flag, a non-default setting no engine of the run
    reads (e.g. `offload="cpu"` for ddp alone), as `check_options` refuses an option. The oracle (`single`)
    takes any of them alone or beside an engine that reads them: none changes its arithmetic."""
    others = [e for e in engines if not single_rank(e)]
    for setting in changed_settings(cfg) if others else ():
        if any(setting in engine_settings(e) for e in others):
            continue
        value, flag = getattr(cfg, setting), SETTINGS[setting].flag
        readers = ", ".join(e for e in ENGINES if setting in engine_settings(e))
        raise ValueError(
            f"{setting}={value!r}{f' ({flag})' if flag else ''}: the engines of this run "
            f"({', '.join(engines)}) have no such setting, so it would be ignored; it is {readers}'s"
        )


def changed_settings(cfg: RunConfig, names: Sequence[str] = ENGINE_SETTINGS) -> list[str]:
    """The settings of `names` (by default those only some engines read) that `cfg` sets to other than
    RunConfig's default."""
    default = RunConfig()
    return [name for name in names if getattr(cfg, name) != getattr(default, name)]


def engine_settings(name: str) -> tuple[str, ...]:
    """The RunConfig settings of `ENGINE_SETTINGS` that engine `name` reads (its registry row's `settings`)."""
    return ENGINES[name].settings


def engine_options(name: str) -> tuple[str, ...]:
    """The `cfg.options` keys engine `name` honours (the `OPTIONS` of its row's `checks_module`)."""
    return tuple(importlib.import_module(ENGINES[name].checks_module).OPTIONS)


def options_for(engine: str | EngineBuilder, cfg: RunConfig) -> RunConfig:
    """`cfg` with only the options `engine` honours (an engine object gets them all)."""
    if not isinstance(engine, str):
        return cfg
    keep = engine_options(engine)
    return replace(cfg, options={k: v for k, v in cfg.options.items() if k in keep})
