"""The benchmark scripts' contracts that hold on any machine (their figures are in benchmarks/results.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run benchmarks/gpu.py itself")
def test_gpu_benchmark_refuses_without_cuda_in_one_sentence(tmp_path):
    out = subprocess.run([sys.executable, ROOT / "benchmarks" / "gpu.py", "--out", tmp_path / "r.md"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "benchmarks/gpu.py: no CUDA device here; run it on a machine with a GPU"
    ]
    assert not (tmp_path / "r.md").exists()
