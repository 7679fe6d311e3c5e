"""`labkit torchrun ARGS`: torchrun itself, with the same arguments, and a failed start told in one sentence.

When a rendezvous cannot complete, torchrun's agent ends with a forty-line traceback and a bare
`RendezvousTimeoutError`, or a `RendezvousConnectionError` that says "see inner exception". This command
runs torchrun's own `run` in this process (so nothing about the launch differs) and turns those failures,
and a rank that failed, into one line on stderr with exit status 1 (or the rank's own status):

    labkit torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        --rdzv-conf join_timeout=60 -m labkit compare --engines fsdp2,deepspeed --hsdp --hpz

`join_timeout` (default 600 s) bounds the wait for the other node agents and `read_timeout` (default
60 s) the wait to reach the store at HOST:PORT; docs/cluster.md has the recipes.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys

from labkit.cli import UsageError

_CALLER_CPP_LEVEL = "LABKIT_CALLER_TORCH_CPP_LOG_LEVEL"  # set in the agent's interpreter: the caller's level
_EXAMPLE = (
    "labkit torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:PORT "
    "-m labkit compare --engines fsdp2"
)


def register(subparsers) -> None:
    """Add the `torchrun` command: every argument after it is torchrun's."""
    p = subparsers.add_parser(
        "torchrun",
        help="torchrun with the same arguments; a rendezvous or rank failure is one sentence",
        description=f"Run torchrun's own launcher in this process, e.g. `{_EXAMPLE}`.",
        add_help=False,
        prefix_chars="\0",  # no option is ours: `--nnodes`, `-m` and the rest all go to torchrun
    )
    p.add_argument("torchrun_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.torchrun_args:
        raise UsageError(f"labkit torchrun: pass torchrun's arguments, e.g. `{_EXAMPLE}`")
    if _CALLER_CPP_LEVEL not in os.environ:
        # The agent's C++ store client logs every failed connection with a C++ stack, at a level torch
        # reads once, when it loads (here it already has): so the agent runs in a fresh interpreter
        # with those logs off, and hands the ranks the caller's own level back.
        env = os.environ | {
            "TORCH_CPP_LOG_LEVEL": "FATAL",
            _CALLER_CPP_LEVEL: os.environ.get("TORCH_CPP_LOG_LEVEL", ""),
        }
        argv = [sys.executable, "-m", "labkit", "torchrun", *args.torchrun_args]
        return subprocess.run(argv, env=env).returncode
    caller_level = os.environ.pop(_CALLER_CPP_LEVEL)
    if caller_level:
        os.environ["TORCH_CPP_LOG_LEVEL"] = caller_level
    else:
        os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousError,
        RendezvousTimeoutError,
    )

    targs = _parse(torchrun, args.torchrun_args)
    conf = _rdzv_conf(targs.rdzv_conf)
    where = targs.rdzv_endpoint or f"{targs.master_addr}:{targs.master_port}"
    # The agent's own logs of the same failure (and its traceback) would bury the sentence below.
    elastic = logging.getLogger("torch.distributed.elastic")
    saved_level = elastic.level
    elastic.setLevel(logging.CRITICAL)
    try:
        torchrun.run(targs)
    except RendezvousTimeoutError:
        return _fail(
            f"the rendezvous at {where} did not gather --nnodes {targs.nnodes} node agents within "
            f"join_timeout={conf.get('join_timeout', '600')} s; start the same command on every node (same "
            "--rdzv-endpoint and --rdzv-id), or pass the --nnodes that will really start"
        )
    except RendezvousConnectionError as e:
        cause = str(e.__cause__ or e).strip().splitlines()[0].rstrip(".")
        return _fail(
            f"cannot reach the rendezvous store at {where} ({cause}); pass --rdzv-endpoint HOST:PORT of the "
            "first node's agent, with the port open to every node"
        )
    except RendezvousClosedError:
        return _fail(
            f"the rendezvous at {where} was closed by another node's agent before this node's ranks ran (its "
            "ranks failed first: its own message says why); fix that, then start every node again"
        )
    except RendezvousError as e:
        return _fail(f"the rendezvous at {where} failed: {type(e).__name__}: {str(e).strip() or 'no detail'}")
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        how = (
            f"was killed by signal {failure.signal_name()}"
            if failure.exitcode < 0
            else f"exited with status {failure.exitcode}"
        )
        _fail(f"rank {rank} {how} (its own message is above); torchrun stopped the ranks of this node")
        return failure.exitcode if failure.exitcode > 0 else 1
    finally:
        elastic.setLevel(saved_level)
    return 0


def _parse(torchrun, argv: list[str]) -> argparse.Namespace:
    """torchrun's own arguments, parsed by its own parser; a bad one said in one sentence (not torchrun's
    usage block), as is a node count or a ranks-per-node torchrun would only reject later, with a traceback."""

    def refuse(message: str):
        raise UsageError(f"labkit torchrun: {message}; `torchrun --help` lists its arguments")

    parser = torchrun.get_args_parser()
    parser.error = refuse
    targs = parser.parse_args(argv)
    try:
        low, high = torchrun.parse_min_max_nnodes(targs.nnodes)
    except ValueError:
        low = high = 0
    if not 0 < low <= high:
        refuse(f"--nnodes {targs.nnodes} is not a node count N, or MIN:MAX with 0 < MIN <= MAX")
    per_node = str(targs.nproc_per_node)
    if not ((per_node.isdigit() and int(per_node) > 0) or per_node in ("auto", "cpu", "gpu", "xpu")):
        refuse(f"--nproc-per-node {per_node} is not a number of ranks (1 or more), auto, cpu or gpu")
    return targs


def _rdzv_conf(text: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in (text or "").split(",") if "=" in kv)


def _fail(sentence: str) -> int:
    print(f"labkit torchrun: {sentence}", file=sys.stderr)
    return 1
