"""`labkit compare --trace DIR` and `labkit.traces` (issue 45): a torch.profiler trace per rank, after the
measured runs, each a Chrome trace that Perfetto opens; bad requests refused before any rank starts."""

from __future__ import annotations

import json

import pytest

from labkit.cli import main
from labkit.engines.base import RunConfig


def _chrome_trace(path) -> list[dict]:
    """The events of a Chrome-trace JSON file (what ui.perfetto.dev and chrome://tracing read)."""
    events = json.loads(path.read_text())["traceEvents"]
    assert events and all("ph" in e for e in events)
    return events


@pytest.mark.slow
def test_compare_traces_each_engine_on_every_rank_after_measuring_it(tmp_path, capsys):
    out = tmp_path / "traces"
    assert main(["compare", "--engines", "single,scratch", "--steps", "2", "--trace", str(out)]) == 0
    err = capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == [
        "scratch-rank0.json",
        "scratch-rank1.json",
        "single-rank0.json",
    ]
    for path in out.iterdir():
        events = _chrome_trace(path)
        names = {e.get("name", "") for e in events if e.get("ph") == "X"}
        assert any("aten::" in n for n in names), path.name  # the step's ops were recorded
    scratch = {e.get("name", "") for e in _chrome_trace(out / "scratch-rank1.json") if e.get("ph") == "X"}
    assert any("all_gather" in n for n in scratch) and any("reduce_scatter" in n for n in scratch)
    assert "labkit compare: scratch traced, step 1: " in err and "(open in ui.perfetto.dev)" in err


@pytest.mark.parametrize(
    "argv, sentence",
    [
        (
            ["--steps", "1"],
            "labkit compare: --trace records the last step after warm-up ones; pass --steps 2",
        ),
    ],
)
def test_compare_refuses_a_trace_it_could_not_take(tmp_path, capsys, argv, sentence):
    assert main(["compare", "--engines", "single", "--trace", str(tmp_path), *argv]) == 2
    assert capsys.readouterr().err.strip().startswith(sentence)


def test_compare_refuses_a_trace_folder_that_is_a_file(tmp_path, capsys):
    file = tmp_path / "f"
    file.write_text("")
    assert main(["compare", "--engines", "single", "--trace", str(file)]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f"labkit compare: --trace {file} is a file; pass a folder (new or existing)"
    )


def test_a_trace_of_one_step_is_refused_on_the_rank_side_too():
    from labkit import traces

    with pytest.raises(ValueError, match="steps=1: a trace needs 2 or more"):
        traces.trace_rank("scratch", RunConfig(steps=1), "/nonexistent")


@pytest.mark.slow
def test_each_rank_traces_the_last_step_alone_with_the_engines_collectives_and_its_ops_table(tmp_path):
    """The trace the benchmark (benchmarks/profile_step.py) and `--trace` share: the last timed step alone,
    with the engine's collectives in it, on every rank; the ops table beside it."""
    import labkit
    from labkit import traces

    cfg = RunConfig(model="tiny", world_size=2, steps=3)
    for engine in ("scratch", "deepspeed"):
        tables = labkit.launch(traces.trace_rank, 2, engine, cfg, str(tmp_path))
        for rank in (0, 1):
            names = [e.get("name", "") for e in _chrome_trace(traces.trace_path(tmp_path, engine, rank))]
            assert [n for n in names if n.startswith("ProfilerStep#")] == ["ProfilerStep#3"], engine
            assert any("allgather" in n.replace("_", "") for n in names), (engine, sorted(set(names))[:40])
        assert all("Self CPU" in table for table in tables)
