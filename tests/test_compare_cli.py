"""`labkit compare`: the contract's JSON with real values, the human table, and one-line usage errors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from engine_helpers import assert_close, reference_losses
from fsdp1_checks import assert_measured_is_planned, assert_prefetch

from labkit.budget import collective_wire_bytes
from labkit.cli import main
from labkit.engines import loop
from labkit.engines.base import RunConfig
from labkit.model import build_model, count_params


def run_compare(tmp_path, capsys, engines: list[str], world_size: int, steps: int, seed: int):
    """`labkit compare` through the CLI: (its JSON, the table's lines on stdout, stderr)."""
    out = tmp_path / "compare.json"
    argv = [
        "compare",
        "--engines",
        ",".join(engines),
        "--world-size",
        str(world_size),
        "--steps",
        str(steps),
        "--seed",
        str(seed),
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    return json.loads(out.read_text()), captured.out.splitlines(), captured.err


def assert_contract(result: dict, engines: list[str], world_size: int, steps: int, seed: int) -> None:
    """The JSON of DESIGN.md's `labkit compare` contract, with real values, for every engine run."""
    cfg = result["config"]
    assert {k: cfg[k] for k in ("model", "world_size", "steps", "dtype", "seed")} == {
        "model": "tiny",
        "world_size": world_size,
        "steps": steps,
        "dtype": "float32",
        "seed": seed,
    }
    assert cfg["n_params"] == count_params(build_model("tiny", seed))
    assert list(result["engines"]) == engines
    for name, rec in result["engines"].items():
        assert set(rec) >= {"losses", "step_time_s", "state_bytes", "peak_mem_bytes", "comm", "timeline"}
        assert len(rec["losses"]) == len(rec["step_time_s"]) == steps
        assert all(t > 0 for t in rec["step_time_s"])
        assert set(rec["state_bytes"]) == {"params", "grads", "optimizer"}
        # Every engine keeps at least the 16 B/param of fp32 AdamW, summed over its ranks.
        ranks = 1 if name == "single" else world_size
        assert ranks * sum(rec["state_bytes"].values()) >= 16 * cfg["n_params"], name
        assert len(rec["peak_mem_bytes"]) == ranks and all(b > 0 for b in rec["peak_mem_bytes"])
        for counts in rec["comm"].values():
            assert set(counts) == {"calls", "payload_bytes", "wire_bytes"} and counts["calls"] > 0
        assert (name == "single") == (rec["comm"] == {}), name
        assert {e["rank"] for e in rec["timeline"]} == set(range(ranks))
        for e in rec["timeline"]:
            assert {"rank", "kind", "name", "start_s", "end_s"} <= set(e) and e["end_s"] >= e["start_s"]


EVERY_ENGINE = ["single", "ddp", "scratch", "fsdp1", "fsdp2", "deepspeed"]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_engine_through_compare_matches_single_its_bytes_and_its_own_state_accounting(
    n, tmp_path, capsys
):
    # DESIGN.md's example with ddp and fsdp1 too, at 2, 3 and 4 ranks, 10 float32 steps (issues 4 and 19):
    # losses against `single`, bytes per collective against each engine's plan, and the state each rank
    # keeps against the engine's own accounting (DeepSpeed's term by term in test_deepspeed).
    steps, seed = 10, 1
    result, table, err = run_compare(tmp_path, capsys, EVERY_ENGINE, n, steps, seed)
    # Imported after the run: importing DeepSpeed prints to stdout, which the table check reads.
    from labkit.engines import deepspeed, fsdp1, fsdp2, scratch

    assert_contract(result, EVERY_ENGINE, n, steps, seed)
    engines = result["engines"]
    # `single` is the oracle; it is plain torch AdamW on the global batch, and every engine matches it.
    assert_close(engines["single"]["losses"], reference_losses(RunConfig(steps=steps, seed=seed)))
    for name in EVERY_ENGINE[1:]:
        assert_close(engines[name]["losses"], engines["single"]["losses"], rel=1e-4)

    # The same probe measures every engine; tiny's widths divide by 2, 3 and 4, so nothing is padded.
    n_params = result["config"]["n_params"]
    param_bytes = 4 * n_params
    cfg, model = RunConfig(world_size=n, steps=steps, seed=seed), build_model("tiny", seed)
    assert engines["ddp"]["comm"]["all_reduce"]["wire_bytes"] == collective_wire_bytes(
        "all_reduce", param_bytes, n
    )
    accounting = {
        scratch: scratch.state_bytes_accounting,
        fsdp1: fsdp1.state_bytes_accounting,
        fsdp2: fsdp2.state_bytes_accounting,
        deepspeed: deepspeed.accounted_state_bytes,
    }
    for engine, accounted in accounting.items():
        record = engines[engine.NAME]
        wire = {k: row["wire_bytes"] for k, row in record["comm"].items() if k != "all_reduce"}
        assert wire == engine.predicted_wire_bytes(model, cfg, n), engine.NAME
        assert wire["reduce_scatter"] == collective_wire_bytes("reduce_scatter", param_bytes, n), engine.NAME
        assert record["state_bytes"] == accounted(model, cfg, n), engine.NAME
    # FSDP1 through the CLI: one collective per unit and use, and forward_prefetch / BACKWARD_PRE issuing each
    # block's gather before that block computes (its per-option cases at 2 and 3 ranks: test_fsdp1).
    assert_measured_is_planned(engines["fsdp1"], cfg, n)
    assert_prefetch(engines["fsdp1"], cfg, len(model.blocks))
    # Unsharded: single and ddp keep 16 B/param whole, plus AdamW's 4-byte step per parameter tensor.
    tensors = len(list(model.parameters()))
    whole = {"params": param_bytes, "grads": param_bytes, "optimizer": 2 * param_bytes + 4 * tensors}
    assert engines["single"]["state_bytes"] == engines["ddp"]["state_bytes"] == whole

    # The table is printed last; ranks' own output (DeepSpeed's op loader) streams to stdout before it.
    title = f"model tiny ({n_params:,} params), world size {n}, {steps} steps"
    table = table[next(i for i, line in enumerate(table) if line.startswith(title)) :]
    assert table[1].split()[:3] == ["engine", "final", "loss"]
    assert [row.split()[0] for row in table[2:]] == EVERY_ENGINE
    assert all(f"labkit compare: {name} done" in err for name in EVERY_ENGINE)


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
        (["--engines", "fsdp2", "--world-size", "4", "--hsdp", "4"], "--hsdp"),  # one group: plain FSDP
        (["--engines", "deepspeed", "--world-size", "4", "--hpz", "1"], "--hpz"),  # hpZ off
        (["--engines", "single,ddp", "--world-size", "4", "--hsdp", "2"], "--hsdp: the engines of this run"),
        (["--engines", "single,ddp", "--offload", "nvme"], "--offload"),
        (["--seed", "18446744073709551616"], "--seed"),  # beyond a 64-bit seed
        # what one process (the oracle alone) would ignore
        (["--engines", "single", "--offload", "cpu"], "--offload"),
        (["--engines", "single", "--link-gbytes", "1"], "--link-gbytes"),
        (["--engines", "single", "--world-size", "4"], "--world-size"),
        # where the result could not be written, said before any rank starts
        (["--engines", "single", "--json", "/nonexistent-labkit/out.json"], "--json"),
        (["--engines", "single", "--json", "/tmp"], "--json"),
    ],
)
def test_bad_arguments_give_one_line_naming_the_flag_and_exit_2(args, flag, capsys, monkeypatch):
    monkeypatch.setattr("labkit.cluster.rank_limit", lambda device_type=None, limits=None: (8, "8 ranks"))
    assert main(["compare", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and flag in err and "Traceback" not in err


def test_too_many_ranks_names_the_limit_that_refuses_them(capsys, monkeypatch):
    monkeypatch.setenv("MEM_LIMIT", "1500000000")  # a spawner's limit: 2 ranks of about 500 MiB
    assert main(["compare", "--engines", "ddp", "--world-size", "4"]) == 2
    assert capsys.readouterr().err.strip() == (
        "labkit compare: --world-size 4 but the memory limit MEM_LIMIT=1.5 GB allows 2 cpu ranks of about "
        "500 MiB each; pass --world-size <= 2"
    )


def test_the_library_refuses_the_same_requests_in_one_sentence():
    with pytest.raises(ValueError, match="unknown engine 'nope'"):
        loop.run("nope", RunConfig())
    with pytest.raises(ValueError, match="world_size=5 does not divide"):
        loop.compare(["ddp"], RunConfig(world_size=5))


def test_each_engine_gets_the_options_it_honours_and_an_option_none_honours_is_refused():
    from labkit.engines.validation import options_for, validate

    cfg = RunConfig(world_size=4, options={"hsdp_shard_size": 2, "zero_hpz_partition_size": 2})
    validate(["fsdp2", "deepspeed"], cfg)  # each honours one of the two: the comparison runs
    assert options_for("fsdp2", cfg).options == {"hsdp_shard_size": 2}
    assert options_for("deepspeed", cfg).options == {"zero_hpz_partition_size": 2}
    assert options_for("ddp", cfg).options == {}
    for engines, flag in ((["ddp"], "hsdp_shard_size"), (["single", "fsdp2"], "zero_hpz_partition_size")):
        with pytest.raises(
            ValueError,
            match=rf"options \['{flag}'\]: the engines of this run .* no such setting, so it would be ignored",
        ):
            validate(engines, RunConfig(world_size=4, options={flag: 2}))
    with pytest.raises(ValueError, match="activation_checkpointing=True: the deepspeed engine refuses it"):
        validate(["deepspeed"], RunConfig(options={"activation_checkpointing": True}))  # in the parent now


# Which engine runs each option on its own ranks (a cfg.options key, or a RunConfig setting that only some
# engines read: validation.ENGINE_SETTINGS).
HONOURS = {
    ("options", "hsdp_shard_size", 2): {"scratch", "fsdp1", "fsdp2"},
    ("options", "zero_hpz_partition_size", 2): {"deepspeed"},
    ("options", "activation_checkpointing", True): {"single", "ddp", "scratch", "fsdp2"},
    # single, the oracle, runs under any of them (none changes its arithmetic), beside the engines that read it
    ("settings", "offload", "nvme"): {"single", "deepspeed"},
    ("settings", "offload", "cpu"): {"single", "scratch", "fsdp2", "deepspeed"},  # fsdp1's needs CUDA ranks
    ("settings", "prefetch", False): {"single", "scratch", "fsdp1", "fsdp2"},
    ("settings", "prefetch_depth", 2): {"single", "scratch", "fsdp2"},  # FSDP1 prefetches one unit ahead
    ("settings", "reshard_after_forward", False): {"single", "scratch", "fsdp1", "fsdp2"},
}


@pytest.mark.parametrize("setting", list(HONOURS), ids=lambda s: f"{s[1]}={s[2]}")
def test_every_engine_runs_or_refuses_each_option_never_ignores_it(setting, monkeypatch):
    from labkit.engines import ENGINES
    from labkit.engines.validation import validate

    monkeypatch.setattr("labkit.cluster.max_ranks", lambda device_type=None: 8)
    where, key, value = setting
    cfg = (
        RunConfig(world_size=4, options={key: value})
        if where == "options"
        else replace(RunConfig(world_size=4), **{key: value})
    )
    for engine in ENGINES:
        if engine in HONOURS[setting]:
            validate([engine], cfg)
            continue
        with pytest.raises(ValueError) as refused:
            validate([engine], cfg)
        said = str(refused.value)
        assert "\n" not in said and (engine in said or "only the deepspeed engine" in said), said
        assert key in said, said


def test_a_setting_no_engine_of_the_run_reads_is_refused_naming_its_flag(capsys, monkeypatch):
    monkeypatch.setattr("labkit.cluster.rank_limit", lambda device_type=None, limits=None: (8, "8 ranks"))
    assert main(["compare", "--engines", "ddp", "--no-prefetch"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("labkit compare: prefetch=False (--no-prefetch): the engines of this run (ddp)")
    assert err.endswith("it is scratch, fsdp1, fsdp2's") and "\n" not in err
    # An engine of the run that reads it is enough; single, the oracle, runs under any config.
    from labkit.engines.validation import validate

    validate(["ddp", "scratch"], RunConfig(world_size=4, prefetch=False, offload="cpu"))
    validate(["single"], RunConfig(world_size=4, prefetch=False, offload="nvme"))
    with pytest.raises(
        ValueError, match=r"offload='cpu' \(--offload\): the engines of this run \(single, ddp\)"
    ):
        validate(["single", "ddp"], RunConfig(world_size=4, offload="cpu"))


def test_compare_machine_adds_the_calibrated_prediction_beside_the_measured_step(tmp_path, capsys):
    from labkit import budget, calibrate

    share = {"1": 1.0, "2": 0.5}
    fit = {"2": {"latency_s": 1e-3, "gbytes": 1.0}}
    profile = {
        "compute_flops_per_s": 1e10,
        "core_share": share,
        "collectives": dict.fromkeys(calibrate.KINDS, fit),
    }
    machine = tmp_path / "machine.json"
    machine.write_text(json.dumps(profile))
    out = tmp_path / "compare.json"
    argv = [
        "compare",
        "--engines",
        "single,ddp",
        "--steps",
        "2",
        "--machine",
        str(machine),
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    engines = json.loads(out.read_text())["engines"]
    n_params = count_params(build_model("tiny"))
    # single: the whole batch (12 x 48 tokens) on one rank at the full rate, no collectives
    assert engines["single"]["predicted_step_s"] == pytest.approx(6 * n_params * 12 * 48 / 1e10)
    # ddp: half the batch per rank at half the rate, plus one all-reduce (one bucket) of 2(n-1)/n x 4 B/param
    ddp_s = (
        6 * n_params * 6 * 48 / (1e10 * 0.5)
        + 1e-3
        + budget.collective_wire_bytes("all_reduce", 4 * n_params, 2) / 1e9
    )
    assert engines["ddp"]["predicted_step_s"] == pytest.approx(ddp_s)
    assert "ddp: predicted" in printed and "predicted/measured" in printed
    assert main(["compare", "--engines", "single", "--machine", str(tmp_path / "none.json")]) == 2
    assert "labkit compare: --machine: cannot read the machine profile" in capsys.readouterr().err
    # a profile that cannot price the run (no fit at 4 ranks) is refused before any engine trains
    assert main(["compare", "--engines", "single,ddp", "--world-size", "4", "--machine", str(machine)]) == 2
    err = capsys.readouterr().err
    assert "labkit compare: --machine: the machine profile has no" in err and "world_size=4" in err
    assert "done in" not in err
    # a profile of the wrong shape, or not text, in one sentence
    machine.write_text(json.dumps({**profile, "core_share": [0.5]}))
    assert main(["compare", "--engines", "single", "--machine", str(machine)]) == 2
    assert "core_share maps world sizes to shares" in capsys.readouterr().err
    machine.write_bytes(b"\xff\xfe\x00binary")
    assert main(["compare", "--engines", "single", "--machine", str(machine)]) == 2
    assert "is not JSON" in capsys.readouterr().err
