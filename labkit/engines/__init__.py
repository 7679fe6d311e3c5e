"""The engines: one module per name, each `build(cfg, model, rank_info) -> Engine` (see `base.py`).

`ENGINES` is here, with no torch import, so the CLI can list the names without loading torch.
"""

ENGINES = ("single", "ddp", "scratch", "fsdp1", "fsdp2", "deepspeed")
