"""Notebook 09, the debugging clinic (issue 45): every case's broken run shows its fault and the fix measurably
removes it. The figures are read from the ONE executed notebook (the `executed` fixture of tests/conftest.py):
its hidden cell displays every case's facts as JSON (`clinic.show_figures`). The choice predictions and the
refusal to name a cause a run did not show are checked without launching anything."""

from __future__ import annotations

import re

import nbformat
import pytest

from labkit.engines.base import RunConfig
from labkit.engines.ds_config import block_numel
from labkit.engines.registry import FSDP2
from labkit.lessons import clinic
from labkit.model import build_model
from labkit.predict import Reveal, predict

NAME = "09_debugging_clinic.ipynb"


def _facts(nb: nbformat.NotebookNode) -> dict:
    found = [
        o["data"]["application/json"]
        for c in nb.cells
        for o in c.get("outputs", [])
        if "application/json" in o.get("data", {})
    ]
    assert len(found) == 1, f"{NAME} should display its facts once, as JSON; found {len(found)}"
    return found[0]


def _parameter(nb: nbformat.NotebookNode, name: str) -> float:
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    return float(re.search(rf"^{name}\s*=\s*(\S+)", cell.source, re.M).group(1))


@pytest.fixture(scope="module")
def clinic_run(executed):
    nb = executed(NAME)
    return nb, _facts(nb)


def test_the_hang_is_ended_by_the_timeout_and_named_by_the_flight_recorder_and_the_fix_finishes(clinic_run):
    nb, facts = clinic_run
    broken, fixed = facts["hang"]["broken"], facts["hang"]["fixed"]
    assert not broken["finished"] and broken["stopped"] == "LaunchTimeout"
    assert broken["seconds"] < _parameter(nb, "hang_timeout_s") + 15  # seconds, not minutes
    # rank 0 all-reduces the scalar it logs while rank 1 all-gathers the next step's first unit
    assert re.search(r"rank 0: all_reduce of \[\[\]\]; rank 1: all_gather of \[\[\d+\]\]", broken["mismatch"])
    assert broken["ops"]["0"][:-1] == broken["ops"]["1"][:-1] and broken["ops"]["0"][-1] == "all_reduce"
    said = broken["torch"]
    assert "has errors" in said and "COLLECTIVE_TYPE_MISMATCH" in said and "log_loss" in said
    assert fixed["finished"] and fixed["mismatch"] is None and fixed["ops"]["0"] == fixed["ops"]["1"]
    assert "has errors" not in fixed["torch"]


def test_accumulation_reduce_scatters_once_per_unit_per_optimizer_step_only_when_fixed(clinic_run):
    nb, facts = clinic_run
    got = facts["accumulation"]
    micro_steps = int(_parameter(nb, "micro_steps"))
    units = len(build_model("tiny").blocks) + 1  # each block and the root
    assert got["fixed"]["reduce_scatters"] == [units] * len(got["fixed"]["reduce_scatters"])
    assert got["broken"]["reduce_scatters"] == [micro_steps * units] * len(got["broken"]["reduce_scatters"])
    # torch's CommDebugMode counts the same calls over the first optimizer step
    assert got["fixed"]["comm_debug"]["_reduce_scatter_base_"] == units
    assert got["broken"]["comm_debug"]["_reduce_scatter_base_"] == micro_steps * units
    assert clinic.largest_relative_difference(got["broken"]["losses"], got["fixed"]["losses"]) < 1e-6
    # the fix's price: the whole model's fp32 gradients held between micro-steps; none without it
    assert got["fixed"]["held_grad_bytes"][0] == facts["state_dict"]["full_model_bytes"]
    assert got["broken"]["held_grad_bytes"][0] == 0


def test_a_full_state_dict_on_every_rank_peaks_at_the_whole_model_and_the_fixes_do_not(clinic_run):
    _, facts = clinic_run
    got = facts["state_dict"]
    other, rank0, full = got["other_rank_peak_bytes"], got["peak_bytes"], got["full_model_bytes"]
    assert full == 4 * sum(p.numel() for p in build_model("tiny").parameters())
    for peaks in (other, rank0):  # the whole model kept, and at most one gathered tensor in flight beside it
        assert full <= peaks["full_everywhere"] < full + got["largest_param_bytes"]
    # a gathered tensor at a time, the next ones arriving before gloo's worker lets go of it: under a block's worth
    block_bytes = 4 * block_numel("tiny")
    assert got["largest_param_bytes"] <= other["full_on_rank0"] < block_bytes < full
    assert rank0["full_on_rank0"] == full
    assert other["sharded"] == rank0["sharded"] == 0


def test_a_tied_head_in_its_own_unit_fails_and_one_unit_for_both_trains_to_singles_losses(clinic_run):
    from labkit.lessons import production

    _, facts = clinic_run
    broken, fixed = facts["tied"]["broken"], facts["tied"]["fixed"]
    assert not broken["tied"] and broken["losses"] is None
    assert "shared with a parameter already managed by another FSDP group" in broken["error"]
    assert fixed["tied"] and fixed["error"] is None
    oracle = production.single_run(RunConfig(model="hf-gpt2", world_size=2, steps=len(fixed["losses"])))
    assert clinic.largest_relative_difference(fixed["losses"], oracle["losses"]) < 1e-5
    assert facts["tied"]["single_losses"] == pytest.approx(oracle["losses"], rel=1e-6)  # the one it printed


