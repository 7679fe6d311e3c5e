"""Start N ranks from a notebook cell or the CLI with torch elastic, and bring back what each returned.

`launch(fn, world_size)` runs `fn` once per rank in processes started by
`torch.distributed.elastic.multiprocessing.start_processes` (the machinery behind `torchrun`), each rank on
the device, backend and start method `labkit.placement` chooses (its names are importable from here too):
gloo on CPU processes, or CUDA ranks on `"cpu:gloo,cuda:nccl"` when every rank has its own GPU. Under a
real `torchrun`/`deepspeed` launcher it does not start anything: it runs `fn` on the rank it finds itself
on and all-gathers the results.

A forked rank inherits `fn` as it is (a function defined in a notebook cell simply exists in the child, with
its source for tracebacks); a spawned one gets `fn` and its arguments by value with cloudpickle, so a
function from `__main__` or a notebook cell works there too. Return values come back by value in both.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import importlib
import io
import json
import mmap
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

import cloudpickle
import torch
import torch.distributed as dist

import labkit.placement
from labkit import collectives, prebuild
from labkit.placement import (  # noqa: F401 (where ranks run: part of labkit.cluster's face, for its callers)
    CPU_BACKEND,
    GPU_BACKEND,
    RANK_BYTES_ESTIMATE,
    RANKS_PER_CORE,
    Placement,
    backend_devices,
    choose_placement,
    launcher_world_size,
    max_ranks,
    node_key,
    placement,
    rank_device,
    rank_limit,
    rank_nodes,
    ranks_per_node,
    under_launcher,
    visible_gpus,
)
from labkit.rank_output import (
    PEER_LOST,
    collective_hint,
    fold_native_frames,
    follow_streams,
    native_failure,
    shown_in_cell,
    tail_text,
    user_frame,
)

DEFAULT_TIMEOUT_S = 120.0
_STATUS_BYTES = 256  # size of each rank's "last collective" slot (bytes)


class LaunchError(RuntimeError):
    """A rank failed. `rank` is the first rank that failed, `rank_traceback` its own traceback text."""

    def __init__(self, message: str, rank: int | None = None, rank_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.rank_traceback = rank_traceback


class LaunchTimeout(LaunchError):
    """The ranks did not all finish within `timeout` seconds. `doing` says what each rank was doing."""

    def __init__(self, message: str, doing: dict[int, str], stacks: dict[int, str] | None = None):
        super().__init__(message)
        self.doing = doing
        self.stacks = stacks or {}  # each rank's full Python stack dump (all threads), for digging deeper


@contextlib.contextmanager
def rank_environ(values: dict[str, str], keep_set: bool = False):
    """Environment variables the ranks of a launch inside this block inherit (read as they start), restored
    after; `keep_set`: a variable the user already set keeps its value."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if not (keep_set and before[k] is not None)})
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT_S,
    start_method: str | None = None,
    device_type: str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks and return their results in rank order.

    Each rank has the default process group initialised (and destroyed after `fn` returns), the usual
    RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT variables set, and its prints shown here
    prefixed `[rank k]`. A rank that raises makes this raise `LaunchError` with that rank's message and
    traceback; ranks still running `timeout` seconds after the call are killed and `LaunchTimeout` says what
    each was doing. `timeout`, `start_method` and `device_type` ("cpu" or "cuda": that kind of rank, see
    `choose_placement`) are options of `launch`; every other keyword goes to `fn`.
    """
    if under_launcher():
        return _run_in_place(fn, world_size, args, kwargs)
    if os.environ.get("LABKIT_LAUNCH_DIR"):
        raise RuntimeError("labkit.launch was called inside a rank; call it once, from the parent process")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: pass a whole number of ranks, 1 or more")
    where = placement(world_size, device_type)
    limit, why = rank_limit(where.device_type)
    if world_size > limit:
        raise ValueError(f"world_size={world_size}: {why}; pass world_size<={limit}")
    if start_method is not None:
        where = Placement(where.backend, where.device_type, start_method)
    return _Run(fn, args, kwargs, world_size, where, timeout).run()


# ---------------------------------------------------------------------------------------------- parent


WAIT_NOTICE_S = 5.0  # a rank inside one collective this long is said to be waiting (seconds)


class _RankPickler(cloudpickle.CloudPickler):
    """cloudpickle, refusing a tensor that is not on the CPU: unpickled in every rank, it would land on the
    parent's device (every rank on cuda:0), not on the rank's own."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            raise ValueError(
                f"the function or its arguments hold a tensor on {obj.device} (shape {tuple(obj.shape)}): every "
                "rank would load it onto that same device; pass it on the CPU and move it inside the function "
                "with .to(labkit.engines.on_rank.rank_info().device)"
            )
        return super().reducer_override(obj)


