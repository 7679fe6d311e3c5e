"""Two nodes emulated on this machine: two real torchrun agents on loopback, `-m labkit compare` under them.

Each agent is one "node" of 2 ranks (torchrun's GROUP_RANK, not the host name, tells the nodes apart), so
ranks 0, 1 are node 0 and ranks 2, 3 node 1. The inter-node bytes the probe measures for full sharding,
HSDP and hpZ must be exactly what `labkit.budget` predicts, collective by collective, and a rendezvous that
cannot complete must end within its timeout in one sentence.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit.budget import plan, ring_link_bytes
from labkit.budget.ring import ring_bytes_all_ranks
from labkit.engines import fsdp2
from labkit.engines.base import RunConfig
from labkit.model import build_model, count_params

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
STEPS = 3  # DeepSpeed's comm is steady from step 2 on (it traces its fetch order in the first steps)
AGENT_TIMEOUT_S = 240
NODES = [0, 0, 1, 1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_", "GROUP_", "TORCHELASTIC"))
    }
    return env | {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}


def _agent(launcher: list[str], endpoint: str, node_rank: int, nproc: int, *extra: str) -> list[str]:
    return [
        *launcher,
        "--nnodes",
        "2",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--node-rank",
        str(node_rank),
        *extra,
    ]


def _start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        argv, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(procs: list[subprocess.Popen], timeout_s: float) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        out.append((p.returncode, stdout, stderr))
    return out


TORCHRUN = [PY, "-m", "torch.distributed.run"]  # the `torchrun` console script, as a module
COMPARE = [
    "-m",
    "labkit",
    "compare",
    "--engines",
    "fsdp2,deepspeed",
    "--world-size",
    "4",
    "--steps",
    str(STEPS),
]


def _deepspeed_node(hostfile: Path, port: int, node_rank: int, *job: str) -> list[str]:
    """One node of the DeepSpeed launcher without ssh: every node runs it with its own --node_rank."""
    return [
        PY,
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        str(hostfile),
        "--no_ssh",
        "--node_rank",
        str(node_rank),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        "--module",
        *job,
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Three launches at once, two node agents each; the JSON rank 0 of each wrote.

    torchrun with full sharding, torchrun with HSDP + hpZ (bare flags: one node's ranks), and fsdp2's
    HSDP under the DeepSpeed launcher (a hostfile of two names for this machine, `--no_ssh`; fsdp2 only,
    which keeps the file within its time: the ranks then never import DeepSpeed).
    """
    tmp = tmp_path_factory.mktemp("multinode")
    hostfile = tmp / "hostfile"
    hostfile.write_text("localhost slots=2\n127.0.0.1 slots=2\n")
    launches = {
        "full": [],
        "split": ["--hsdp", "--hpz"],
        "split_ds_launcher": ["--hsdp", "--engines", "fsdp2"],
    }
    procs = []
    for name, flags in launches.items():
        port = _free_port()
        job = [*COMPARE, *flags, "--json", str(tmp / f"{name}.json")]
        for node_rank in (0, 1):
            if name == "split_ds_launcher":
                procs.append(_start(_deepspeed_node(hostfile, port, node_rank, *job[1:])))
            else:
                procs.append(_start(_agent(TORCHRUN, f"127.0.0.1:{port}", node_rank, 2, *job)))
    start_s = time.perf_counter()
    results = _finish(procs, AGENT_TIMEOUT_S)
    print(f"three launches of two node agents each, at once: {time.perf_counter() - start_s:.1f} s")
    for rc, stdout, stderr in results:
        assert rc == 0, stdout[-2000:] + stderr[-4000:]
    tables = [stdout for _, stdout, _ in results if "final loss" in stdout]
    assert len(tables) == 3, "exactly one rank per launch (global rank 0) prints the table"
    assert all("inter-node links" in t for t in tables)
    return {name: json.loads((tmp / f"{name}.json").read_text()) for name in launches}


def _measured(record: dict) -> dict[str, dict[str, int]]:
    return {
        kind: {"intra_node": row["intra_node_bytes"], "inter_node": row["inter_node_bytes"]}
        for kind, row in record["comm_by_link"].items()
    }


def _terms(params: int, **kw) -> dict[str, dict[str, int]]:
    """plan()'s bytes per link of each term, all ranks summed, for the emulated cluster: 4 ranks, 2 per node."""
    result = plan(params, 4, gpus_per_node=2, precision="fp32", **kw)
    return {t["key"]: t["ring_bytes_all_ranks"] for t in result["traffic_terms"]}


def _add(*rows: dict[str, int]) -> dict[str, int]:
    return {link: sum(r[link] for r in rows) for link in ("intra_node", "inter_node")}


