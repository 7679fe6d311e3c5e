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
from labkit.names import HSDP

RANK_CHOICES = tuple(2**k for k in range(14))  # 1 .. 8192 ranks
# memory sizes a dropdown offers (bytes, decimal): common GPUs (16 GB .. a B200's 192 GB), and hosts' RAM
GPU_MEMORY_CHOICES = tuple(int(g * 1e9) for g in (16, 24, 32, 40, 48, 80, 94, 96, 141, 192))
HOST_MEMORY_CHOICES = tuple(int(g * 1e9) for g in (256, 512, 1000, 1500, 2000, 4000))


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


# The controls over `plan()`'s inputs: which widget each gets, its label and its range (a log slider's
# exponents). Values start at the caller's options, else at the defaults of `budget.PlanInputs`; dropdowns
# and toggles list the input's choices unless the settings name `options`. Inputs not here keep their value.
CONTROLS: dict[str, tuple[str, str, dict]] = {
    "params": ("log", "params", {"base": 10, "low": 6, "high": 13, "step": 0.01, "readout_format": ".3g"}),
    "world_size": ("ranks", "ranks", {}),
    "strategy": ("toggle", "strategy", {}),
    "group_size": ("dropdown", "group size", {"options": [1]}),  # the divisors of world_size, once known
    "gpus_per_node": ("dropdown", "GPUs/node", {"options": [1, 2, 4, 8, 16]}),
    "precision": ("dropdown", "precision", {}),
    "offload_optimizer": ("dropdown", "offload opt.", {}),
    "offload_params": ("dropdown", "offload params", {}),
    "prefetch": ("checkbox", "one-layer prefetch", {}),
    "reshard_after_forward": ("checkbox", "reshard after forward", {}),
    "tokens_per_rank": (
        "log",
        "tokens/rank",
        {"base": 2, "low": 9, "high": 20, "step": 1, "readout_format": ".0f"},
    ),
    "link_gbytes": (
        "log",
        "NIC GB/s",
        {"base": 10, "low": 0, "high": 3, "step": 0.01, "readout_format": ".3g"},
    ),
    "intra_gbytes": (
        "log",
        "NVLink GB/s",
        {"base": 10, "low": 1, "high": 3.5, "step": 0.01, "readout_format": ".3g"},
    ),
    "peak_tflops": (
        "log",
        "peak TFLOP/s",
        {"base": 10, "low": 1, "high": 4, "step": 0.01, "readout_format": ".4g"},
    ),
    "mfu": ("slider", "MFU", {"min": 0.05, "max": 1.0, "step": 0.01}),
    "gpu_memory_bytes": ("bytes", "GPU memory", {"options": GPU_MEMORY_CHOICES}),
    "host_memory_bytes": ("bytes", "host RAM/node", {"options": HOST_MEMORY_CHOICES}),
}
# How the controls are laid out: one row of widgets per tuple.
ROWS = (
    ("params", "world_size"),
    ("strategy",),
    ("group_size", "gpus_per_node", "precision"),
    ("offload_optimizer", "offload_params", "prefetch", "reshard_after_forward"),
    ("tokens_per_rank", "peak_tflops", "mfu"),
    ("link_gbytes", "intra_gbytes"),
    ("gpu_memory_bytes", "host_memory_bytes"),
)
_SPECS = {i.name: i.spec for i in budget.INPUTS}


def _control(name: str, value) -> W.Widget:
    """The widget `CONTROLS` names for the input `name`, starting at `value`."""
    widget, label, settings = CONTROLS[name]
    if widget == "log":
        return log_slider(value, description=label, **settings)
    if widget == "slider":
        return W.FloatSlider(value=value, description=label, **settings)
    if widget == "checkbox":
        return W.Checkbox(value=value, description=label)
    if widget == "ranks":
        return W.SelectionSlider(
            options=sorted(set(RANK_CHOICES) | {int(value)}), value=int(value), description=label
        )
    if widget == "bytes":  # a dropdown of sizes, labelled in GB, holding bytes (the caller's size added)
        sizes = sorted(set(settings["options"]) | {int(value)})
        return W.Dropdown(
            options=[(budget.format_bytes(b), b) for b in sizes], value=int(value), description=label
        )
    settings = {"options": _SPECS[name].choices, **settings}
    if value is None:  # an input whose default is "none given" (group_size) starts on the first option
        value = settings["options"][0]
    kind = W.Dropdown if widget == "dropdown" else W.ToggleButtons
    return kind(value=value, description=label, **settings)


class BudgetCalculator:
    """Controls for the inputs of `plan()` (`CONTROLS`), a figure (memory bars + time bars) and a numbers table.

    `controls` maps each `plan()` argument name to its widget; `result` is the latest `plan()` result;
    `widget` is the whole layout. A combination `plan()` refuses (say offload of params under ddp) shows its
    one-sentence error instead of a figure and keeps the last good result.
    """

    def __init__(
        self,
        params: float = 30e9,
        world_size: int = 256,
        strategy: str = budget.DEFAULTS["strategy"],
        **options,
    ):
        start = {
            **budget.DEFAULTS,
            **options,
            "params": params,
            "world_size": world_size,
            "strategy": strategy,
        }
        c = {name: _control(name, start[name]) for name in CONTROLS}
        self.controls = c
        self._fixed = {k: v for k, v in options.items() if k not in c}  # options without a control (e.g. qwz)
        self._set_group_choices(options.get("group_size") or min(c["gpus_per_node"].value, int(world_size)))
        self.image = W.Image(format="png", layout=W.Layout(max_width="760px", object_fit="contain"))
        self.table = W.HTML()
        self.error = W.HTML()
        self.fit = W.HTML()  # the fewest ranks that fit, for the inputs other than the ranks
        self.result: dict | None = None
        self.widget = W.VBox(
            [W.HBox([c[name] for name in row]) if len(row) > 1 else c[row[0]] for row in ROWS]
            + [
                self.error,
                self.fit,
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
        if values["strategy"] != HSDP:
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
        self.fit.value = html.escape(self._fewest_ranks(result["params"], result["strategy"], opts))

    @staticmethod
    def _fewest_ranks(params: int, strategy: str, options: dict) -> str:
        """One line: the fewest ranks at which these inputs fit (budget.fewest_ranks), or why none do."""
        search = budget.fewest_ranks(params, strategy, **options)
        return f"Fewest ranks that fit: {search['reason']}"

    def static_html(self) -> str:
        """The current figure and table as one self-contained HTML fragment (no widgets needed)."""
        png = base64.b64encode(self.image.value).decode("ascii")
        return (
            f'<div style="display:flex;gap:16px;align-items:flex-start"><img src="data:image/png;base64,{png}" '
            f'style="max-width:760px"/>{self.table.value}</div><p>{self.fit.value}</p>'
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
    params: float = 30e9,
    world_size: int = 256,
    strategy: str = budget.DEFAULTS["strategy"],
    *,
    static: bool = False,
    **options,
):
    """A calculator over `plan()` starting from these arguments (any `plan()` option may be given).

    Displays live controls where a front end renders widgets, and a static figure + table otherwise;
    `static=True` returns only the static view (for slides and executed reports).
    """
    calc = BudgetCalculator(params, world_size, strategy, **options)
    return StaticBudget(calc) if static else calc
