"""Build DeepSpeed's ops once, at set-up, so that no notebook cell waits on a JIT compile.

A DeepSpeed run on CPU ranks compiles C++ ops the first time it needs them (through torch's
`cpp_extension.load`, ninja and g++): the shared-memory collectives when its comm backend starts, FusedAdam
for a plain ZeRO-3 optimizer, DeepSpeedCPUAdam for optimizer offload, async_io for NVMe offload. On a node
with GPUs, CUDA ranks need the CUDA accelerator's own builds of async_io (NVMe offload) and of the quantizer
(ZeRO++ qwZ / qgZ), compiled with nvcc. `python -m labkit.prebuild` builds what `plan_ops` says this node
needs and can build (one sentence for each CUDA op it cannot: no nvcc, another CUDA major than torch's, no
libaio), removes the `lock` file an interrupted build leaves behind (torch waits on it forever), and pins
two things for every Python of the environment, with a one-line `.pth` file:
- TORCH_EXTENSIONS_DIR defaults to `<sys.prefix>/torch_extensions`, so a build belongs to the torch it was
  compiled against and two checkouts never rebuild each other's ops (a value the user set wins);
- the `ninja` torch calls is the environment's own (`<sys.prefix>/share/labkit/bin` goes first on PATH):
  two ninja versions read each other's build logs as dirty, so a kernel that found /usr/bin/ninja after a
  build by the venv's ninja (or the other way round) would recompile every op, minutes each.

The CUDA ops build into `extensions_dir("cuda")`, a folder of their own: DeepSpeed names the CPU and the CUDA
builds of async_io alike, and torch rebuilds an extension whose folder holds the other one's build (minutes
inside a cell each time a node alternates between CPU and CUDA ranks). They are built the way DeepSpeed's
JIT path builds them (`builder.load()`, what a rank would run), not by reinstalling DeepSpeed with
`DS_BUILD_AIO=1 DS_BUILD_QUANTIZER=1`: the same libraries, without touching the pinned package.

`op_status()` inspects without building; `labkit doctor` uses it with `toolchain()` and `plan_ops()`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass

# (DeepSpeed builder class, extension name): what a CPU run of DeepSpeed JIT-builds on first use.
CPU_OPS = (
    ("ShareMemCommBuilder", "deepspeed_shm_comm"),  # deepspeed.comm on the CPU accelerator, at init
    ("FusedAdamBuilder", "fused_adam"),  # the optimizer of a ZeRO-3 config {"type": "AdamW"}
    ("CPUAdamBuilder", "cpu_adam"),  # DeepSpeedCPUAdam, with "offload_optimizer": {"device": "cpu"}
    ("AsyncIOBuilder", "async_io"),  # NVMe offload (ZeRO-Infinity); needs libaio (Debian's libaio-dev)
)
# (builder class of DeepSpeed's CUDA accelerator, extension name, what needs it on CUDA ranks): nvcc-built.
CUDA_OPS = (
    ("AsyncIOBuilder", "async_io", "NVMe offload"),  # a CUDAOpBuilder: needs CUDA_HOME as well as libaio
    ("QuantizerBuilder", "quantizer", "ZeRO++ quantized weights and gradients (qwZ, qgZ)"),
)
CUDA_SUBDIR = "cuda-accelerator"  # under the extensions folder: the CUDA builds of ops named like CPU ones
PTH_NAME = "labkit-torch-extensions.pth"
NINJA_DIR = os.path.join("share", "labkit", "bin")  # under sys.prefix: holds only a link to ninja
PTH_LINE = (
    "import os, sys; "
    "os.environ.setdefault('TORCH_EXTENSIONS_DIR', os.path.join(sys.prefix, 'torch_extensions')); "
    f"_b = os.path.join(sys.prefix, {NINJA_DIR!r}); _p = os.environ.get('PATH', ''); "
    "os.path.isdir(_b) and not _p.startswith(_b + os.pathsep) and os.environ.__setitem__('PATH', _b + os.pathsep + _p)\n"
)
WAIT_FOR_BUILDER_S = 900.0  # how long to wait on a build another live process is running (s)


@dataclass(frozen=True)
class OpStatus:
    """One op's state on disk: `status` is built | missing | out of date | building | interrupted | skipped
    (not needed here) | unbuildable (needed, but this node cannot compile it: `reason` says why)."""

    name: str
    status: str
    build_dir: str
    library: str
    lock_holders: list[int]
    reason: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Toolchain:
    """What decides which ops this node needs and can build (`toolchain()` reads it; tests make it up)."""

    gpus: int | None  # CUDA devices visible here (`placement.visible_gpus`); None: some, uncounted
    torch_cuda: str | None  # the CUDA release torch was built for ("12.8"); None for a CPU build
    cuda_home: str | None  # the toolkit torch's cpp_extension (and so DeepSpeed) compiles with
    nvcc_release: str | None  # "12.8" from `$CUDA_HOME/bin/nvcc -V`; None when it does not run
    libaio: bool  # libaio's header and library (async_io links it)
    linux: bool


@dataclass(frozen=True)
class PlannedOp:
    """One op `python -m labkit.prebuild` builds (`action` "build") or leaves ("skip", with `reason`)."""

    accelerator: str  # "cpu" or "cuda": whose builder (DeepSpeed's accelerators build different sources)
    builder: str
    name: str
    needed_for: str
    action: str
    reason: str = ""

    def refusal(self, torch_cuda: str | None) -> str:
        """One sentence for a CUDA op this node cannot build: what it costs and what to do."""
        fix = (
            "install libaio (`scripts/install-debian-packages binder/apt.txt`)"
            if self.reason == "libaio is not installed"
            else f"install the CUDA {torch_cuda} toolkit (nvcc) and set CUDA_HOME to it"
        )
        return (
            f"DeepSpeed's CUDA op {self.name} cannot be built on this node ({self.reason}), so "
            f"{self.needed_for} on GPU ranks is refused: {fix}, then run `python -m labkit.prebuild`"
        )


def plan_ops(tc: Toolchain) -> list[PlannedOp]:
    """The ops this node needs, CPU ops first, each to build or to skip with the reason (pure: no I/O).

    CPU ranks (every machine): `CPU_OPS`, the shared-memory collectives only on Linux (DeepSpeed falls
    back to gloo elsewhere), async_io only with libaio. CUDA ranks (a CUDA build of torch and at least one
    visible GPU): `CUDA_OPS`, which compile with nvcc, so they need the toolkit at CUDA_HOME and an nvcc of
    torch's CUDA major version (DeepSpeed's `assert_no_cuda_mismatch` accepts other minors of one major).
    """
    plan = []
    for builder, name in CPU_OPS:
        reason = ""
        if name == "deepspeed_shm_comm" and not tc.linux:
            reason = "not Linux: DeepSpeed uses gloo"
        elif name == "async_io" and not tc.libaio:
            reason = "libaio is not installed"
        plan.append(PlannedOp("cpu", builder, name, "CPU ranks", "skip" if reason else "build", reason))
    if not tc.torch_cuda or not tc.gpus:
        return plan
    for builder, name, needed_for in CUDA_OPS:
        reason = ""
        if tc.cuda_home is None:
            reason = "no CUDA toolkit: CUDA_HOME is not set and no nvcc is on PATH"
        elif tc.nvcc_release is None:
            reason = f"{tc.cuda_home}/bin/nvcc does not run"
        elif tc.nvcc_release.split(".")[0] != tc.torch_cuda.split(".")[0]:
            reason = f"nvcc is CUDA {tc.nvcc_release} but torch was built for CUDA {tc.torch_cuda}"
        elif name == "async_io" and not tc.libaio:
            reason = "libaio is not installed"
        plan.append(PlannedOp("cuda", builder, name, needed_for, "skip" if reason else "build", reason))
    return plan


def toolchain() -> Toolchain:
    """This node's `Toolchain`. Imports torch's cpp_extension (its CUDA_HOME is what DeepSpeed uses)."""
    import torch
    import torch.utils.cpp_extension as cpp

    from labkit.placement import visible_gpus

    return Toolchain(
        gpus=visible_gpus(),
        torch_cuda=torch.version.cuda,
        cuda_home=cpp.CUDA_HOME,
        nvcc_release=nvcc_release(cpp.CUDA_HOME),
        libaio=libaio_available(),
        linux=sys.platform.startswith("linux"),
    )


def nvcc_release(cuda_home: str | None) -> str | None:
    """The "X.Y" release `$cuda_home/bin/nvcc -V` reports, read as DeepSpeed's `installed_cuda_version` does."""
    if cuda_home is None:
        return None
    try:
        out = subprocess.run(
            [os.path.join(cuda_home, "bin", "nvcc"), "-V"], capture_output=True, text=True, timeout=30
        ).stdout.split()
        return ".".join(out[out.index("release") + 1].rstrip(",").split(".")[:2])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def extensions_dir(accelerator: str = "cpu") -> str:
    """The folder torch builds extensions in, computed as torch does, without creating it.

    `accelerator="cuda"`: the folder of DeepSpeed's CUDA builds, `CUDA_SUBDIR` inside it (already that
    folder in a CUDA rank, whose TORCH_EXTENSIONS_DIR `labkit.launch` points there).
    """
    base = _torch_extensions_dir()
    if accelerator == "cpu" or os.path.basename(base) == CUDA_SUBDIR:
        return base
    return os.path.join(base, CUDA_SUBDIR)


