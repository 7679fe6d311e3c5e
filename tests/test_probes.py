"""The probes: bytes per collective against the ring formula (hand-issued collectives on 2, 3 and 4 ranks,
odd sizes, subgroups), the emulated link and its overlap, the timeline, state bytes and CPU peak memory.

The hand-issued checks at n ranks share one launch (`probe_jobs`); the loop's runs keep a launch of their own.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from launches import job, launched_on_demand

from labkit.probes import PeakMemory, Probes, exposed_comm_s, state_bytes

F32 = 4  # bytes per float32 element
BF16 = 2


def ring(kind: str, payload_bytes: int, n: int) -> int:
    """The ring definition, written out here so the test does not trust the code under test."""
    factor = 2 if kind == "all_reduce" else 1
    return factor * (n - 1) * payload_bytes // n


def _issue_collectives() -> dict:
    n, rank = dist.get_world_size(), dist.get_rank()
    probes = Probes(rank, torch.device("cpu"))
    with probes:
        dist.all_gather_single(torch.empty(7 * n), torch.ones(7))  # FSDP2's name
        dist.all_gather_into_tensor(
            torch.empty(7 * n, dtype=torch.bfloat16), torch.ones(7, dtype=torch.bfloat16)
        )
        dist.all_gather([torch.empty(3) for _ in range(n)], torch.ones(3))
        dist.reduce_scatter_single(torch.empty(5), torch.ones(5 * n))
        dist.reduce_scatter_tensor(torch.empty(5), torch.ones(5 * n))  # DeepSpeed's name, calls the new one
        dist.all_reduce(torch.ones(13))
        dist.all_reduce(torch.ones(13), async_op=True).wait()
        dist.broadcast(torch.ones(11), src=0)
        dist.barrier()
    summed = torch.ones(13)
    dist.all_reduce(summed)  # after uninstall: not counted
    return {
        "summary": probes.comm.summary(),
        "functions": [c.function for c in probes.comm.calls],
        "groups": {c.group_size for c in probes.comm.calls},
        "events": probes.timeline.events,
    }


@pytest.mark.parametrize("n", [2, 3, 4])
def test_bytes_per_collective_follow_the_ring_formula(n, ranks):
    results = ranks(n)["collectives"]
    expected_payload = {
        "all_gather": 7 * n * F32 + 7 * n * BF16 + 3 * n * F32,
        "reduce_scatter": 2 * 5 * n * F32,
        "all_reduce": 2 * 13 * F32,
        "broadcast": 11 * F32,
        "barrier": 0,
    }
    expected_wire = {
        "all_gather": ring("all_gather", 7 * n * F32, n)
        + ring("all_gather", 7 * n * BF16, n)
        + ring("all_gather", 3 * n * F32, n),
        "reduce_scatter": 2 * ring("reduce_scatter", 5 * n * F32, n),
        "all_reduce": 2 * ring("all_reduce", 13 * F32, n),
        "broadcast": ring("broadcast", 11 * F32, n),
        "barrier": 0,
    }
    calls = {"all_gather": 3, "reduce_scatter": 2, "all_reduce": 2, "broadcast": 1, "barrier": 1}
    for r in results:
        assert r["summary"] == {
            k: {"calls": calls[k], "payload_bytes": expected_payload[k], "wire_bytes": expected_wire[k]}
            for k in calls
        }
        # a deprecated name is counted once, under its own name, not again as the new one it calls
        assert r["functions"] == [
            "all_gather_single",
            "all_gather_into_tensor",
            "all_gather",
            "reduce_scatter_single",
            "reduce_scatter_tensor",
            "all_reduce",
            "all_reduce",
            "broadcast",
            "barrier",
        ]
        assert r["groups"] == {n}
        kinds = {e["kind"] for e in r["events"]}
        assert kinds == {"comm", "wait"}
        assert sum(e["kind"] == "comm" for e in r["events"]) == len(r["functions"])


def _subgroups() -> list:
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    odd = dist.new_group([0, 2, 3])
    mine = pairs[rank // 2]
    probes = Probes(rank, torch.device("cpu"))
    with probes:
        dist.all_gather_single(torch.empty(2 * 9), torch.ones(9), group=mine)
        dist.all_reduce(torch.ones(10), group=odd)  # rank 1 is not in it: torch does nothing, nor do we
    return [(c.kind, c.payload_bytes, c.wire_bytes, c.group_size, c.group_ranks) for c in probes.comm.calls]


def test_subgroup_calls_use_the_group_size_and_record_its_ranks(ranks):
    calls = ranks(4)["subgroups"]
    pair_ag = ("all_gather", 18 * F32, ring("all_gather", 18 * F32, 2), 2)
    trio_ar = ("all_reduce", 10 * F32, ring("all_reduce", 10 * F32, 3), 3, (0, 2, 3))
    assert calls[0] == [(*pair_ag, (0, 1)), trio_ar]
    assert calls[1] == [(*pair_ag, (0, 1))]
    assert calls[2] == [(*pair_ag, (2, 3)), trio_ar]
    assert calls[3] == [(*pair_ag, (2, 3)), trio_ar]


def _stacked_patches() -> dict:
    """labkit.launch's hang tracker (installed in every rank), the probe over it, a grader's watcher on top."""
    import os

    from torch.distributed import distributed_c10d

    from labkit.cluster import _read_status
    from labkit.collectives import COLLECTIVES, Patch

    n, rank = dist.get_world_size(), dist.get_rank()
    tracker = dist.all_reduce
    seen = []

    def watch(name, fn):
        def watched(*args, **kwargs):
            seen.append(name)
            return fn(*args, **kwargs)

        return watched

    probes = Probes(rank, torch.device("cpu"))
    with probes:
        probe = dist.all_reduce
        with Patch(COLLECTIVES, watch, outermost=True):
            top = dist.all_reduce
            dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * n))  # torch runs reduce_scatter_single
            dist.all_reduce(torch.ones(3))
            try:
                probes.comm.uninstall()  # out of order: the watcher still calls the probe
                error = ""
            except RuntimeError as e:
                error = str(e)
        probe_back_on_top = dist.all_reduce is probe and distributed_c10d.all_reduce is probe
    status = _read_status(os.path.join(os.environ["LABKIT_LAUNCH_DIR"], f"status{rank}"))
    return {
        "seen": seen,
        "probed": [c.function for c in probes.comm.calls],
        "error": error,
        "stacked": top.__wrapped__ is probe and probe.__wrapped__ is tracker,
        "restored": probe_back_on_top and dist.all_reduce is tracker is distributed_c10d.all_reduce,
        "looks_like_torch": top.__name__ == "all_reduce"
        and top.__doc__ == tracker.__wrapped__.__doc__
        and inspect.signature(top) == inspect.signature(tracker.__wrapped__),
        "tracker_status": status,
    }


def test_patches_stack_tracker_then_probe_then_a_watcher_and_come_off_in_reverse_order(ranks):
    for r in ranks(2)["stacked patches"]:
        assert r["stacked"] and r["restored"] and r["looks_like_torch"]
        # the outermost patches see the call made, not the one torch makes inside it
        assert r["seen"] == r["probed"] == ["reduce_scatter_tensor", "all_reduce"]
        assert r["error"] == (
            "torch.distributed.all_gather_single was wrapped again after this Patch and still is; "
            "remove the later wrapper first"
        )
        assert r["tracker_status"].startswith("returned from all_reduce (collective #")  # it saw every call


def test_a_collective_imported_by_name_is_looked_up_at_each_call():
    from torch.distributed import all_gather_single, reduce_scatter_single

    from labkit.collectives import Patch, late_bound

    namespace = {"ag": all_gather_single, "rs": reduce_scatter_single, "other": len}
    assert sorted(late_bound(namespace)) == ["ag", "rs"] and namespace["other"] is len
    assert namespace["ag"].__name__ == "all_gather_single"
    seen = []
    with Patch(["all_gather_single"], lambda name, fn: lambda *a, **k: seen.append((name, a))):
        namespace["ag"]("out", "in")  # a patch installed after the import sees the call
    assert seen == [("all_gather_single", ("out", "in"))]


def _deepspeed_backend_built_before_the_probe() -> dict:
    """DeepSpeed's comm backend built before the probe, holding torch's function by reference as on torch
    2.11 (where `all_gather_into_tensor` does its work itself instead of calling the module's new name)."""
    import deepspeed
    import deepspeed.comm as dscomm
    from deepspeed.comm import comm as ds_comm_module
    from torch.distributed import distributed_c10d

    deepspeed.init_distributed(dist_backend="gloo")  # the process group exists: DeepSpeed reuses it
    backend = ds_comm_module.cdb
    backend.all_gather_function = distributed_c10d.all_gather_single  # a reference taken before the probe
    held = backend.all_gather_function
    probes = Probes(dist.get_rank(), torch.device("cpu"))
    with probes:
        rebound = backend.all_gather_function is not held
        out = torch.empty(2 * 1000)
        dscomm.all_gather_into_tensor(out, torch.full((1000,), float(dist.get_rank())))
    return {
        "rebound": rebound,
        "restored": backend.all_gather_function is held,
        "summary": probes.comm.summary(),
        "gathered": out[::1000].tolist(),
    }


def test_a_deepspeed_backend_built_before_the_probe_is_still_measured(ranks):
    for r in ranks(2)["deepspeed backend"]:
        assert r["rebound"] and r["restored"] and r["gathered"] == [0.0, 1.0]
        assert r["summary"]["all_gather"] == {"calls": 1, "payload_bytes": 8000, "wire_bytes": 4000}


def test_torch_2_13_has_the_single_names_and_an_older_torch_gets_them(monkeypatch):
    from torch.distributed import distributed_c10d

    from labkit import collectives

    assert collectives.PROVIDED == [] and dist.all_gather_single is distributed_c10d.all_gather_single
    for new in collectives.SINGLE_NAMES:  # torch 2.11: no such names
        monkeypatch.delattr(distributed_c10d, new)
        monkeypatch.delattr(dist, new)
    assert collectives.provide_single_names() == list(collectives.SINGLE_NAMES)
    assert dist.all_gather_single is distributed_c10d.all_gather_into_tensor
    assert dist.reduce_scatter_single is distributed_c10d.reduce_scatter_tensor


LINK_GBYTES = 0.01  # 1e7 B/s
ELEMENTS = 250_000  # 1 MB of float32; on 2 ranks an all-reduce sends 2 x 1/2 x 1 MB = 1 MB: 0.1 s on the link


def _link() -> dict:
    rank = dist.get_rank()
    probes = Probes(rank, torch.device("cpu"), link_gbytes=LINK_GBYTES)
    out = {}
    with probes:
        start = time.perf_counter()
        dist.all_reduce(torch.ones(ELEMENTS))
        out["sync_s"] = time.perf_counter() - start

        dist.barrier()
        probes.timeline.step = 1
        work = dist.all_reduce(torch.ones(ELEMENTS), async_op=True)
        out["is_work"] = isinstance(work, dist.Work)
        time.sleep(0.4)  # compute while the collective crosses the link
        work.wait()
        out["delegated"] = work.exception() is None and work.result()[0].shape == (ELEMENTS,)  # inner Work
        probes.timeline.step = None

        dist.barrier()
        start = time.perf_counter()
        works = [dist.all_reduce(torch.ones(ELEMENTS), async_op=True) for _ in range(2)]
        works[0].wait()
        first_s = time.perf_counter() - start
        works[1].get_future().wait()  # the link's delay sits in the future too
        out["fifo_s"] = (first_s, time.perf_counter() - start)
    events = probes.timeline.events
    out["overlapped_exposed_s"] = exposed_comm_s([e for e in events if e["step"] == 1])
    out["overlapped_comm_s"] = [
        e["end_s"] - e["start_s"] for e in events if e["step"] == 1 and e["kind"] == "comm"
    ]
    out["sync_exposed_s"] = exposed_comm_s(events[:2])
    out["wire_bytes"] = probes.comm.calls[0].wire_bytes
    return out


def test_emulated_link_delays_collectives_and_an_overlapped_one_exposes_almost_nothing(ranks):
    link_s = ELEMENTS * F32 / (LINK_GBYTES * 1e9) - 1e-6  # minus float rounding of the event times
    for r in ranks(2)["link"]:
        assert r["wire_bytes"] == ELEMENTS * F32
        assert r["sync_s"] >= link_s
        assert r["sync_exposed_s"] >= link_s
        assert r["is_work"] and r["delegated"]  # FSDP2 waits only on isinstance(work, Work)
        assert r["overlapped_comm_s"][0] >= link_s  # in flight for at least the link time...
        assert r["overlapped_exposed_s"] < 0.5 * link_s  # ...but hidden behind the 0.4 s of compute
        first_s, both_s = r["fifo_s"]
        assert first_s >= link_s and both_s >= 2 * link_s  # one link, first in first out


def _dtensor_state() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    param = distribute_tensor(torch.ones(10, 4), mesh, [Shard(0)])
    flat = torch.zeros(100)
    return state_bytes({"params": [param], "grads": [flat[:50], flat[50:]], "optimizer": [flat[:10]]})


def test_state_bytes_count_local_shards_and_shared_storage_once(ranks):
    for r in ranks(2)["dtensor state"]:
        assert r == {"params": 5 * 4 * F32, "grads": 100 * F32, "optimizer": 0}


def test_cpu_peak_memory_follows_live_storages_through_views_frees_and_resizes():
    memory = PeakMemory(torch.device("cpu"))
    memory.start()
    x = torch.empty(1_000_000)
    x.view(1000, 1000).add_(1)  # a view and an in-place op allocate nothing
    del x
    a, b = torch.zeros(500_000), torch.ones(500_000)
    a.untyped_storage().resize_(0)  # how FSDP2 frees an unsharded parameter...
    a.untyped_storage().resize_(8_000_000)  # ...and allocates it again
    peak = memory.stop() - memory.start_bytes
    assert peak == 8_000_000 + 500_000 * F32
    del a, b


def test_cpu_peak_memory_sees_backward():
    linear = torch.nn.Linear(1000, 1000)
    memory = PeakMemory(torch.device("cpu"))
    memory.start()
    linear(torch.randn(10, 1000)).sum().backward()
    grads_bytes = sum(p.numel() * F32 for p in linear.parameters())
    assert grads_bytes <= memory.stop() - memory.start_bytes < grads_bytes + 200_000


# ------------------------------------------------------------------------------ the CUDA path, on CPU


def test_on_cpu_the_span_edge_sync_does_nothing_and_on_cuda_it_waits_for_the_stream():
    from labkit.probes.timeline import _no_sync, device_sync

    probes = Probes(0, torch.device("cpu"))
    assert probes.timeline.sync is _no_sync and not probes.timeline.syncs and _no_sync() is None
    assert device_sync(torch.device("cpu")) is _no_sync
    assert device_sync(torch.device("cuda", 0)) is not _no_sync  # built without touching CUDA


class _Counted:
    """A span-edge hook that counts its calls and records `clock` when it ran (the timestamps follow it)."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.times: list[float] = []

    def __call__(self) -> None:
        self.times.append(self.clock())


def test_every_span_edge_runs_the_sync_hook_before_its_timestamp():
    from labkit.model import build_model, loss_fn
    from labkit.probes.clock import RankClock
    from labkit.probes.timeline import Timeline

    clock = RankClock()
    hook = _Counted(clock.now)  # the timeline's clock: the rank's, not the wall's
    timeline = Timeline(0, sync=hook, clock=clock)
    with timeline.span("compute", "forward"):
        pass
    assert len(hook.times) == 2
    model = build_model("tiny")
    timeline.watch_blocks(model)
    tokens, targets = (torch.randint(0, 8, (2, 4)), torch.randint(0, 8, (2, 4)))
    loss_fn(model(tokens), targets).backward()
    blocks = len(model.blocks)
    assert len(hook.times) == 2 + 4 * blocks  # each block: forward start and end, backward start and end
    spans = [e for e in timeline.events if e["name"].startswith("blocks.")]
    assert len(spans) == 2 * blocks
    edges = sorted(hook.times)
    for e in spans:  # each edge's time was taken right after a sync ran
        for t in (e["start_s"], e["end_s"]):
            before = max(s for s in edges if s <= t + timeline.t0_s)
            assert 0 <= t + timeline.t0_s - before < 0.05


def _comm_edges() -> dict:
    """Real gloo collectives under a probe whose timeline counts its sync calls."""
    probes = Probes(dist.get_rank(), torch.device("cpu"))
    hook = _Counted()
    probes.timeline.sync = hook
    with probes:
        dist.all_reduce(torch.ones(5))  # synchronous: issue and return
        sync_calls = len(hook.times)
        work = dist.all_reduce(torch.ones(5), async_op=True)  # async: issue, then the wait's two edges
        work.wait()
        sync_total = len(hook.times)
        kinds = sorted({(e["kind"], e["name"]) for e in probes.timeline.events})
        held = _held_after_wait(n=dist.get_world_size())
    return {
        "sync": sync_calls,
        "total": sync_total,
        "kinds": kinds,
        **held,
    }


def _until_dropped(data_ptrs: set[int], timeout_s: float = 2.0) -> None:
    """Wait until no storage Python can reach starts at one of `data_ptrs` (at most `timeout_s`)."""
    from labkit.probes.memory import reachable_storages

    deadline = time.monotonic() + timeout_s
    while any(st.data_ptr() in data_ptrs for st in reachable_storages()) and time.monotonic() < deadline:
        time.sleep(0.001)


def _held_after_wait(n: int) -> dict:
    """References to an all-gather's buffers once its wait() returned, with and without a CPU peak measured,
    and what the peak's tracker counts live once the caller dropped them."""
    out = {}
    send, recv = torch.ones(1000), torch.empty(n * 1000)
    work = dist.all_gather_single(recv, send, async_op=True)
    work.wait()
    out["unmeasured"] = (send._use_count(), recv._use_count())  # the Work still holds them
    unmeasured = {send.untyped_storage().data_ptr(), recv.untyped_storage().data_ptr()}
    del work, send, recv
    _until_dropped(unmeasured)  # by gloo's thread, a moment later: not live when the peak starts
    memory = PeakMemory(torch.device("cpu"))
    memory.start()
    before = memory._tracker.live_bytes
    send, recv = torch.ones(1000), torch.empty(n * 1000)
    work = dist.all_gather_single(recv, send, async_op=True)
    work.wait()
    out["measured"] = (send._use_count(), recv._use_count())
    out["again"] = (work.wait(), work.is_completed())
    dist.all_gather_single(recv, send)  # synchronous
    out["sync_buffers"] = (send._use_count(), recv._use_count())
    del work, send, recv
    out["left"] = memory._tracker.live_bytes - before
    memory.stop()
    return out


def test_the_comm_probe_syncs_at_issue_return_and_both_ends_of_a_wait_and_settles_buffers_for_a_peak(ranks):
    """Each edge of a collective syncs the timeline. And gloo's worker thread drops a Work a moment after
    waking its waiter: buffers it dropped last would be freed on that thread at a time no run repeats. While
    a CPU peak is measured, wait() lets go of the Work and returns once the backend holds no reference to
    the buffers (a sync call too), so the caller's own drop frees them."""
    for r in ranks(2)["comm edges"]:
        assert r["sync"] == 2 and r["total"] == 2 + 3
        assert r["kinds"] == [("comm", "all_reduce"), ("wait", "all_reduce")]
        assert r["unmeasured"][0] > 1 and r["unmeasured"][1] > 1
        assert r["measured"] == (1, 1) and r["sync_buffers"] == (1, 1)
        assert r["again"] == (True, True)
        assert r["left"] == 0


def test_state_bytes_by_device_counts_every_key_under_its_category_once():
    from labkit.probes import state_bytes_by_device

    flat = torch.zeros(100)
    host = torch.zeros(30)
    state = {
        "params": [flat[:40]],
        "grads": [flat[40:]],
        "optimizer": [],
        "host_optimizer": [host, host[:5]],
        "unknown": [torch.zeros(7)],
    }
    assert state_bytes_by_device(state) == {"cpu": {"params": 100 * F32, "grads": 0, "optimizer": 30 * F32}}
    assert state_bytes(state) == {"params": 100 * F32, "grads": 0, "optimizer": 0}  # the device's keys only


def test_offload_on_cpu_ranks_shows_the_optimizer_in_host_buffers_and_records_a_baseline_of_its_own():
    """The scratch engine's offload keeps the optimizer in host buffers ("host_optimizer"): `state_bytes`,
    the contract's keys, has 0 B of optimizer on the device; the split by device finds them on "cpu"
    (on a GPU rank the same split shows them leaving cuda:k). Without offload both hold m and v."""
    from labkit.engines import loop
    from labkit.engines.base import RunConfig
    from labkit.model import build_model, count_params

    cfg = RunConfig(model="tiny", world_size=2, steps=1)
    runs = [
        ("scratch", cfg),
        ("scratch", replace(cfg, offload="cpu")),
        ("scratch", cfg),
        ("deepspeed", cfg),
        ("scratch", cfg),
    ]
    plain, offloaded, again, _, after_deepspeed = loop.run_many(runs)
    # Nothing of the two scratch runs before it is alive when the third starts (its grad hooks hold the
    # engine weakly). DeepSpeed leaves its model behind (hooks in autograd's C++ side hold it), at least
    # the fp32 weights; the run after it leaves that out of its figures, which equal the first run's (the
    # peak within 1%: garbage that `gc` collects at its own moments during a step can move it by kBs).
    assert again["mem_prior_bytes"] == plain["mem_prior_bytes"]
    fp32_weights = 4 * count_params(build_model("tiny"))
    assert min(after_deepspeed["mem_prior_bytes"]) >= plain["mem_prior_bytes"][0] + fp32_weights
    for rec in (again, after_deepspeed):
        assert rec["mem_baseline_bytes"] == plain["mem_baseline_bytes"]
        assert rec["peak_mem_bytes"] == pytest.approx(plain["peak_mem_bytes"], rel=0.01)
    shard_bytes = plain["state_bytes"]["params"]  # fp32 master shards of this rank (bytes)
    assert plain["state_bytes_by_device"] == {"cpu": plain["state_bytes"]}
    assert plain["state_bytes"]["optimizer"] == 2 * shard_bytes  # m and v
    assert offloaded["state_bytes"]["optimizer"] == 0
    host = offloaded["state_bytes_by_device"]["cpu"]
    assert host["optimizer"] == 4 * shard_bytes  # m, v, the host master copy, the gradient landing buffer
    assert host["params"] == offloaded["state_bytes"]["params"] == shard_bytes
    for rec in (plain, offloaded):
        assert len(rec["mem_baseline_bytes"]) == 2
        assert all(0 < b <= p for b, p in zip(rec["mem_baseline_bytes"], rec["peak_mem_bytes"], strict=True))


# ------------------------------------------------------------------------------------------ the launches


def probe_jobs(n: int) -> dict:
    """The hand-issued checks at `n` ranks, every rank's result of each, in launch order: DeepSpeed's
    backend last (it initialises DeepSpeed's comm for the process)."""
    jobs = {"collectives": job(_issue_collectives, per_rank=True)}
    if n == 4:
        jobs["subgroups"] = job(_subgroups, per_rank=True)
    if n == 2:
        for name, fn in (
            ("stacked patches", _stacked_patches),
            ("link", _link),
            ("dtensor state", _dtensor_state),
            ("comm edges", _comm_edges),
            ("deepspeed backend", _deepspeed_backend_built_before_the_probe),
        ):
            jobs[name] = job(fn, per_rank=True)
    return jobs


@pytest.fixture(scope="module")
def ranks():
    """`get(n)`: {job name: every rank's result} of `probe_jobs(n)`, launched the first time a test asks."""
    return launched_on_demand(probe_jobs)
