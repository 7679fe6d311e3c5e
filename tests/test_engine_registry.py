"""The engine registry: every row points at a real module, a budget strategy and settings the loop knows."""

from __future__ import annotations

import importlib
import importlib.util

from labkit import budget
from labkit.engines import ENGINES
from labkit.engines.loop import engine_options
from labkit.engines.run_config import SETTINGS


def test_every_row_names_a_module_a_strategy_and_known_settings():
    for name, spec in ENGINES.items():
        assert spec.name == name and spec.module == f"labkit.engines.{name}", spec
        assert importlib.util.find_spec(spec.module) is not None, spec.module
        assert spec.strategy in budget.STRATEGIES, spec
        assert set(spec.settings) <= set(SETTINGS), spec
        assert engine_options(name), name  # its checks module names the options it honours
    # The light checks module, not the engine's (which imports DeepSpeed), answers for deepspeed.
    assert importlib.import_module(ENGINES["deepspeed"].checks_module).__name__ == "labkit.engines.ds_config"
    assert [n for n, spec in ENGINES.items() if spec.single_rank] == ["single"]
