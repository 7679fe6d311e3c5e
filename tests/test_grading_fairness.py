"""The same answer, the same grade (issue 46): every student's cases exercise the same conditions, so a
planted mistake scores the same under every student's name, though each name draws other cases. And a
crash in one answer costs only the checks built on it: ex03's flat buffer is judged when pack_grads raises,
ex04's schedule when forward_order does, ex08's useful world size when the threshold does.

Each exercise whose cases are drawn per student gets a mistake that shows under some conditions only (the
issue's gather that keeps the padding rows, a sum of every strategy's bytes over n, a batch size typed in,
the mesh's two axes swapped, ...), graded here, probe and judge, under six names (six seeds); ex02's is
also graded by `labkit grade` under three names, the issue's own scenario. The capstone's is in
tests/test_capstone.py (a planted mistake graded under two names).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from grading_batches import graded_kernel, labkit_cli, plant, read

from labkit.grading.kit import Exercise, judge_all, load, probe_all, submission_seed

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "solutions"
NAMES = ("ada", "bob", "cyd", "dee", "eve", "fay")  # six students, six seeds
SOLUTION_OF = {
    "ex01_memory": "01_memory",
    "ex02_shard": "02_shard_gather",
    "ex03_reduce_scatter": "03_reduce_scatter",
    "ex04_prefetch": "04_prefetch",
    "ex05_deepspeed": "05_deepspeed_config",
    "ex06_hsdp": "06_hsdp",
    "ex08_critical_batch": "08_critical_batch",
    "ex09_diagnose": "09_diagnose",
}
# exercise -> {mistake: [(answer cell id, solution's text, the mistake's)]}
PLANTED = {
    "ex01_memory": {
        "every_strategy_sharded": [  # right on one rank (and for ZeRO-3) only
            ("answer-state", "params * (replicated + sharded / world_size)", "params * (replicated + sharded) / world_size")
        ],
    },
    "ex02_shard": {
        "gather_keeps_padding": [("answer-gather", "return out[:d0]", "return out")],  # the issue's
        "padding_in_front": [
            ("answer-shard", "shard[: real.shape[0]] = real", "shard[rows - real.shape[0] :] = real")
        ],
    },
    "ex03_reduce_scatter": {
        "tail_dropped": [  # no padding: the elements past n * (numel // n) are lost
            ("answer-flat", "chunk = -(-flat_grad.numel() // world_size)", "chunk = flat_grad.numel() // world_size"),
            ("answer-flat", "padded[: flat_grad.numel()] = flat_grad.reshape(-1)", "padded[:] = flat_grad.reshape(-1)[: padded.numel()]"),
        ],
    },
    "ex05_deepspeed": {
        "batch_typed_in": [("answer-offload", '"train_batch_size": micro_batch * world_size', '"train_batch_size": 8')],
    },
    "ex06_hsdp": {
        "axes_swapped": [("answer-mesh", "return shard_groups, replicate_groups", "return replicate_groups, shard_groups")],
    },
    "ex08_critical_batch": {
        "bf16_typed_in": [("answer-critical", "* weight_bytes / link_bytes_per_s", "* 2 / link_bytes_per_s")],
    },
    "ex09_diagnose": {  # the lists read by position: right until a ring drops their first entries unevenly
        "positional": [("answer-diagnose", "    start = max((min(seqs) for seqs in by_seq.values() if seqs), default=1)\n", "    by_seq = {r: {i + 1: e for i, e in enumerate(rows)} for r, rows in entries.items()}\n    start = 1\n")],
    },
}  # fmt: skip
RANKS_FREE = {
    "ex01_memory",
    "ex05_deepspeed",
    "ex06_hsdp",
    "ex08_critical_batch",
    "ex09_diagnose",
}  # in process
LAUNCHES_LEFT_OUT = {
    "ex08_critical_batch",
    "ex09_diagnose",
}  # their checks that launch ranks: not graded here


def graded_checks(exercise_id: str) -> Exercise:
    """The exercise's checks this test grades: all of them, but ex08's and ex09's that launch ranks (FSDP2 on 2
    or 3 ranks, whose cases differ by the model's seed and the rows alone)."""
    exercise = load(exercise_id)
    if exercise_id in LAUNCHES_LEFT_OUT:
        return Exercise(exercise.id, exercise.title, tuple(c for c in exercise.checks if not c.group))
    return exercise


