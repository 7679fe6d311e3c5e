"""`labkit calibrate` and the calibrated plan: the fits against their own measurements, the profile's
round trip, a hand-written profile's step time worked out by hand, and `labkit budget --machine`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from labkit import budget, calibrate
from labkit.cli import main
from labkit.neighbours import busy_neighbours

HAND = {  # a machine: 10 GFLOP/s alone, half of it at 2 ranks; every collective 1 ms + 1 GB/s
    "compute_flops_per_s": 1e10,
    "core_share": {"1": 1.0, "2": 0.5},
    "collectives": {k: {"2": {"latency_s": 1e-3, "gbytes": 1.0}} for k in calibrate.KINDS},
}
HAND_PLAN = {"layers": 4, "tokens_per_rank": 1000, "precision": "fp32", "gpus_per_node": 2}


def test_the_robust_line_recovers_an_exact_line_and_one_slow_call_cannot_tilt_it():
    xs = [1e5, 1e6, 2e6, 4e6, 1e7]
    a, b, rms = calibrate.robust_line(xs, [2e-3 + x / 5e8 for x in xs])
    assert a == pytest.approx(2e-3) and b == pytest.approx(1 / 5e8) and rms == pytest.approx(0, abs=1e-12)
    # one size measured wrong (here the largest, as fast as the smallest): least squares flattens the line past
    # zero; the median of the pairs' slopes, 6 of them exact out of 10, does not move
    ys = [2e-3 + x / 5e8 for x in xs[:4]] + [2e-3]
    slope, _ = np.polyfit(xs, ys, 1)
    a, b, rms = calibrate.robust_line(xs, ys)
    assert b == pytest.approx(1 / 5e8) and slope < 0.5 / 5e8
    assert rms == pytest.approx(np.sqrt(np.mean((np.array(ys) - a - b * np.array(xs)) ** 2)))
    with pytest.raises(ValueError, match="two or more distinct x"):
        calibrate.robust_line([1.0, 1.0], [1.0, 2.0])


def test_a_real_calibration_fits_its_own_measurements_and_round_trips_through_json(tmp_path):
    """Issue 41: measured beside a classmate's busy kernel (one spinning process at normal priority), the profile
    still fits every collective, records how much of the ranks' time the neighbour took, and its compute rate
    (on the rank's clock) stays near a quiet calibration's taken in the same test."""
    quiet = calibrate.calibrate("tiny", (2,), repeats=2)
    with busy_neighbours(1, nice=0):
        profile = calibrate.calibrate("tiny", (2,), repeats=2)
    assert profile["compute_flops_per_s"] > 0 and 0 < profile["core_share"]["2"]
    assert profile["compute_flops_per_s"] == pytest.approx(quiet["compute_flops_per_s"], rel=0.35)
    machine = profile["machine"]
    assert machine["noise"]["run_delay_share"]["2"] > quiet["machine"]["noise"]["run_delay_share"]["2"]
    assert set(machine["noise"]["compute_spread"]) == {"1", "2"} and set(machine["noise"]["sync_spread"]) == {
        "2"
    }
    # the drift: a barrier mid-step costs at least nothing and less than a whole step's share of compute
    assert profile["sync_s"]["1"] == 0 and 0 <= profile["sync_s"]["2"] < 1 / profile["core_share"]["2"]
    assert (
        machine["repeats"] == 2 and len(machine["load_average_before"]) == len(machine["load_average"]) == 3
    )
    for kind in calibrate.KINDS:
        fit = profile["collectives"][kind]["2"]
        wire, seconds = np.array(fit["points"], dtype=float).T
        assert len(wire) == len(calibrate.PAYLOAD_BYTES)
        assert list(wire) == [budget.collective_wire_bytes(kind, p, 2) for p in calibrate.PAYLOAD_BYTES]
        intercept, slope, _ = calibrate.robust_line(list(wire), list(seconds))  # the stored line: Theil-Sen's
        assert fit["latency_s"] == pytest.approx(intercept, rel=1e-6, abs=1e-9)
        assert fit["gbytes"] == pytest.approx(1 / slope / 1e9, rel=1e-6)
        k = len(wire)
        pairwise = [
            (seconds[j] - seconds[i]) / (wire[j] - wire[i]) for i in range(k) for j in range(i + 1, k)
        ]
        assert slope == pytest.approx(float(np.median(pairwise)), rel=1e-9)  # the median of the pairs' slopes
        residuals = seconds - (fit["latency_s"] + wire / (fit["gbytes"] * 1e9))
        assert fit["residual_s"] == pytest.approx(np.sqrt(np.mean(residuals**2)), rel=1e-6, abs=1e-12)
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(profile))
    loaded = budget.load_machine_profile(str(path))
    assert loaded == profile
    assert budget.plan(1e6, 2, machine=loaded, **HAND_PLAN) == budget.plan(
        1e6, 2, machine=profile, **HAND_PLAN
    )


def test_plan_with_a_hand_written_profile_gives_the_hand_computed_step():
    result = budget.plan(
        1e6, 2, "zero3", machine=HAND, link_gbytes=math.inf, intra_gbytes=math.inf, **HAND_PLAN
    )
    compute_s = 6 * 1e6 * 1000 / (1e10 * 0.5)
    per_collective_s = 5 * 1e-3 + 2e6 / 1e9  # 4 layers + the root = 5 calls; (n-1)/n x 4 MB = 2 MB sent
    assert result["compute_time_s"] == pytest.approx(compute_s)
    assert result["backend_comm_time_s"] == pytest.approx(3 * per_collective_s)
    assert result["step_time_s"] == pytest.approx(compute_s + 3 * per_collective_s)
    # a 1 MB/s link: each collective lasts 2 s; what is beyond gloo's own time overlaps as the plan says
    slow = budget.plan(1e6, 2, "zero3", machine=HAND, link_gbytes=1e-3, intra_gbytes=1e-3, **HAND_PLAN)
    excess = 2.0 - per_collective_s
    fwd_k, bwd_k = compute_s / 3, 2 * compute_s / 3

    def exposed(c, k):
        return c / 4 + 3 * max(0.0, c / 4 - k / 4)

    expected = compute_s + 3 * per_collective_s + exposed(excess, fwd_k) + exposed(2 * excess, bwd_k)
    assert slow["step_time_s"] == pytest.approx(expected)
    ddp = budget.plan(1e6, 2, "ddp", machine=HAND, link_gbytes=math.inf, intra_gbytes=math.inf, **HAND_PLAN)
    assert ddp["traffic_terms"][0]["calls"] == 1  # 4 MB of gradients: one DDP bucket
    assert ddp["step_time_s"] == pytest.approx(compute_s + 1e-3 + 4e6 / 1e9)


def test_without_prefetch_each_all_gather_waits_for_the_ranks_drift_and_with_it_none_does():
    drifting = {**HAND, "sync_s": {"2": 4e-3}}  # each wait on every rank mid-step: 4 ms
    options = {"link_gbytes": math.inf, "intra_gbytes": math.inf, **HAND_PLAN}
    base = budget.plan(1e6, 2, "zero3", machine=HAND, prefetch=False, **options)
    late = budget.plan(1e6, 2, "zero3", machine=drifting, prefetch=False, **options)
    # 4 layers + the root, gathered in the forward and again in the backward: 10 waits of 4 ms
    assert late["sync_wait_s"] == pytest.approx(10 * 4e-3) and base["sync_wait_s"] == 0
    assert late["step_time_s"] == pytest.approx(base["step_time_s"] + 10 * 4e-3)
    prefetched = budget.plan(1e6, 2, "zero3", machine=drifting, prefetch=True, **options)
    assert prefetched["sync_wait_s"] == 0
    assert prefetched["step_time_s"] == pytest.approx(
        budget.plan(1e6, 2, "zero3", machine=HAND, **options)["step_time_s"]
    )
    ddp = budget.plan(1e6, 2, "ddp", machine=drifting, prefetch=False, **options)
    assert (
        ddp["sync_wait_s"] == 0
    )  # its all-reduces are waited on after the backward: one wait, not one per unit


def test_a_profile_without_the_world_size_or_the_keys_is_refused_in_one_sentence(tmp_path):
    with pytest.raises(ValueError, match=r"no all_gather fit at world_size=4 \(it has 2\); calibrate there"):
        budget.plan(1e6, 4, machine=HAND)
    with pytest.raises(ValueError, match="needs the keys compute_flops_per_s"):
        budget.plan(1e6, 2, machine={"core_share": {}})
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="is not JSON"):
        budget.load_machine_profile(str(tmp_path / "bad.json"))


def test_labkit_budget_machine_prints_the_calibrated_step_and_refuses_a_missing_file(tmp_path, capsys):
    path = tmp_path / "machine.json"
    path.write_text(json.dumps(HAND))
    argv = [
        "budget",
        "--params",
        "1e6",
        "--world-size",
        "2",
        "--layers",
        "4",
        "--tokens-per-rank",
        "1000",
        "--precision",
        "fp32",
        "--gpus-per-node",
        "2",
        "--machine",
        str(path),
        "--json",
        "-",
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["compute_time_s"] == pytest.approx(1.2) and result["machine"]["core_share"] == 0.5
    assert (
        main(["budget", "--params", "1e6", "--world-size", "2", "--machine", str(tmp_path / "none.json")])
        == 2
    )
    assert "cannot read the machine profile" in capsys.readouterr().err


def test_a_changed_load_is_said_in_one_sentence_and_a_steady_one_is_not():
    profile = {**HAND, "machine": {"cpus": 2, "load_average_before": [0.4, 0.5, 0.6]}}
    assert calibrate.load_changed(profile, (1.3, 0.5, 0.6)) is None  # within 0.5 per CPU of 2 CPUs
    said = calibrate.load_changed(profile, (2.6, 1.0, 0.7))
    assert said.startswith(
        "the machine is busier than when it was calibrated (1-minute load average 0.4 then, 2.6 now"
    )
    assert "calibrate again" in said
    assert calibrate.load_changed(
        {**profile, "machine": {"cpus": 2, "load_average_before": [3.0]}}, (0.1,)
    ).startswith("the machine is quieter")
    assert calibrate.load_changed(HAND, (9.0,)) is None  # a hand-written profile records no load
    with pytest.raises(ValueError, match="repeats=0"):
        calibrate.calibrate("tiny", (2,), repeats=0)
    assert main(["calibrate", "--out", "/dev/null", "--repeats", "0"]) == 2


def test_a_calibration_that_stops_leaves_the_profile_already_there_whole(tmp_path, monkeypatch, capsys):
    out = tmp_path / "machine.json"
    out.write_text('{"kept": 1}')

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(calibrate, "calibrate", interrupted)
    assert main(["calibrate", "--out", str(out), "--world-sizes", "2"]) == 130
    assert out.read_text() == '{"kept": 1}'  # not emptied before the measurement, as it used to be
    assert main(["calibrate", "--out", str(tmp_path / "no" / "machine.json")]) == 2
    assert "the folder" in capsys.readouterr().err


def test_the_drift_is_the_least_waiting_ranks_wait_per_barrier_step_by_step():
    """Issue 41: every rank leaves a barrier with the last, so the rank that waited least is the one whose
    compute set the pace: its waits are what the barriers added. Per step, never across steps (a slow step on
    one rank and a slow step on another are not one drift), and never the difference of two step times."""
    waits = [[0.040, 0.004, 0.020], [0.010, 0.030, 0.016]]  # rank 0, rank 1; three synced steps
    assert calibrate.drift_per_wait_s(waits, 4) == pytest.approx([0.0025, 0.001, 0.004])
    with pytest.raises(ValueError):
        calibrate.drift_per_wait_s([[0.1, 0.2], [0.1]], 2)  # a rank that timed fewer steps
