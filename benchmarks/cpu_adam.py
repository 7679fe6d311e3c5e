"""CPU Adam throughput on this machine: params per second of one AdamW step on the host, three optimizers.

    python benchmarks/cpu_adam.py [--numels 1e6,1e7] [--reps 7] [--out benchmarks/results.md]

What an offloaded optimizer costs per step is params / this rate (`labkit.budget`'s host Adam input):
- `DeepSpeedCPUAdam` (deepspeed.ops.adam, AdamW mode: DeepSpeed's vectorised C++ op, what ZeRO-Offload runs),
- labkit's `ShardedAdamW(offload=True)` (labkit/zero/optimizer.py: copy the gradient in, AdamW in torch ops
  on the host master copy, copy the weights back),
- plain `torch.optim.AdamW` (its default for-loop path, and `fused=True`).
Each on one fp32 tensor of N elements with a gradient, at one thread and at all of this process's threads;
a figure is N / the median step time over `reps` steps after two warm-up steps, the optimizers interleaved.
It writes its section into `--out` in place (the rest of the file is run_all.py's).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
from sections import write_section  # benchmarks/sections.py (a script's own folder is on sys.path)

SECTION = "## CPU Adam throughput"
HYPER = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}  # the lab's RunConfig AdamW


def _deepspeed_cpu_adam(p: torch.Tensor) -> Callable[[], None]:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    opt = DeepSpeedCPUAdam([p], adamw_mode=True, **HYPER)
    return opt.step


def _labkit_offloaded(p: torch.Tensor) -> Callable[[], None]:
    from labkit.zero import ShardedAdamW

    return ShardedAdamW([p], offload=True, **HYPER).step


def _torch_adamw(fused: bool) -> Callable[[torch.Tensor], Callable[[], None]]:
    def make(p: torch.Tensor) -> Callable[[], None]:
        return torch.optim.AdamW([p], fused=fused, **HYPER).step

    return make


OPTIMIZERS: dict[str, Callable[[torch.Tensor], Callable[[], None]]] = {
    "DeepSpeedCPUAdam": _deepspeed_cpu_adam,
    "labkit ShardedAdamW (offload)": _labkit_offloaded,
    "torch AdamW": _torch_adamw(fused=False),
    "torch AdamW (fused)": _torch_adamw(fused=True),
}


def cpu_adam_ready() -> str | None:
    """None when DeepSpeed's cpu_adam op was built at set-up, else the sentence saying how to build it."""
    from labkit import prebuild

    status = prebuild.op_status("cpu_adam").status
    return (
        None if status == "built" else f"DeepSpeed's cpu_adam op is {status}: run `python -m labkit.prebuild`"
    )


def params_per_s(numel: int, threads: int, reps: int, names: list[str]) -> dict[str, float]:
    """{optimizer: params per second} for one fp32 tensor of `numel` elements at `threads` threads."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    steps = {}
    for name in names:
        p = torch.nn.Parameter(torch.randn(numel, generator=gen))
        p.grad = torch.randn(numel, generator=gen) * 1e-3
        steps[name] = OPTIMIZERS[name](p)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps + 2):
        for name in names:  # interleaved, so a machine that slows down slows every optimizer alike
            start = time.perf_counter()
            steps[name]()
            if rep >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: numel / statistics.median(t) for name, t in times.items()}


def measure(numels: list[int], reps: int) -> dict[tuple[str, int, int], float]:
    """{(optimizer, threads, numel): params per second}, at one thread and at all threads."""
    names = list(OPTIMIZERS) if cpu_adam_ready() is None else [n for n in OPTIMIZERS if "DeepSpeed" not in n]
    all_threads = torch.get_num_threads()
    out = {}
    for threads in sorted({1, all_threads}):
        for numel in numels:
            for name, rate in params_per_s(numel, threads, reps, names).items():
                out[(name, threads, numel)] = rate
    torch.set_num_threads(all_threads)
    return out


def section_lines(rates: dict[tuple[str, int, int], float]) -> list[str]:
    """The results.md section: one row per optimizer and thread count, one column per tensor size."""
    numels = sorted({k[2] for k in rates})
    lines = [
        f"{SECTION} (params/s, one AdamW step on one fp32 tensor; median of interleaved steps)",
        "",
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; load "
        f"average {', '.join(f'{x:.1f}' for x in os.getloadavg())} (1, 5, 15 min) as it ended: other work "
        "shared the CPUs. What `labkit.budget`'s host Adam time divides by; DeepSpeedCPUAdam is what "
        "DeepSpeed's ZeRO-Offload runs.",
        "",
        "| optimizer | threads | " + " | ".join(f"{n:.0e} params" for n in numels) + " |",
        "|---|---|" + "---|" * len(numels),
    ]
    for name, threads in dict.fromkeys((k[0], k[1]) for k in rates):
        cells = " | ".join(f"{rates[(name, threads, n)]:.3g}" for n in numels)
        lines.append(f"| {name} | {threads} | {cells} |")
    if cpu_adam_ready() is not None:
        lines += ["", f"DeepSpeedCPUAdam not measured: {cpu_adam_ready()}."]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numels", default="1e6,1e7", help="tensor sizes, comma-separated (elements)")
    parser.add_argument("--reps", type=int, default=7, help="timed steps per optimizer and size")
    parser.add_argument("--out", default="benchmarks/results.md")
    args = parser.parse_args(argv)
    numels = [int(float(x)) for x in args.numels.split(",")]
    rates = measure(numels, args.reps)
    lines = section_lines(rates)
    write_section(args.out, SECTION, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
