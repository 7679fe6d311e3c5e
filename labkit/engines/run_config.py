"""`RunConfig`: every setting of one comparison run with its type, choices, default, unit and help, in one place.

Building one checks each setting (one sentence naming it, ValueError) and that the world size divides the
model's global batch; `labkit compare`'s flags are made from `SETTINGS`. Torch-free, so the CLI reads the
schema without loading torch (the model's name is checked against `labkit.model` only when a run is built).
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, NamedTuple

from labkit.names import OFFLOAD_TARGETS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}  # compute dtype (torch's name) -> bytes per element


class Setting(NamedTuple):
    """How one `RunConfig` field is checked, and what `labkit compare` says about it.

    kind: "model" (a name of `labkit.model.CONFIGS`), "count" (a whole number, at least `low`; None: any),
    "number" (0 or more), "rate" (above 0), "pair" (two numbers in [0, 1)), "choice" (one of `choices`),
    "switch" (True or False) or "options" (a dict of engine extras); a setting whose default is None may be
    None. `flag`: its `labkit compare` flag ("" for none); `flag_help`: the flag's help when the flag
    switches the setting off.
    """

    kind: str
    help: str
    unit: str = ""
    choices: tuple[str, ...] = ()
    low: int | None = None
    high: int | None = None
    flag: str = ""
    flag_help: str = ""


def _setting(default: Any, kind: str, help: str, **spec: Any) -> Any:
    return field(default=default, metadata={"setting": Setting(kind, help, **spec)})


@dataclass(frozen=True)
class RunConfig:
    """One comparison run. The same config gives every engine the same model, seed, batches and AdamW.

    Prefetch has two spellings, kept in step: `prefetch_depth` (units gathered ahead; 0 is no prefetch) and
    `prefetch`, which follows it when left None. `prefetch=False` sets the depth to 0; `prefetch=True` turns
    a depth of 0 into 1 (so `replace(cfg, prefetch=True)` switches a run without prefetch back on). Once
    built, `prefetch == (prefetch_depth > 0)`.
    """

    model: str = _setting("tiny", "model", "a model of labkit.model.CONFIGS, e.g. tiny", flag="--model")
    world_size: int = _setting(
        2, "count", "ranks of the multi-rank engines", unit="ranks", low=1, flag="--world-size"
    )
    steps: int = _setting(5, "count", "timed training steps", unit="steps", low=1, flag="--steps")
    dtype: str = _setting(
        "float32",
        "choice",
        "compute dtype; master weights, gradient reduction and AdamW stay float32",
        choices=tuple(DTYPE_BYTES),
        flag="--dtype",
    )
    seed: int = _setting(
        0, "count", "seed of the initial weights and the batches", low=0, high=2**63 - 1, flag="--seed"
    )
    lr: float = _setting(1e-3, "number", "AdamW's learning rate")
    betas: tuple[float, float] = _setting((0.9, 0.95), "pair", "AdamW's decay rates of its two moments")
    eps: float = _setting(1e-8, "number", "AdamW's epsilon")
    weight_decay: float = _setting(0.1, "number", "AdamW's decoupled weight decay")
    prefetch: bool | None = _setting(
        None,
        "switch",
        "sharded engines: all-gather the next units ahead of use (None: on unless prefetch_depth is 0)",
        flag="--no-prefetch",
        flag_help="sharded engines: no all-gather ahead of use",
    )
    prefetch_depth: int = _setting(
        1,
        "count",
        "sharded engines: units gathered ahead of the one computing (0: no prefetch)",
        unit="units",
        low=0,
    )
    reshard_after_forward: bool = _setting(
        True, "switch", "sharded engines: free gathered weights after forward, all-gather again in backward"
    )
    offload: str = _setting(
        "none",
        "choice",
        "optimizer state on the host (cpu) or, deepspeed only, in swap files (nvme)",
        choices=OFFLOAD_TARGETS,
        flag="--offload",
    )
    link_gbytes: float | None = _setting(
        None, "rate", "emulated link of X GB/s per rank", unit="GB/s", flag="--link-gbytes"
    )
    options: dict[str, Any] = field(
        default_factory=dict,
        metadata={"setting": Setting("options", "engine-specific extras: each engine's OPTIONS")},
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (value is None and f.default is None):
                _CHECKS[f.metadata["setting"].kind](f.name, value, f.metadata["setting"])
        depth = self.prefetch_depth
        if self.prefetch is False:
            depth = 0
        elif self.prefetch is True:
            depth = max(depth, 1)
        object.__setattr__(self, "prefetch_depth", depth)  # frozen: settled once, as __init__ stores
        object.__setattr__(self, "prefetch", depth > 0)
        self.sequences_per_rank()

    def sequences_per_rank(self, world_size: int | None = None) -> int:
        """The model's global batch / `world_size` ranks (default: this run's); one sentence when it does not
        divide: the one check of a world size against the batch."""
        from labkit.model import config

        world_size = self.world_size if world_size is None else world_size
        global_batch = config(self.model).global_batch
        if global_batch % world_size:
            divisors = ", ".join(str(d) for d in range(1, global_batch + 1) if global_batch % d == 0)
            raise ValueError(
                f"world_size={world_size} does not divide the global batch of {global_batch} sequences of "
                f"model {self.model!r}; pass one of {divisors}"
            )
        return global_batch // world_size

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of the compute dtype: what a gathered weight costs on the wire."""
        return DTYPE_BYTES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _alternatives(choices: tuple[str, ...]) -> str:
    quoted = [repr(c) for c in choices]
    return f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_model(name: str, value: Any, s: Setting) -> None:
    from labkit.model import CONFIGS, config

    if not isinstance(value, str) or value.partition("@")[0] not in CONFIGS:
        raise ValueError(f"{name}={value!r} is unknown; choose from {', '.join(CONFIGS)}")
    config(value)  # a batch after '@' that is not a whole number of sequences


