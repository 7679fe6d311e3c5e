"""The benchmark on one CUDA device: engines side by side over NCCL (world size 1), and stream overlap.

    python benchmarks/gpu.py [--out benchmarks/results-gpu.md] [--reps 3] [--steps 6]

For a machine with a GPU (under five minutes on one). Two parts, both medians of interleaved repetitions:
1. step time of scratch / fsdp2 / deepspeed / ddp on `small` (fp32 and bf16), one rank on one GPU, NCCL
   (the code path of a GPU hub; on one rank the collectives are device copies, so this times the engines'
   own overhead, not a network), with the ratio to fsdp2;
2. CUDA-stream overlap: an all-gather on a side stream while the default stream multiplies matrices, timed
   with CUDA events: comm alone, compute alone, both together, and the fraction of the shorter one hidden
   ((comm + compute - both) / min(comm, compute); 1.0 = fully overlapped).
Without CUDA it says so in one sentence and exits 2.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_all import step_times  # noqa: E402 (the CPU benchmark's interleaved timing, shared)

import labkit  # noqa: E402
from labkit.engines.base import RunConfig  # noqa: E402
from labkit.engines.loop import available_engines  # noqa: E402


def _stream_overlap(numel: int, matmul_n: int, reps: int) -> dict[str, float]:
    """Rank side: CUDA-event times (ms) of an all-gather of `numel` fp32 elements and of `matmul_n`^3
    matmuls, alone and on two streams at once; medians over `reps`."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device())
    shard = torch.randn(numel, device=device)
    full = torch.empty(numel * dist.get_world_size(), device=device)
    a = torch.randn(matmul_n, matmul_n, device=device)
    side = torch.cuda.Stream()

    def timed(comm: bool, compute: bool) -> float:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if comm:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                dist.all_gather_into_tensor(full, shard)
        if compute:
            for _ in range(8):
                a @ a
        if comm:
            torch.cuda.current_stream().wait_stream(side)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    for _ in range(2):  # warm-up: NCCL communicator, cuBLAS handles
        timed(True, True)
    samples = {k: [] for k in ("comm", "compute", "both")}
    for _ in range(reps):
        samples["comm"].append(timed(True, False))
        samples["compute"].append(timed(False, True))
        samples["both"].append(timed(True, True))
    return {k: statistics.median(v) for k, v in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results-gpu.md")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here; run it on a machine with a GPU", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0)
    engines = [e for e in ("scratch", "fsdp2", "deepspeed", "ddp") if e in available_engines()]
    lines = [
        f"# GPU benchmark ({time.strftime('%Y-%m-%d')}, {name}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, NCCL, world size 1)",
        "",
        "## Step time (median s per step; ratio to fsdp2)",
        "",
        "| model | dtype | " + " | ".join(engines) + " | scratch/fsdp2 |",
        "|---|---|" + "---|" * len(engines) + "---|",
    ]
    for dtype in ("float32", "bfloat16"):
        cfg = RunConfig(model="small", world_size=1, steps=args.steps, dtype=dtype)
        times = step_times(engines, cfg, args.reps)
        cells = " | ".join(f"{times[e]:.4f}" for e in engines)
        lines.append(f"| small | {dtype} | {cells} | {times['scratch'] / times['fsdp2']:.2f} |")
        print(lines[-1], flush=True)

    ms = labkit.launch(_stream_overlap, 1, 64 * 2**20, 4096, max(args.reps, 5))[0]
    hidden = (ms["comm"] + ms["compute"] - ms["both"]) / min(ms["comm"], ms["compute"])
    lines += ["", "## CUDA-stream overlap (all-gather of 256 MB on a side stream, 8 matmuls 4096^3)", "",
              f"comm alone {ms['comm']:.2f} ms, compute alone {ms['compute']:.2f} ms, both {ms['both']:.2f} ms: "
              f"{hidden:.0%} of the shorter one hidden"]  # fmt: skip
    text = "\n".join(lines) + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
