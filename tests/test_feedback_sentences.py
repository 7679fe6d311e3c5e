"""Feedback that names the mistake, without starting a process: a library's error said as one whole sentence
(`labkit.errors`), exercise 05's DeepSpeed refusals in the grade and in `check()`, exercise 02's shard said with
its shapes, the build-along's "fix `shard` first" and the reveal's gate (`labkit.buildalong.reveal.passed`)."""

from __future__ import annotations

import re

import pytest
import torch

from labkit.buildalong import reveal
from labkit.buildalong.verdicts import CheckResult, fix_first
from labkit.errors import LONGEST_CHARS, error_text, one_sentence
from labkit.grading import public

OFFLOAD_PARAMS = {  # exercise 05's offload config with the classic misspelling: offload_params
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_params": {"device": "cpu"},
    },
}
WHOLE = "DeepSpeedZeroConfig rejects offload_params: Extra inputs are not permitted (got {'device': 'cpu'})"


def _deepspeed_refusal() -> BaseException:
    with pytest.raises(Exception) as caught:
        public.parse(OFFLOAD_PARAMS, 4)
    return caught.value


def test_deepspeed_s_validation_error_is_said_whole_without_its_link():
    said = error_text(_deepspeed_refusal())
    assert said == f"ValidationError: {WHOLE}", said
    assert "http" not in said and "…" not in said and "\n" not in said


def test_a_long_message_ends_at_its_first_sentence_or_a_whole_word():
    torch_says = (
        "Trying to backward through the graph a second time (or directly access saved tensors after they have "
        "already been freed). Saved intermediate values of the graph are freed when you call .backward() or "
        "autograd.grad(). Specify retain_graph=True if you need to backward through the graph a second time or "
        "if you need to access saved tensors after calling backward."
    )
    assert one_sentence(torch_says) == torch_says[: torch_says.index(". Saved") + 1]
    words = " ".join(f"word{i}" for i in range(200))  # no sentence end anywhere
    cut = one_sentence(words)
    assert cut.endswith(" …") and len(cut) <= LONGEST_CHARS + 2
    assert cut[:-2].split()[-1] in words.split()  # the last word kept is a whole word
    short = "mat1 and mat2 shapes cannot be multiplied (3x4 and 5x4)"
    assert one_sentence(f"{short}\n") == short
    with pytest.raises(RuntimeError) as caught:
        torch.ones(3, 4) @ torch.ones(5, 4)
    assert error_text(caught.value) == f"RuntimeError: {short}"


def test_exercise_05_says_deepspeed_s_whole_sentence_in_the_grade_and_in_check():
    from labkit.grading.checks import ex05_deepspeed

    _, feedback = ex05_deepspeed._accepted_judge([OFFLOAD_PARAMS, OFFLOAD_PARAMS], seed=0)
    assert WHOLE in feedback, feedback
    ns = {
        "offload_config": lambda n, micro: OFFLOAD_PARAMS,
        "zeropp_config": lambda n, g, micro: OFFLOAD_PARAMS,
    }
    cases = public._config_cases(ns)
    assert [ok for ok, _ in cases] == [False, False]
    assert cases[0][1] == f"offload_config: DeepSpeed refuses it (ValidationError: {WHOLE})", cases[0][1]


def _no_padding(full, rank, n):
    return full.tensor_split(n)[rank].clone()


def _garbage_padding(full, rank, n):
    rows = -(-full.shape[0] // n)
    out = torch.full((rows, *full.shape[1:]), 7.0)
    mine = full[rank * rows : (rank + 1) * rows]
    out[: mine.shape[0]] = mine
    return out


@pytest.mark.parametrize(
    "shard, said",
    [
        (_no_padding, "shape [7, 4] on 3 ranks: rank 1's shard has shape [2, 4], want [3, 4]"),
        (_garbage_padding, "shape [7, 4] on 3 ranks: padding row 1 of rank 2's shard is not zero"),
    ],
)
def test_exercise_02_s_check_says_the_shard_s_shapes_and_rows(shard, said):
    cases = public._shard_cases({"shard_rows": shard})
    assert not cases[0][0] and cases[0][1].startswith(said), cases[0][1]


def test_a_later_check_says_fix_the_earlier_piece_first():
    sentence = "rank 2 of 3 has 33 rows of the 101-row tok.weight; every rank needs ceil(101/3) = 34"
    assert fix_first("shard", sentence) == f"fix `shard` first, this check runs on it: {sentence}"
    assert fix_first("forward", "x").startswith("fix `before_forward` and `after_forward` first, ")
    stub = "write this piece: shard (the idea), then run this check again"
    assert fix_first("shard", stub) == stub  # a piece still to write is said as itself
    assert re.fullmatch(r"[^\n]+", fix_first("gather", sentence))


def test_the_reveal_waits_for_every_check_it_is_given(capsys):
    ok, failed = CheckResult("shard", True, "right"), CheckResult("gather", False, "wrong")
    assert reveal.passed([ok]) and reveal.passed(ok) and reveal.passed(True)
    assert not reveal.passed([ok, failed]) and not reveal.passed([]) and not reveal.passed(False)
    reveal.show([ok, failed], reveal.show)
    assert capsys.readouterr().out.strip() == reveal.NOT_YET