def dumps_for_ranks(call: Any) -> bytes:
    """(fn, args, kwargs) by value for spawned ranks; ValueError, one sentence, for a tensor off the CPU."""
    buffer = io.BytesIO()
    _RankPickler(buffer).dump(call)
    return buffer.getvalue()


@contextlib.contextmanager
def _parent_heap_frozen(forking: bool):
    """While ranks fork, the parent's objects sit in the garbage collector's permanent generation, so each
    rank's collections (and the memory probe's scans of what is live, `probes.memory.reachable_storages`)
    skip everything the rank inherited: a notebook kernel's or a test process's heap, hundreds of thousands
    of objects, scanned twice per run otherwise. The parent thaws them once the ranks have forked."""
    if not forking:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class _Run:
    """One launch: `world_size` children meeting at rank 0's TCP store, their logs tailed, failures read."""

    def __init__(self, fn, args, kwargs, world_size: int, where: Placement, timeout: float):
        # The clock starts here, not once the ranks are up: a caller with a deadline of its own (a grader's
        # probe, `grading.kit.launch_timeout`) gets the launch's account of its ranks inside that deadline,
        # whatever the import below and the forks cost on a loaded machine.
        self.deadline = time.monotonic() + timeout
        self.world_size = world_size
        self.where = where
        self.timeout = timeout
        # Forked children inherit `fn` as it is (tracebacks keep real file names and source lines);
        # spawned ones get it by value.
        call = (fn, args, kwargs)
        self.payload = call if where.start_method == "fork" else dumps_for_ranks(call)
        if where.start_method == "fork":
            # torch.optim's first optimizer imports torch._dynamo, about 2 s per process: imported here
            # once, every forked rank of every launch inherits it instead.
            importlib.import_module("torch._dynamo")
        self.dir = tempfile.mkdtemp(prefix="labkit-launch-")

    def run(self) -> list[Any]:
        """Start the ranks; retry once if another process took the rendezvous port in the meantime."""
        try:
            for attempt in (1, 2):
                try:
                    return self._run_once(_free_port())
                except LaunchError as e:
                    if attempt == 2 or "address already in use" not in str(e).lower():
                        raise
                    _empty_dir(self.dir)
            raise AssertionError("unreachable")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _run_once(self, port: int) -> list[Any]:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std, start_processes
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.tail_log import TailLog

        n = self.world_size
        envs = {r: self._env(r, port) for r in range(n)}
        args = {r: (self.payload, self.dir, self.where.backend) for r in range(n)}
        logs = {r: self._log(r) for r in range(n)}
        saved_handlers = _signal_handlers()
        saved_levels = _quiet_elastic_loggers()
        pc = tail = None
        try:
            # No thread of ours may run in this process while it forks (a lock held by one would be
            # copied held into every child): the store lives in rank 0, the log tailer starts after.
            with _parent_heap_frozen(self.where.start_method == "fork"):
                pc = start_processes(
                    name="labkit",
                    entrypoint=_rank_main,
                    args=args,
                    envs=envs,
                    logs_specs=DefaultLogsSpecs(
                        log_dir=os.path.join(self.dir, "elastic"), redirects=Std.NONE
                    ),
                    start_method=self.where.start_method,
                )
            prefixes = {r: f"[rank {r}] " for r in range(n)}
            tail = TailLog("labkit", logs, sys.stdout, prefixes, log_line_filter=shown_in_cell).start()
            return self._wait(pc)
        except SignalException as e:
            raise KeyboardInterrupt(f"interrupted by signal {e.sigval}; the {n} ranks were stopped") from None
        finally:
            if pc is not None:
                pc.close(timeout=5)
            if tail is not None:
                tail.stop()
            _restore_signal_handlers(saved_handlers)
            for logger, level in saved_levels.items():
                logger.setLevel(level)

    def _env(self, rank: int, port: int) -> dict[str, str]:
        n = str(self.world_size)
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": n,
            "LOCAL_WORLD_SIZE": n,
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "LABKIT_LAUNCH_DIR": self.dir,
        }
        if self.where.device_type == "cpu":
            # CPU ranks never touch a GPU, and DeepSpeed picks its CPU accelerator without a warning.
            env["CUDA_VISIBLE_DEVICES"] = ""
            env["DS_ACCELERATOR"] = os.environ.get("DS_ACCELERATOR", "cpu")
        else:
            # CUDA ranks keep the CUDA_VISIBLE_DEVICES they inherit (a hub's share of the node); DeepSpeed's
            # CUDA ops live apart from its CPU ops of the same names (`prebuild.extensions_dir`).
            env["DS_ACCELERATOR"] = "cuda"
            env["TORCH_EXTENSIONS_DIR"] = prebuild.extensions_dir("cuda")
        return env

    def _wait(self, pc) -> list[Any]:
        waits: dict[int, list] = {}  # rank -> [its status, since when, said]
        next_look = time.monotonic() + 1.0
        while True:
            result = pc.wait(timeout=0)
            if result is not None:
                break
            if time.monotonic() >= next_look:
                next_look = time.monotonic() + 1.0
                self._say_long_waits(waits)
            if time.monotonic() > self.deadline:
                doing, stacks = self._what_ranks_are_doing(pc)
                lines = "\n".join(f"  rank {r}: {d}" for r, d in sorted(doing.items()))
                raise LaunchTimeout(
                    f"the {self.world_size} ranks did not finish within timeout={self.timeout:g} s and were "
                    f"stopped; what each was doing:\n{lines}",
                    doing,
                    stacks,
                )
            time.sleep(0.02)
        if result.is_failed():
            raise self._first_failure(self._ended_ranks(pc, result))
        return [cloudpickle.loads(result.return_values[r]) for r in range(self.world_size)]

    def _ended_ranks(self, pc, result) -> dict[int, int]:
        """rank -> exit status (negative: the signal) of every rank that failed on its own. The launcher names
        the first failure it saw, then stops the rest (SIGTERM, SIGKILL after a wait); a rank that had already
        left with a status of its own is read from torch.multiprocessing's processes."""
        failed = {r: f.exitcode for r, f in result.failures.items()}
        stopped = (-signal.SIGTERM, -signal.SIGKILL)
        for rank, process in enumerate(getattr(getattr(pc, "_pc", None), "processes", [])):
            if rank not in failed and process.exitcode not in (None, 0, *stopped):
                failed[rank] = process.exitcode
        return failed

    def _first_failure(self, failed: dict[int, int]) -> LaunchError:
        """The root cause. A rank that only lost its peer (gloo's 'Connection reset by peer') is an echo of
        another's failure, so it is told last; of the rest, a rank that died without a report comes first
        (its peers' errors follow from it), else the earliest report of an exception."""
        reports = {r: self._read_json(f"error{r}.json") for r in failed}
        logs = {r: tail_text(self._log(r), max_lines=400) for r in failed if not reports[r]}
        said = {
            r: reports[r]["error"] if reports[r] else native_failure(logs[r], _LAUNCHER_FILES)[0]
            for r in failed
        }
        causes = [r for r in sorted(failed) if not any(t in said[r] for t in PEER_LOST)] or sorted(failed)
        silent = [r for r in causes if not reports[r]]
        if not silent:
            first = min((reports[r] for r in causes), key=lambda e: e["time"])
            error = fold_native_frames(first["error"])
            return LaunchError(
                f"rank {first['rank']} failed: {error}{collective_hint(error)}\n\n"
                f"Traceback from rank {first['rank']}:\n{fold_native_frames(first['traceback'])}",
                first["rank"],
                first["traceback"],
            )
        rank = silent[0]
        status = failed[rank]
        how = (
            f"was killed by signal {signal.Signals(-status).name}"
            if status < 0
            else f"exited with status {status}"
        )
        cause, frame = native_failure(logs[rank], _LAUNCHER_FILES)
        if cause:  # a C++ library aborted the rank (gloo's checks do): its own line first, the C stack folded
            where = f" at {frame}" if frame else ""
            return LaunchError(f"rank {rank} {how}{where}: {cause}{collective_hint(cause)}", rank, logs[rank])
        log = "\n".join(logs[rank].splitlines()[-20:])  # its last output, as much as a message can hold
        return LaunchError(
            f"rank {rank} {how} before returning" + (f"; its last output:\n{log}" if log else ""), rank
        )

    def _log(self, rank: int) -> str:
        return os.path.join(self.dir, f"rank{rank}.log")

    def _say_long_waits(self, waits: dict[int, list]) -> None:
        """Say once, on the caller's stdout, each rank that has sat inside one collective for WAIT_NOTICE_S:
        in a notebook cell that would otherwise show nothing until the timeout."""
        now = time.monotonic()
        for rank in range(self.world_size):
            status = _read_status(os.path.join(self.dir, f"status{rank}"))
            if rank not in waits or waits[rank][0] != status:
                waits[rank] = [status, now, False]
            elif (
                status.startswith("inside ") and not waits[rank][2] and now - waits[rank][1] >= WAIT_NOTICE_S
            ):
                waits[rank][2] = True
                print(
                    f"labkit.launch: rank {rank} has waited {now - waits[rank][1]:.0f} s {status.split(' (')[0]} "
                    "(a rank that never calls it keeps it waiting); the launch stops at "
                    f"timeout={self.timeout:g} s and says what each rank was doing",
                    flush=True,
                )

    def _what_ranks_are_doing(self, pc) -> tuple[dict[int, str], dict[int, str]]:
        """Ask each live rank to dump its stacks (faulthandler on SIGUSR1) and read its last collective."""
        pids = pc.pids()
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
        doing, stacks = {}, {}
        for rank in range(self.world_size):
            status = _read_status(os.path.join(self.dir, f"status{rank}"))
            stacks[rank] = tail_text(os.path.join(self.dir, f"stack{rank}.txt"), 400)
            where = user_frame(stacks[rank], _LAUNCHER_FILES)
            doing[rank] = status + (f"; at {where}" if where else "")
        return doing, stacks

    def _read_json(self, name: str) -> dict | None:
        try:
            with open(os.path.join(self.dir, name)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None


def _run_in_place(fn, world_size: int, args, kwargs) -> list[Any]:
    """Under torchrun: run `fn` on this rank and all-gather every rank's result.

    The default group is created by the first call and kept for the process's life (destroyed at exit):
    a second `init_process_group` under torchrun reads the first one's gloo addresses, still in the
    agent's store under the same keys, and hangs (docs/measured.md).
    """
    if not dist.is_initialized():
        # A rank of its own already (nothing is forked after this), so asking CUDA directly is safe here.
        backend = GPU_BACKEND if torch.cuda.is_available() else CPU_BACKEND
        if "cuda" in backend_devices(backend):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            os.environ["TORCH_EXTENSIONS_DIR"] = prebuild.extensions_dir("cuda")
        dist.init_process_group(backend)
        import atexit

        atexit.register(_destroy_default_group)
    if dist.get_world_size() != world_size:
        raise ValueError(
            f"world_size={world_size} but the launcher started {dist.get_world_size()} ranks; "
            f"pass world_size={dist.get_world_size()}"
        )
    value = fn(*args, **kwargs)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, value)
    return gathered