def test_inter_node_bytes_drop_exactly_as_the_budget_predicts(runs):
    full, split = runs["full"], runs["split"]
    model = build_model("tiny")
    n_params = count_params(model)
    block_params = sum(p.numel() for b in model.blocks for p in b.parameters())
    assert split["config"]["options"] == {"hsdp_shard_size": 2, "zero_hpz_partition_size": 2}
    for result in (full, split):
        assert {name: rec["nodes"] for name, rec in result["engines"].items()} == {
            "fsdp2": NODES,
            "deepspeed": NODES,
        }
    # Every layout trains the same model: the four loss curves agree.
    reference = full["engines"]["fsdp2"]["losses"]
    for result in (full, split):
        for rec in result["engines"].values():
            assert rec["losses"] == pytest.approx(reference, rel=1e-4)

    # fsdp2, full sharding over the 4 ranks: every collective is a ring over both nodes, so 2 of its 4 links
    # cross. FSDP2 keeps the root gathered from forward to backward: its backward all-gather moves the
    # blocks only, which is plan() for the blocks' parameters.
    z3, z3_blocks = _terms(n_params, strategy="zero3"), _terms(block_params, strategy="zero3")
    assert _measured(full["engines"]["fsdp2"]) == {
        "all_gather": _add(z3["all_gather_forward"], z3_blocks["all_gather_backward"]),
        "reduce_scatter": z3["reduce_scatter"],
    }
    # fsdp2 HSDP, shard groups of one node: all-gathers and reduce-scatters never leave the node; the only
    # inter-node bytes are the all-reduce of each 1/2 gradient shard between the two nodes.
    hsdp, hsdp_blocks = (_terms(p, strategy="hsdp", group_size=2) for p in (n_params, block_params))
    measured = _measured(split["engines"]["fsdp2"])
    assert measured == {
        "all_gather": _add(hsdp["all_gather_forward"], hsdp_blocks["all_gather_backward"]),
        "reduce_scatter": hsdp["reduce_scatter"],
        "all_reduce": hsdp["all_reduce"],
    }
    assert measured["all_gather"]["inter_node"] == measured["reduce_scatter"]["inter_node"] == 0
    assert measured["all_reduce"] == {"intra_node": 0, "inter_node": 8 * n_params}  # 4 ranks x 2(1/2) x 4N/2

    # deepspeed (fair knobs: every parameter gathered before forward and before backward), plus its one
    # 8-byte all-reduce of the gradient norm over all 4 ranks.
    norm = ring_link_bytes("all_reduce", 8, NODES)
    assert _measured(full["engines"]["deepspeed"]) == {
        "all_gather": _add(z3["all_gather_forward"], z3["all_gather_backward"]),
        "reduce_scatter": z3["reduce_scatter"],
        "all_reduce": norm,
    }
    # hpZ over one node: the backward all-gather reads the node's secondary partition, so only the forward
    # all-gather and the reduce-scatter still cross: the inter-node all-gather bytes halve.
    hpz = _terms(n_params, strategy="zero3", hpz=True)
    measured = _measured(split["engines"]["deepspeed"])
    assert measured == {
        "all_gather": _add(hpz["all_gather_forward"], hpz["all_gather_backward"]),
        "reduce_scatter": hpz["reduce_scatter"],
        "all_reduce": norm,
    }
    assert hpz["all_gather_backward"]["inter_node"] == 0
    assert (
        2 * measured["all_gather"]["inter_node"]
        == _measured(full["engines"]["deepspeed"])["all_gather"]["inter_node"]
    )

    # The DeepSpeed launcher numbers its nodes by --node_rank (CROSS_RANK) and says LOCAL_SIZE: the same
    # nodes, the same shard groups, the same bytes on every link.
    ds_launcher = runs["split_ds_launcher"]
    assert ds_launcher["config"]["options"] == {"hsdp_shard_size": 2}
    assert list(ds_launcher["engines"]) == ["fsdp2"]
    assert ds_launcher["engines"]["fsdp2"]["nodes"] == NODES
    assert ds_launcher["engines"]["fsdp2"]["comm_by_link"] == split["engines"]["fsdp2"]["comm_by_link"]

    # Rank 0's own per-rank record still matches each engine's wrap plan (HSDP adds the all-reduce).
    cfg = RunConfig(world_size=4, steps=STEPS, options={"hsdp_shard_size": 2})
    predicted = fsdp2.predicted_wire_bytes(model, cfg, 4)
    assert {k: v["wire_bytes"] for k, v in split["engines"]["fsdp2"]["comm"].items()} == predicted


