"""The capstone (exercise 07): the solution scores full marks, the pristine exercise 0 (graded, not an error),
and eleven planted mistakes each lose the checks of the property they break, with feedback naming the
mistake; a one-line crash in one piece loses only the checks of the properties that piece touches (the
reference piece stands in for it), and weights never freed cost more than a crash in the optimizer.

The grades come from the session's shared grading run (tests/grading_batches.py, one pair of `labkit grade
DIR --gradebook` runs with exercise 08's): the solution the whole way (its notebook run too), and fourteen
`--answers-only` with --jobs 2 (the solution again, whose grade must be the same, the pristine exercise and
the planted mistakes, which are edits of the solution's answer cells, one of them under a second name).
check() on the notebook's model is run here and compared with those grades of the same notebooks.
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

from labkit.grading.checks import ex07_capstone as capstone
from labkit.grading.kit import judge_all, load, submission_seed

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "07_capstone.ipynb"
EXERCISE = ROOT / "exercises" / "07_capstone.ipynb"
FREED, SHARDED_GRADS, GRADIENTS, LOSSES, STATE, BYTES, PREFETCH = (
    c.name for c in load("ex07_capstone").checks
)
NEVER_FREES = [  # every unit's full weights stay gathered from its forward to its backward
    (
        "answer-hooks",
        "def after_forward(unit: Unit) -> None:\n    for p in unit.params:\n        free(p)",
        "def after_forward(unit: Unit) -> None:\n    pass",
    )
]

# mistake -> [(answer cell id, text of the solution, what the mistake writes instead)]
PLANTED = {
    "no_prefetch": [  # every unit gathers synchronously in its own before_forward
        (
            "answer-hooks",
            "    if unit.next is not None:\n        start_gather(unit.next)  # on the wire while this unit computes\n",
            "",
        )
    ],
    "parameter_major": [  # the packed buffers laid out as if every rank's rows of parameter 0 came first
        (
            "answer-unit",
            "rows = by_rank[:, offset : offset + s.numel()]",
            "rows = recv[unit.n * offset : unit.n * (offset + s.numel())]",
        ),
        (
            "answer-hooks",
            "send = torch.cat(columns, dim=1)",
            "send = torch.cat([c.reshape(-1) for c in columns])",
        ),
    ],
    "no_mean": [("answer-hooks", "    mine /= n", "    pass")],  # the sum over ranks, not the mean
    "kept_after_forward": NEVER_FREES,
    "kept_after_forward_by_another_student": NEVER_FREES,  # the same answer under another name: another seed
    "optimizer_typo": [("answer-optimizer", "lr=lab.lr,", "lr=lab.learning_rate,")],  # the crash
    "after_forward_crash": [
        (
            "answer-hooks",
            "    for p in unit.params:\n        free(p)\n",
            "    for p in unit.params:\n        free(p, unit)\n",
        )
    ],
    "full_grads_kept": [("answer-hooks", "        p.grad = None\n", "")],  # autograd accumulates into them
    "kept_in_a_global": [  # every receive buffer kept in a list of the answers' own: freed is not freed
        (
            "answer-unit",
            "def start_gather(unit: Unit) -> None:",
            "KEPT = []\n\n\ndef start_gather(unit: Unit) -> None:",
        ),
        (
            "answer-unit",
            "    by_rank = recv.view(unit.n, -1)",
            "    KEPT.append(recv)\n    by_rank = recv.view(unit.n, -1)",
        ),
    ],
    "kept_as_double": [  # every receive buffer kept as a float64 copy: other bytes, the same weights
        (
            "answer-unit",
            "def start_gather(unit: Unit) -> None:",
            "KEPT = []\n\n\ndef start_gather(unit: Unit) -> None:",
        ),
        (
            "answer-unit",
            "    by_rank = recv.view(unit.n, -1)",
            "    KEPT.append(recv.double())\n    by_rank = recv.view(unit.n, -1)",
        ),
    ],
    "tensor_swapped_free": [  # "freed" by a new empty tensor: autograd saved the gathered one, alive to backward
        (
            "answer-hooks",
            "def after_forward(unit: Unit) -> None:\n    for p in unit.params:\n        free(p)",
            "def after_forward(unit: Unit) -> None:\n    for p in unit.params:\n        p.data = torch.empty(0)",
        )
    ],
    "all_reduce": [  # the right mean, by an all-reduce of the whole buffer: n/(n-1)... twice the wire bytes
        (
            "answer-hooks",
            "dist.reduce_scatter_single(mine, send.reshape(-1), op=dist.ReduceOp.SUM, group=unit.group)",
            "dist.all_reduce(send, group=unit.group)\n    mine.copy_(send[unit.rank])",
        )
    ],
}
LOSES = {
    "no_prefetch": {PREFETCH},
    "parameter_major": {GRADIENTS, LOSSES},
    "no_mean": {GRADIENTS},
    "kept_after_forward": {FREED},
    "kept_after_forward_by_another_student": {FREED},
    "optimizer_typo": {LOSSES, STATE},  # what AdamW touches; the rest judged with the reference in its place
    "after_forward_crash": {FREED},
    "full_grads_kept": {LOSSES, SHARDED_GRADS, STATE},  # autograd adds the next step's to them
    "kept_in_a_global": {FREED, SHARDED_GRADS},
    "kept_as_double": {FREED, SHARDED_GRADS},
    "tensor_swapped_free": {FREED},
    "all_reduce": {BYTES},
}
SAYS = {
    "no_prefetch": "not yet for blocks.1",
    "parameter_major": "rank-major",
    "no_mean": "divide the reduce-scatter's sum by n",
    "kept_after_forward": "free them in after_forward",
    "kept_after_forward_by_another_student": "free them in after_forward",
    "optimizer_typo": "could not run your make_optimizer: AttributeError",
    "after_forward_crash": "could not run your after_forward: TypeError",
    "full_grads_kept": "set each p.grad to None",
    "kept_in_a_global": "free them in after_forward",
    "kept_as_double": "free them in after_forward",
    "tensor_swapped_free": "free a parameter's storage, not its tensor",
    "all_reduce": "also ran all_reduce: ZeRO-3 needs only all-gathers and reduce-scatters",
}


def planted(mistake: str):
    """The solution with `mistake` planted into its answer cells (each edit must find its text)."""
    return plant(SOLUTION, PLANTED[mistake])


register("ex07", SOLUTION, {"pristine": read(EXERCISE), **{mistake: planted(mistake) for mistake in PLANTED}})


@pytest.fixture(scope="module")
def reports(shared_grades) -> dict[str, dict]:
    """The solution graded the whole way and, answers only, again beside the others (`grading_batches`)."""
    return reports_of(shared_grades, "ex07")


@pytest.mark.timeout(900)  # the shared grading run, when this test is the first to ask for it
def test_the_solution_scores_full_marks_and_its_report_times_each_stage(reports):
    r = reports["solution"]
    assert r["status"] == "graded", r["reason"]
    assert r["score"] == r["max_score"] == capstone.EXERCISE.max_score == 20, r["checks"]
    assert all(c["passed"] for c in r["checks"])
    times = r["timings_s"]
    print(f"solution: {r['runtime_s']:.1f} s ({times})")
    # Speed is benchmarks/grading_sandbox.py's to measure (this test runs beside neighbours): here, only that
    # each stage was timed and the stages fit in the whole run.
    assert set(times) == {"notebook", "answers", "judge"} and min(times.values()) > 0, times
    assert sum(times.values()) <= r["runtime_s"] + 1, (times, r["runtime_s"])


def test_answers_only_gives_the_solution_the_grade_of_the_whole_run_without_the_notebook(reports):
    assert_answers_only_grades_as_the_whole_run(reports)


def test_the_pristine_exercise_scores_zero_and_is_graded(reports):
    r = reports["pristine"]
    assert r["status"] == "graded", r["reason"]
    assert r["score"] == 0 and r["max_score"] == 20
    assert lock_entry(r)["passed"]
    assert all("NotImplementedError" in c["feedback"] for c in answer_checks(r)), r["checks"]


def test_the_same_answer_under_two_names_scores_the_same(reports):
    """Two students, two hidden models: weights never freed cost both the same points."""
    one, other = reports["kept_after_forward"], reports["kept_after_forward_by_another_student"]
    assert one["seed"] != other["seed"]
    assert one["score"] == other["score"] < one["max_score"], (one["checks"], other["checks"])


def test_never_freeing_costs_more_than_a_crash_in_the_optimizer(reports):
    """What makes it ZeRO-3 weighs most: the issue's ordering (0/15 for the typo, 12.75/15 for never freeing)
    turned around."""
    never_frees, typo = reports["kept_after_forward"], reports["optimizer_typo"]
    print(f"\nnever frees: {never_frees['score']}/20; a typo in make_optimizer: {typo['score']}/20")
    assert never_frees["score"] < typo["score"] < typo["max_score"]


@pytest.mark.parametrize("mistake", ["optimizer_typo", "after_forward_crash"])
def test_a_crash_in_one_piece_keeps_the_points_of_what_it_does_not_touch(reports, mistake):
    """The reference piece stands in for the crashing one, said in the feedback of every check it judged."""
    r = reports[mistake]
    piece = {"optimizer_typo": "make_optimizer", "after_forward_crash": "after_forward"}[mistake]
    for c in answer_checks(r):
        if c["name"] in LOSES[mistake]:
            assert c["points"] == 0 and SAYS[mistake] in c["feedback"], c
        else:
            assert c["points"] == c["max_points"], c
            assert f"judged with the reference {piece} in place of yours" in c["feedback"], c


@pytest.mark.parametrize("mistake", list(PLANTED))
def test_each_planted_mistake_loses_the_checks_of_its_property_and_only_them(reports, mistake):
    r = reports[mistake]
    assert r["status"] == "graded", r["reason"]
    assert lock_entry(r)["passed"]  # only answer cells were edited
    for c in answer_checks(r):
        if c["name"] in LOSES[mistake]:
            assert not c["passed"] and c["points"] < c["max_points"], (mistake, c)
        else:
            assert c["passed"], (mistake, c)
    assert any(SAYS[mistake] in c["feedback"] for c in answer_checks(r)), (mistake, r["checks"])
    assert r["score"] < r["max_score"]


def test_each_student_gets_a_seed_and_the_seven_checks_share_one_limited_run(reports):
    seeds = {name: r["seed"] for name, r in reports.items() if name != ANSWERS_ONLY}
    assert seeds["solution"] == submission_seed(0, "ex07_capstone", "solution")
    assert len(set(seeds.values())) == len(seeds)  # a hidden model per student
    [group] = load("ex07_capstone").groups()
    assert len(group) == 7 and {c.limit_s for c in group} == {capstone.RANKS_LIMIT_S}
    assert capstone.LAUNCH_TIMEOUT_S < capstone.RANKS_LIMIT_S
    assert all(r["limits_s"]["answers"] >= capstone.RANKS_LIMIT_S for r in reports.values())


def test_the_hidden_models_are_uneven_against_3_ranks_and_not_tiny():
    from labkit.model import config

    for seed in range(40):
        cfg = capstone.model_config(seed)
        # 3 blocks for everyone: with 2, the root and two blocks are the whole model (the forward's bound)
        assert cfg != config("tiny") and cfg.n_layers == 3 and cfg.global_batch % capstone.RANKS == 0
        for rows in (cfg.vocab_size, cfg.d_model, cfg.d_mlp, cfg.seq_len):
            assert rows % capstone.RANKS, (seed, cfg)


def test_forged_or_malformed_observations_earn_nothing():
    exercise = load("ex07_capstone")
    units = ["root", "blocks.0", "blocks.1", "blocks.2"]  # a forger's zeros: nothing held, nothing reduced
    zeros = {
        "after_forward": dict.fromkeys(units, 0),
        "after_grad": {u: {"weights": 0, "grads": 0, "shard_grads": 0} for u in units},
        "peak": {"bytes": 0, "unit": "root"},
    }
    training = {"losses": [4.0] * capstone.STEPS, "grads": {}}
    forged_ranks = {
        GRADIENTS: training,
        LOSSES: training,
        BYTES: {"all_gather": {"wire_bytes": 1}, "reduce_scatter": {"wire_bytes": 1}},
        FREED: zeros,
        SHARDED_GRADS: zeros,
        STATE: {"params": 0, "grads": 0, "optimizer": 0},
        PREFETCH: {"gathers": [], "order": []},
    }
    forged = {
        name: {"value": {"ranks": [seen] * capstone.RANKS, "stand_ins": {}}}
        for name, seen in forged_ranks.items()
    }
    malformed = {c.name: {"value": {"score": 10}} for c in exercise.checks}
    for observations in (forged, malformed, {"score": 10}, {}):
        assert sum(e["points"] for e in judge_all(exercise, observations, seed=5)) == 0


def test_the_memory_probe_weighs_every_full_tensor_a_unit_keeps_and_what_autograd_saved():
    """`held_bytes`: a unit's parameters, `pending` and any attribute the student added (containers too),
    the storages its parameters had when gathered while they live on (autograd keeps one a free by
    `p.data = torch.empty(0)` left) and, `anywhere`, a tensor anywhere that holds rows other ranks keep (a
    copy in the answers' globals, cast or not); never its shards or their gradients, nor a copy of this rank's rows."""
    import torch

    from labkit.buildalong.scaffold import Unit
    from labkit.grading.capstone_memory import gathered, held_bytes

    linear = torch.nn.Linear(16, 6)
    params = list(linear.parameters())  # 96 + 6 floats, gathered; 3 ranks keep 2 rows each
    shards = [torch.zeros(2, 16, requires_grad=True), torch.zeros(2, requires_grad=True)]
    shards[0].grad = torch.zeros(2, 16)
    unit = Unit("blocks.0", linear, params, shards, [6, 6], rank=0, n=3)
    assert held_bytes(unit) == 4 * (96 + 6)
    seen = gathered(unit)
    kept = {"full": linear.weight.detach().clone(), "mine": linear.weight.detach()[:2].clone()}  # a global
    kept["cast"] = linear.weight.detach().double()  # a copy in another dtype: other bytes, the same rows
    out = linear(torch.ones(1, 16, requires_grad=True))  # autograd saves the weight for backward
    for p in params:
        p.untyped_storage().resize_(0)  # the storage trick: nothing left, saved views included
    assert held_bytes(unit, seen) == 0
    # the two copies; "mine" holds rank 0's rows only
    assert held_bytes(unit, seen, anywhere=True) == (4 + 8) * 96
    del kept["full"]
    assert held_bytes(unit, seen, anywhere=True) == 8 * 96
    del kept["cast"]
    assert held_bytes(unit, seen, anywhere=True) == 0
    for p in params:
        p.untyped_storage().resize_(4 * p.numel())
        p.data = torch.empty(0)  # a new tensor: the gathered weight lives on where autograd saved it
    assert held_bytes(unit) == 0 and held_bytes(unit, seen) == 4 * 96
    del out
    assert held_bytes(unit, seen) == 0  # the graph is gone: so is what it saved
    unit.gathered = torch.zeros(30)  # kept beside the unit
    unit.pending["grads"] = [torch.zeros(24), (torch.zeros(6),)]
    assert held_bytes(unit) == 4 * (30 + 24 + 6)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mistake", ["solution", "no_mean", "no_prefetch", "kept_after_forward"])
def test_check_on_the_notebooks_model_flags_what_the_grade_marks_down(reports, mistake):
    """The student release's check() runs the grade's seven checks on the notebook's `tiny`: a wrong gradient
    scale, weights never freed and no prefetch each fail its line there and lose the same check's points in
    the grade (the shared run's grade of the same notebook); the solution passes both."""
    nb = read(SOLUTION) if mistake == "solution" else planted(mistake)
    graded = answer_checks(reports[ANSWERS_ONLY if mistake == "solution" else mistake])
    shown, graded = assert_check_and_grade_agree("ex07_capstone", nb, SAYS.get(mistake, ""), graded)
    failing = {e["name"] for e in shown if not e["passed"]}
    assert failing == {e["name"] for e in graded if not e["passed"]} == LOSES.get(mistake, set()), shown