def _destroy_default_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def leave_launched_rank(status: int) -> NoReturn:
    """End a rank that torchrun or the DeepSpeed launcher started: destroy its group, flush, exit `status`.

    The interpreter's own teardown is skipped on purpose. There, after the run's work and output were done,
    about one exit in eight of `labkit compare --engines fsdp2,deepspeed` under two torchrun agents aborted
    in a C++ destructor ('terminate called without an active exception', no Python frame on the stack); the
    agent then reported the rank as failed and the other node's agent waited minutes for it.
    """
    _destroy_default_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


# ---------------------------------------------------------------------------------------------- child


def _rank_main(payload: bytes | tuple, run_dir: str, backend: str) -> bytes:
    """Body of every rank: wire up output and diagnostics, join the group, run `fn`, report."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _redirect_output(os.path.join(run_dir, f"rank{rank}.log"))
    _die_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # being stopped by the parent is not this rank's error
    stack_file = open(os.path.join(run_dir, f"stack{rank}.txt"), "w")  # noqa: SIM115 (kept open for faulthandler)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)
    # A C++ abort (gloo's checks) dumps the Python stack into this rank's own log, where `native_failure`
    # reads the caller's frame (a parent's faulthandler, e.g. pytest's, would write it elsewhere).
    faulthandler.enable(file=2, all_threads=True)
    _track_collectives(os.path.join(run_dir, f"status{rank}"))
    # A forked rank must not use the OpenMP pool it inherited from a parent that computed (libgomp is
    # not fork-safe: the first parallel region can hang), so forked ranks run one intra-op thread.
    if isinstance(payload, tuple):
        torch.set_num_threads(1)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        if "cuda" in backend_devices(backend):
            torch.cuda.set_device(rank_device(backend, int(os.environ["LOCAL_RANK"])))
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size)
        fn, args, kwargs = cloudpickle.loads(payload) if isinstance(payload, bytes) else payload
        value = cloudpickle.dumps(fn(*args, **kwargs))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 (every failure is reported to the parent, then the rank exits)
        report = {
            "rank": rank,
            "time": time.time(),
            "error": f"{type(e).__name__}: {e}" if str(e) else type(e).__name__,
            "traceback": "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next)),
        }
        with open(os.path.join(run_dir, f"error{rank}.json"), "w") as f:
            json.dump(report, f)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    return value


def _redirect_output(path: str) -> None:
    """Send this process's fd 1 and 2, and Python's sys.stdout/stderr, to `path`, line-buffered."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    parent_stderr = sys.stderr
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    # the logging handlers a forked rank inherits still write to the parent's stream objects
    follow_streams(sys.stdout, sys.stderr, {id(parent_stderr), id(sys.__stderr__)})


