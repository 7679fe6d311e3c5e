"""labkit.launch: ranks started by torch elastic, results back in rank order, failures reported fast."""

import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import labkit
from labkit.cluster import LaunchError, LaunchTimeout
from labkit.placement import max_ranks, rank_limit

PY = sys.executable


def _sum_of_ranks(scale=1):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} says hi", flush=True)
    return t.item() * scale


def _no_children_left():
    deadline = time.monotonic() + 5
    while psutil.Process().children(recursive=True) and time.monotonic() < deadline:
        time.sleep(0.05)
    return psutil.Process().children(recursive=True) == []


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_all_reduce_of_ranks_gives_every_rank_the_same_sum(n, capfd):
    assert labkit.launch(_sum_of_ranks, n, scale=2) == [2.0 * sum(range(n))] * n
    out = capfd.readouterr().out
    for r in range(n):
        assert f"[rank {r}] rank {r} of {n} says hi" in out


def test_args_kwargs_and_rank_ordered_return_values():
    def fn(base, *, offset):
        return (base + dist.get_rank() + offset, os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"])

    assert labkit.launch(fn, 3, 10, offset=100) == [(110 + r, str(r), "3") for r in range(3)]


def test_repeated_launches_in_one_process_free_their_ports_and_children():
    for _ in range(4):
        assert labkit.launch(_sum_of_ranks, 2) == [1.0, 1.0]
    assert _no_children_left()


def test_a_rank_that_raises_is_named_with_its_own_message_and_traceback():
    def planted():
        t = torch.ones(1)
        dist.all_reduce(t)
        if dist.get_rank() == 2:
            raise ValueError("planted on rank 2")
        dist.all_reduce(t)  # the others wait here for rank 2, which never comes

    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        labkit.launch(planted, 4)
    assert time.monotonic() - start < 30
    assert info.value.rank == 2
    assert "rank 2 failed: ValueError: planted on rank 2" in str(info.value)
    assert 'raise ValueError("planted on rank 2")' in info.value.rank_traceback
    assert _no_children_left()


def test_a_bare_exception_in_a_rank_is_one_line_in_a_checks_feedback():
    from labkit.grading.kit import probe_error

    def unwritten():
        if dist.get_rank() == 1:
            raise NotImplementedError  # a stub the learner has not written yet
        return 0

    with pytest.raises(LaunchError) as info:
        labkit.launch(unwritten, 2)
    assert str(info.value).startswith("rank 1 failed: NotImplementedError\n")
    assert probe_error(info.value) == "LaunchError: rank 1 failed: NotImplementedError"


def test_a_rank_that_dies_without_a_word_is_reported_with_its_exit_status():
    def dies():
        if dist.get_rank() == 1:
            os._exit(3)
        dist.barrier()

    with pytest.raises(LaunchError, match="rank 1 exited with status 3"):
        labkit.launch(dies, 2)


def test_a_segfault_is_reported_as_a_signal():
    def crashes():
        if dist.get_rank() == 0:
            import ctypes

            ctypes.string_at(0)
        dist.barrier()

    with pytest.raises(LaunchError, match="rank 0 was killed by signal SIGSEGV"):
        labkit.launch(crashes, 2)
    assert _no_children_left()


def test_a_hang_times_out_saying_what_each_rank_was_doing():
    def hangs():
        t = torch.ones(1)
        dist.all_reduce(t)
        if dist.get_rank() == 0:
            while True:
                time.sleep(0.05)
        dist.all_reduce(t)

    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        labkit.launch(hangs, 3, timeout=3)
    assert time.monotonic() - start < 15
    doing = info.value.doing
    assert "returned from all_reduce (collective #1" in doing[0] and "in hangs" in doing[0]
    for r in (1, 2):
        assert "inside all_reduce (collective #2" in doing[r]
    assert "did not finish within timeout=3 s" in str(info.value)
    assert _no_children_left()


def test_the_timeout_counts_from_the_call_not_from_the_ranks_start(monkeypatch):
    """What the parent does before its ranks are up (here a slow import, as torch._dynamo's is beside busy
    neighbours) is inside `timeout`: a grader's probe gets the launch's account before its own limit."""
    import importlib
    import types

    from labkit import cluster

    def slow_import(name):
        time.sleep(4)
        return importlib.import_module(name)

    monkeypatch.setattr(cluster, "importlib", types.SimpleNamespace(import_module=slow_import))
    start = time.monotonic()
    with pytest.raises(LaunchTimeout, match="did not finish within timeout=4 s"):
        labkit.launch(time.sleep, 2, 3600, timeout=4)
    assert time.monotonic() - start < 4 + 4  # the clock did not start again after the import
    assert _no_children_left()


@pytest.mark.parametrize("bad", [0, -1, 2.5, "2"])
def test_a_world_size_that_is_not_a_positive_whole_number_fails_before_anything_starts(bad):
    with pytest.raises(ValueError, match="pass a whole number of ranks"):
        labkit.launch(_sum_of_ranks, bad)


def test_more_ranks_than_the_machine_can_run_is_refused_with_the_limit():
    limit, why = rank_limit("cpu")
    assert limit == max_ranks("cpu")
    with pytest.raises(ValueError) as refused:
        labkit.launch(_sum_of_ranks, limit + 1, device_type="cpu")
    assert str(refused.value) == f"world_size={limit + 1}: {why}; pass world_size<={limit}"


def test_launch_inside_a_rank_is_refused():
    def nested():
        return labkit.launch(_sum_of_ranks, 2)

    with pytest.raises(LaunchError, match="called inside a rank"):
        labkit.launch(nested, 1)


SCRIPT = """
import sys, torch, torch.distributed as dist, labkit
def total():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()
# One write of one short line: under torchrun four ranks share the pipe, and a line written in pieces interleaves.
sys.stdout.write(f"RESULT {{labkit.launch(total, 4{extra})}}\\n")
"""


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_a_function_defined_in_python_c_code_runs_with_either_start_method(start_method):
    code = SCRIPT.format(extra=f", start_method={start_method!r}")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "RESULT [6.0, 6.0, 6.0, 6.0]" in out.stdout


def test_under_real_torchrun_launch_runs_in_place(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT.format(extra="")))
    torchrun = [PY, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--standalone", str(script)]
    out = subprocess.run(torchrun, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("RESULT [6.0, 6.0, 6.0, 6.0]") == 4


def _gather_a_wrong_shard():
    shard = torch.ones(2 if dist.get_rank() < 2 else 3)  # rank 2's shard is one element too long
    out = torch.empty(shard.numel() * dist.get_world_size())  # each rank consistent with itself
    dist.all_gather_single(out, shard)
    return out.sum().item()


def test_a_collective_mismatch_that_aborts_a_rank_leads_with_its_own_line_and_a_hint():
    """gloo aborts the process (std::terminate) when sizes differ: the parent reads the C++ message and the
    innermost frame of the caller's code from the rank's output, not the tail of its stack dump."""
    with pytest.raises(LaunchError) as failed:
        labkit.launch(_gather_a_wrong_shard, 3, timeout=60)
    said = str(failed.value)
    first = said.splitlines()[0]
    assert first.startswith("rank ") and " was killed by signal SIGABRT at " in first
    assert (
        "test_cluster.py:" in first
        and " in _gather_a_wrong_shard (inside torch's all_gather_single): " in first
    )
    assert "Received data size doesn't match expected size" in first, said
    assert first.endswith(
        "every rank must call the same collectives, in the same order, with tensors of the same size"
    )
    assert len(said.splitlines()) == 1 and "multiprocessing" not in said
    assert _no_children_left()


def test_torchs_cpp_frames_are_folded_out_of_a_ranks_error():
    from labkit.rank_output import fold_native_frames

    error = "RuntimeError: boom\nException raised from f at x.cpp:1 (most recent call first):\nframe #0: a\nframe #1: b\n"
    assert fold_native_frames(error) == "RuntimeError: boom\n  (3 C++ frames folded)"


def _late_barrier():
    if dist.get_rank() == 0:
        time.sleep(3.0)  # the others wait in the barrier meanwhile
    dist.barrier()
    return dist.get_rank()


def test_a_rank_waiting_in_a_collective_is_said_before_the_timeout(capsys, monkeypatch):
    monkeypatch.setattr("labkit.cluster.WAIT_NOTICE_S", 1.0)
    assert labkit.launch(_late_barrier, 2, timeout=60) == [0, 1]
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("labkit.launch: rank 1")]
    assert len(said) == 1, said
    assert (
        said[0].startswith("labkit.launch: rank 1 has waited ")
        and " s inside barrier (a rank that never" in said[0]
    )
    assert said[0].endswith("the launch stops at timeout=60 s and says what each rank was doing")


@pytest.mark.parametrize("launched", [True, False])
def test_a_launched_rank_leaves_without_the_interpreters_teardown_and_keeps_its_status(launched):
    """Under a launcher the command's status comes back but atexit work (the teardown that aborted) is skipped."""
    code = textwrap.dedent(
        """
        import atexit, sys
        import labkit.cluster
        atexit.register(lambda: print("teardown ran"))
        from labkit.cli import main
        sys.exit(main(["budget", "--params", "1e9", "--world-size", "-8"]))
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE")}
    if launched:
        env["TORCHELASTIC_RUN_ID"] = "test"
    done = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr  # the bad flag's one sentence, status kept
    assert "--world-size" in done.stderr and "Traceback" not in done.stderr
    assert ("teardown ran" in done.stdout) is not launched
