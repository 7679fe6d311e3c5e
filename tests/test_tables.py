"""labkit.tables: the one fixed-width formatter, the one median step time, and the tables built on them.

Pure Python on hand-made records and `plan()` results: no ranks are started.
"""

from __future__ import annotations

import subprocess
import sys

from labkit import budget, tables


def _record(step_time_s, losses=(2.0, 1.5, 1.0), state=100, peak=(300, 400), optimizer_spans_s=()):
    """A record of the `labkit compare` contract, as small as the tables read it."""
    return {
        "losses": list(losses),
        "step_time_s": list(step_time_s),
        "state_bytes": {"params": state, "grads": state, "optimizer": 2 * state},
        "peak_mem_bytes": list(peak),
        "comm": {
            "all_gather": {"calls": 2, "payload_bytes": 96, "wire_bytes": 48},
            "reduce_scatter": {"calls": 1, "payload_bytes": 96, "wire_bytes": 48},
        },
        "comm_by_link": {},
        "nodes": [0, 0],
        "timeline": [
            {"rank": 0, "kind": "compute", "name": "optimizer", "start_s": 0.0, "end_s": s}
            for s in optimizer_spans_s
        ],
    }


def test_median_step_leaves_out_the_warm_up_step_only_when_there_are_more():
    assert tables.median_step_s(_record([9.0, 1.0, 3.0])) == 2.0  # step 0 (9 s of warm-up) left out
    assert tables.median_step_s(_record([9.0, 1.0, 3.0, 2.0])) == 2.0
    assert tables.median_step_s(_record([9.0])) == 9.0  # one step: it is all there is


def test_fixed_width_aligns_columns_two_spaces_apart_and_rules_under_the_header():
    text = tables.fixed_width([("name", "bytes"), ("a", "1,000"), ("longer", "7")], rule=True)
    assert text.splitlines() == [
        "name    bytes",
        "-------------",
        "a       1,000",
        "longer      7",
    ]


def test_record_summaries():
    rec = _record([5.0, 1.0, 1.0], optimizer_spans_s=(0.25, 0.75))
    assert tables.wire_bytes(rec) == 96 and tables.wire_bytes(rec, "all_gather") == 48
    assert tables.wire_bytes(rec, "all_reduce") == 0
    assert tables.phase_s(rec, "optimizer") == 0.5 and tables.phase_s(rec, "forward") == 0.0
    (row,) = tables.offload_rows({"scratch": rec})
    assert row == {
        "run": "scratch",
        "device_state_bytes": 400,
        "optimizer_state_bytes": 200,
        "peak_mem_bytes": 400,
        "optimizer_phase_s": 0.5,
        "step_s": 1.0,
    }


def test_records_and_compare_tables_use_the_median_step_and_keep_their_columns():
    records = {
        "single": _record([5.0, 0.010, 0.020]),
        "fsdp2": _record([5.0, 0.030, 0.050], losses=(2.0, 1.5, 1.1)),
    }
    rows = tables.records_table(records).splitlines()
    assert rows[0].split()[:3] == ["engine", "last", "loss"] and set(rows[1]) == {"-"}
    assert rows[2].split() == ["single", "1.000000", "0.0e+00", "48", "48", "0", "400", "400", "15"]
    assert rows[3].split()[:3] == ["fsdp2", "1.100000", "1.0e-01"] and rows[3].split()[-1] == "40"

    config = {"model": "tiny", "n_params": 1000, "world_size": 2, "steps": 3, "dtype": "float32"}
    lines = tables.compare_table({"config": config, "engines": records}).splitlines()
    assert lines[0].startswith("model tiny (1,000 params), world size 2, 3 steps, float32")
    assert lines[1].split()[:3] == ["engine", "final", "loss"]
    assert [line.split()[0] for line in lines[2:]] == ["single", "fsdp2"]
    assert lines[3].split()[2:4] == ["1.00e-01", "40.0"]  # max |loss - single|, then the median step in ms


def test_compare_table_adds_the_link_table_for_runs_across_nodes():
    rec = _record([1.0, 1.0])
    rec["nodes"] = [0, 1]
    rec["comm_by_link"] = {"all_gather": {"intra_node_bytes": 2000, "inter_node_bytes": 1000}}
    config = {"model": "tiny", "n_params": 10, "world_size": 2, "steps": 2, "dtype": "float32"}
    text = tables.compare_table({"config": config, "engines": {"fsdp2": rec}})
    assert "bytes on intra-node / inter-node links" in text
    assert "2 kB / 1 kB" in text


def test_plan_tables_and_needs_offload_are_budgets():
    plans = {"zero3": budget.plan(30e9, 256, "zero3"), "hsdp": budget.plan(30e9, 512, "hsdp", group_size=8)}
    rows = tables.strategy_rows(plans).splitlines()
    assert [r.split()[0] for r in rows[2:]] == ["zero3", "hsdp"]
    assert budget.format_bytes(plans["zero3"]["state_bytes_per_rank"]) in rows[2]
    offloaded = {"opt -> cpu": budget.plan(70e9, 8, "zero3", offload_optimizer="cpu")}
    assert budget.format_bytes(offloaded["opt -> cpu"]["gpu_bytes_per_rank"]) in tables.scale_rows(offloaded)

    fits = tables.needs_offload(30e9, 256, 80e9)
    assert fits["fits_without_offload"] and fits["offload"] is None
    tight = tables.needs_offload(70e9, 8, 80e9)
    assert not tight["fits_without_offload"]
    remedy = tight["offload"]
    again = budget.plan(
        70e9,
        8,
        "zero3",
        offload_optimizer=remedy["offload_optimizer"],
        offload_params=remedy["offload_params"],
    )
    assert remedy["gpu_bytes_per_rank"] == again["gpu_bytes_per_rank"] <= 80e9


def test_plan_table_aligns_figures_and_puts_verdicts_on_their_own_line():
    text = tables.plan_table(budget.plan(70e9, 8, offload_optimizer="cpu", host_memory_bytes=1e12))
    lines = text.splitlines()
    width = len(next(line for line in lines if line.startswith("  state total")))
    figures = [line for line in lines if line.startswith("  ") and ": " not in line]
    assert {len(line) for line in figures} == {width}  # one right edge for every figure
    assert (
        "  verdict, GPU: fits: 17.5 GB state and buffers per rank of 80 GB, 62.5 GB left for activations"
        in lines
    )
    assert any(line.startswith("  verdict, host: does not fit: 1.12 TB per node") for line in lines)
    assert lines[lines.index("assumptions") - 2].split() == ["step", "27.570", "s"]
    found = budget.fewest_ranks(30e9)
    result = {**found.pop("plan"), "fewest_ranks": found}
    assert tables.plan_table(result).splitlines()[1] == f"fewest ranks that fit: {found['reason']}"


def test_tables_import_no_torch():
    code = "import sys, labkit.tables; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