def _track_collectives(path: str) -> None:
    """Record, in a small shared file, the last collective this rank entered and whether it returned."""
    with open(path, "wb") as f:
        f.write(b"no collective entered yet".ljust(_STATUS_BYTES))
    with open(path, "r+b") as f:
        slot = mmap.mmap(f.fileno(), _STATUS_BYTES)
    start = time.monotonic()
    count = [0]

    def mark(text: str) -> None:
        slot[:] = text.encode()[:_STATUS_BYTES].ljust(_STATUS_BYTES)

    def track(name: str, original: Callable) -> Callable:
        def tracked(*args, **kwargs):
            count[0] += 1
            mark(f"inside {name} (collective #{count[0]}, entered at t={time.monotonic() - start:.2f} s)")
            out = original(*args, **kwargs)
            mark(f"returned from {name} (collective #{count[0]}, its last)")
            return out

        return tracked

    # Every call, inner ones too, for the rank's whole life: installed before the probes wrap over it.
    collectives.Patch(collectives.COLLECTIVES, track).install()


# ---------------------------------------------------------------------------------------------- helpers


def _read_status(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(_STATUS_BYTES).decode(errors="replace").strip() or "unknown"
    except OSError:
        return "had not started"


# Not the rank's own code: this launcher, its placement helpers and labkit.collectives' wrappers.
_LAUNCHER_FILES = (__file__, labkit.placement.__file__, collectives.__file__)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this rank if the launching process dies (so no orphan rank lingers)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _free_port() -> int:
    """A TCP port on the loopback that nobody listens on now (rank 0 binds it a moment later)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _empty_dir(path: str) -> None:
    for name in os.listdir(path):
        full = os.path.join(path, name)
        shutil.rmtree(full) if os.path.isdir(full) else os.remove(full)


_HANDLED_SIGNALS = [
    getattr(signal, s) for s in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, s)
]


def _signal_handlers() -> dict:
    """The parent's signal handlers, which start_processes replaces with its own (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.getsignal(s) for s in _HANDLED_SIGNALS}


def _restore_signal_handlers(saved: dict) -> None:
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _quiet_elastic_loggers() -> dict:
    """Silence torch elastic's own failure logs: `launch` raises one exception that says it all."""
    import logging

    saved = {}
    for name in ("torch.distributed.elastic", "torch.multiprocessing"):
        logger = logging.getLogger(name)
        saved[logger] = logger.level
        logger.setLevel(logging.CRITICAL)
    return saved
