"""ipywidgets calculators over `labkit.budget.plan()`: move a slider, see memory terms, step time and numbers.

`budget_calculator()` returns a `BudgetCalculator`; displaying it shows live controls in JupyterLab
(ipywidgets 8). Its display bundle also carries a static PNG and HTML table, so a notebook executed with no
front end (papermill, nbconvert) keeps a figure and the numbers; `static=True` shows only those.
"""

from __future__ import annotations

import base64
import html
import math

import ipywidgets as W

from labkit import budget, plots

RANK_CHOICES = tuple(2**k for k in range(14))  # 1 .. 8192 ranks


def log_slider(
    value: float, *, base: float, low: float, high: float, step: float, **kwargs
) -> W.FloatLogSlider:
    """A `FloatLogSlider` from about `base**low` to `base**high` whose exponent grid passes through `value`'s.

    The browser snaps the handle, and its readout, to the exponents `min + k * step`: with `min=6, step=0.01`
    the 30e9 the numbers are computed for reads "3.02e+10", and 989 peak TFLOP/s reads "1000". So `min` is
    `low` moved down by less than one step (and the range widens to hold a `value` outside it).
    """
    exponent = math.log(value, base)
    steps_below = max(0, math.ceil((exponent - low) / step - 1e-9))  # min in (low - step, low]
    return W.FloatLogSlider(
        value=value,
        base=base,
        min=exponent - steps_below * step,
        max=max(high, exponent),
        step=step,
        **kwargs,
    )


def table_html(result: dict) -> str:
    """The `summary_rows` of a plan result as a small HTML table."""
    out = ['<table style="font-size:12px;border-collapse:collapse">']
    section = None
    for sec, quantity, value in budget.summary_rows(result):
        if sec != section:
            out.append(
                f'<tr><th colspan="2" style="text-align:left;padding-top:6px">{html.escape(sec)}</th></tr>'
            )
            section = sec
        out.append(
            f'<tr><td style="padding-right:12px">{html.escape(quantity)}</td>'
            '<td style="text-align:right;font-family:monospace;white-space:nowrap">'
            f"{html.escape(value)}</td></tr>"
        )
    out.append("</table>")
    return "".join(out)


