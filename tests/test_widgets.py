"""labkit.widgets and the budget plots: live controls headless, and the static fallback a notebook keeps."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")

import nbformat  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from labkit import KERNEL_NAME, budget, plots, widgets  # noqa: E402


@pytest.fixture(scope="module")
def calc():
    return widgets.budget_calculator(30e9, 256, "zero3")


def test_starts_on_the_plan_it_was_given(calc):
    assert calc.result == budget.plan(30e9, 256, "zero3")
    assert calc.image.value[:8] == b"\x89PNG\r\n\x1a\n"
    assert "1.875 GB" in calc.table.value and "480 GB" in calc.table.value


def test_moving_a_slider_redraws_figure_and_table(calc):
    before_png, before_table = calc.image.value, calc.table.value
    calc.controls["world_size"].value = 512
    assert calc.result["state_bytes_per_rank"] == 937_500_000
    assert calc.image.value != before_png and calc.table.value != before_table
    assert "937.5 MB" in calc.table.value
    calc.controls["params"].value = 7.5e9
    assert calc.result["params"] == 7_500_000_000


def test_hsdp_offers_divisors_and_defaults_to_a_node(calc):
    calc.controls["world_size"].value = 512
    calc.controls["strategy"].value = "hsdp"
    assert calc.controls["group_size"].value == 8
    assert 3 not in calc.controls["group_size"].options and 64 in calc.controls["group_size"].options
    assert calc.result["group_size"] == 8 and calc.result["replica_groups"] == 64
    calc.controls["group_size"].value = 64
    assert calc.result["state_bytes_per_rank"] == calc.result["static_bytes_total"] // 64
    calc.controls["strategy"].value = "zero3"
    assert calc.result["group_size"] == 512  # the group control only applies to hsdp


def test_an_impossible_combination_shows_the_sentence_and_keeps_the_last_plan(calc):
    calc.controls["strategy"].value = "zero3"
    good = calc.result
    calc.controls["strategy"].value = "ddp"
    calc.controls["offload_params"].value = "cpu"
    assert "offload_params needs sharded weights" in calc.error.value
    calc.controls["offload_params"].value = "none"
    assert calc.error.value == "" and calc.result["strategy"] == "ddp" and calc.result is not good


def test_display_bundle_has_widget_view_and_static_fallback(calc):
    bundle = calc._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "data:image/png;base64," in bundle["text/html"] and "<table" in bundle["text/html"]
    static = widgets.budget_calculator(1e9, 8, static=True)._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" not in static
    assert static["image/png"][:4] == b"\x89PNG" and "<table" in static["text/html"]


def test_params_slider_puts_the_default_30e9_on_its_grid():
    # The browser snaps the handle to the exponents min + k x step. log10(30e9) = 10.477121254719663 is
    # 447.71 steps of 0.01 above 6, so min is 6 moved down to 448 steps below it: 5.997121254719663.
    slider = widgets.budget_calculator().controls["params"]
    assert (slider.base, slider.step, slider.max, slider.readout_format) == (10, 0.01, 13, ".3g")
    assert slider.min == pytest.approx(5.997121254719663, abs=1e-12)
    assert slider.min <= 6 < slider.min + slider.step, "the range starts at most one step below 1e6"
    assert (math.log10(30e9) - slider.min) / slider.step == pytest.approx(448, abs=1e-9)
    on_grid = [10 ** (slider.min + k * slider.step) for k in (447, 448, 449)]
    assert on_grid[1] == pytest.approx(30e9, rel=1e-12) and slider.value == 30e9
    assert [format(v, slider.readout_format) for v in on_grid] == ["2.93e+10", "3e+10", "3.07e+10"]


def test_plots_are_figures_with_one_segment_per_term():
    results = [budget.plan(30e9, 256, s) for s in ("ddp", "zero1", "zero3")]
    fig = plots.memory_bars(results)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == list(budget.MEMORY_TERMS)
    heights = [p.get_height() for p in ax.patches]
    assert len(heights) == 5 * 3  # five terms stacked on three bars
    assert sum(heights[0::3]) == pytest.approx(480)  # the ddp bar: the whole state, in GB
    t = plots.time_bars(budget.plan(30e9, 256))
    widths = [p.get_width() for p in t.axes[0].patches]
    assert widths[0] == pytest.approx(budget.plan(30e9, 256)["compute_time_s"])
    assert len(plots.figure_png(t)) > 1000
    # With the optimizer on the host, the prefetch row ends at the plan's step time: CPU Adam drawn too.
    offloaded = budget.plan(70e9, 8, "zero3", offload_optimizer="cpu")
    ax = plots.time_bars(offloaded).axes[0]
    prefetch_row = [p for p in ax.patches if p.get_y() + p.get_height() / 2 == pytest.approx(1)]
    assert max(p.get_x() + p.get_width() for p in prefetch_row) == pytest.approx(offloaded["step_time_s"])
    assert "CPU Adam" in [t.get_text() for t in ax.get_legend().get_texts()]


@pytest.mark.timeout(300)
def test_executed_notebook_keeps_a_static_figure(tmp_path):
    """As papermill/nbconvert run it: a kernel with no front end, then the saved outputs."""
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "from labkit.widgets import budget_calculator\nbudget_calculator(30e9, 256)"
        )
    ]
    nbclient.NotebookClient(
        nb, timeout=240, kernel_name=KERNEL_NAME, resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    data = [o for o in nb.cells[0].outputs if o.output_type in ("display_data", "execute_result")][0]["data"]
    assert "data:image/png;base64," in data["text/html"] and "1.875 GB" in data["text/html"]


def test_controls_are_made_from_plan_inputs():
    calc = widgets.BudgetCalculator(30e9, 256)
    assert set(calc.controls) == set(widgets.CONTROLS)
    assert sorted(n for row in widgets.ROWS for n in row) == sorted(widgets.CONTROLS)  # each laid out once
    specs = {i.name: i.spec for i in budget.INPUTS}
    for name, control in calc.controls.items():
        assert name in specs, name  # every control is an input of plan()
        if name in budget.DEFAULTS and name != "group_size":
            assert control.value == pytest.approx(budget.DEFAULTS[name]), name
        if specs[name].kind == "choice":
            assert tuple(control.options) == specs[name].choices, name
    start = {**budget.DEFAULTS, "params": 30e9, "world_size": 256, "group_size": None}
    assert calc.options() == {name: start[name] for name in widgets.CONTROLS}
    start = widgets.BudgetCalculator(1e9, 8, "zero1", mfu=0.5, tokens_per_rank=4096, qgz=False)
    assert (start.controls["mfu"].value, start.controls["tokens_per_rank"].value) == (0.5, 4096)
    assert start.options()["qgz"] is False  # an input without a control is passed through


def test_gpu_memory_control_moves_the_verdict_and_the_fewest_ranks():
    calc = widgets.BudgetCalculator(30e9, 8)  # 60 GB per rank
    gpu = calc.controls["gpu_memory_bytes"]
    assert gpu.value == 80e9 and ("80 GB", 80_000_000_000) in gpu.options
    assert calc.result["fits"] and "does it fit?" in calc.table.value
    assert "fits: 60 GB state and buffers per rank of 80 GB, 20 GB left for activations" in calc.table.value
    assert calc.fit.value == (
        "Fewest ranks that fit: 6 ranks are the fewest at which zero3 fits: 80 GB per rank of 80 GB; "
        "at 5 ranks it needs 96 GB."
    )
    gpu.value = 40_000_000_000
    assert calc.result["gpu_memory_bytes"] == 40e9 and not calc.result["fits"]
    assert "does not fit: 60 GB state and buffers per rank is 20 GB more than 40 GB" in calc.table.value
    assert calc.fit.value.startswith("Fewest ranks that fit: 12 ranks")  # 480 GB / 40 GB
    assert calc.fit.value in calc.static_html()
    calc.controls["offload_optimizer"].value = "cpu"
    calc.controls["host_memory_bytes"].value = 256_000_000_000  # 8 ranks x 60 GB of offloaded state
    assert "only NVMe fits" in calc.result["host_verdict"] and "only NVMe fits" in calc.table.value
    odd = widgets.BudgetCalculator(30e9, 8, gpu_memory_bytes=70e9)  # a size the dropdown lacks is added
    assert odd.controls["gpu_memory_bytes"].value == 70e9 and odd.result["gpu_memory_bytes"] == 70e9
