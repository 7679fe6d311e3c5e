"""`RunConfig`: every setting of one comparison run with its type, choices, default, unit and help, in one place.

Building one checks each setting (one sentence naming it, ValueError) and that the world size divides the
model's global batch; `labkit compare`'s flags are made from `SETTINGS`. Torch-free, so the CLI reads the
schema without loading torch (the model's name is checked against `labkit.model` only when a run is built).
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from labkit.fields import Spec, check, setting, spec_of
from labkit.names import OFFLOAD_TARGETS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}  # compute dtype (torch's name) -> bytes per element


@dataclass(frozen=True)
class RunConfig:
    """One comparison run. The same config gives every engine the same model, seed, batches and AdamW.

    Prefetch has two spellings, kept in step: `prefetch_depth` (units gathered ahead; 0 is no prefetch) and
    `prefetch`, which follows it when left None. `prefetch=False` sets the depth to 0; `prefetch=True` turns
    a depth of 0 into 1 (so `replace(cfg, prefetch=True)` switches a run without prefetch back on). Once
    built, `prefetch == (prefetch_depth > 0)`.
    """

    model: str = setting("tiny", "model", "a model of labkit.model.CONFIGS, e.g. tiny", flag="--model")
    world_size: int = setting(
        2, "count", "ranks of the multi-rank engines", unit="ranks", low=1, flag="--world-size"
    )
    steps: int = setting(5, "count", "timed training steps", unit="steps", low=1, flag="--steps")
    dtype: str = setting(
        "float32",
        "choice",
        "compute dtype; master weights, gradient reduction and AdamW stay float32",
        choices=tuple(DTYPE_BYTES),
        flag="--dtype",
    )
    seed: int = setting(
        0, "count", "seed of the initial weights and the batches", low=0, high=2**63 - 1, flag="--seed"
    )
    lr: float = setting(1e-3, "number", "AdamW's learning rate")
    betas: tuple[float, float] = setting((0.9, 0.95), "pair", "AdamW's decay rates of its two moments")
    eps: float = setting(1e-8, "number", "AdamW's epsilon")
    weight_decay: float = setting(0.1, "number", "AdamW's decoupled weight decay")
    prefetch: bool | None = setting(
        None,
        "switch",
        "sharded engines: all-gather the next units ahead of use (None: on unless prefetch_depth is 0)",
        flag="--no-prefetch",
        flag_help="sharded engines: no all-gather ahead of use",
    )
    prefetch_depth: int = setting(
        1,
        "count",
        "sharded engines: units gathered ahead of the one computing (0: no prefetch)",
        unit="units",
        low=0,
    )
    reshard_after_forward: bool = setting(
        True, "switch", "sharded engines: free gathered weights after forward, all-gather again in backward"
    )
    offload: str = setting(
        "none",
        "choice",
        "optimizer state on the host (cpu) or, deepspeed only, in swap files (nvme)",
        choices=OFFLOAD_TARGETS,
        flag="--offload",
    )
    link_gbytes: float | None = setting(
        None, "rate", "emulated link of X GB/s per rank", unit="GB/s", flag="--link-gbytes"
    )
    options: dict[str, Any] = field(
        default_factory=dict,
        metadata={"spec": Spec("options", "engine-specific extras: each engine's OPTIONS")},
    )

    def __post_init__(self) -> None:
        for f in fields(self):  # frozen: the checked values are stored as __init__ does
            object.__setattr__(self, f.name, check(f.name, getattr(self, f.name), spec_of(f), _RUN_KINDS))
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


def _check_model(name: str, value: Any, s: Spec) -> str:
    from labkit.model import CONFIGS, config

    if not isinstance(value, str) or value.partition("@")[0] not in CONFIGS:
        raise ValueError(f"{name}={value!r} is unknown; choose from {', '.join(CONFIGS)}")
    config(value)  # a batch after '@' that is not a whole number of sequences
    return value


def _check_options(name: str, value: Any, s: Spec) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{name}={value!r}: pass a dict of engine-specific settings")
    return value


_RUN_KINDS = {"model": _check_model, "options": _check_options}  # the kinds only a run has

SETTINGS: dict[str, Spec] = {f.name: spec_of(f) for f in fields(RunConfig)}
DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(RunConfig) if f.default is not MISSING}