class BudgetCalculator:
    """Controls for every input of `plan()`, a figure (memory bars + time bars) and a numbers table.

    `controls` maps each `plan()` argument name to its widget; `result` is the latest `plan()` result;
    `widget` is the whole layout. A combination `plan()` refuses (say offload of params under ddp) shows its
    one-sentence error instead of a figure and keeps the last good result.
    """

    def __init__(self, params: float = 30e9, world_size: int = 256, strategy: str = "zero3", **options):
        ranks = sorted(set(RANK_CHOICES) | {int(world_size)})
        c = {
            "params": log_slider(
                params, base=10, low=6, high=13, step=0.01, description="params", readout_format=".3g"
            ),
            "world_size": W.SelectionSlider(options=ranks, value=int(world_size), description="ranks"),
            "strategy": W.ToggleButtons(options=budget.STRATEGIES, value=strategy, description="strategy"),
            "group_size": W.Dropdown(options=[1], value=1, description="group size"),
            "gpus_per_node": W.Dropdown(
                options=[1, 2, 4, 8, 16], value=options.get("gpus_per_node", 8), description="GPUs/node"
            ),
            "precision": W.Dropdown(
                options=tuple(budget.PRECISIONS),
                value=options.get("precision", "bf16_mixed"),
                description="precision",
            ),
            "offload_optimizer": W.Dropdown(
                options=budget.OFFLOAD_TARGETS,
                value=options.get("offload_optimizer", "none"),
                description="offload opt.",
            ),
            "offload_params": W.Dropdown(
                options=budget.OFFLOAD_TARGETS,
                value=options.get("offload_params", "none"),
                description="offload params",
            ),
            "prefetch": W.Checkbox(value=options.get("prefetch", True), description="one-layer prefetch"),
            "reshard_after_forward": W.Checkbox(
                value=options.get("reshard_after_forward", True), description="reshard after forward"
            ),
            "tokens_per_rank": log_slider(
                options.get("tokens_per_rank", 16384),
                base=2,
                low=9,
                high=20,
                step=1,
                description="tokens/rank",
                readout_format=".0f",
            ),
            "link_gbytes": log_slider(
                options.get("link_gbytes", 50.0),
                base=10,
                low=0,
                high=3,
                step=0.01,
                description="NIC GB/s",
                readout_format=".3g",
            ),
            "intra_gbytes": log_slider(
                options.get("intra_gbytes", 450.0),
                base=10,
                low=1,
                high=3.5,
                step=0.01,
                description="NVLink GB/s",
                readout_format=".3g",
            ),
            "peak_tflops": log_slider(
                options.get("peak_tflops", 989.0),
                base=10,
                low=1,
                high=4,
                step=0.01,
                description="peak TFLOP/s",
                readout_format=".4g",
            ),
            "mfu": W.FloatSlider(
                value=options.get("mfu", 0.4), min=0.05, max=1.0, step=0.01, description="MFU"
            ),
        }
        self.controls = c
        self._fixed = {k: v for k, v in options.items() if k not in c}  # options without a control (e.g. qwz)
        self._set_group_choices(options.get("group_size") or min(c["gpus_per_node"].value, int(world_size)))
        self.image = W.Image(format="png", layout=W.Layout(max_width="760px", object_fit="contain"))
        self.table = W.HTML()
        self.error = W.HTML()
        self.result: dict | None = None
        self.widget = W.VBox(
            [
                W.HBox([c["params"], c["world_size"]]),
                c["strategy"],
                W.HBox([c["group_size"], c["gpus_per_node"], c["precision"]]),
                W.HBox(
                    [c["offload_optimizer"], c["offload_params"], c["prefetch"], c["reshard_after_forward"]]
                ),
                W.HBox([c["tokens_per_rank"], c["peak_tflops"], c["mfu"]]),
                W.HBox([c["link_gbytes"], c["intra_gbytes"]]),
                self.error,
                # Not stretched to the table's height (a flex row stretches its items), the table below it
                # when the two do not fit side by side.
                W.HBox(
                    [self.image, self.table], layout=W.Layout(flex_flow="row wrap", align_items="flex-start")
                ),
            ]
        )
        c["world_size"].observe(self._on_world_size, names="value")
        c["gpus_per_node"].observe(self._on_world_size, names="value")
        for name, control in c.items():
            if name not in ("world_size", "gpus_per_node"):
                control.observe(lambda _change: self.update(), names="value")
        self.update()

    def options(self) -> dict:
        """The keyword arguments of `plan()` the controls currently spell."""
        values = {name: control.value for name, control in self.controls.items()}
        values.update(self._fixed)
        if values["strategy"] != "hsdp":
            values["group_size"] = None
        return values

    def update(self) -> None:
        """Recompute the plan and redraw the figure and the table (called on every control change)."""
        opts = self.options()
        try:
            result = budget.plan(opts.pop("params"), opts.pop("world_size"), opts.pop("strategy"), **opts)
        except ValueError as e:
            self.error.value = f'<span style="color:#b00">{html.escape(str(e))}</span>'
            return
        self.error.value = ""
        self.result = result
        self.image.value = plots.figure_png(plots.budget_figure(result))
        self.table.value = table_html(result)

    def static_html(self) -> str:
        """The current figure and table as one self-contained HTML fragment (no widgets needed)."""
        png = base64.b64encode(self.image.value).decode("ascii")
        return (
            f'<div style="display:flex;gap:16px;align-items:flex-start"><img src="data:image/png;base64,{png}" '
            f'style="max-width:760px"/>{self.table.value}</div>'
        )

    def _set_group_choices(self, wanted: int | None = None) -> None:
        n = self.controls["world_size"].value
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        current = wanted or self.controls["group_size"].value
        default = min(self.controls["gpus_per_node"].value, n)
        value = current if current in divisors else (default if default in divisors else 1)
        self.controls["group_size"].options = divisors
        self.controls["group_size"].value = value

    def _on_world_size(self, _change) -> None:
        self._set_group_choices()
        self.update()

    def _repr_mimebundle_(self, **kwargs):
        bundle = self.widget._repr_mimebundle_(**kwargs) or {}
        # A live front end renders the widget view; without one (papermill, nbconvert) the HTML is what stays.
        bundle["text/html"] = self.static_html()
        bundle["text/plain"] = (
            budget.format_bytes(self.result["state_bytes_per_rank"]) + " per rank (budget calculator)"
        )
        return bundle


class StaticBudget:
    """What `budget_calculator(static=True)` displays: the figure and the table, no controls."""

    def __init__(self, calculator: BudgetCalculator):
        self.result = calculator.result
        self.figure = plots.budget_figure(self.result)
        self.html = calculator.static_html()

    def _repr_mimebundle_(self, **kwargs):
        png = plots.figure_png(self.figure)
        return {"text/html": self.html, "image/png": png, "text/plain": f"budget: {self.result['strategy']}"}


def budget_calculator(
    params: float = 30e9, world_size: int = 256, strategy: str = "zero3", *, static: bool = False, **options
):
    """A calculator over `plan()` starting from these arguments (any `plan()` option may be given).

    Displays live controls where a front end renders widgets, and a static figure + table otherwise;
    `static=True` returns only the static view (for slides and executed reports).
    """
    calc = BudgetCalculator(params, world_size, strategy, **options)
    return StaticBudget(calc) if static else calc
