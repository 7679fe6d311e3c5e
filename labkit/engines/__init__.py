"""The engines: one module per name, each `build(cfg, model, rank_info) -> Engine` (see `base.py`).

`ENGINES` (name -> `EngineSpec`, from `registry.py`) is here, with no torch import, so the CLI can list
the names without loading torch.
"""

from labkit.engines.registry import ENGINES, EngineSpec

__all__ = ["ENGINES", "EngineSpec"]
