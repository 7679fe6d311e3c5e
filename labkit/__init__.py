"""labkit: a teaching lab for fully sharded data parallelism (ZeRO-3), measured live.

`labkit.launch(fn, world_size)` starts ranks from a notebook cell; `labkit.model.build_model()` builds the
lab's model; the engines, probes and budget arithmetic live in their own modules. Importing `labkit`
itself is cheap: torch is imported only when something that needs it is used (`labkit.budget` never does).
"""

from __future__ import annotations

from typing import Any

from labkit.rank_output import quiet_deepspeed_logger

__all__ = ["launch", "LaunchError", "LaunchTimeout"]
__version__ = "0.1.0"
# The Jupyter kernel the set-up registers (`make lab`, binder/postBuild) and every committed notebook names.
KERNEL_NAME = "labkit"
quiet_deepspeed_logger()  # before anything of labkit imports DeepSpeed, which logs its accelerator choice


def __getattr__(name: str) -> Any:
    if name in __all__:
        from labkit import cluster

        return getattr(cluster, name)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")
