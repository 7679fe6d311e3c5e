"""The benchmark on CUDA devices: the engines side by side over NCCL, and stream overlap sized to the comm.

    python benchmarks/gpu.py [--out benchmarks/results-gpu.md] [--reps 3] [--steps 6]

For a machine with a GPU (about two minutes on one). Two parts, both medians of interleaved repetitions,
in milliseconds:
1. step time and MFU of scratch / fsdp2 / deepspeed / ddp on `gpt-125m` (`--model gpt-1b` for the ~1B one;
   fp32 and bf16), with the ratio to fsdp2: every (engine, dtype, repetition) run in ONE launch
   (`loop.run_many`), one rank per visible GPU up to 4 (world size 1 on one GPU: the collectives are then
   device copies, so this times the engines' own overhead, not a network). MFU is 6 x params x tokens per
   step / step time / the GPUs' peak (`budget.model_flops_utilisation`): the datasheet's dense peak for a
   GPU `DATASHEET_TFLOPS` knows, else a measured matmul's rate, said beside it;
2. CUDA-stream overlap: an all-gather on a side stream while the default stream multiplies matrices,
   timed with CUDA events: comm alone, compute alone, both together, and the fraction of the shorter one
   hidden ((comm + compute - both) / min(comm, compute); 1.0 = fully overlapped). The compute is sized to
   the comm (as many 2048^3 matmuls as take the all-gather's time), so neither hides the other by sheer
   size. On one GPU the all-gather is NCCL's local copy; with two or more it crosses the interconnect.
`benchmarks/gpu_smoke.py` runs part of this too (`benchmark_lines`) and writes it beside its checks.
Without CUDA it says so in one sentence and exits 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from sections import write_report  # benchmarks/sections.py (a script's own folder is on sys.path)

import labkit
from labkit import cluster
from labkit.budget import model_flops_utilisation
from labkit.engines.base import RunConfig
from labkit.engines.loop import run_many
from labkit.engines.run_config import DTYPE_BYTES
from labkit.model import GPT, count_params
from labkit.model import config as model_config
from labkit.tables import median_step_s

ENGINES = ("scratch", "fsdp2", "deepspeed", "ddp")
MATMUL_N = 2048
# Dense peak TFLOP/s per GPU from the vendors' datasheets (SXM parts): (bf16 tensor cores, fp32 without TF32,
# torch's default for fp32 matmuls). A GPU not listed is measured instead (`measured_peak_flops`).
DATASHEET_TFLOPS = {"H200": (989.0, 67.0), "H100": (989.0, 67.0), "A100": (312.0, 19.5), "L4": (121.0, 30.3)}


def peak_flops(device_name: str, dtype: str) -> tuple[float, str] | None:
    """(peak FLOP/s of one GPU in `dtype`, where it comes from) from `DATASHEET_TFLOPS`, or None."""
    for gpu, (bf16, fp32) in DATASHEET_TFLOPS.items():
        if gpu in device_name.upper():
            return (bf16 if dtype == "bfloat16" else fp32) * 1e12, f"{gpu} datasheet"
    return None


def measured_peak_flops(dtype: str, n: int = 8192, reps: int = 10) -> float:
    """FLOP/s of n x n matmuls in `dtype` on this GPU, timed with CUDA events (a floor of its real peak)."""
    a = torch.randn(n, n, device="cuda", dtype=getattr(torch, dtype))
    a @ a  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ a
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) / 1e3)


def step_times_ms(engines: list[str], cfgs: list[RunConfig], reps: int) -> dict[tuple[str, str], float]:
    """{(engine, dtype): median step time (ms)} of every engine under every cfg, all in one launch, the
    engines interleaved (A B C A B C ...) so a machine that slows down slows every engine alike."""
    runs = [(e, cfg) for _ in range(reps) for cfg in cfgs for e in engines]
    samples: dict[tuple[str, str], list[float]] = {}
    for (engine, cfg), rec in zip(runs, run_many(runs, timeout_s=900.0), strict=True):
        samples.setdefault((engine, cfg.dtype), []).append(median_step_s(rec) * 1e3)
    return {key: statistics.median(v) for key, v in samples.items()}


def _stream_overlap(numel: int, reps: int) -> dict[str, float]:
    """Rank side: CUDA-event times (ms) of an all-gather of `numel` fp32 elements per rank and of matmuls
    sized to take about as long, alone and on two streams at once; medians over `reps`."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device())
    shard = torch.randn(numel, device=device)
    full = torch.empty(numel * dist.get_world_size(), device=device)
    a = torch.randn(MATMUL_N, MATMUL_N, device=device)
    side = torch.cuda.Stream()

    def timed(comm: bool, matmuls: int) -> float:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if comm:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                dist.all_gather_into_tensor(full, shard)
        for _ in range(matmuls):
            a @ a
        if comm:
            torch.cuda.current_stream().wait_stream(side)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    for _ in range(2):  # warm-up: NCCL communicator, cuBLAS handles
        timed(True, 1)
    comm_ms = statistics.median(timed(True, 0) for _ in range(reps))
    matmul_ms = statistics.median(timed(False, 1) for _ in range(reps))
    matmuls = max(1, round(comm_ms / matmul_ms))
    samples = {k: [] for k in ("comm", "compute", "both")}
    for _ in range(reps):
        samples["comm"].append(timed(True, 0))
        samples["compute"].append(timed(False, matmuls))
        samples["both"].append(timed(True, matmuls))
    return {**{k: statistics.median(v) for k, v in samples.items()}, "matmuls": matmuls}


