"""`RunConfig`, the one schema of a run: its checks, its two spellings of prefetch, the flags made from it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from labkit.cli import build_parser, main
from labkit.engines.run_config import DEFAULTS, SETTINGS, RunConfig
from labkit.model import CONFIGS


def test_prefetch_and_its_depth_are_one_setting_in_two_spellings():
    off = RunConfig(prefetch=False)
    assert off == RunConfig(prefetch_depth=0) and (off.prefetch, off.prefetch_depth) == (False, 0)
    assert (RunConfig().prefetch, RunConfig().prefetch_depth) == (True, 1)
    deep = RunConfig(prefetch_depth=2)
    assert deep.prefetch and replace(deep, steps=3).prefetch_depth == 2
    assert replace(deep, prefetch=False).prefetch_depth == 0  # off wins over the depth it had
    assert replace(off, prefetch=True).prefetch_depth == 1  # and a run switched back on prefetches again
    assert json.loads(json.dumps(deep.to_dict()))["prefetch_depth"] == 2


@pytest.mark.parametrize(
    "change, sentence",
    [
        ({"model": "huge"}, "model='huge' is unknown; choose from " + ", ".join(CONFIGS)),
        ({"world_size": 0}, "world_size=0: pass a whole number of ranks, 1 or more"),
        ({"world_size": 5}, "world_size=5 does not divide the global batch of 12 sequences of model 'tiny'"),
        ({"steps": 0}, "steps=0: pass a whole number of steps, 1 or more"),
        ({"seed": 1.5}, "seed=1.5: pass a whole number"),
        ({"dtype": "float16"}, "dtype='float16': pass 'float32' or 'bfloat16'"),
        ({"offload": "disk"}, "offload='disk': pass 'none', 'cpu' or 'nvme'"),
        ({"link_gbytes": 0}, r"link_gbytes=0: pass a number above 0 \(GB/s\), or None"),
        ({"lr": -1.0}, "lr=-1.0: pass a number, 0 or more"),
        ({"betas": (1.0, 0.9)}, r"betas=\(1.0, 0.9\): pass a tuple of two numbers in \[0, 1\)"),
        ({"prefetch_depth": -1}, "prefetch_depth=-1: pass a whole number of units, 0 or more"),
        ({"reshard_after_forward": None}, "reshard_after_forward=None: pass True or False"),
    ],
)
def test_a_bad_setting_is_refused_when_built_in_one_sentence_naming_it(change, sentence):
    with pytest.raises(ValueError, match=sentence) as refused:
        RunConfig(**change)
    assert "\n" not in str(refused.value)


def test_compare_flags_are_made_from_the_schema():
    compare = build_parser()._subparsers._group_actions[0].choices["compare"]
    actions = {a.dest: a for a in compare._actions}
    for name, setting in SETTINGS.items():
        if not setting.flag:
            assert name not in actions, name
            continue
        action = actions[name]
        assert action.option_strings == [setting.flag]
        assert action.default == (None if name == "world_size" else DEFAULTS[name]), name
        assert tuple(action.choices or ()) == setting.choices, name
    assert actions["prefetch"].help == "sharded engines: no all-gather ahead of use"


def test_compare_names_the_flag_in_the_schemas_sentences(capsys):
    assert main(["compare", "--model", "huge"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"labkit compare: --model 'huge' is unknown; choose from {', '.join(CONFIGS)}"
    )
    assert main(["compare", "--world-size", "5"]) == 2
    assert capsys.readouterr().err.strip() == (
        "labkit compare: --world-size 5 does not divide the global batch of 12 sequences of model 'tiny'; "
        "pass one of 1, 2, 3, 4, 6, 12"
    )


def test_a_run_setting_put_in_options_is_refused_with_the_setting_to_pass():
    """No flag accepted and ignored: a RunConfig setting put in `options`, where no engine of the run reads it,
    is refused in the parent, and the sentence names the setting to pass instead."""
    from labkit.engines.validation import validate

    with pytest.raises(
        ValueError, match=r"prefetch_depth is no engine's \(as an option; the run's own setting is "
    ):
        validate(["scratch"], RunConfig(options={"prefetch_depth": 2}))
