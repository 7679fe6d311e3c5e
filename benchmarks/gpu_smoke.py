"""The lab's CUDA path, end to end, on whatever GPUs this machine shows: one command, under 10 minutes.

    python benchmarks/gpu_smoke.py [--out benchmarks/results-gpu.md] [--budget-s 480]
                                   [--skip-prebuild] [--skip-notebooks] [--skip-benchmark]

Checks, each one row (passed / FAILED / skipped, with why, and its seconds):
- environment: versions (torch, CUDA, NCCL, DeepSpeed), the GPUs (NVML's count against CUDA's), /dev/shm,
  CUDA_HOME and nvcc, what `labkit.prebuild.plan_ops` plans, `cluster.placement` for 1 to 4 ranks;
- set-up: `python -m labkit.prebuild` (DeepSpeed's CUDA ops, or the sentence saying why not) and
  `labkit doctor` (its 2-rank all-reduce smoke test included);
- collectives: an all-reduce of a CPU tensor and of a CUDA tensor on the device-mapped backend, on one
  rank per GPU (up to 4), with `rank_info()`'s device and backend;
- helpers: every notebook's rank-side helper on CUDA ranks (00's gather/scatter, the scratch hook trace,
  FSDP2's inspections and features, DeepSpeed's accounting, the build-along's checks, a scratch
  checkpoint); those needing more GPUs than here are skipped, saying how many;
- engines: single, ddp, scratch, fsdp1, fsdp2, deepspeed in float32 and bfloat16 against single, their
  state split by device and the CUDA peak (an engine run twice in one launch must peak the same);
- offload: host offload of scratch, fsdp1, fsdp2 and deepspeed on CUDA (optimizer state on "cpu"), NVMe
  offload and ZeRO++ quantization (refused in one sentence when their CUDA op could not be built);
- 1-GPU hub: with CUDA_VISIBLE_DEVICES naming one GPU, a parent that has initialised CUDA launches 2
  CPU ranks (spawned), a comparison at world_size 2 runs `single` on CPU too, and notebooks 00-08 run
  under papermill with their defaults (world sizes 2-4 on CPU ranks), after the GPU checks, two at a
  time, each under its own limit (not the smoke's budget);
- benchmark: `benchmarks/gpu.py`'s step times and stream overlap, short, if time is left.
It writes everything to `--out` and exits 1 if a check failed. Without CUDA it says so in one sentence and
exits 2, writing nothing. It needs the lab's environment with torch's CUDA build and the `python3` Jupyter
kernel (`make lab` on that machine); it downloads nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
NOTEBOOK_TIMEOUT_S = 420
LAUNCH_TIMEOUT_S = 300.0
FP32_REL, BF16_REL = 1e-4, 1e-2  # against float32 single, as the CPU suite holds every engine


@dataclass
class Row:
    section: str
    name: str
    status: str  # "passed", "FAILED", "skipped"
    detail: str
    seconds: float


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"  # whole: the report is read


class Smoke:
    """The checks' rows, and the time budget: a check that would start after the deadline is skipped."""

    def __init__(self, budget_s: float):
        self.rows: list[Row] = []
        self.deadline = time.monotonic() + budget_s

    def check(self, section: str, name: str, fn, *args) -> Any:
        """Run `fn(*args)`: it returns a detail string (passed), or (status, detail), or raises (FAILED)."""
        if time.monotonic() > self.deadline:
            self.rows.append(Row(section, name, "skipped", "out of time (--budget-s)", 0.0))
            return None
        start = time.perf_counter()
        try:
            out = fn(*args)
            status, detail = out if isinstance(out, tuple) else ("passed", out)
        except Exception as e:  # noqa: BLE001 (every failure is a row; the next check still runs)
            status, detail = "FAILED", first_line(e)
        row = Row(section, name, status, str(detail), time.perf_counter() - start)
        self.rows.append(row)
        print(f"[{row.status:>7}] {section}: {name} ({row.seconds:.1f} s) {row.detail}", flush=True)
        return row

    def add(self, section: str, name: str, status: str, detail: str, seconds: float) -> None:
        self.rows.append(Row(section, name, status, detail, seconds))
        print(f"[{status:>7}] {section}: {name} ({seconds:.1f} s) {detail}", flush=True)