def _check_count(name: str, value: Any, s: Setting) -> None:
    below = s.low is not None and _whole(value) and value < s.low
    above = s.high is not None and _whole(value) and value > s.high
    if not _whole(value) or below or above:
        of = f" of {s.unit}" if s.unit else ""
        least = "" if s.low is None else f", {s.low} or more"
        most = "" if s.high is None else f", at most {s.high:,}"
        raise ValueError(f"{name}={value!r}: pass a whole number{of}{least}{most}")


def _check_number(name: str, value: Any, s: Setting) -> None:
    if not _real(value) or value < 0:
        raise ValueError(f"{name}={value!r}: pass a number, 0 or more")


def _check_rate(name: str, value: Any, s: Setting) -> None:
    if not _real(value) or value <= 0:
        raise ValueError(f"{name}={value!r}: pass a number above 0 ({s.unit}), or None")


def _check_pair(name: str, value: Any, s: Setting) -> None:
    if not isinstance(value, tuple) or len(value) != 2 or not all(_real(b) and 0 <= b < 1 for b in value):
        raise ValueError(f"{name}={value!r}: pass a tuple of two numbers in [0, 1), e.g. (0.9, 0.95)")


def _check_choice(name: str, value: Any, s: Setting) -> None:
    if value not in s.choices:
        raise ValueError(f"{name}={value!r}: pass {_alternatives(s.choices)}")


def _check_switch(name: str, value: Any, s: Setting) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: pass True or False")


def _check_options(name: str, value: Any, s: Setting) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"{name}={value!r}: pass a dict of engine-specific settings")


_CHECKS = {
    "model": _check_model,
    "count": _check_count,
    "number": _check_number,
    "rate": _check_rate,
    "pair": _check_pair,
    "choice": _check_choice,
    "switch": _check_switch,
    "options": _check_options,
}

SETTINGS: dict[str, Setting] = {f.name: f.metadata["setting"] for f in fields(RunConfig)}
DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(RunConfig) if f.default is not MISSING}
