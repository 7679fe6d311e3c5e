"""labkit.flight (issue 45): torch's flight recorder on gloo ranks, dumped per rank and read by torch's own
analyser and by the lab's one-line reading, for a run that hangs and for one that does not."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist

from labkit import LaunchTimeout, flight


def _steps(skipping_rank: int) -> int:
    """Three rounds of an all-reduce then an all-gather; `skipping_rank` leaves out the second all-reduce."""
    x = torch.ones(8)
    for i in range(3):
        if not (dist.get_rank() == skipping_rank and i == 1):
            dist.all_reduce(x)
        dist.all_gather_single(torch.empty(8 * dist.get_world_size()), x)
    return dist.get_rank()


@pytest.mark.slow
def test_a_rank_that_skips_a_collective_is_named_by_torchs_analyser_and_by_the_first_mismatch(tmp_path):
    run = flight.record(_steps, 2, 1, dump_dir=tmp_path, dump_after_s=4, timeout=8)
    assert run.results is None and isinstance(run.error, LaunchTimeout)  # a hang: no exception from here
    assert run.analysis["ranks"] == [0, 1]  # dumped while hung, before the timeout stopped them
    ops = {r: [e.op for e in es] for r, es in run.analysis["entries"].items()}
    assert ops == {
        0: ["all_reduce", "all_gather", "all_reduce"],
        1: ["all_reduce", "all_gather", "all_gather"],
    }
    assert run.analysis["mismatch"] == (
        "collective #3 of group 'default_pg' differs between the ranks: rank 0: all_reduce of [[8]]; "
        "rank 1: all_gather of [[8]]"
    )
    said = run.analysis["torch"]
    assert "Collective sequence number: 3 has errors" in said and "Culprit rank 1" in said
    assert "COLLECTIVE_TYPE_MISMATCH" in said


@pytest.mark.slow
def test_a_run_whose_ranks_agree_returns_its_results_and_no_mismatch(tmp_path):
    run = flight.record(_steps, 2, -1, dump_dir=tmp_path)
    assert run.results == [0, 1] and run.error is None
    by_rank = run.analysis["entries"]
    assert [e.op for e in by_rank[0]] == ["all_reduce", "all_gather"] * 3 == [e.op for e in by_rank[1]]
    assert [e.seq for e in by_rank[0]] == list(range(1, 7))
    assert run.analysis["mismatch"] is None and "has errors" not in run.analysis["torch"]


def test_a_gloo_dump_gets_its_default_groups_name_so_torchs_analyser_can_read_it(tmp_path):
    """torch 2.13 on gloo: the config is keyed "" while the entries name the group "0" (its analyser then
    stops with KeyError('0', 0)); `load` renames the config, and leaves a dump that agrees alone."""
    entry = {"process_group": ("0", "default_pg"), "collective_seq_id": 1, "profiling_name": "gloo:barrier"}
    dump = {
        "version": "2.10",
        "pg_config": {"": {"name": "", "desc": "", "ranks": "[0, 1]"}},
        "entries": [entry],
    }
    (tmp_path / "rank_0").write_bytes(pickle.dumps(dump))
    named = {"version": "2.10", "pg_config": {"7": {"name": "7", "desc": "d", "ranks": "[0]"}}, "entries": []}
    (tmp_path / "rank_1").write_bytes(pickle.dumps(named))
    loaded = flight.load(tmp_path)
    assert loaded[0]["pg_config"] == {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}
    assert loaded[1]["pg_config"] == named["pg_config"]


def test_record_refuses_a_dump_time_past_its_timeout(tmp_path):
    with pytest.raises(ValueError, match=r"dump_after_s=30: pass seconds above 0 and below timeout=10"):
        flight.record(_steps, 2, -1, dump_dir=tmp_path, dump_after_s=30, timeout=10)
