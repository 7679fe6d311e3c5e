"""`labkit compare`: the contract's JSON with real values, the human table, and one-line usage errors."""

from __future__ import annotations

import json

import pytest

from labkit.cli import main
from labkit.engines import loop
from labkit.engines.base import RunConfig
from labkit.model import build_model, count_params


def test_compare_writes_the_contract_json_and_prints_a_table(tmp_path, capsys):
    out = tmp_path / "compare.json"
    argv = [
        "compare",
        "--engines",
        "single,ddp",
        "--world-size",
        "2",
        "--steps",
        "3",
        "--seed",
        "1",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    result = json.loads(out.read_text())

    cfg = result["config"]
    assert {k: cfg[k] for k in ("model", "world_size", "steps", "dtype", "seed")} == {
        "model": "tiny", "world_size": 2, "steps": 3, "dtype": "float32", "seed": 1}  # fmt: skip
    assert cfg["n_params"] == count_params(build_model("tiny", 1))
    assert list(result["engines"]) == ["single", "ddp"]
    for name, rec in result["engines"].items():
        assert set(rec) >= {"losses", "step_time_s", "state_bytes", "peak_mem_bytes", "comm", "timeline"}
        assert len(rec["losses"]) == len(rec["step_time_s"]) == 3
        assert all(t > 0 for t in rec["step_time_s"])
        assert sum(rec["state_bytes"].values()) > 16 * cfg["n_params"]
        assert len(rec["peak_mem_bytes"]) == (1 if name == "single" else 2)
        for counts in rec["comm"].values():
            assert set(counts) == {"calls", "payload_bytes", "wire_bytes"} and counts["calls"] > 0
        for e in rec["timeline"]:
            assert {"rank", "kind", "name", "start_s", "end_s"} <= set(e) and e["end_s"] >= e["start_s"]
    assert result["engines"]["single"]["losses"] == pytest.approx(
        result["engines"]["ddp"]["losses"], rel=1e-4
    )
    assert result["engines"]["ddp"]["comm"]["all_reduce"]["wire_bytes"] > 0

    table = captured.out.splitlines()
    assert table[1].split()[:3] == ["engine", "final", "loss"]
    assert [row.split()[0] for row in table[2:]] == ["single", "ddp"]
    assert "labkit compare: single done" in captured.err and "labkit compare: ddp done" in captured.err


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--engines", "single,nccl_magic"], "--engines"),
        (["--world-size", "0"], "--world-size"),
        (["--world-size", "5"], "--world-size"),  # does not divide the global batch of 12
        (["--world-size", "12"], "--world-size"),  # more ranks than this machine runs
        (["--steps", "-1"], "--steps"),
        (["--link-gbytes", "0"], "--link-gbytes"),
        (["--dtype", "float16"], "--dtype"),
        (["--model", "huge"], "--model"),
        (["--world-size", "4", "--hsdp", "3"], "--hsdp"),  # a shard group that does not divide the world
        (["--world-size", "4", "--hpz", "0"], "--hpz"),
    ],
)
def test_bad_arguments_give_one_line_naming_the_flag_and_exit_2(args, flag, capsys, monkeypatch):
    monkeypatch.setattr("labkit.cluster.max_ranks", lambda device_type=None: 8)
    assert main(["compare", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and flag in err and "Traceback" not in err


def test_an_engine_without_its_module_yet_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(loop, "available_engines", lambda: ["single", "ddp"])
    assert main(["compare", "--engines", "single,fsdp2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "labkit compare: --engines 'fsdp2' is not implemented yet (no labkit/engines/fsdp2.py); "
        "available: single,ddp"
    )


def test_the_library_refuses_the_same_requests_in_one_sentence(monkeypatch):
    with pytest.raises(ValueError, match="unknown engine 'nope'"):
        loop.run("nope", RunConfig())
    with pytest.raises(ValueError, match="world_size=5 does not divide"):
        loop.compare(["ddp"], RunConfig(world_size=5))
    monkeypatch.setattr(loop, "engine_module_name", lambda name: f"labkit.engines.not_written_{name}")
    with pytest.raises(loop.EngineUnavailable, match="engine 'ddp' is not implemented yet"):
        loop.run("ddp", RunConfig())
