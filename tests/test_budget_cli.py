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
    argv = [
        "budget",
        "--params",
        "7e9",
        "--world-size",
        "16",
        "--strategy",
        "zero2",
        "--tokens-per-rank",
        "4096",
        "--link-gbytes",
        "25",
        "--peak-tflops",
        "312",
        "--mfu",
        "0.5",
        "--precision",
        "fp32",
        "--json",
        str(out),
    ]
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
        (["--params", "70GB", "--world-size", "8"], "--params"),
        (["--params", "70B", "--world-size", "8", "--gpu-memory", "80Gb"], "--gpu-memory"),
        (["--params", "70B", "--world-size", "8", "--gpu-memory", "0GB"], "--gpu-memory"),
        (["--params", "70B", "--world-size", "8", "--host-memory", "lots"], "--host-memory"),
        (["--params", "70B", "--world-size", "8", "--link-gbytes", "400Gb/s"], "--link-gbytes"),
        (["--params", "70B", "--world-size", "most"], "--world-size"),
        (["--params", "30e9", "--world-size", "auto", "--strategy", "ddp"], "--world-size auto"),
        (["--params", "30e9", "--world-size", "auto", "--mfu", "2"], "--mfu"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, flag, capsys):
    assert main(["budget", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and lines[0].startswith("labkit budget")
    assert captured.out == ""


def test_bad_input_in_a_real_process_has_no_traceback():
    cmd = [
        sys.executable,
        "-m",
        "labkit",
        "budget",
        "--params",
        "30e9",
        "--world-size",
        "256",
        "--strategy",
        "hsdp",
        "--group-size",
        "3",
    ]
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


def test_size_suffixes_reach_plan(capsys):
    argv = [
        "budget",
        "--params",
        "70B",
        "--world-size",
        "8",
        "--gpu-memory",
        "141GB",
        "--host-memory",
        "1TB",
        "--link-gbytes",
        "50GB/s",
        "--intra-gbytes",
        "0.9TB/s",
        "--offload-optimizer",
        "cpu",
        "--json",
        "-",
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    expected = budget.plan(
        70e9, 8, gpu_memory_bytes=141e9, host_memory_bytes=1e12, intra_gbytes=900.0, offload_optimizer="cpu"
    )
    assert result == json.loads(json.dumps(expected))
    assert result["params"] == 70_000_000_000 and result["options"]["intra_gbytes"] == 900.0
    args = build_parser().parse_args(
        ["budget", "--params", "125M", "--world-size", "1k", "--gpu-memory", "80GiB"]
    )
    assert (args.params, args.world_size, args.gpu_memory_bytes) == (125_000_000, 1000, 80 * 2**30)


def test_size_errors_say_what_would_do(capsys):
    assert main(["budget", "--params", "70GB", "--world-size", "8"]) == 2
    assert capsys.readouterr().err.strip() == (
        "labkit budget: argument --params: '70GB' is not a number of parameters; write one such as 70B, 125M, "
        "16k or 7e9 (k, M, B, T: decimal)."
    )
    assert main(["budget", "--params", "70B", "--world-size", "8", "--link-gbytes", "400Gb/s"]) == 2
    assert "(400 Gb/s of bits is 50GB/s)" in capsys.readouterr().err


def test_does_it_fit_and_the_assumptions_are_printed(capsys):
    assert (
        main(["budget", "--params", "30e9", "--world-size", "512", "--strategy", "hsdp", "--group-size", "8"])
        == 0
    )
    out = capsys.readouterr().out
    assert "verdict, GPU: fits: 60 GB state and buffers per rank of 80 GB, 20 GB left for activations" in out
    tail = out[out.index("\nassumptions\n") :]
    for shown in (
        "16384 tokens",
        "989 TFLOP/s",
        "0.4",
        "50 GB/s",
        "450 GB/s",
        "25 GB/s",
        "5 GB/s",
        "1B params/s",
    ):
        assert shown in tail, shown
    assert (
        main(["budget", "--params", "70B", "--world-size", "8", "--tokens-per-rank", "4096", "--mfu", "0.5"])
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "4096 tokens" in out
        and "does not fit: 140 GB state and buffers per rank is 60 GB more than 80 GB" in out
    )
    assert (
        main(
            [
                "budget",
                "--params",
                "70B",
                "--world-size",
                "8",
                "--offload-optimizer",
                "cpu",
                "--host-memory",
                "1TB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "host optimizer (CPU Adam)" in out and "8.750 s" in out
    assert (
        "verdict, host: does not fit: 1.12 TB per node is 120 GB more than 1 TB of host RAM; only NVMe fits"
        in out
    )


def test_world_size_auto_gives_the_fewest_ranks_that_fit(capsys):
    assert (
        main(["budget", "--params", "30e9", "--world-size", "auto", "--gpu-memory", "80GB", "--json", "-"])
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["world_size"] == 6 and result["fewest_ranks"]["one_fewer"]["world_size"] == 5
    assert {k: v for k, v in result.items() if k != "fewest_ranks"} == json.loads(
        json.dumps(budget.plan(30e9, 6))
    )
    assert main(["budget", "--params", "70B", "--world-size", "auto"]) == 0
    head = capsys.readouterr().out.splitlines()[:2]
    assert head == [
        "70B params on 14 ranks, zero3, bf16_mixed (16 B/param); 1 GB = 1e9 B",
        "fewest ranks that fit: 14 ranks are the fewest at which zero3 fits: 80 GB per rank of 80 GB; at 13 ranks "
        "it needs 86.15 GB.",
    ]
    assert main(["budget", "--params", "30e9", "--world-size", "auto", "--strategy", "ddp"]) == 2
    assert capsys.readouterr().err.strip() == (
        "labkit budget: --world-size auto: nothing fits in --gpu-memory=80 GB: even at 1,048,576 ranks ddp needs "
        "480 GB per rank (state 480 GB); shard more (zero3), offload, or checkpoint activations."
    )


def test_help_lists_the_assumptions():
    sub = next(a for a in build_parser()._subparsers._group_actions if a.dest == "command").choices["budget"]
    lines = sub.format_help().splitlines()
    epilog = lines[
        lines.index("the step time assumes (defaults; every plan prints the values it used):") + 1 :
    ]
    shown = [line[:44].split() for line in epilog[:-1]]  # the flag and its default, in two columns
    assert shown == [
        ["--tokens-per-rank", "16384", "tokens"],
        ["--peak-tflops", "989", "TFLOP/s"],
        ["--mfu", "0.4"],
        ["--link-gbytes", "50", "GB/s"],
        ["--intra-gbytes", "450", "GB/s"],
        ["--host-gbytes", "25", "GB/s"],
        ["--nvme-gbytes", "5", "GB/s"],
        ["--host-adam-params-per-s", "1B", "params/s"],
    ]
    assert [i.name for i in budget.INPUTS if i.spec.assumption] == [
        "tokens_per_rank",
        "peak_tflops",
        "mfu",
        "link_gbytes",
        "intra_gbytes",
        "host_gbytes",
        "nvme_gbytes",
        "host_adam_params_per_s",
    ]
    text = " ".join(lines)
    text = " ".join(text.split())
    assert (
        "--gpu-memory N memory of one GPU, for the verdict (an H100: 80 GB) [bytes] (default: 80 GB)" in text
    )
    assert "or auto: the fewest that fit --gpu-memory" in text


UNREAD = {  # an input, a value other than its default, and a plan that does not read it
    "group_size": (8, {}),
    "reshard_after_forward": (False, {"strategy": "ddp"}),
    "prefetch": (False, {"strategy": "zero2"}),
    "quant_block_elems": (128, {}),
    "nvme_gbytes": (3.0, {"offload_optimizer": "cpu"}),
    "host_gbytes": (10.0, {}),
    "host_adam_params_per_s": (5e8, {"offload_params": "cpu"}),
    "attention_heads": (16, {}),
    "seq_len": (2048, {}),
    "micro_batch": (2, {}),
    "vocab_size": (50_000, {}),
    "zero_init": (False, {}),
    "additional_buffer_factor": (2.0, {}),
}


@pytest.mark.parametrize("name", sorted(UNREAD))
def test_a_flag_the_plan_would_not_read_is_refused_and_truly_changes_nothing(name, capsys):
    from labkit.cli.budget import _FLAGS

    value, base = UNREAD[name]
    without = budget.plan(7e9, 16, **base)
    given = budget.plan(7e9, 16, **base, **{name: value})
    echoed = ("options", "assumptions")  # the inputs, as the plan repeats them
    assert {k: v for k, v in given.items() if k not in echoed} == {
        k: v for k, v in without.items() if k not in echoed
    }  # the refusal's sentence is true: the plan comes out the same
    flag = _FLAGS[name]
    typed = [flag] if isinstance(value, bool) else [flag, str(value)]
    argv = ["budget", "--params", "7e9", "--world-size", "16"]
    argv += [f"{_FLAGS[k]}={v}" for k, v in base.items()]
    assert main([*argv, *typed]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"{flag} would change nothing in this plan" in err