def rel_diff(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


# ------------------------------------------------------------------------------------------- environment


def environment() -> dict[str, str]:
    from labkit import cluster, prebuild

    try:
        import deepspeed

        ds = deepspeed.__version__
    except Exception as e:  # noqa: BLE001
        ds = f"not importable ({first_line(e)})"
    shm = os.statvfs("/dev/shm") if os.path.exists("/dev/shm") else None
    tc = prebuild.toolchain()
    names = []
    for i in range(torch.cuda.device_count()):
        gib = torch.cuda.get_device_properties(i).total_memory / 2**30
        sm = "".join(map(str, torch.cuda.get_device_capability(i)))
        names.append(f"{torch.cuda.get_device_name(i)} ({gib:.0f} GiB, sm_{sm})")
    gib = (lambda blocks: f"{blocks * shm.f_frsize / 2**30:.1f} GiB") if shm else None
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "host": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cpus)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "CUDA (torch built for)": str(torch.version.cuda),
        "NCCL": ".".join(map(str, torch.cuda.nccl.version())),
        "DeepSpeed": ds,
        "GPUs (CUDA)": f"{len(names)}: " + "; ".join(names),
        "GPUs (NVML, what placement counts)": str(cluster.visible_gpus()),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)"),
        "/dev/shm": f"{gib(shm.f_blocks)}, {gib(shm.f_bavail)} free" if shm else "absent",
        "CUDA_HOME": str(tc.cuda_home),
        "nvcc": f"{shutil.which('nvcc')} (CUDA {tc.nvcc_release})",
        "libaio": str(tc.libaio),
        "prebuild plan (CUDA ops)": "; ".join(
            f"{op.name}: {op.action}" + (f" ({op.reason})" if op.reason else "")
            for op in prebuild.plan_ops(tc)
            if op.accelerator == "cuda"
        )
        or "none",
        "placement, ranks 1-4": "; ".join(
            f"{n}: {p.backend}/{p.device_type}/{p.start_method}"
            for n, p in ((n, cluster.placement(n)) for n in range(1, 5))
        ),
    }


def check_gpu_count() -> str:
    from labkit import cluster

    nvml, cuda = cluster.visible_gpus(), torch.cuda.device_count()
    if nvml != cuda:
        raise AssertionError(f"NVML counts {nvml} GPUs, CUDA {cuda}: placement would pick the wrong ranks")
    return f"{cuda} GPU(s), NVML and CUDA agree"


def check_shm() -> tuple[str, str]:
    if not os.path.exists("/dev/shm"):
        return "FAILED", "no /dev/shm: NCCL's intra-node transport and DeepSpeed's shm collectives need it"
    shm = os.statvfs("/dev/shm")
    gib = shm.f_bavail * shm.f_frsize / 2**30
    if gib < 1:
        return (
            "FAILED",
            f"only {gib:.2f} GiB free in /dev/shm (docker's default 64 MB stalls NCCL): --shm-size",
        )
    return "passed", f"{gib:.1f} GiB free"


# ------------------------------------------------------------------------------------------------ set-up


def run_prebuild() -> tuple[str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "labkit.prebuild"], capture_output=True, text=True, timeout=600
    )
    said = [ln for ln in out.stderr.splitlines() if ln.startswith("labkit.prebuild:")]
    tail = (out.stdout.strip().splitlines() or [""])[-1]
    if out.returncode:
        return "FAILED", "; ".join(said) or out.stderr.strip()[-300:]
    return "passed", tail + ("; refused: " + " | ".join(said) if said else "")


def run_doctor() -> tuple[str, str]:
    out = subprocess.run(
        [sys.executable, "-m", "labkit", "doctor", "--json", "-"], capture_output=True, text=True, timeout=300
    )
    report = json.loads(out.stdout)
    smoke = report["smoke_test"]
    ops = report["deepspeed_ops"]
    detail = (
        f"backend {report['backend']['backend']} on {report['backend']['device_type']}; smoke "
        f"{'ok' if smoke.get('ok') else smoke}; cpu ops {ops['ops']}; cuda ops {ops.get('cuda_ops', {})}; "
        f"problems: {report['problems'] or 'none'}"
    )
    return ("passed" if smoke.get("ok") else "FAILED"), detail


