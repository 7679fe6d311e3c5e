"""Exercise 09 (a hung run: read its flight recorder, fix its step): the recorded run is the hang the exercise
says it is; the solution scores full marks and the pristine exercise 0 (the session's shared grading run,
tests/grading_batches.py: the solution the whole way and answers only, the pristine exercise answers only); each
planted wrong diagnosis or step loses the checks of its property, in the grade and in check() alike (probed and
judged here); the hidden hung runs hold their edge cases for every seed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from grading_batches import (
    answer_checks,
    assert_answers_only_grades_as_the_whole_run,
    graded_kernel,
    lock_entry,
    plant,
    read,
    register,
    reports_of,
)

from labkit.grading import diagnose, public
from labkit.grading.checks import ex09_diagnose as ex09
from labkit.grading.kit import Exercise, judge_all, load, probe_all
from labkit.lessons import uneven

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "09_diagnose.ipynb"
EXERCISE = ROOT / "exercises" / "09_diagnose.ipynb"
ID, SEED = "ex09_diagnose", 3
CULPRIT, CAUSE, SAME, LOSSES = (c.name for c in load(ID).checks)

POSITIONAL = [  # the ranks' lists compared by position: right until a ring drops their first entries unevenly
    (
        "answer-diagnose",
        "    start = max((min(seqs) for seqs in by_seq.values() if seqs), default=1)\n",
        "    by_seq = {r: {i + 1: e for i, e in enumerate(rows)} for r, rows in entries.items()}\n"
        "    start = 1\n",
    )
]
CAUSES_SWAPPED = [("answer-diagnose", '"other collective" if mine.op != theirs.op else "other sizes"', '"other sizes" if mine.op != theirs.op else "other collective"')]  # fmt: skip
ITS_OWN_COLLECTIVE = [("answer-diagnose", '"waiting_in": theirs.op', '"waiting_in": (mine or theirs).op')]
THE_REPORTED_STEP = [  # returns at once on a rank without rows: its peers wait in the count's all-reduce
    (
        "answer-step",
        "    total = torch.tensor(",
        "    if tokens.shape[0] == 0:\n        return 0.0\n    total = torch.tensor(",
    )
]
NO_WORLD_SIZE = [("answer-step", "(summed * dist.get_world_size() / total)", "(summed / total)")]
MEAN_OF_MEANS = [  # each rank's mean, averaged over the ranks: uneven rows weigh unevenly
    (
        "answer-step",
        "    (summed * dist.get_world_size() / total).backward()",
        "    rows = max(targets.numel(), 1)\n    (summed / rows).backward()",
    )
]


register("ex09", SOLUTION, {"pristine": read(EXERCISE)})


@pytest.fixture(scope="module")
def reports(shared_grades) -> dict[str, dict]:
    """The solution graded the whole way and, answers only, again beside the pristine exercise."""
    return reports_of(shared_grades, "ex09")


@pytest.mark.timeout(900)  # the shared grading run, when this test is the first to ask for it
def test_the_solution_scores_full_marks_the_pristine_exercise_zero_and_its_run_hangs_as_it_says(reports):
    assert_answers_only_grades_as_the_whole_run(reports)
    solution, pristine = reports["solution"], reports["pristine"]
    assert solution["status"] == "graded" and solution["score"] == solution["max_score"] == 10, solution
    assert pristine["status"] == "graded" and pristine["score"] == 0 and lock_entry(pristine)["passed"]
    assert not any(c["passed"] for c in answer_checks(pristine))
    executed = read(Path(solution["executed_notebook"]))
    said = {
        c.id: "".join(o.get("text", "") for o in c.outputs) for c in executed.cells if c.cell_type == "code"
    }
    assert "the launch ended with LaunchTimeout" in said["demo-artefact"]
    assert "rank 2: 0 entries; the last: nothing" in said["demo-artefact"]
    assert (
        "the reported run: {'rank': 2, 'seq': 1, 'waiting_in': 'all_gather', 'cause': 'stopped'}"
        in said["demo-diagnose"]
    )
    assert "missing ranks: {2}" in said["demo-reveal"]
    assert said["demo-step"].count("the same collectives on every rank: True") == 2


def graded(edits: list, answer: str) -> dict[str, list[dict]]:
    """{"grade": entries, "check": entries} of the checks calling `answer`, on the solution with `edits`."""
    namespace = graded_kernel(plant(SOLUTION, edits))
    out = {}
    for where, exercise in (("grade", load(ID)), ("check", public.load(ID, ID))):
        chosen = Exercise(
            exercise.id, exercise.title, tuple(c for c in exercise.checks if answer in c.answers)
        )
        out[where] = judge_all(chosen, probe_all(chosen, namespace, SEED), SEED)
    return out


def lost(entries: list[dict]) -> set[str]:
    return {e["name"] for e in entries if e["points"] < e["max_points"]}


@pytest.mark.parametrize(
    ("edits", "loses", "says"),
    [
        (POSITIONAL, {CULPRIT, CAUSE}, "each recorder keeps its last"),
        (CAUSES_SWAPPED, {CAUSE}, "cause 'other sizes'"),
        (ITS_OWN_COLLECTIVE, {CAUSE}, "waiting_in"),
    ],
    ids=["positional", "causes_swapped", "its_own_collective"],
)
def test_each_wrong_diagnosis_loses_its_check_in_the_grade_and_in_check(edits, loses, says):
    for where, entries in graded(edits, "diagnose").items():
        assert lost(entries) == loses, (where, entries)
        assert any(says in e["feedback"] for e in entries if e["name"] in loses), (where, entries)


@pytest.mark.slow
def test_the_reported_step_loses_both_step_checks_naming_the_rank_that_returned(monkeypatch):
    monkeypatch.setattr(diagnose, "LAUNCH_TIMEOUT_S", 12.0)
    for where, entries in graded(THE_REPORTED_STEP, "train_step").items():
        assert lost(entries) == {SAME, LOSSES}, (where, entries)
        said = " ".join(e["feedback"] for e in entries)
        assert "never called all_reduce" in said and "returned without calling it" in said, (where, said)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("edits", "says"),
    [(NO_WORLD_SIZE, "every gradient is 1/3 of single's"), (MEAN_OF_MEANS, "single's")],
    ids=["no_world_size", "mean_of_means"],
)
def test_a_step_that_weighs_rows_wrong_keeps_the_collectives_and_loses_the_gradients(edits, says):
    for where, entries in graded(edits, "train_step").items():
        assert lost(entries) == {LOSSES}, (where, entries)
        assert says in next(e["feedback"] for e in entries if e["name"] == LOSSES), (where, entries)


@pytest.mark.parametrize("seed", [0, 1, 7, 1609680561])
def test_the_hidden_hung_runs_hold_their_edge_cases_for_every_seed(seed):
    hangs = ex09.hangs(seed)
    causes = [h.cause for h in hangs]
    assert causes == [
        uneven.STOPPED,
        uneven.OTHER_COLLECTIVE,
        uneven.OTHER_SIZES,
        uneven.STOPPED,
        uneven.OTHER_COLLECTIVE,
        uneven.OTHER_SIZES,
    ]
    first = {r: rows[0].seq for r, rows in hangs[0].entries().items()}  # the ring: lists start apart
    culprit = hangs[0].culprit
    assert all(first[culprit] == seq - 1 for r, seq in first.items() if r != culprit)
    assert hangs[3].entries()[hangs[3].culprit] == []  # it issued nothing at all
    assert all(h.world_size >= 4 for h in hangs[4:])
    rows, _ = ex09.splits(seed)
    assert sorted(rows[0])[0] == 0 < sorted(rows[0])[1] and sum(rows[0]) == 12
    assert 0 < sum(rows[1]) < 12


def test_a_hang_refuses_a_skip_with_nothing_after_it_in_one_sentence():
    program = ((uneven.ALL_GATHER, ((8,),)), (uneven.ALL_GATHER, ((8,),)))
    with pytest.raises(ValueError, match=r"^at=1: the collective after it must be another one, to skip to$"):
        uneven.Hang(program, 3, 0, uneven.OTHER_COLLECTIVE, 1)
    with pytest.raises(ValueError, match=r"^world_size=2, culprit=0: pass 3 or more ranks$"):
        uneven.Hang(program, 2, 0, uneven.STOPPED, 1)
