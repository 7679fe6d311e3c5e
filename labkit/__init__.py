"""labkit: a teaching lab for fully sharded data parallelism (ZeRO-3), measured live.

`labkit.launch(fn, world_size)` starts ranks from a notebook cell; `labkit.model.build_model()` builds the
lab's model; the engines, probes and budget arithmetic live in their own modules.
"""

from labkit.cluster import LaunchError, LaunchTimeout, launch

__all__ = ["launch", "LaunchError", "LaunchTimeout"]
__version__ = "0.1.0"