def test_the_ring_rule_in_closed_form_is_the_rule_applied_group_by_group():
    for n, size, per_node, strided in [
        (16, 4, 8, False),
        (16, 4, 8, True),
        (12, 3, 2, False),
        (12, 4, 3, True),
        (512, 64, 8, True),
        (8, 8, 2, False),
    ]:
        stride = n // size if strided else 1
        groups = (
            [range(i, n, stride) for i in range(stride)]
            if strided
            else [range(a, a + size) for a in range(0, n, size)]
        )
        by_group = _add(
            *(ring_link_bytes("all_gather", 1024 * size, [r // per_node for r in g]) for g in groups)
        )
        assert by_group == ring_bytes_all_ranks("all_gather", 1024 * size, n, size, per_node, strided)
    # A ring over 2 nodes of 2 ranks: 2 of its 4 links cross; inside one node none does.
    assert ring_link_bytes("reduce_scatter", 400, [0, 0, 1, 1]) == {"intra_node": 600, "inter_node": 600}
    assert ring_link_bytes("reduce_scatter", 400, [0, 0, 0, 0]) == {"intra_node": 1200, "inter_node": 0}


def test_one_node_means_the_launchers_ranks_per_node(monkeypatch):
    from labkit.engines.ds_config import ds_config

    node = {"hsdp_shard_size": "node", "zero_hpz_partition_size": "node"}
    cfg = RunConfig(world_size=4, options=node)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert fsdp2.hsdp_shard_size(cfg, 4) == 4  # no launcher: this machine is the one node
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):  # torchrun's name, then the DeepSpeed launcher's
        monkeypatch.setenv(name, "2")
        assert fsdp2.hsdp_shard_size(cfg, 4) == 2
        assert ds_config(cfg, 4)["zero_optimization"]["zero_hpz_partition_size"] == 2
        monkeypatch.delenv(name)


def test_a_rendezvous_that_cannot_complete_fails_in_one_sentence_within_its_timeout():
    wrapper = [PY, "-m", "labkit", "torchrun"]
    job = ["-m", "labkit", "compare", "--engines", "fsdp2", "--steps", "1"]
    lonely = f"127.0.0.1:{_free_port()}"
    unreachable = "192.0.2.1:29400"  # TEST-NET-1: reserved, never routed
    mismatch = f"127.0.0.1:{_free_port()}"
    start_s = time.perf_counter()
    procs = [
        # only one of the two agents starts
        _start(_agent(wrapper, lonely, 0, 1, "--rdzv-conf", "join_timeout=5", *job)),
        # the endpoint does not answer
        _start(_agent(wrapper, unreachable, 1, 1, "--rdzv-conf", "join_timeout=5,read_timeout=3", *job)),
        # both agents start, one rank each, but the job asks for 4 ranks
        *(_start(_agent(wrapper, mismatch, r, 1, *job, "--world-size", "4")) for r in (0, 1)),
    ]
    (rc_lonely, _, err_lonely), (rc_far, _, err_far), *mismatched = _finish(procs, 120)
    elapsed_s = time.perf_counter() - start_s
    assert elapsed_s < 90, f"the failures took {elapsed_s:.0f} s: a timeout did not bound them"

    for err in (err_lonely, err_far, *(e for _, _, e in mismatched)):
        assert "Traceback" not in err, err[-3000:]
    assert rc_lonely == 1
    assert err_lonely.strip().splitlines()[-1] == (
        f"labkit torchrun: the rendezvous at {lonely} did not gather --nnodes 2 node agents within "
        "join_timeout=5 s; start the same command on every node (same --rdzv-endpoint and --rdzv-id), or "
        "pass the --nnodes that will really start"
    )
    assert rc_far == 1
    last = err_far.strip().splitlines()[-1]
    assert last.startswith(f"labkit torchrun: cannot reach the rendezvous store at {unreachable} (")
    assert last.endswith(
        "pass --rdzv-endpoint HOST:PORT of the first node's agent, with the port open to every node"
    )
    # Each node's rank refuses the mismatch in one sentence and its agent exits with the rank's status 2. On a
    # loaded machine the first agent to stop takes the rendezvous (its store, or its closed flag) with it: the
    # other agent then ends in one sentence of its own, status 1, whether or not its rank had spoken yet.
    said = "labkit compare: --world-size 4 but the launcher started 2 ranks (nodes x ranks per node); pass --world-size 2 or leave it out"
    ends = [(rc, said in err, err.strip().splitlines()[-1]) for rc, _, err in mismatched]
    assert any(
        rc == 2 and refused and last.startswith("labkit torchrun: rank ") for rc, refused, last in ends
    ), [err[-2000:] for _, _, err in mismatched]
    for rc, _, last in ends:
        assert rc in (1, 2) and last.startswith("labkit torchrun: "), last