def scores(exercise_id: str, mistake: str, names=NAMES) -> dict[str, float]:
    """{student: points} of the solution with `mistake` planted, probed and judged on each student's seed."""
    nb = plant(SOLUTIONS / f"{SOLUTION_OF[exercise_id]}.ipynb", PLANTED[exercise_id][mistake])
    namespace = graded_kernel(nb)
    exercise = graded_checks(exercise_id)
    out = {}
    for name in names:
        seed = submission_seed(0, exercise_id, name)
        entries = judge_all(exercise, probe_all(exercise, namespace, seed), seed)
        out[name] = round(sum(e["points"] for e in entries), 2)
    return out


CASES = [(ex, mistake) for ex, mistakes in PLANTED.items() for mistake in mistakes]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("exercise_id", "mistake"), CASES)
def test_a_planted_mistake_scores_the_same_under_every_name(exercise_id, mistake):
    names = NAMES if exercise_id in RANKS_FREE else NAMES[:3]  # a launch of ranks per name
    got = scores(exercise_id, mistake, names)
    print(f"\n{exercise_id} {mistake}: {got}")
    full = graded_checks(exercise_id).max_score
    assert len(set(got.values())) == 1, got
    assert 0 < next(iter(got.values())) < full, got  # the mistake costs points, and not all of them


def test_each_name_still_draws_its_own_cases():
    """The conditions are everyone's; the sizes are each student's."""
    from labkit.grading.checks import ex01_memory, ex02_shard, ex03_reduce_scatter, ex05_deepspeed, ex06_hsdp
    from labkit.grading.checks import ex08_critical_batch as ex08
    from labkit.grading.checks import ex09_diagnose as ex09

    draws = {
        "ex01_memory": lambda s: ex01_memory._fit_cases(s) + ex01_memory._state_cases(s, "ddp"),
        "ex02_shard": lambda s: ex02_shard._cases(s, "shard", (3, 2, 4)),
        "ex03_reduce_scatter": lambda s: (
            ex03_reduce_scatter._flat_numels(s),
            ex03_reduce_scatter._shapes(s),
        ),
        "ex05_deepspeed": ex05_deepspeed._cases,
        "ex06_hsdp": ex06_hsdp._cases,
        "ex08_critical_batch": lambda s: ex08._critical_cases(s) + ex08._useful_cases(s),
        "ex09_diagnose": lambda s: (ex09.hangs(s), ex09.splits(s)),
    }
    for exercise_id, draw in draws.items():
        cases = [repr(draw(submission_seed(0, exercise_id, name))) for name in NAMES]
        assert len(set(cases)) > 1, exercise_id


def test_the_drawn_shapes_keep_their_conditions_on_every_seed():
    """ex02's and ex03's drawn places: one rank short of rows where uneven, a multiple where exact."""
    from labkit.grading.checks import ex02_shard, ex03_reduce_scatter
    from labkit.grading.kit import one_rank_short

    for seed in range(300):
        drawn = ex02_shard._cases(seed, "shard", (3, 2, 4))[-3:]
        assert [(len(shape), n) for shape, n in drawn] == [(2, 4), (2, 2), (3, 3)]
        assert [one_rank_short(shape[0], n) for shape, n in drawn] == [True, False, True]
        assert drawn[1][0][0] % 2 == 0
        assert one_rank_short(ex03_reduce_scatter._flat_numels(seed)[-1], 3)
        assert all(one_rank_short(shape[0], 3) for shape in ex03_reduce_scatter._shapes(seed)[-1])
    assert [one_rank_short(d0, 3) for d0 in (4, 5, 6, 7)] == [False, True, False, True]  # 4: 2, 2, 0 rows