def _torch_extensions_dir() -> str:
    pinned = os.environ.get("TORCH_EXTENSIONS_DIR")
    if pinned:
        return pinned
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accel = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accel = "cu" + torch.version.cuda.replace(".", "")
    else:
        accel = "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(get_default_build_root(), f"{py}_{accel}")


def lock_holders(lock_path: str) -> list[int] | None:
    """Process ids that hold `lock_path` open (torch's FileBaton keeps it open while it builds).

    None when this cannot be told (no /proc, or processes this user may not inspect).
    """
    if not os.path.isdir("/proc/self/fd"):
        return None
    target = os.path.realpath(lock_path)
    holders, blind = [], False
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except PermissionError:
            blind = True
            continue
        except OSError:
            continue  # the process ended while we looked
        for fd in fds:
            try:
                if os.readlink(os.path.join(fd_dir, fd)) == target:
                    holders.append(int(pid))
                    break
            except OSError:
                continue
    return None if blind and not holders else holders


def libaio_available() -> bool:
    """True when libaio's header and library are installed (what DeepSpeed's async_io op compiles against)."""
    import ctypes.util

    headers = ("/usr/include/libaio.h", os.path.join(sys.prefix, "include", "libaio.h"))
    return any(os.path.exists(h) for h in headers) and ctypes.util.find_library("aio") is not None