def test_bf16_weights_lose_a_fine_tuning_update_that_fp32_masters_keep(clinic_run):
    _, facts = clinic_run
    broken, fixed = facts["bf16"]["broken"], facts["bf16"]["fixed"]
    assert (broken["dtype"], fixed["dtype"]) == ("bfloat16", "float32")
    assert broken["unchanged"] > 0.5 and fixed["unchanged"] < 0.01


def test_deepspeeds_knobs_leave_its_peak_and_a_bucket_in_proportion_brings_it_near_fsdp2(
    clinic_run,
):
    got = clinic_run[1]["buffers"]
    defaults, knobs, bucket, fsdp2 = (got[k] for k in (*clinic.DEEPSPEED_WAYS, FSDP2))
    assert defaults["bucket_bytes"] == knobs["bucket_bytes"] == 4 * 500_000_000  # DeepSpeed's default, fp32
    assert knobs["state_bytes"]["params"] < defaults["state_bytes"]["params"]  # the knobs did shard
    changed = abs(knobs["peak_bytes"] - defaults["peak_bytes"])
    assert changed < 0.01 * defaults["peak_bytes"]  # "the knobs change nothing"
    assert defaults["peak_bytes"] > defaults["bucket_bytes"] > 100 * bucket["bucket_bytes"]
    assert bucket["peak_bytes"] < 2 * fsdp2["peak_bytes"] < defaults["peak_bytes"] / 50
    assert defaults["losses"] == knobs["losses"] == bucket["losses"]


def test_the_trace_shows_forward_gathers_issued_a_block_ahead_only_with_explicit_prefetch(clinic_run):
    got = clinic_run[1]["prefetch"]
    later_blocks = len(build_model("tiny").blocks) - 1
    assert got["broken"] == {"early": 0, "of": later_blocks, "prefetches": 0}
    assert got["fixed"] == {"early": later_blocks, "of": later_blocks, "prefetches": later_blocks}


def test_early_gathers_reads_the_order_of_a_traces_annotations_not_its_durations():
    def span(name, ts):
        return {"ph": "X", "name": name, "ts": ts, "dur": 1000.0}

    ahead = [span("FSDP::pre_forward (blocks.0)", 0), span("FSDP::forward_prefetch for blocks.1", 5)]
    ahead += [span("FSDP::all_gather (blocks.1)", 6), span("FSDP::post_forward (blocks.0)", 9)]
    ahead += [span("FSDP::all_gather (blocks.1)", 50)]  # the backward's gather: not the first
    assert clinic.early_gathers(ahead, 2) == {"early": 1, "of": 1, "prefetches": 1}
    late = [span("FSDP::pre_forward (blocks.0)", 0), span("FSDP::post_forward (blocks.0)", 9)]
    late += [span("FSDP::all_gather (blocks.1)", 10)]
    assert clinic.early_gathers(late, 2) == {"early": 0, "of": 1, "prefetches": 0}


def test_every_case_predicted_as_a_choice_and_revealed_by_the_evidence(clinic_run):
    nb, _ = clinic_run
    asked = [c for c in nb.cells if "predict" in c.metadata.get("tags", [])]
    assert len(asked) == len(clinic.CASES) >= 6 and all("choices=" in c.source for c in asked)
    assert set(_facts(nb)) == set(clinic.CASES)  # every case's facts reached the tests
    outputs = [o for c in nb.cells for o in c.get("outputs", [])]
    text = "\n".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in outputs)
    for case in clinic.CASES.values():
        assert f"{case.question}: the evidence says ({case.answer}) {case.choices[case.answer - 1]}." in text


# ------------------------------------------------------------------------------------- no launch needed


def test_a_choice_reveal_names_the_answer_and_judges_the_choice():
    four = ("a", "b", "c", "d")
    shown = Reveal("Why", "", 2, 3, mistake="the usual one", source="the evidence says", choices=four)
    assert str(shown).splitlines() == [
        "Why: the evidence says (2) b.",
        "You chose (3) c: not this one.",
        "The usual mistake: the usual one",
    ]
    assert "You chose (2) b: right." in str(Reveal("Why", "", 2, 2, choices=four))
    assert "No prediction entered" in str(Reveal("Why", "", 2, None, choices=four))
    guess = predict("Why", choices=four)
    guess.widget()
    guess._box.value = guess._box.options[3]
    assert guess.value == 4


def test_a_cause_the_facts_do_not_show_is_refused_in_a_sentence():
    same = {"broken": {"reduce_scatters": [5, 5]}, "fixed": {"reduce_scatters": [5, 5]}}
    with pytest.raises(RuntimeError, match="this run did not show case 'accumulation'"):
        clinic.cause("accumulation", same)
    shown = {"broken": {"reduce_scatters": [10]}, "fixed": {"reduce_scatters": [5]}}
    assert clinic.cause("accumulation", shown) == clinic.CASES["accumulation"].answer
