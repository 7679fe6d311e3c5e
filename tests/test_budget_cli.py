"""`labkit budget`: the table, --json, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from labkit import budget
from labkit.cli import build_parser, main

CONTRACT_KEYS = {
    "static_bytes_total",
    "state_bytes_per_rank",
    "traffic_bytes_per_rank",
    "comm_time_s",
    "compute_time_s",
}


def test_table_shows_the_fact_sheet_numbers(capsys):
    assert main(["budget", "--params", "30e9", "--world-size", "256"]) == 0
    out = capsys.readouterr().out
    assert "30B params on 256 ranks, zero3" in out
    assert "1.875 GB" in out and "480 GB" in out and "179.3 GB" in out and "180 GB" in out
    assert "3.586 s" in out and "7.455 s" in out


def test_json_to_stdout_is_plan(capsys):
    argv = [
        "budget",
        "--params",
        "30e9",
        "--world-size",
        "512",
        "--strategy",
        "hsdp",
        "--group-size",
        "8",
        "--json",
        "-",
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)  # stdout is JSON only
    assert CONTRACT_KEYS <= set(result)
    expected = json.loads(json.dumps(budget.plan(30e9, 512, "hsdp", group_size=8)))
    assert result == expected
    assert result["traffic_bytes_by_link"] == {"intra_node": 157_500_000_000, "inter_node": 14_765_625_000}


def test_json_to_file_and_options_reach_plan(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["budget", "--params", "7e9", "--world-size", "16", "--strategy", "zero2", "--tokens-per-rank", "4096",
            "--link-gbytes", "25", "--peak-tflops", "312", "--mfu", "0.5", "--precision", "fp32", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "zero2" in capsys.readouterr().out  # the table still prints
    result = json.loads(out.read_text())
    assert result["compute_time_s"] == pytest.approx(6 * 7e9 * 4096 / (312e12 * 0.5))
    assert result["precision"] == "fp32" and result["memory_bytes_per_rank"]["master"] == 0
    assert result["options"]["link_gbytes"] == 25


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--params", "0", "--world-size", "8"], "--params"),
        (["--params", "-3e9", "--world-size", "8"], "--params"),
        (["--params", "30e9", "--world-size", "0"], "--world-size"),
        (
            ["--params", "30e9", "--world-size", "256", "--strategy", "hsdp", "--group-size", "3"],
            "--group-size",
        ),
        (["--params", "30e9", "--world-size", "256", "--group-size", "7"], "--group-size"),
        (["--params", "30e9", "--world-size", "256", "--strategy", "zero9"], "--strategy"),
        (["--params", "lots", "--world-size", "256"], "--params"),
        (["--params", "30e9", "--world-size", "256", "--mfu", "1.2"], "--mfu"),
        (
            ["--params", "30e9", "--world-size", "8", "--strategy", "ddp", "--offload-params", "cpu"],
            "--offload-params",
        ),
        (["--world-size", "8"], "--params"),
        (["--params", "30e9", "--world-size", "2.5"], "--world-size"),
        (
            ["--params", "30e9", "--world-size", "8", "--largest-layer-params", "1.5"],
            "--largest-layer-params",
        ),
        (["--params", "30e9", "--world-size", "8", "--strategy", "hsdp", "--qwz"], "--qwz"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, flag, capsys):
    assert main(["budget", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and lines[0].startswith("labkit budget")
    assert captured.out == ""


def test_bad_input_in_a_real_process_has_no_traceback():
    cmd = [sys.executable, "-m", "labkit", "budget", "--params", "30e9", "--world-size", "256", "--strategy", "hsdp",
           "--group-size", "3"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "--group-size=3 does not divide --world-size=256" in proc.stderr


def test_flags_are_made_from_plan_inputs():
    parser = build_parser()
    args = parser.parse_args(["budget", "--params", "30e9", "--world-size", "256"])
    assert args.params == 30_000_000_000 and args.world_size == 256
    for name, default in budget.DEFAULTS.items():
        assert getattr(args, name) == default, name  # every input has a flag, with plan()'s default
    on = parser.parse_args(["budget", "--params", "1e9", "--world-size", "8", "--no-prefetch", "--qgz"])
    assert (on.prefetch, on.qgz, on.reshard_after_forward) == (False, True, True)
    sub = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices["budget"]
    text = " ".join(sub.format_help().split())  # unwrapped
    assert "[GB/s] (default: 50)" in text and "[TFLOP/s] (default: 989)" in text and "--no-zero-init" in text


def test_help_imports_no_torch():
    """`labkit --help` and `labkit budget --help` answer without importing torch (the CLI's promise)."""
    code = (
        "import sys\n"
        "from labkit.cli import main\n"
        "for argv in (['--help'], ['budget', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, e\n"
        "print('torch' in sys.modules, file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--tokens-per-rank" in proc.stdout
    assert proc.stderr.strip() == "False"
