"""Exercise 08: the solution scores full marks, the pristine exercise 0 (graded, not an error), and two planted
mistakes in the accumulation step each lose the check of the property they break and only it.

The grades come from the session's shared grading run (tests/grading_batches.py, with the capstone's): the
solution graded the whole way and, `--answers-only`, the solution again (whose grade must be the same), the
pristine exercise and the mistakes, edits of the solution's answer cell. check() is run here and compared
with those grades of the same notebooks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from grading_batches import (
    ANSWERS_ONLY,
    answer_checks,
    assert_answers_only_grades_as_the_whole_run,
    assert_check_and_grade_agree,
    lock_entry,
    plant,
    read,
    register,
    reports_of,
)

from labkit.grading.kit import load

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "08_critical_batch.ipynb"
EXERCISE = ROOT / "exercises" / "08_critical_batch.ipynb"
CRITICAL, USEFUL, SCATTERS, LOSSES = (c.name for c in load("ex08_critical_batch").checks)
SYNC_LINE = (
    "        model.set_requires_gradient_sync(i == k - 1)  # reduce-scatter only after the last micro-batch\n"
)
PLANTED = {
    "always_sync": (SYNC_LINE, ""),  # every micro-step reduce-scatters: the right sum, twice the bytes
    "sync_first": (
        SYNC_LINE,
        "        model.set_requires_gradient_sync(i == 0)\n",
    ),  # the last backward never reduced
    "sum_of_means": (  # the right loss returned, each micro-batch's gradient not divided by k: AdamW hides it
        "micro_loss = loss_fn(model(tokens), targets) / k  # the micro-batches' gradients sum to the batch's\n"
        "        micro_loss.backward()\n        total += micro_loss.item()",
        "micro_loss = loss_fn(model(tokens), targets)\n        micro_loss.backward()\n"
        "        total += micro_loss.item() / k",
    ),
}
LOSES = {"always_sync": {SCATTERS}, "sync_first": {LOSSES}, "sum_of_means": {LOSSES}}
SAYS = {  # what the feedback of the check it loses names
    "always_sync": "reduce-scatters",
    "sync_first": "single's",
    "sum_of_means": "every gradient is 2.00 x single's: the sum of the 2 micro-batches' mean gradients",
}


def planted(mistake: str):
    return plant(SOLUTION, [("answer-accumulate", *PLANTED[mistake])])


register("ex08", SOLUTION, {"pristine": read(EXERCISE), **{mistake: planted(mistake) for mistake in PLANTED}})


@pytest.fixture(scope="module")
def reports(shared_grades) -> dict[str, dict]:
    """The solution graded the whole way and, answers only, again beside the others (`grading_batches`)."""
    return reports_of(shared_grades, "ex08")


@pytest.mark.timeout(900)  # the shared grading run, when this test is the first to ask for it
def test_answers_only_gives_the_solution_the_grade_of_the_whole_run(reports):
    assert_answers_only_grades_as_the_whole_run(reports)


@pytest.mark.timeout(900)
def test_the_solution_scores_full_marks_and_the_pristine_exercise_zero(reports):
    solution, pristine = reports["solution"], reports["pristine"]
    assert solution["status"] == "graded", solution.get("reason")
    assert solution["score"] == solution["max_score"] == 10, solution["checks"]
    assert pristine["status"] == "graded" and pristine["score"] == 0 and lock_entry(pristine)["passed"]
    assert not any(c["passed"] for c in answer_checks(pristine))


@pytest.mark.parametrize("mistake", sorted(PLANTED))
def test_each_planted_mistake_loses_its_check_and_only_it(reports, mistake):
    report = reports[mistake]
    assert report["status"] == "graded", report.get("reason")
    lost = {c["name"] for c in answer_checks(report) if not c["passed"]}
    assert lost == LOSES[mistake], report["checks"]


def test_a_shared_launch_runs_once_per_answers_and_seed_and_keeps_a_failure():
    from labkit.grading.kit import SharedLaunch

    def answer():
        return 0

    runs = []
    shared = SharedLaunch()
    assert shared.result((answer, 10**9), lambda: runs.append(1) or len(runs)) == 1
    assert shared.result((answer, 10**9 + 0), lambda: runs.append(1) or len(runs)) == 1  # equal seed: kept
    assert shared.result((lambda: 0, 10**9), lambda: runs.append(1) or len(runs)) == 2  # other answer: again
    assert shared.result((answer, 7), lambda: runs.append(1) or len(runs)) == 3  # other seed: again

    def dies():
        raise RuntimeError("rank 1 died")

    failing = SharedLaunch()
    for _ in range(2):  # every probe of the group reports the one failure, launched once
        with pytest.raises(RuntimeError, match="rank 1 died"):
            failing.result((answer, 1), dies)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mistake", ["solution", *sorted(PLANTED)])
def test_check_flags_each_planted_mistake_the_grade_marks_down(reports, mistake):
    """The student release's check() (the notebook's demonstration: seed 0, 2 ranks) fails a line for each
    mistake whose grade (the shared run's grade of the same notebook) loses points, naming it; the solution
    passes both."""
    nb = read(SOLUTION) if mistake == "solution" else planted(mistake)
    graded = answer_checks(reports[ANSWERS_ONLY if mistake == "solution" else mistake])
    assert_check_and_grade_agree("ex08_critical_batch", nb, SAYS.get(mistake, ""), graded)