def benchmark_lines(reps: int, steps: int, model: str = "gpt-125m") -> list[str]:
    """The benchmark's Markdown: the step-time and MFU table, then the overlap line (times in ms)."""
    gpus = cluster.visible_gpus() or 1
    world_size = min(gpus, 4)
    engines = list(ENGINES)
    cfgs = [RunConfig(model=model, world_size=world_size, steps=steps, dtype=d) for d in DTYPE_BYTES]
    times = step_times_ms(engines, cfgs, reps)
    shape = model_config(model)
    with torch.device("meta"):  # counted without allocating a 1B model's weights
        params = count_params(GPT(shape))
    tokens = shape.global_batch * shape.seq_len
    lines = [
        f"## Step time and MFU, {model} ({params:,} params, {tokens:,} tokens per step), {world_size} rank(s) "
        f"on {world_size} GPU(s), NCCL (median ms per step, MFU; ratio to fsdp2)",
        "",
        "| model | dtype | peak per GPU | " + " | ".join(engines) + " | scratch/fsdp2 |",
        "|---|---|---|" + "---|" * len(engines) + "---|",
    ]
    for cfg in cfgs:
        peak, source = peak_flops(torch.cuda.get_device_name(0), cfg.dtype) or (
            measured_peak_flops(cfg.dtype),
            "measured matmul",
        )
        cells = " | ".join(
            f"{times[(e, cfg.dtype)]:.1f} ms, MFU "
            f"{model_flops_utilisation(params, tokens, times[(e, cfg.dtype)] / 1e3, peak * world_size):.1%}"
            for e in engines
        )
        ratio = times[("scratch", cfg.dtype)] / times[("fsdp2", cfg.dtype)]
        lines.append(
            f"| {model} | {cfg.dtype} | {peak / 1e12:.0f} TFLOP/s ({source}) | {cells} | {ratio:.2f} |"
        )
    numel = 16 * 2**20  # 64 MB of fp32 per rank
    ms = labkit.launch(_stream_overlap, world_size, numel, max(reps, 5))[0]
    hidden = (ms["comm"] + ms["compute"] - ms["both"]) / min(ms["comm"], ms["compute"])
    copy = "NCCL's local copy on one GPU" if world_size == 1 else f"over {world_size} GPUs"
    lines += [
        "",
        f"## CUDA-stream overlap (all-gather of {numel * 4 * world_size // 2**20} MiB, {copy}; "
        f"{ms['matmuls']} matmuls {MATMUL_N}^3 sized to it)",
        "",
        f"comm alone {ms['comm']:.2f} ms, compute alone {ms['compute']:.2f} ms, both {ms['both']:.2f} ms: "
        f"{hidden:.0%} of the shorter one hidden",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results-gpu.md")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", default="gpt-125m", help="gpt-125m, gpt-1b, or any model of labkit.model")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here; run it on a machine with a GPU", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(0)
    lines = [
        f"# GPU benchmark ({time.strftime('%Y-%m-%d')}, {name}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))})",
        "",
        *benchmark_lines(args.reps, args.steps, args.model),
    ]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