# ------------------------------------------------------------------------------------------- collectives


def _rank_collectives() -> dict[str, Any]:
    import torch.distributed as dist

    from labkit.engines.on_rank import rank_info

    info = rank_info()
    n = info.world_size
    on_cpu = torch.tensor([float(info.rank + 1)])
    on_cuda = torch.tensor([float(info.rank + 1)], device=info.device)
    dist.all_reduce(on_cpu)  # gloo inside the device-mapped group
    dist.all_reduce(on_cuda)  # NCCL
    names: list[Any] = [None] * n
    dist.all_gather_object(names, torch.cuda.get_device_name(info.device))
    dist.barrier()
    return {
        "backend": info.backend,
        "device": str(info.device),
        "cpu": on_cpu.item(),
        "cuda": on_cuda.item(),
        "cuda_tensor_device": str(on_cuda.device),
        "names": names,
    }


def check_collectives(world_size: int) -> str:
    import labkit
    from labkit.cluster import GPU_BACKEND

    ranks = labkit.launch(_rank_collectives, world_size, timeout=LAUNCH_TIMEOUT_S)
    want = world_size * (world_size + 1) / 2
    for r, got in enumerate(ranks):
        assert got["backend"] == GPU_BACKEND, got
        assert got["device"] == f"cuda:{r}" == got["cuda_tensor_device"], got
        assert got["cpu"] == got["cuda"] == want, got
    backend = ranks[0]["backend"]
    return f"{world_size} rank(s): backend {backend}, CPU and CUDA all-reduce = {want:g} on every rank"


# ----------------------------------------------------------------------------------------------- helpers


def _gather_and_scatter() -> dict[str, Any]:
    """Notebook 00's second cell, on this rank's device."""
    import torch.distributed as dist

    from labkit.engines.on_rank import rank_info
    from labkit.probes import Probes

    info = rank_info()
    rank, n = info.rank, info.world_size
    with Probes(rank, info.device) as probes:
        shard = torch.arange(2.0, device=info.device) + 10 * rank
        full = torch.empty(2 * n, device=info.device)
        dist.all_gather_single(full, shard)
        grad = torch.full((2 * n,), float(rank + 1), device=info.device)
        mine = torch.empty(2, device=info.device)
        dist.reduce_scatter_single(mine, grad)
    return {"full": full.tolist(), "mine": mine.tolist(), "comm": probes.comm.summary()}


def _checkpoint_roundtrip(path: str) -> dict[str, Any]:
    from labkit.engines import on_rank, scratch
    from labkit.engines.base import RunConfig
    from labkit.zero import checkpoint

    cfg = RunConfig(model="tiny", world_size=on_rank.rank_info().world_size, steps=2)
    engine = scratch.build(cfg, on_rank.rank_model("tiny"), on_rank.rank_info())
    on_rank.train_steps(engine, cfg)
    checkpoint.save(path, engine.zero, engine.optimizer)
    fresh = scratch.build(cfg, on_rank.rank_model("tiny", seed=1), on_rank.rank_info())
    checkpoint.load(path, fresh.zero, fresh.optimizer)
    same = all(torch.equal(a, b) for a, b in zip(engine.zero.shards(), fresh.zero.shards(), strict=True))
    return {"same": same, "device": str(fresh.zero.shards()[0].device)}


def _finite(losses: list[float]) -> bool:
    return bool(losses) and all(math.isfinite(x) for x in losses)


def _expect(ok: bool, detail: str) -> str:
    if not ok:
        raise AssertionError(detail)
    return detail


