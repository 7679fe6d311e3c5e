"""The benchmark scripts' contracts that hold on any machine (their figures are in benchmarks/results.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run the GPU scripts themselves")
@pytest.mark.parametrize(
    ("script", "sentence"),
    [
        ("gpu.py", "benchmarks/gpu.py: no CUDA device here; run it on a machine with a GPU"),
        (
            "gpu_smoke.py",
            "benchmarks/gpu_smoke.py: no CUDA device is visible here; run it on a machine with a GPU",
        ),
    ],
)
def test_the_gpu_scripts_refuse_without_cuda_in_one_sentence(tmp_path, script, sentence):
    out = subprocess.run(
        [sys.executable, ROOT / "benchmarks" / script, "--out", tmp_path / "r.md"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [sentence]
    assert not (tmp_path / "r.md").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run the GPU scripts themselves")
def test_the_gpu_session_refuses_an_unknown_part_and_reports_a_missing_gpu_under_out(tmp_path):
    """The prepared device call: PART is checked first; on a CPU machine the smoke's own sentence lands in
    $OUT, with its exit status, where the device tool brings files back from (no wheels carried here)."""
    script = ["bash", ROOT / "benchmarks" / "gpu_session.sh"]
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "PY": sys.executable, "WHEELS": str(tmp_path)}
    bad = subprocess.run(script, env=env | {"PART": "all"}, capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.strip() == "gpu_session.sh: PART=all; pass smoke or bench"
    done = subprocess.run(script, env=env, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "smoke.log").read_text()
    assert "no CUDA device is visible here" in log and log.endswith("gpu_smoke.py exit status 2\n"), log


def results_figures(markdown: str) -> dict:
    """The figures of benchmarks/results.md that the README quotes: the run's date, each step-time row
    {(model, ranks, dtype): (scratch s, fsdp2 s, ratio)}, each exposed-comm ratio, the probes' cost and the
    course's total seconds."""
    lines = markdown.splitlines()
    date = re.match(r"# Benchmarks \((\d{4}-\d\d-\d\d), ", lines[0])
    assert date, (
        "benchmarks/results.md does not start with '# Benchmarks (DATE, ...)': regenerate it (make bench)"
    )
    steps, exposed = {}, {}
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 8 and cells[1].isdigit() and cells[2] in ("float32", "bfloat16"):
            steps[(cells[0], int(cells[1]), cells[2])] = (cells[3], cells[4], cells[7])
        elif len(cells) == 10 and cells[1].isdigit():
            exposed[cells[0]] = cells[6]
    probes = re.search(r"median difference of a pair ([+-]\d+\.\d)% of the bare step", markdown)
    total = re.search(r"^- total (\d+) s", markdown, re.M)
    assert steps and exposed and probes and total, (
        "benchmarks/results.md lacks a section: regenerate it (make bench)"
    )
    return {"date": date[1], "steps": steps, "exposed": exposed, "probes": probes[1], "course_s": total[1]}


def test_readme_performance_quotes_the_benchmark_results():
    figures = results_figures((ROOT / "benchmarks" / "results.md").read_text())
    readme = (ROOT / "README.md").read_text()
    prose = readme.split("## Performance", 1)[1].split("\n## ", 1)[0]
    section = " ".join(prose.split())  # a figure may be split across lines
    assert f"measured on {figures['date']}" in section
    for model in ("tiny", "small"):
        scratch_s, fsdp2_s, ratio = figures["steps"][(model, 4, "float32")]
        assert f"`{model}` 4 ranks fp32 {scratch_s} / {fsdp2_s} = {ratio}" in section, model
    for model, ratio in figures["exposed"].items():
        assert f"{ratio}x on `{model}`" in section, model
    assert f"{figures['probes']}% of the bare step" in section
    assert f"{figures['course_s']} s (target < 600 s)" in section


def test_the_gpu_model_family_and_its_mfu_arithmetic_on_the_cpu():
    """gpt-125m and gpt-1b are the lab's GPT at GPU sizes (counted on the meta device), gpt-125m trains a
    step on the CPU on a slice of its batch, and MFU is 6 N T / step / peak with the datasheet's peak."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu import DATASHEET_TFLOPS, peak_flops

    from labkit.budget import model_flops_utilisation
    from labkit.engines.base import RunConfig
    from labkit.engines.single import SingleEngine
    from labkit.model import GPT, batch, build_model, config, count_params

    with torch.device("meta"):
        sizes = {name: count_params(GPT(config(name))) for name in ("gpt-125m", "gpt-1b")}
    assert 120e6 < sizes["gpt-125m"] < 130e6 and 0.95e9 < sizes["gpt-1b"] < 1.1e9, sizes
    engine = SingleEngine(build_model("gpt-125m"), RunConfig(model="gpt-125m"), torch.device("cpu"))
    tokens, targets = batch(0, "gpt-125m")
    losses = []
    for _ in range(2):  # one sequence of 32 tokens: a CPU step of a GPU-sized model
        loss = engine.forward_loss(tokens[:1, :32], targets[:1, :32])
        engine.backward(loss)
        engine.optimizer_step()
        losses.append(loss.item())
    assert losses[1] < losses[0], losses
    assert peak_flops("NVIDIA H200", "bfloat16") == (DATASHEET_TFLOPS["H200"][0] * 1e12, "H200 datasheet")
    assert peak_flops("Some Other GPU", "float32") is None  # measured instead
    # the fact sheet's case: 6 x 30e9 x 16,384 FLOPs in 7.4 s on a 989 TFLOP/s GPU is about 40% MFU
    assert model_flops_utilisation(30e9, 16384, 7.45, 989e12) == pytest.approx(0.40, abs=0.005)


def test_a_whole_report_keeps_the_sections_other_benchmarks_put_in_the_file(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from sections import write_report, write_section

    out = tmp_path / "results.md"
    write_report(str(out), ["# Benchmarks", "", "## Step time", "old", "", "## Against the targets", "- old"])
    write_section(str(out), "## CPU Adam throughput", ["## CPU Adam throughput (params/s)", "1e9"])
    write_report(
        str(out), ["# Benchmarks", "", "## Step time", "new", "", "## Against the targets", "- new"], True
    )
    text = out.read_text()
    assert "new" in text and "old" not in text  # its own sections replaced
    assert text.index("## Against the targets") < text.index("## CPU Adam throughput (params/s)\n1e9")
    write_report(
        str(out), ["# Benchmarks", "", "## Step time", "again"]
    )  # without keep_others: the whole file
    assert "CPU Adam" not in out.read_text()