@pytest.mark.timeout(600)
def test_identical_submissions_graded_under_three_names_score_the_same(tmp_path):
    """The issue's scenario through `labkit grade`: one ex02 submission (a gather that keeps the padding rows)
    under three names."""
    import csv

    import nbformat

    nb = plant(SOLUTIONS / "02_shard_gather.ipynb", PLANTED["ex02_shard"]["gather_keeps_padding"])
    folder = tmp_path / "submissions"
    folder.mkdir()
    for name in NAMES[:3]:
        nbformat.write(nb, folder / f"{name}.ipynb")
    book = tmp_path / "grades.csv"
    done = labkit_cli("grade", str(folder), "--gradebook", str(book), "--answers-only", "--jobs", "2")
    assert done.returncode == 0, done.stderr
    with open(book, newline="") as f:
        rows = list(csv.DictReader(f))
    scores_ = {row["student"]: row["score"] for row in rows}
    print(f"\nex02, a gather that keeps the padding rows, under three names: {scores_}")
    assert len(rows) == 3 and len(set(scores_.values())) == 1, rows
    assert 0 < float(rows[0]["score"]) < 6
    seeds = {read_report(tmp_path, name)["seed"] for name in NAMES[:3]}
    assert len(seeds) == 3


def read_report(tmp_path: Path, name: str) -> dict:
    import json

    return json.loads((tmp_path / "grades-reports" / f"{name}.report.json").read_text())


def test_padding_in_front_is_said_in_the_exercises_own_words():
    """ex02's shard with its zero rows first: the feedback speaks of padding, not of packing parameters."""
    nb = plant(SOLUTIONS / "02_shard_gather.ipynb", PLANTED["ex02_shard"]["padding_in_front"])
    namespace = graded_kernel(nb)
    exercise = load("ex02_shard")
    shard = Exercise(exercise.id, exercise.title, exercise.checks[:1])
    [entry] = judge_all(shard, probe_all(shard, namespace, 5), 5)
    assert not entry["passed"] and "padding rows go at the end" in entry["feedback"], entry
    assert "parameter by parameter" not in entry["feedback"]


@pytest.mark.timeout(300)
def test_the_solutions_still_score_full_marks_on_a_new_draw():
    """The cases drawn within their conditions are still ones the solutions answer in full."""
    for exercise_id in SOLUTION_OF:
        nb = read(SOLUTIONS / f"{SOLUTION_OF[exercise_id]}.ipynb")
        exercise = graded_checks(exercise_id)
        seed = submission_seed(0, exercise_id, "ada")
        entries = judge_all(exercise, probe_all(exercise, graded_kernel(nb), seed), seed)
        assert all(e["passed"] for e in entries), entries


# exercise -> (a one-line crash in a helper answer, {check: points it keeps}); the other checks earn nothing
CRASHES = {
    "ex03_reduce_scatter": (
        ("answer-pack", "dim0_rows(g.shape[0], world_size)", "dim0_rows(g.shape[0], world_sise)"),
        {"flat buffer: this rank's shard of the mean gradient (vs an all-reduce)": 3, "flat buffer: one reduce-scatter per buffer, no all-reduce": 1},
    ),
    "ex04_prefetch": (
        ("answer-orders", "for i in range(n_blocks)]", "for i in range(n_block)]"),
        {"prefetch schedule of a steady step": 3, "all-gathers per step, with and without reshard_after_forward": 2},
    ),
    "ex08_critical_batch": (
        ("answer-critical", "(world_size - 1) / world_size", "(world_size - 1) / world_sizes"),
        {"largest useful world size": 2},
    ),
}  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("exercise_id", list(CRASHES))
def test_a_crash_in_one_answer_costs_only_the_checks_built_on_it(exercise_id):
    """The answers built on the crashing one are judged with the reference in its place, said in their feedback."""
    edit, keeps = CRASHES[exercise_id]
    nb = plant(SOLUTIONS / f"{SOLUTION_OF[exercise_id]}.ipynb", [edit])
    exercise = graded_checks(exercise_id)
    seed = submission_seed(0, exercise_id, "ada")
    entries = judge_all(exercise, probe_all(exercise, graded_kernel(nb), seed), seed)
    print(f"\n{exercise_id}: {[(e['name'], e['points']) for e in entries]}")
    assert {e["name"]: e["points"] for e in entries} == {
        c.name: keeps.get(c.name, 0) for c in exercise.checks
    }
    for e in entries:
        if (
            e["name"] in keeps and exercise_id != "ex03_reduce_scatter"
        ):  # ex03's flat checks need no pack_grads
            assert "judged with the reference" in e["feedback"] and "in place of yours" in e["feedback"], e
        elif e["name"] not in keeps:
            assert "NameError" in e["feedback"], e
