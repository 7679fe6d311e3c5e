"""labkit.budget.roofline: the tokens per rank at which ZeRO-3's link time equals its compute, read off a full
plan and against the closed form T* = (b/2) (n-1)/n R/B; the largest world size a global batch keeps busy."""

import pytest

from labkit import budget
from labkit.budget.roofline import closed_form_critical_tokens, critical_tokens, largest_useful_world_size

FACT_SHEET = dict(tokens_per_rank=16384, link_gbytes=50, peak_tflops=989, mfu=0.4)  # the 30B case


@pytest.mark.parametrize("world_size", [16, 64, 256])
@pytest.mark.parametrize("precision", ["bf16_mixed", "fp32"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_plan_and_the_closed_form_agree_where_every_collective_crosses_the_link(
    world_size, precision, checkpointing
):
    got = critical_tokens(
        30e9, world_size, precision=precision, activation_checkpointing=checkpointing, **FACT_SHEET
    )
    weight_bytes = budget.PRECISIONS[precision]["weights"]
    rate = 989e12 * 0.4 * (6 / 8 if checkpointing else 1)
    expected = weight_bytes / 2 * (world_size - 1) / world_size * rate / 50e9
    assert got["critical_tokens_per_rank"] == pytest.approx(expected, rel=1e-9)
    assert got["closed_form_tokens_per_rank"] == pytest.approx(expected, rel=1e-9)
    assert expected == pytest.approx(closed_form_critical_tokens(rate, 50e9, weight_bytes, world_size))


def test_the_fact_sheets_30b_run_is_compute_bound_at_16k_tokens_per_rank():
    got = critical_tokens(30e9, 256, **FACT_SHEET)
    assert got["compute_time_s"] == pytest.approx(7.45, abs=0.01)  # claim 15
    assert got["comm_time_s"] == pytest.approx(3.6 * 255 / 256, rel=1e-6)  # 3 x 2 B x 30e9 over 50 GB/s
    assert got["critical_tokens_per_rank"] == pytest.approx(7881, abs=1)
    assert got["tokens_per_rank"] > 2 * got["critical_tokens_per_rank"]


def test_above_the_critical_tokens_prefetch_leaves_only_the_floor_and_below_it_the_link_shows():
    critical = critical_tokens(30e9, 256, **FACT_SHEET)["critical_tokens_per_rank"]

    def exposed(tokens):
        return budget.plan(30e9, 256, **{**FACT_SHEET, "tokens_per_rank": tokens})["exposed_comm_prefetch_s"]

    floor = exposed(critical)
    assert exposed(2 * critical) == pytest.approx(floor) == pytest.approx(exposed(8 * critical))
    assert exposed(critical / 2) > 5 * floor
    # each phase's first layer of collectives has nothing before it to hide behind: 1 of the 32 layers
    assert floor == pytest.approx(critical_tokens(30e9, 256, **FACT_SHEET)["comm_time_s"] / 32)


def test_hsdp_keeps_the_gathers_inside_a_node_so_fewer_tokens_keep_it_busy():
    zero3 = critical_tokens(30e9, 256, **FACT_SHEET)
    hsdp = critical_tokens(30e9, 256, "hsdp", **FACT_SHEET)
    assert hsdp["critical_tokens_per_rank"] < zero3["critical_tokens_per_rank"] / 4
    assert hsdp["compute_time_s"] == zero3["compute_time_s"]


def test_the_largest_useful_world_size_is_the_last_node_count_whose_share_stays_above_the_threshold():
    got = largest_useful_world_size(
        30e9, 4e6, **{k: v for k, v in FACT_SHEET.items() if k != "tokens_per_rank"}
    )
    assert got["world_size"] % 8 == 0
    assert got["tokens_per_rank"] == 4e6 / got["world_size"] >= got["critical_tokens_per_rank"]
    nxt = got["next"]
    assert (
        nxt["world_size"] == got["world_size"] + 8
        and nxt["tokens_per_rank"] < nxt["critical_tokens_per_rank"]
    )
    assert got["world_size"] == 8 * int(4e6 / 7900 / 8)  # the threshold barely moves with n: about 7.9k
    doubled = largest_useful_world_size(30e9, 8e6)
    assert doubled["world_size"] == pytest.approx(2 * got["world_size"], abs=8)  # a larger batch buys ranks


def test_a_batch_too_small_for_one_node_says_so_and_bad_input_is_refused():
    got = largest_useful_world_size(30e9, 100)
    assert got["world_size"] is None and got["next"]["world_size"] == 8
    with pytest.raises(ValueError, match="global_tokens"):
        largest_useful_world_size(30e9, 0)
    with pytest.raises(ValueError, match="above 0"):
        closed_form_critical_tokens(1e12, 0)


def test_tensor_parallel_inside_a_node_multiplies_the_useful_ranks_by_its_degree():
    alone = largest_useful_world_size(30e9, 4e6)
    for t in (2, 4, 8):
        got = largest_useful_world_size(30e9, 4e6, tensor_parallel=t)
        assert got["world_size"] == pytest.approx(t * alone["world_size"], rel=0.01)
        assert got["tokens_per_rank"] >= got["critical_tokens_per_rank"]  # the group's share clears it
    with pytest.raises(ValueError, match="divisor of gpus_per_node"):
        largest_useful_world_size(30e9, 4e6, tensor_parallel=3)
