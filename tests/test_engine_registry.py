"""The engine registry: every row points at a real module, a budget strategy and settings the loop knows."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import labkit
from labkit import budget
from labkit.engines import ENGINES
from labkit.engines.registry import ORACLE
from labkit.engines.run_config import SETTINGS
from labkit.engines.validation import engine_options


def test_every_row_names_a_module_a_strategy_and_known_settings():
    for name, spec in ENGINES.items():
        assert spec.name == name and spec.module == f"labkit.engines.{name}", spec
        assert importlib.util.find_spec(spec.module) is not None, spec.module
        assert spec.strategy in budget.STRATEGIES, spec
        assert set(spec.settings) <= set(SETTINGS), spec
        assert engine_options(name), name  # its checks module names the options it honours
    # The light checks module, not the engine's (which imports DeepSpeed), answers for deepspeed.
    assert importlib.import_module(ENGINES["deepspeed"].checks_module).__name__ == "labkit.engines.ds_config"
    assert [n for n, spec in ENGINES.items() if spec.single_rank] == ["single"] == [ORACLE]
    for name, spec in ENGINES.items():
        assert importlib.import_module(spec.module).NAME == name  # the module's name is the registry's


# Strings equal to an engine's name that are not engines: another vocabulary that shares the word.
# (labkit/budget/ is skipped whole: its strategies and accountings are its own, "ddp" and "deepspeed" among them.)
NOT_ENGINES = {
    ("tables.py", "deepspeed"): "a budget accounting",
    ("cli/budget.py", "deepspeed"): "a budget accounting (the flags only its estimator reads)",
    ("doctor.py", "deepspeed"): "a package the doctor looks for",
    ("engines/ds_config.py", "deepspeed"): "the package's import name",
    ("lessons/deepspeed_inspect.py", "deepspeed"): "the package's module prefix",
    ("buildalong/verdicts.py", "single"): "a CheckResult figure the learner reads: single's losses",
    ("buildalong/fsdp2_check.py", "single"): "a CheckResult figure the learner reads: single's losses",
    ("buildalong/deepspeed_check.py", "single"): "a CheckResult figure the learner reads: single's losses",
    ("names.py", "ddp"): "the data-parallel strategy, which the ddp engine's name shares",
}


def test_engine_names_are_spelled_only_in_the_registry():
    root = Path(labkit.__file__).parent
    found: dict[tuple[str, str], list[int]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "engines/registry.py" or rel.startswith(("budget/", "_course/")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in ENGINES:
                found.setdefault((rel, node.value), []).append(node.lineno)
    stray = {key: lines for key, lines in found.items() if key not in NOT_ENGINES}
    assert not stray, f"engine names typed outside labkit/engines/registry.py (import its constants): {stray}"
    assert set(NOT_ENGINES) <= set(found), set(NOT_ENGINES) - set(found)


def test_every_engine_that_accounts_has_the_accounting_functions_and_no_other_does():
    """The accounting protocol is declared in the registry (`ACCOUNTING`, `EngineSpec.accounts`): each engine
    that says it prices its own step has every function, taking (model, cfg, world_size), returning bytes by
    key for the lab's model; the engines that do not say so have none of them."""
    import inspect

    from labkit.engines.base import RunConfig
    from labkit.engines.registry import ACCOUNTING
    from labkit.model import build_model

    cfg = RunConfig(model="tiny", world_size=2)
    for name, spec in ENGINES.items():
        module = importlib.import_module(spec.module)
        present = [f for f in ACCOUNTING if hasattr(module, f)]
        assert present == (list(ACCOUNTING) if spec.accounts else []), (name, present)
        for f in present:
            params = list(inspect.signature(getattr(module, f)).parameters)
            assert params[:3] == ["model", "cfg", "world_size"], (name, f, params)
            got = getattr(module, f)(build_model(cfg.model), cfg, 2)
            assert got and all(
                isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in got.items()
            ), (
                name,
                f,
                got,
            )
    assert {n for n, s in ENGINES.items() if s.accounts} == {"scratch", "fsdp1", "fsdp2", "deepspeed"}