def _helper_table(cfg, tmp: str) -> list[tuple[str, Any, Any, bool]]:
    """(name, call, verify: result -> detail, runs here) for every notebook's rank-side helper."""
    from labkit.lessons import deepspeed_inspect as di
    from labkit.lessons import engine_inspect
    from labkit.lessons import fsdp2_features as ff
    from labkit.lessons import fsdp2_inspect as fi

    n = cfg.world_size
    dcp = os.path.join(tmp, "dcp")
    saved: dict[str, Any] = {}

    def gathered(r):
        want = [v + 10 * k for k in range(n) for v in (0.0, 1.0)]
        return _expect(r["full"] == want, f"full {r['full']}, wire {r['comm']['all_gather']['wire_bytes']} B")

    def resumed(r):
        drift = max(abs(a - b) for a, b in zip(r["losses"], saved["continued_losses"], strict=True))
        return _expect(drift < 1e-5, f"resumed {r['losses']} vs {saved['continued_losses']}")

    def compiled(r):
        if "skipped" in r:
            return r["skipped"]
        graphs = "; ".join(f"{g['forward_of']}.forward x{g['calls']:g} per step" for g in r.get("graphs", []))
        return _expect(
            _finite(r["losses"]),
            f"first step {r['first_step_s']:.1f} s, later {r['later_step_s'] * 1e3:.1f} ms; graphs: {graphs}; "
            f"frames Dynamo skipped: {len(r.get('skipped_frames', []))} (FSDP2's hooks are never compiled)",
        )

    def gathers(r):  # FSDP2 issues no collective when its shard group has one rank (_fsdp_param_group.py)
        want = "some" if n > 1 else "none: FSDP2 skips the collectives of a 1-rank shard group"
        return _expect(
            (r["all_gather_calls"] > 0) == (n > 1), f"{r['all_gather_calls']} all-gathers ({want})"
        )

    def losses(r):
        return _expect(_finite(r["losses"]), f"losses {[round(x, 4) for x in r['losses']]}")

    return [
        ("00 all_gather_single / reduce_scatter_single", _gather_and_scatter, gathered, True),
        (
            "engine_inspect.hook_trace",
            lambda: engine_inspect.hook_trace("tiny", 1),
            lambda t: _expect({m for _, m, _ in t} >= {"before_forward", "after_grad"}, f"{len(t)} moments"),
            True,
        ),
        (
            "fsdp2_inspect.param_placements",
            lambda: fi.param_placements(cfg),
            lambda r: _expect(all(v["is_dtensor"] for v in r.values()), str(r["tok.weight"]["placements"])),
            True,
        ),
        (
            "fsdp2_inspect.mixed_precision_by_block",
            lambda: fi.mixed_precision_by_block(cfg),
            lambda r: _expect(r["param_dtype"][0] == "torch.bfloat16", str(r["param_dtype"])),
            True,
        ),
        ("fsdp2_inspect.replicate_vs_shard", lambda: fi.replicate_vs_shard(cfg), str, True),
        (
            "fsdp2_inspect.first_step_logs(per_block=True)",
            lambda: fi.first_step_logs(cfg, True),
            gathers,
            True,
        ),
        (
            "fsdp2_inspect.first_step_logs(per_block=False)",
            lambda: fi.first_step_logs(cfg, False),
            gathers,
            True,
        ),
        ("fsdp2_features.ignored_params(sync=False)", lambda: ff.ignored_params(cfg), losses, True),
        ("fsdp2_features.ignored_params(sync=True)", lambda: ff.ignored_params(cfg, sync=True), losses, True),
        (
            "fsdp2_features.dcp_save",
            lambda: saved.update(ff.dcp_save(cfg, dcp, continue_steps=2)) or saved,
            losses,
            True,
        ),
        ("fsdp2_features.dcp_load", lambda: ff.dcp_load(cfg, dcp, cfg.steps, 2), resumed, True),
        ("fsdp2_features.compile_sharded (inductor)", lambda: ff.compile_sharded(cfg), compiled, True),
        ("fsdp2_features.comm_debug_counts", lambda: ff.comm_debug_counts(cfg), str, True),
        ("fsdp2_features.hsdp", lambda: ff.hsdp(cfg), losses, n >= 2 and n % 2 == 0),
        ("fsdp2_features.tp_fsdp", lambda: ff.tp_fsdp(cfg), losses, n == 4),
        (
            "deepspeed_inspect.own_accounting_beside_probe",
            lambda: di.own_accounting_beside_probe(cfg),
            losses,
            True,
        ),
        (
            "deepspeed_inspect.itemise_state",
            lambda: di.itemise_state(replace(cfg, steps=1)),
            lambda r: _expect(r["measured_bytes"] > 0, f"{r['measured_bytes']:,} B"),
            True,
        ),
        (
            "zero.checkpoint save + load (map_location)",
            lambda: _checkpoint_roundtrip(os.path.join(tmp, "ck")),
            lambda r: _expect(r["same"] and r["device"].startswith("cuda"), f"reloaded on {r['device']}"),
            True,
        ),
    ]


