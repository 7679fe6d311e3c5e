"""torch.distributed's collective functions: the one table of them, and the one place that wraps them.

Three layers watch collectives from outside the code that issues them, each with a `Patch` from here: the
hang tracker of `labkit.cluster` (in every rank, for its whole life), the comm probe of `labkit.probes`
(bytes, timeline, emulated link) and grading checks that record which collectives an answer calls. A patch
replaces each function on both `torch.distributed` and `distributed_c10d` (torch's own functions call one
another through the latter) with a wrapper over whatever was there, so patches stack: the tracker is
installed first, the probe over it, a check over both, and the last installed runs first. A library that
took a collective by reference before the patch (DeepSpeed's comm backend keeps `all_gather_into_tensor`
and `reduce_scatter_tensor` from when it was built) is rebound too, and given its function back on removal.

torch 2.13 names the tensor collectives `all_gather_single` / `reduce_scatter_single`; on an older torch
(a hub's 2.11 or 2.12) `provide_single_names` gives those names to the functions they replace.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch.distributed as dist
from torch.distributed import distributed_c10d

from labkit.names import ALL_GATHER, ALL_REDUCE, BROADCAST, REDUCE_SCATTER


class Collective(NamedTuple):
    """What a collective function does (`kind`), which argument holds its full payload, whether it is charged."""

    kind: str  # "all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all", "barrier", ...
    payload_arg: str  # the argument that holds the full payload; "" when there is none
    counted: bool = True  # the comm probe charges it (see the entries marked False for why not)


COLLECTIVES: dict[str, Collective] = {
    # FSDP2 calls the *_single names; DeepSpeed the deprecated *_tensor ones, which torch runs by
    # calling the *_single ones; DDP's comm hook all_reduce.
    "all_gather_single": Collective(ALL_GATHER, "output_tensor"),
    "all_gather_into_tensor": Collective(ALL_GATHER, "output_tensor"),
    "_all_gather_base": Collective(ALL_GATHER, "output_tensor"),
    "all_gather": Collective(ALL_GATHER, "tensor_list"),
    "all_gather_coalesced": Collective(ALL_GATHER, "output_tensor_lists"),
    "reduce_scatter_single": Collective(REDUCE_SCATTER, "input"),
    "reduce_scatter_tensor": Collective(REDUCE_SCATTER, "input"),
    "_reduce_scatter_base": Collective(REDUCE_SCATTER, "input"),
    "reduce_scatter": Collective(REDUCE_SCATTER, "input_list"),
    "all_reduce": Collective(ALL_REDUCE, "tensor"),
    "all_reduce_coalesced": Collective(ALL_REDUCE, "tensors"),
    "broadcast": Collective(BROADCAST, "tensor"),
    "all_to_all_single": Collective("all_to_all", "input"),
    "all_to_all": Collective("all_to_all", "input_tensor_list"),
    "barrier": Collective("barrier", ""),
    # Object collectives: the tensor collectives they run inside are the ones charged.
    "all_gather_object": Collective(ALL_GATHER, "", counted=False),
    "broadcast_object_list": Collective(BROADCAST, "", counted=False),
    # Rooted, point-to-point and monitored ones: the probe has no ring model for them.
    "reduce": Collective("reduce", "tensor", counted=False),
    "gather": Collective("gather", "tensor", counted=False),
    "scatter": Collective("scatter", "tensor", counted=False),
    "monitored_barrier": Collective("barrier", "", counted=False),
    "send": Collective("send", "tensor", counted=False),
    "recv": Collective("recv", "tensor", counted=False),
    "isend": Collective("send", "tensor", counted=False),
    "irecv": Collective("recv", "tensor", counted=False),
}
COUNTED = tuple(name for name, c in COLLECTIVES.items() if c.counted)  # what the comm probe wraps
SINGLE_NAMES = {
    "all_gather_single": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
}


def provide_single_names() -> list[str]:
    """Give torch 2.13's names to the functions they replace where this torch lacks them (2.11, 2.12), on
    `torch.distributed` and `distributed_c10d`; the names given (none on 2.13). Same arguments, same work."""
    given = []
    for new, old in SINGLE_NAMES.items():
        if not hasattr(distributed_c10d, new) and hasattr(distributed_c10d, old):
            setattr(distributed_c10d, new, getattr(distributed_c10d, old))
            setattr(dist, new, getattr(distributed_c10d, old))
            given.append(new)
    return given


def late_bound(namespace: dict) -> list[str]:
    """Rebind each name in `namespace` that holds a collective function itself (`from torch.distributed
    import reduce_scatter_single` in a notebook cell) to one that looks the function up on `distributed_c10d`
    at each call, so patches installed later (and in forked ranks) see those calls; the names rebound."""
    originals = {id(getattr(distributed_c10d, n)): n for n in COLLECTIVES if hasattr(distributed_c10d, n)}
    rebound = []
    for key, value in list(namespace.items()):
        name = originals.get(id(value))
        if name is not None:
            namespace[key] = functools.update_wrapper(_by_name(name), value)
            rebound.append(key)
    return rebound


def _by_name(name: str) -> Callable:
    def call(*args, **kwargs):
        return getattr(distributed_c10d, name)(*args, **kwargs)

    return call


def held_by_reference() -> list[tuple[object, str]]:
    """(object, attribute) where a library keeps a collective function it took by reference: DeepSpeed's
    torch comm backend (`deepspeed.comm.comm.cdb`, built once per process) holds `all_gather_function`
    and `reduce_scatter_function` (deepspeed/comm/torch.py). Nothing is imported to look."""
    backend = getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
    attrs = ("all_gather_function", "reduce_scatter_function")
    return [(backend, a) for a in attrs if backend is not None and callable(getattr(backend, a, None))]


Wrap = Callable[[str, Callable], Callable]  # (function name, the function it replaces) -> the wrapper


class Patch:
    """Each of `names` (those this torch has) replaced by `wrap(name, current)` while installed.

    `outermost=True`: a call made from inside another call of the same patch (torch runs
    `reduce_scatter_tensor` by calling `reduce_scatter_single`) goes straight to the function underneath,
    so each call the caller made is seen once. `with Patch(...):` installs and removes; remove patches
    in the reverse order of installing them (a later wrapper still calls this one's).
    """

    def __init__(self, names: Iterable[str], wrap: Wrap, outermost: bool = False):
        self.names = [name for name in names if hasattr(distributed_c10d, name)]
        self.wrap = wrap
        self.outermost = outermost
        self._saved: dict[str, tuple[Callable, Callable | None]] = {}  # name -> (c10d's, torch.distributed's)
        self._installed: dict[str, Callable] = {}
        self._rebound: list[tuple[object, str, Callable]] = []  # (holder, attribute, what it held)
        self._inside = threading.local()  # per thread: inside a call of this patch already

    @property
    def installed(self) -> bool:
        return bool(self._installed)

    def install(self) -> Patch:
        if self.installed:
            raise RuntimeError("this Patch is installed already; remove() it before installing it again")
        for name in self.names:
            current = getattr(distributed_c10d, name)
            self._saved[name] = (current, getattr(dist, name, None))
            self._installed[name] = self._wrapper(name, current)
            setattr(distributed_c10d, name, self._installed[name])
            if hasattr(dist, name):
                setattr(dist, name, self._installed[name])
        for holder, attr in held_by_reference():
            held = getattr(holder, attr)
            name = next((n for n, fns in self._saved.items() if held in fns), None)
            if name is not None:
                setattr(holder, attr, self._installed[name])
                self._rebound.append((holder, attr, held))
        return self

    def remove(self) -> None:
        covered = [n for n, fn in self._installed.items() if getattr(distributed_c10d, n) is not fn]
        if covered:
            raise RuntimeError(
                f"torch.distributed.{covered[0]} was wrapped again after this Patch and still is; "
                "remove the later wrapper first"
            )
        for name, (c10d_fn, dist_fn) in self._saved.items():
            setattr(distributed_c10d, name, c10d_fn)
            if dist_fn is not None:
                setattr(dist, name, dist_fn)
        for holder, attr, held in self._rebound:
            setattr(holder, attr, held)
        for holder, attr in held_by_reference():  # a backend built while installed took a wrapper of ours
            name = next((n for n, fn in self._installed.items() if getattr(holder, attr) is fn), None)
            if name is not None:
                setattr(holder, attr, self._saved[name][1] or self._saved[name][0])
        self._saved.clear()
        self._installed.clear()
        self._rebound.clear()

    def __enter__(self) -> Patch:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()

    def _wrapper(self, name: str, current: Callable) -> Callable:
        wrapped = self.wrap(name, current)
        inside = self._inside

        def wrapper(*args, **kwargs):
            if not self.outermost:
                return wrapped(*args, **kwargs)
            if getattr(inside, "active", False):
                return current(*args, **kwargs)  # an inner call of one already seen
            inside.active = True
            try:
                return wrapped(*args, **kwargs)
            finally:
                inside.active = False

        return functools.update_wrapper(wrapper, current)  # its name, doc and `__wrapped__` = `current`


PROVIDED = provide_single_names()  # on import, in the notebook's kernel and in every rank (labkit.cluster)