def op_status(name: str, ext_dir: str | None = None) -> OpStatus:
    """Where op `name` stands, read from its build folder; builds nothing and creates nothing."""
    build_dir = os.path.join(ext_dir or extensions_dir(), name)
    library = os.path.join(build_dir, f"{name}.so")
    lock = os.path.join(build_dir, "lock")
    if name == "deepspeed_shm_comm" and not sys.platform.startswith("linux"):
        return OpStatus(name, "skipped", build_dir, library, [])  # DeepSpeed falls back to gloo there
    if name == "async_io" and not libaio_available():
        return OpStatus(name, "skipped", build_dir, library, [])  # NVMe offload is then refused, saying why
    if os.path.exists(lock):
        holders = lock_holders(lock)
        if holders is None:  # cannot see who holds it: trust a young lock, distrust an old one
            young = time.time() - os.path.getmtime(lock) < WAIT_FOR_BUILDER_S
            return OpStatus(name, "building" if young else "interrupted", build_dir, library, [])
        return OpStatus(name, "building" if holders else "interrupted", build_dir, library, holders)
    if not os.path.exists(library):
        return OpStatus(name, "missing", build_dir, library, [])
    return OpStatus(name, "built" if _up_to_date(build_dir) else "out of date", build_dir, library, [])


def _up_to_date(build_dir: str) -> bool:
    """True unless ninja's dry run says the library needs rebuilding (sources or torch headers changed)."""
    ninja = shutil.which("ninja")
    if ninja is None or not os.path.exists(os.path.join(build_dir, "build.ninja")):
        return True  # nothing better to go on than the library being there
    try:
        out = subprocess.run([ninja, "-C", build_dir, "-n"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return True
    return out.returncode == 0 and "no work to do" in out.stdout


def pin_environment() -> str | None:
    """Write the `.pth` that pins TORCH_EXTENSIONS_DIR and ninja (module docstring); apply it here too.

    Only inside a virtual or conda environment that this user can write; returns the `.pth` path, or None
    when it left the environment alone (then torch's default folder under ~/.cache and PATH's ninja apply).
    """
    in_env = sys.prefix != sys.base_prefix or os.path.exists(os.path.join(sys.prefix, "conda-meta"))
    site_dir = sysconfig.get_paths()["purelib"]
    if not in_env or not os.access(site_dir, os.W_OK):
        return None
    scripts_ninja = os.path.join(sysconfig.get_paths()["scripts"], "ninja")
    ninja = scripts_ninja if os.path.exists(scripts_ninja) else shutil.which("ninja")
    if ninja:
        link = os.path.join(sys.prefix, NINJA_DIR, "ninja")
        os.makedirs(os.path.dirname(link), exist_ok=True)
        if os.path.realpath(link) != os.path.realpath(ninja):
            if os.path.lexists(link):
                os.remove(link)
            os.symlink(os.path.realpath(ninja), link)
    path = os.path.join(site_dir, PTH_NAME)
    if not os.path.exists(path) or open(path).read() != PTH_LINE:
        with open(path, "w") as f:
            f.write(PTH_LINE)
    exec(PTH_LINE, {})  # the same effect on this process as on the next one
    return path


def clear_interrupted(status: OpStatus) -> bool:
    """Remove the lock of an interrupted build (no live process holds it); True when one was removed."""
    if status.status != "interrupted":
        return False
    try:
        os.remove(os.path.join(status.build_dir, "lock"))
    except FileNotFoundError:
        pass
    return True


def _wait_for_builder(name: str, ext_dir: str, limit_s: float) -> OpStatus:
    status = op_status(name, ext_dir)
    if status.status == "building":
        print(f"  {name}: process {status.lock_holders or '?'} is building it; waiting (up to {limit_s:g} s)")
        deadline = time.monotonic() + limit_s
        while status.status == "building" and time.monotonic() < deadline:
            time.sleep(1.0)
            status = op_status(name, ext_dir)
        if status.status == "building":
            raise RuntimeError(
                f"{name} has been locked by a build for over {limit_s:g} s; if no build is running, "
                f"remove {os.path.join(status.build_dir, 'lock')} and run `python -m labkit.prebuild` again"
            )
    return status


def deepspeed_arch_list(torch_list: str | None, capabilities: list[tuple[int, int]]) -> str:
    """The `TORCH_CUDA_ARCH_LIST` DeepSpeed's CUDA builder can parse: each entry "X.Y" or "X.Y+PTX".

    DeepSpeed reads every entry as integers (`int("0a")` fails on Hopper images' "9.0a"), so an
    arch-specific suffix is dropped (9.0a -> 9.0); with no list set, the visible GPUs' (major, minor)."""
    entries = (torch_list or "").replace(",", ";").replace(" ", ";").split(";")
    if not any(e.strip() for e in entries):
        entries = [f"{major}.{minor}" for major, minor in capabilities]
    archs: dict[tuple[int, int], bool] = {}
    for entry in filter(None, (e.strip() for e in entries)):
        cc, ptx = entry.removesuffix("+PTX"), entry.endswith("+PTX")
        found = re.fullmatch(r"(\d+)\.(\d+)[a-z]?", cc)
        if found is None:
            raise ValueError(f"TORCH_CUDA_ARCH_LIST entry {entry!r} is not a compute capability like 9.0")
        key = int(found[1]), int(found[2])
        archs[key] = archs.get(key, False) or ptx
    return ";".join(f"{ma}.{mi}{'+PTX' if ptx else ''}" for (ma, mi), ptx in sorted(archs.items()))


def build_all(verbose: bool = False, accelerator_name: str = "cpu") -> list[dict]:
    """Build (or confirm) the ops `plan_ops` plans for `accelerator_name` with that DeepSpeed accelerator.

    One accelerator per process (DeepSpeed picks it once, and caches loaded ops by name): `main` builds the
    CUDA ops in a child process. Each dict: `name`, `before` (its status on entry), `seconds` (time to
    build or load it, s). Raises RuntimeError naming the op when a build fails.
    """
    os.environ["DS_ACCELERATOR"] = accelerator_name  # that accelerator's builders, whatever GPUs exist
    if accelerator_name == "cuda":
        import torch

        gpus = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        archs = deepspeed_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST"), gpus)
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
        print(f"  for compute capabilities {archs} (TORCH_CUDA_ARCH_LIST)")
    ext_dir = extensions_dir(accelerator_name)
    os.environ["TORCH_EXTENSIONS_DIR"] = ext_dir  # where torch's load() builds them
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    planned = [op for op in plan_ops(toolchain()) if op.accelerator == accelerator_name]
    report = []
    for op in planned:
        class_name, name = op.builder, op.name
        if op.action == "skip" and accelerator_name == "cuda":
            report.append({"name": name, "before": "unbuildable", "seconds": 0.0})
            continue
        status = _wait_for_builder(name, ext_dir, WAIT_FOR_BUILDER_S)
        if status.status == "skipped":
            report.append({"name": name, "before": "skipped", "seconds": 0.0})
            continue
        if clear_interrupted(status):
            print(f"  {name}: removed the lock an interrupted build left in {status.build_dir}; rebuilding")
        builder = accelerator.create_op_builder(class_name)
        if not builder.is_compatible(verbose):
            report.append({"name": name, "before": "skipped", "seconds": 0.0})
            print(
                f"  {name}: not compatible with this machine, skipped ({builder.error_log or 'no reason given'})"
            )
            continue
        start = time.perf_counter()
        try:
            builder.load(verbose)
        except Exception as e:  # noqa: BLE001 (one sentence naming the op, the compiler log is above)
            raise RuntimeError(f"building DeepSpeed op {name} failed: {e}") from e
        seconds = time.perf_counter() - start
        report.append({"name": name, "before": status.status, "seconds": seconds})
        done = "already built, loaded" if status.status == "built" else "built"
        print(f"  {name:<20} {done} in {seconds:.1f} s")
    return report


def main(argv: list[str] | None = None) -> int:
    """`python -m labkit.prebuild [--no-pin] [--verbose]`; returns the exit status.

    A CUDA op this node cannot build is one sentence on stderr and not a failure: the rest of the lab runs,
    and a run that needs the op is refused then (`labkit doctor` lists it too).
    """
    parser = argparse.ArgumentParser(prog="python -m labkit.prebuild", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--no-pin", action="store_true", help="leave TORCH_EXTENSIONS_DIR and PATH as they are"
    )
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    parser.add_argument("--accelerator", choices=("cpu", "cuda"), help=argparse.SUPPRESS)  # main's child
    args = parser.parse_args(argv)
    if not args.no_pin:
        pth = pin_environment()
        if pth:
            print(
                f"TORCH_EXTENSIONS_DIR defaults to {os.environ['TORCH_EXTENSIONS_DIR']} and ninja is "
                f"{shutil.which('ninja')} (set in {pth})"
            )
    if args.accelerator == "cuda":
        return _build_or_say("cuda", args.verbose)
    print(f"building DeepSpeed CPU ops in {extensions_dir()}")
    status = _build_or_say("cpu", args.verbose)
    tc = toolchain()
    cuda_ops = [op for op in plan_ops(tc) if op.accelerator == "cuda"]
    for op in cuda_ops:
        if op.action == "skip":
            print(f"labkit.prebuild: {op.refusal(tc.torch_cuda)}", file=sys.stderr)
    if status == 0 and any(op.action == "build" for op in cuda_ops):
        where = f"{extensions_dir('cuda')} (CUDA {tc.nvcc_release} at {tc.cuda_home})"
        print(f"building DeepSpeed CUDA ops in {where}")
        cmd = [sys.executable, "-m", "labkit.prebuild", "--no-pin", "--accelerator", "cuda"]
        status = subprocess.run(cmd + (["--verbose"] if args.verbose else [])).returncode
    return status


def _build_or_say(accelerator_name: str, verbose: bool) -> int:
    start = time.perf_counter()
    try:
        build_all(verbose, accelerator_name)
    except (RuntimeError, ValueError) as e:  # a failed build, or a TORCH_CUDA_ARCH_LIST it cannot use
        print(f"labkit.prebuild: {e}", file=sys.stderr)
        return 1
    print(f"DeepSpeed {accelerator_name.upper()} ops ready ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