def _rank_helpers(cfg, tmp: str, gpus: int) -> dict[str, tuple[str, str]]:
    """Rank side: every notebook helper on this CUDA rank; {name: (status, detail)}. On one rank a failure
    leaves no peer waiting; on several, a helper that fails on one rank only ends in the launch's timeout."""
    out: dict[str, tuple[str, str]] = {}
    for name, call, verify, runs_here in _helper_table(cfg, tmp):
        if not runs_here:  # hsdp wants an even world size, tp_fsdp four ranks (their notebook runs them on 4)
            out[name] = ("skipped", f"needs more GPUs (this machine: {gpus})")
            continue
        start = time.perf_counter()
        try:
            detail = verify(call())
            out[name] = ("passed", f"{detail} ({time.perf_counter() - start:.1f} s)")
        except Exception as e:  # noqa: BLE001 (a row each)
            out[name] = ("FAILED", first_line(e))
    return out


def check_helpers(smoke: Smoke, world_size: int, gpus: int) -> None:
    import labkit
    from labkit.engines.base import RunConfig

    cfg = RunConfig(model="tiny", world_size=world_size, steps=3)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            ranks = labkit.launch(_rank_helpers, world_size, cfg, tmp, gpus, timeout=LAUNCH_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001
            smoke.add(
                "helpers",
                f"rank-side helpers on {world_size} CUDA rank(s)",
                "FAILED",
                first_line(e),
                time.perf_counter() - start,
            )
            return
    for name, (status, detail) in ranks[0].items():
        worst = next((r[name] for r in ranks if r[name][0] == "FAILED"), (status, detail))
        smoke.add("helpers", name, worst[0], worst[1], 0.0)
    smoke.check("helpers", "build-along checks (02's filled pieces)", check_build_along, world_size)


def check_build_along(world_size: int) -> str:
    from labkit.buildalong import checks
    from labkit.buildalong.cells import pieces_from_notebook

    pieces = pieces_from_notebook()  # the instructor's copy: the build cells filled
    results = checks.run_checks([(s, pieces) for s in checks.STEPS], world_size, "tiny_uneven", quiet=True)
    failed = [str(r) for r in results if not r.ok]
    if failed:
        raise AssertionError("; ".join(failed))
    return f"{len(results)} checks passed on {world_size} rank(s)"


# ------------------------------------------------------------------------------------------------ engines


def check_engines(world_size: int) -> str:
    from labkit.engines.base import RunConfig
    from labkit.engines.loop import run_many
    from labkit.engines.run_config import DTYPE_BYTES

    engines = ["ddp", "scratch", "fsdp1", "fsdp2", "deepspeed"]
    cfgs = [RunConfig(model="tiny", world_size=world_size, steps=3, dtype=d) for d in DTYPE_BYTES]
    singles = run_many([("single", c) for c in cfgs])
    runs = [(e, c) for c in cfgs for e in engines] + [("scratch", cfgs[0])]  # scratch again: same peak?
    records = run_many(runs, timeout_s=LAUNCH_TIMEOUT_S)
    problems, worst, steps_on_cpu = [], {}, {}
    for (engine, cfg), rec in zip(runs, records, strict=True):
        rel = rel_diff(rec["losses"], singles[0]["losses"])
        limit = FP32_REL if cfg.dtype == "float32" else BF16_REL
        worst[f"{engine} {cfg.dtype}"] = rel
        if rel > limit:
            problems.append(f"{engine} {cfg.dtype} {rel:.1e} off single (limit {limit:g})")
        by_device = rec["state_bytes_by_device"]
        host = {k: v for k, v in by_device.get("cpu", {}).items() if v}
        if set(by_device) - {"cuda:0", "cpu"} or set(host) - {"optimizer"}:
            problems.append(f"{engine} {cfg.dtype} keeps state on {sorted(by_device)}: {by_device}")
        elif host:  # torch's AdamW keeps each `step` on the CPU unless capturable or fused: a line of its own
            steps_on_cpu[f"{engine} {cfg.dtype}"] = host["optimizer"]
        if not rec["peak_mem_bytes"][0] > 0:
            problems.append(f"{engine} {cfg.dtype}: no CUDA peak")
    first, again = records[engines.index("scratch")], records[-1]
    drift = abs(first["peak_mem_bytes"][0] - again["peak_mem_bytes"][0]) / first["peak_mem_bytes"][0]
    if drift > 0.02:
        problems.append(f"scratch's peak moved {drift:.1%} after other engines ran in the same ranks")
    if problems:
        raise AssertionError("; ".join(problems))
    diffs = ", ".join(f"{k} {v:.1e}" for k, v in worst.items())
    steps = ", ".join(f"{k} {v:,} B" for k, v in steps_on_cpu.items()) or "none"
    return (
        f"{len(runs)} runs; rel. diff to single fp32: {diffs}; repeated scratch peak drift {drift:.2%}; "
        f"on the CPU, AdamW's step scalars only: {steps}"
    )


def check_offload(world_size: int) -> str:
    from labkit.engines.base import RunConfig
    from labkit.engines.loop import run_many

    cfg = RunConfig(model="tiny", world_size=world_size, steps=3)
    single = run_many([("single", cfg)])[0]
    engines = ("scratch", "fsdp1", "fsdp2", "deepspeed")
    records = run_many([(e, replace(cfg, offload="cpu")) for e in engines], timeout_s=LAUNCH_TIMEOUT_S)
    out, problems = [], []
    for engine, rec in zip(engines, records, strict=True):
        rel = rel_diff(rec["losses"], single["losses"])
        host = rec["state_bytes_by_device"].get("cpu", {}).get("optimizer", 0)
        device = rec["state_bytes_by_device"].get("cuda:0", {}).get("optimizer", 0)
        out.append(f"{engine}: optimizer {host:,} B on cpu, {device:,} B on cuda:0, rel {rel:.1e}")
        if rel > FP32_REL or not host:
            problems.append(out[-1])
    if problems:
        raise AssertionError("; ".join(problems))
    return "; ".join(out)


def _cuda_op_plan() -> dict[str, Any]:
    from labkit import prebuild

    return {op.name: op for op in prebuild.plan_ops(prebuild.toolchain()) if op.accelerator == "cuda"}


def check_nvme(world_size: int) -> tuple[str, str]:
    from labkit.engines.base import RunConfig
    from labkit.engines.loop import run_many

    cfg = RunConfig(model="tiny", world_size=world_size, steps=2, offload="nvme")
    plan = _cuda_op_plan()["async_io"]
    try:
        rec = run_many([("deepspeed", cfg)], timeout_s=LAUNCH_TIMEOUT_S)[0]
    except Exception as e:  # noqa: BLE001
        if plan.action == "skip" and "async_io" in str(e):
            return "passed", f"refused as planned ({plan.reason}): {first_line(e)}"
        raise
    if plan.action == "skip":
        return "FAILED", f"ran although async_io was planned unbuildable ({plan.reason})"
    single = run_many([("single", replace(cfg, offload="none"))])[0]
    rel = rel_diff(rec["losses"], single["losses"])
    if rel > FP32_REL:
        return "FAILED", f"{rel:.1e} off single"
    return "passed", f"swap files {rec['swap_file_bytes']}, rel {rel:.1e}"


def check_quantized(world_size: int) -> tuple[str, str]:
    from labkit.engines.base import RunConfig
    from labkit.engines.loop import run_many

    plan = _cuda_op_plan()["quantizer"]
    if plan.action == "skip":
        return "skipped", plan.refusal(torch.version.cuda)
    options = {"zero_quantized_weights": True, "zero_quantized_gradients": True}
    cfg = RunConfig(model="tiny", world_size=world_size, steps=3, options=options)
    rec = run_many([("deepspeed", cfg)], timeout_s=LAUNCH_TIMEOUT_S)[0]
    if not _finite(rec["losses"]):
        return "FAILED", f"losses {rec['losses']}"
    return "passed", f"losses {rec['losses']}, comm {sorted(rec['comm'])}"


# ------------------------------------------------------------------------------------------- 1-GPU hub


def _rank_hub() -> dict[str, Any]:
    from deepspeed.accelerator import get_accelerator

    from labkit.engines.on_rank import rank_info
    from labkit.zero import ShardedAdamW

    shard = torch.nn.Parameter(torch.ones(4))
    shard.grad = torch.ones(4)
    ShardedAdamW([shard], offload=True).step()
    info = rank_info()
    return {
        "device": str(info.device),
        "backend": info.backend,
        "ds": get_accelerator().device_name(),
        "cuda_visible": torch.cuda.is_available(),
    }


def hub_child() -> int:
    """In a process that sees one GPU: CUDA initialised here first, then CPU ranks; prints JSON."""
    import labkit
    from labkit import cluster
    from labkit.engines.base import RunConfig
    from labkit.engines.loop import compare

    torch.zeros(1, device="cuda")  # the parent has initialised CUDA, as a notebook that used the GPU has
    facts: dict[str, Any] = {"placement": str(cluster.placement(2))}
    facts["ranks"] = labkit.launch(_rank_hub, 2, timeout=LAUNCH_TIMEOUT_S)
    out = compare(["single", "scratch", "fsdp2"], RunConfig(model="tiny", world_size=2, steps=2))
    facts["devices"] = {name: sorted(rec["state_bytes_by_device"]) for name, rec in out["engines"].items()}
    facts["rel"] = {
        n: rel_diff(r["losses"], out["engines"]["single"]["losses"]) for n, r in out["engines"].items()
    }
    print("HUB " + json.dumps(facts))
    return 0


def check_hub(gpu: str) -> str:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--hub-child"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("HUB ")), None)
    if out.returncode or line is None:
        raise AssertionError((out.stderr.strip().splitlines() or ["no output"])[-1])
    facts = json.loads(line[4:])
    assert "'cpu'" in facts["placement"] and "'spawn'" in facts["placement"], facts["placement"]
    for r in facts["ranks"]:
        assert r == {"device": "cpu", "backend": "gloo", "ds": "cpu", "cuda_visible": False}, r
    assert all(d == ["cpu"] for d in facts["devices"].values()), facts["devices"]
    assert all(v < FP32_REL for v in facts["rel"].values()), facts["rel"]
    return f"placement {facts['placement']}; every engine of a 2-rank comparison on cpu ({facts['devices']})"


class Notebooks:
    """Notebooks 00-08 under papermill with one visible GPU (their world sizes 2-4: CPU ranks), `parallel`
    at a time, each stopped at its own limit."""

    def __init__(self, gpu: str, parallel: int = 2):
        self.env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
        self.out = Path(tempfile.mkdtemp(prefix="labkit-gpu-smoke-nb-"))
        self.waiting = list(NOTEBOOKS)
        self.running: dict[Path, tuple[subprocess.Popen, float, Any]] = {}
        self.done: dict[str, tuple[str, str, float]] = {}
        self.parallel = parallel

    def poll(self) -> bool:
        """Start what may start, collect what finished; True while any is left."""
        for nb, (proc, start, log) in list(self.running.items()):
            if proc.poll() is not None:
                seconds = time.perf_counter() - start
                log.close()
                err = Path(log.name).read_text(errors="replace").strip().splitlines()
                status = "passed" if proc.returncode == 0 else "FAILED"
                detail = (
                    ""
                    if proc.returncode == 0
                    else next((ln for ln in reversed(err) if "Error" in ln), (err or ["?"])[-1])
                )
                self.done[nb.name] = (status, detail, seconds)
                del self.running[nb]
        for proc, start, _ in self.running.values():  # each notebook has a limit of its own
            if proc.poll() is None and time.perf_counter() - start > NOTEBOOK_TIMEOUT_S + 30:
                proc.kill()  # papermill's per-cell timeout should have ended it; collected on the next poll
        while self.waiting and len(self.running) < self.parallel:
            nb = self.waiting.pop(0)
            cmd = [
                sys.executable,
                "-m",
                "papermill",
                str(nb),
                str(self.out / nb.name),
                "-k",
                "python3",
                "--cwd",
                str(nb.parent),
                "--execution-timeout",
                str(NOTEBOOK_TIMEOUT_S),
                "--no-progress-bar",
            ]
            log = open(self.out / f"{nb.stem}.log", "w")  # noqa: SIM115 (closed when the run ends)
            proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT)
            self.running[nb] = (proc, time.perf_counter(), log)
        return bool(self.waiting or self.running)

    def finish(self, smoke: Smoke) -> None:
        """Wait for every notebook: each stops at its own limit, not at the smoke's budget."""
        while self.poll():
            time.sleep(1.0)
        for name in sorted(self.done):
            status, detail, seconds = self.done[name]
            smoke.add("1-GPU hub: notebooks under papermill", name, status, detail, seconds)
        shutil.rmtree(self.out, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ report


def write_report(path: Path, env: dict[str, str], rows: list[Row], bench: list[str], total_s: float) -> None:
    failed = sum(r.status == "FAILED" for r in rows)
    lines = [
        f"# GPU smoke ({env['date']}, {env['GPUs (CUDA)']})",
        "",
        f"`python benchmarks/gpu_smoke.py`: {len(rows)} checks, {failed} failed, "
        f"{sum(r.status == 'skipped' for r in rows)} skipped, {total_s:.0f} s.",
        "",
        "## Environment",
        "",
        *(f"- {k}: {v}" for k, v in env.items()),
        "",
        "## Checks",
        "",
        "| section | check | result | s | detail |",
        "|---|---|---|---|---|",
        *(
            f"| {r.section} | {r.name} | {r.status} | {r.seconds:.1f} | {r.detail.replace('|', '/')} |"
            for r in rows
        ),
    ]
    if bench:
        lines += ["", *bench]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results-gpu.md"))
    parser.add_argument("--budget-s", type=float, default=480.0, help="start no check after this (s)")
    parser.add_argument("--skip-prebuild", action="store_true")
    parser.add_argument("--skip-notebooks", action="store_true")
    parser.add_argument("--skip-benchmark", action="store_true")
    parser.add_argument("--hub-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "benchmarks/gpu_smoke.py: no CUDA device is visible here; run it on a machine with a GPU",
            file=sys.stderr,
        )
        return 2
    if args.hub_child:
        return hub_child()
    start = time.perf_counter()
    smoke = Smoke(args.budget_s)
    env = environment()
    gpus = torch.cuda.device_count()
    world_size = min(gpus, 4)
    first_gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    smoke.check("environment", "GPU count (NVML vs CUDA)", check_gpu_count)
    smoke.check("environment", "/dev/shm", check_shm)
    if not args.skip_prebuild:
        smoke.check("set-up", "python -m labkit.prebuild", run_prebuild)
    smoke.check("set-up", "labkit doctor (its 2-rank smoke test)", run_doctor)
    smoke.check("collectives", "CPU and CUDA tensors on one rank", check_collectives, 1)
    if world_size > 1:
        smoke.check(
            "collectives", f"CPU and CUDA tensors on {world_size} ranks", check_collectives, world_size
        )
    check_helpers(smoke, world_size, gpus)
    smoke.check(
        "engines", f"5 engines x fp32/bf16 vs single on {world_size} rank(s)", check_engines, world_size
    )
    smoke.check("offload", "host offload of scratch, fsdp1, fsdp2, deepspeed", check_offload, world_size)
    smoke.check("offload", "deepspeed NVMe offload (async_io)", check_nvme, world_size)
    smoke.check("offload", "deepspeed qwZ + qgZ (quantizer)", check_quantized, world_size)
    smoke.check(
        "1-GPU hub", f"CUDA_VISIBLE_DEVICES={first_gpu}: CPU ranks after CUDA init", check_hub, first_gpu
    )
    if (
        not args.skip_notebooks
    ):  # after the build and the GPU checks: nothing compiles or competes beside them
        notebooks = Notebooks(first_gpu)
        notebooks.finish(smoke)
    bench: list[str] = []
    if not args.skip_benchmark and smoke.deadline - time.monotonic() > 90:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from gpu import benchmark_lines

        def figures() -> str:
            bench.extend(benchmark_lines(reps=2, steps=4))
            return "figures below"

        row = smoke.check("benchmark", "benchmarks/gpu.py (2 reps, 4 steps)", figures)
        if row is not None and row.status != "passed":
            bench.clear()
    total_s = time.perf_counter() - start
    write_report(Path(args.out), env, smoke.rows, bench, total_s)
    failed = [r for r in smoke.rows if r.status == "FAILED"]
    print(f"{len(smoke.rows)} checks, {len(failed)} failed, {total_s:.0f} s; written to {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
