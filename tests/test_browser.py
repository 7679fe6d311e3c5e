"""The lab in a real browser (issue 9): JupyterLab started as `make lab` starts it, in headless Chromium.

1. The budget calculator of notebooks/01_memory.ipynb: open (a copy of the notebook cut after the calculator
   cell, on the `labkit` kernel), run all cells, check what renders, press the right arrow on the ranks
   slider, and check that the table and the figure follow: the table is `labkit.budget.plan`'s for the inputs
   the controls display, the figure is the PNG `labkit.plots` draws for that plan.
2. A deck built by `labkit slides`: stepped through with the keyboard, slide count from the notebook's
   `slideshow` metadata.

Screenshots go to test-artifacts/browser/ (and `failed-<step>.png` of the page when a step fails). Chromium
is Debian's (/usr/bin/chromium, from tests/apt.txt); the test fails, saying how to install it, without it.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import time
from contextlib import ExitStack, contextmanager

import browser_helpers
import pytest
from browser_helpers import (
    INSTALL_HINT,
    KERNEL,
    ROOT,
    STEP_TIMEOUT_MS,
    VENV_BIN,
    artifacts_dir,
    chromium,
    expected_slide_count,
    make_lab_command,
    notebook_copy,
    running_lab,
)

from labkit import budget, plots, widgets
from labkit.cli import main as labkit_main

NOTEBOOK = ROOT / "notebooks" / "01_memory.ipynb"  # the one with the calculator; fast up to it
CALCULATOR_CALL = "budget_calculator("
RUN_TIMEOUT_MS = 120_000  # all cells of the copy, on a loaded machine
VIEWPORT = {"width": 1400, "height": 1600}  # tall enough for the whole calculator output
# The calculator's slider labels -> the `plan()` arguments they set.
SLIDERS = {
    "params": "params",
    "ranks": "world_size",
    "tokens/rank": "tokens_per_rank",
    "peak TFLOP/s": "peak_tflops",
    "MFU": "mfu",
    "NIC GB/s": "link_gbytes",
    "NVLink GB/s": "intra_gbytes",
}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Chromium, started by the first test that opens a page (so that a missing Chromium fails that test
    with its sentence) and closed after the module's last test."""
    for stale in artifacts_dir().glob("failed-*.png"):  # from an earlier run
        stale.unlink()
    with ExitStack() as stack:
        started = []

        def context():
            if not started:
                profile = tmp_path_factory.mktemp("chromium") / "profile"
                started.append(stack.enter_context(chromium(profile, viewport=VIEWPORT)))
            return started[0]

        yield context


@pytest.fixture
def open_page(browser):
    """Opens a page in the shared Chromium; pages are closed after the test."""
    pages = []

    def new_page():
        pages.append(browser().new_page())
        return pages[-1]

    try:
        yield new_page
    finally:
        for page in pages:
            page.close()


@contextmanager
def step(page, name: str):
    """One step of the walk: timed, and on failure named, with a screenshot of the page."""
    start_s = time.perf_counter()
    try:
        yield
    except Exception as e:
        shot = artifacts_dir() / f"failed-{re.sub(r'[^A-Za-z0-9]+', '_', name).strip('_')}.png"
        try:
            page.screenshot(path=str(shot))
        except Exception as shot_error:  # the page may be what broke
            shot = f"none ({shot_error})"
        raise AssertionError(f"browser step {name!r} failed (screenshot: {shot}): {e}") from e
    print(f"{name}: {time.perf_counter() - start_s:.1f} s")


def open_and_run_all(page, base: str, token: str, copy, timeout_ms: int) -> None:
    """Open `copy` in JupyterLab on the `labkit` kernel, wait for it idle, run all cells, wait for them all."""
    specs = page.request.get(f"{base}/api/kernelspecs?token={token}").json()["kernelspecs"]
    assert KERNEL in specs, (
        f"the {KERNEL!r} Jupyter kernel is not registered (found {sorted(specs)}); run `make setup`"
    )
    kernel_name = specs[KERNEL]["spec"]["display_name"]
    with step(page, f"open {copy.name}, kernel idle"):
        page.goto(f"{base}/lab/tree/{copy.name}?token={token}")
        page.wait_for_selector(".jp-Notebook .jp-Cell")
        page.wait_for_function(
            "t => document.querySelector('#jp-main-statusbar')?.innerText.includes(t)",
            arg=f"{kernel_name} | Idle",
            timeout=STEP_TIMEOUT_MS,
        )
    with step(page, f"run all cells of {copy.name}"):
        page.locator(".lm-MenuBar-itemLabel:text-is('Run')").click()
        page.locator(".lm-Menu-itemLabel:text-is('Run All Cells')").click()
        page.wait_for_function(
            """n => { const p = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')];
                      return p.length === n
                             && p.every(e => /^\\[\\d+\\]:$/.test(e.textContent.trim())); }""",
            arg=sum(c["cell_type"] == "code" for c in json.loads(copy.read_text())["cells"]),
            timeout=timeout_ms,
        )


def _table_rows(table) -> list[tuple[str, str, str]]:
    """The calculator's table as `budget.summary_rows` spells it: (section, quantity, value)."""
    cells = table.evaluate("t => [...t.rows].map(r => [...r.cells].map(c => c.innerText.trim()))")
    rows, section = [], None
    for row in cells:
        if len(row) == 1:
            section = row[0]
        else:
            rows.append((section, row[0], row[1]))
    return rows


def _displayed_inputs(widget) -> dict:
    """The `plan()` arguments the calculator's controls display (slider readouts, the active strategy)."""
    shown = {}
    for slider in widget.locator(".widget-slider").all():
        label = slider.locator(".widget-label").inner_text().strip()
        readout = slider.locator(".widget-readout").inner_text().strip()
        shown[SLIDERS[label]] = float(readout)
    shown["world_size"] = int(shown["world_size"])
    shown["strategy"] = widget.locator(".widget-toggle-button.mod-active").inner_text().strip()
    return shown


def _expected_rows(shown: dict) -> list[tuple[str, str, str]]:
    opts = dict(shown)
    return budget.summary_rows(
        budget.plan(opts.pop("params"), opts.pop("world_size"), opts.pop("strategy"), **opts)
    )


def _calculator_arguments(notebook: dict) -> dict:
    """The keyword arguments of the notebook's `budget_calculator(...)` call."""
    source = next("".join(c["source"]) for c in notebook["cells"] if CALCULATOR_CALL in "".join(c["source"]))
    call = next(
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "budget_calculator"
    )
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords}


def _expected_png(shown: dict) -> bytes:
    """The PNG `labkit.plots` draws for plan() of these inputs: what the calculator's figure must show."""
    opts = dict(shown)
    result = budget.plan(opts.pop("params"), opts.pop("world_size"), opts.pop("strategy"), **opts)
    return plots.figure_png(plots.budget_figure(result))


def _shown_png(img) -> bytes:
    """The bytes behind the image element's src (ipywidgets' Image sets a blob: URL of the widget's value)."""
    return bytes(img.evaluate("async i => [...new Uint8Array(await (await fetch(i.src)).arrayBuffer())]"))


def _wait_for_image(img) -> None:
    img.wait_for(state="visible")
    img.page.wait_for_function("i => i.complete && i.naturalWidth > 0", arg=img.element_handle())


def test_calculator_runs_and_follows_its_slider_in_jupyterlab(open_page, tmp_path):
    page = open_page()
    notebook_dir = tmp_path / "notebooks"
    notebook_dir.mkdir()
    copy = notebook_copy(NOTEBOOK, notebook_dir, CALCULATOR_CALL)
    shots = artifacts_dir()
    with running_lab(tmp_path, tmp_path / "lab") as (base, token):  # serves tmp_path/notebooks
        open_and_run_all(page, base, token, copy, RUN_TIMEOUT_MS)

        cells = page.locator(".jp-CodeCell")
        with step(page, "outputs rendered"):
            errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
            assert errors.count() == 0, f"a cell wrote to stderr or raised:\n{errors.first.inner_text()}"
            p = budget.plan(30e9, 256, "ddp")
            total = f"total: {p['state_bytes_per_rank'] / 30e9:g} B/param"
            assert cells.filter(has_text=total).count() == 1, total  # the calculator's first output
            bars = cells.filter(has_text="static state of the whole model")
            for strategy in ("ddp", "zero1", "zero2", "zero3"):
                state = budget.plan(30e9, 256, strategy)["state_bytes_per_rank"]
                assert f"{strategy:>5}: {budget.format_bytes(state)} per rank" in bars.inner_text()
            _wait_for_image(bars.locator(".jp-RenderedImage img"))
            widget = cells.filter(has=page.locator(".widget-slider")).locator(".jp-OutputArea-output")
            figure, table = widget.locator(".widget-image"), widget.locator("table")
            _wait_for_image(figure)
            page.locator(".jp-Notebook").evaluate("nb => nb.scrollTo(0, 0)")
            page.screenshot(path=str(shots / "lab-01_memory-ran.png"))

        with step(page, "the calculator shows plan() of the inputs it displays"):
            before = _displayed_inputs(widget)
            called = _calculator_arguments(json.loads(copy.read_text()))
            assert {k: before[k] for k in called} == called, "the controls do not show the notebook's inputs"
            assert _table_rows(table) == _expected_rows(before)
            box = figure.bounding_box()
            natural = figure.evaluate("i => [i.naturalWidth, i.naturalHeight]")
            assert box["height"] / box["width"] == pytest.approx(natural[1] / natural[0], rel=0.02), (
                "the figure is drawn distorted"
            )
            # Byte for byte: matplotlib's Agg PNG of the same figure is the same bytes in the kernel and here
            # (same venv, fonts and rcParams; the inline backend sets no rcParams), metadata included.
            assert _shown_png(figure) == _expected_png(before), (
                "the figure is not the plan of the inputs shown"
            )
            before_src, before_png = figure.get_attribute("src"), figure.screenshot()
            widget.screenshot(path=str(shots / "calculator-before.png"))

        with step(page, "press the right arrow on the ranks slider"):
            before_text = table.inner_text()
            handle = widget.locator(".widget-slider:has(.widget-label:text-is('ranks')) .noUi-handle")
            handle.focus()
            page.keyboard.press("ArrowRight")
            page.wait_for_function("([t, b]) => t.innerText !== b", arg=[table.element_handle(), before_text])
            _wait_for_image(figure)

        with step(page, "table and figure follow"):
            after = _displayed_inputs(widget)
            next_ranks = widgets.RANK_CHOICES[widgets.RANK_CHOICES.index(before["world_size"]) + 1]
            assert after == {**before, "world_size": next_ranks}
            assert _table_rows(table) == _expected_rows(after)
            state = budget.plan(after["params"], next_ranks, after["strategy"])["state_bytes_per_rank"]
            assert ("memory per rank", "state total", budget.format_bytes(state)) in _table_rows(table)
            assert figure.get_attribute("src") != before_src
            assert figure.screenshot() != before_png, "the figure did not change"
            expected = _expected_png(after)
            assert expected != _expected_png(before), "the two plans draw the same figure: the check is void"
            assert _shown_png(figure) == expected, f"the figure is not the plan of {next_ranks} ranks"
            widget.screenshot(path=str(shots / "calculator-after.png"))
    print(f"screenshots: {shots}/lab-01_memory-ran.png, calculator-before.png, calculator-after.png")


BUILD_ALONG = "02_zero3_from_scratch.ipynb"
# What a learner writes into step 1's build cell of the student copy: a right shard, in their own words.
LEARNERS_SHARD = """def shard(full, rank, n):
    per_rank = (full.shape[0] + n - 1) // n
    piece = torch.zeros((per_rank, *full.shape[1:]), dtype=torch.float32, device=full.device)
    real = full[rank * per_rank : (rank + 1) * per_rank]
    piece[: len(real)] = real
    return piece
"""


def test_the_student_copy_of_the_build_along_says_write_this_piece_then_passes_the_learners_shard(
    open_page, tmp_path, monkeypatch
):
    """02 of `labkit release --student` in JupyterLab, with the release's own labkit: Run All goes through the
    stubs (each check says "write this piece"); a shard the learner types into step 1's build cell then
    passes step 1's check."""
    page = open_page()
    release = tmp_path / "student"
    assert labkit_main(["release", "--student", str(release)]) == 0
    copy = release / "notebooks" / BUILD_ALONG
    nb = json.loads(copy.read_text())
    nb["metadata"]["kernelspec"] = {"name": KERNEL, "display_name": KERNEL, "language": "python"}
    copy.write_text(json.dumps(nb, indent=1))
    monkeypatch.setenv("PYTHONPATH", str(release))  # the kernel imports the release's labkit
    sources = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    check_cells = [i for i, src in enumerate(sources) if re.search(r"^\w+_check = checks\.check_", src, re.M)]
    assert len(check_cells) == 6, "02 should have one check per build step"
    stub = next(i for i, src in enumerate(sources) if 'write_this_piece("shard"' in src)
    assert "-(-full.shape[0] // n)" not in "".join(sources)  # the filled answer is not in the student copy
    shots = artifacts_dir()
    with running_lab(release, tmp_path / "lab") as (base, token):
        open_and_run_all(page, base, token, copy, 4 * RUN_TIMEOUT_MS)
        cells = page.locator(".jp-CodeCell")
        with step(page, "every step's check says write this piece"):
            for i in check_cells:  # JupyterLab renders only the cells near the view: scroll to each
                cells.nth(i).scroll_into_view_if_needed()
                output = cells.nth(i).locator(".jp-OutputArea")
                page.wait_for_function(  # laid out once in view: its text appears then
                    "e => /[✓✗]/.test(e.innerText)", arg=output.element_handle(), timeout=STEP_TIMEOUT_MS
                )
                text = output.inner_text()
                assert text.lstrip().startswith("✗") and "write this piece: " in text, f"cell {i}: {text}"
            page.screenshot(path=str(shots / "lab-02_student-copy-ran.png"))
        with step(page, "the learner writes shard and runs its check"):
            cells.nth(stub).scroll_into_view_if_needed()
            editor = cells.nth(stub).locator(".cm-content")
            editor.click()
            page.keyboard.press("Control+A")
            page.keyboard.insert_text(LEARNERS_SHARD)
            page.keyboard.press("Shift+Enter")  # defines shard and moves to the check cell
            page.keyboard.press("Shift+Enter")  # runs the check
            verdict = cells.nth(check_cells[0]).locator(".jp-OutputArea")
            page.wait_for_function(
                "e => e.innerText.includes('✓')", arg=verdict.element_handle(), timeout=RUN_TIMEOUT_MS
            )
            text = verdict.inner_text()
            assert "write this piece" not in text, text[:400]
            cells.nth(check_cells[0]).screenshot(path=str(shots / "lab-02_learners-shard-passes.png"))


def _leaf_slides(page) -> int:
    return page.evaluate("document.querySelectorAll('.reveal .slides section:not(:has(section))').length")


def _current_slide(page) -> int:
    """The index of the slide on screen among the deck's leaf slides (document order)."""
    return page.evaluate(
        """() => { const leaves = [...document.querySelectorAll(
                       '.reveal .slides section:not(:has(section))')];
                   return leaves.findIndex(s => s.classList.contains('present')); }"""
    )


def test_slide_decks_step_through_with_the_keyboard(open_page, tmp_path):
    page = open_page()
    out = tmp_path / "slides"
    with step(page, "labkit slides"):
        built = subprocess.run(
            [str(VENV_BIN / "labkit"), "slides", "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert built.returncode == 0, built.stderr
    notebooks = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    with step(page, "every deck has the slides its notebook's metadata says"):
        for nb_path in notebooks:
            deck = out / f"{nb_path.stem}.slides.html"
            page.goto(deck.as_uri())
            page.wait_for_selector(".reveal.ready")
            expected = expected_slide_count(json.loads(nb_path.read_text()))
            assert _leaf_slides(page) == expected, (
                f"{deck.name}: {_leaf_slides(page)} slides, metadata says {expected}"
            )

    expected = expected_slide_count(json.loads(NOTEBOOK.read_text()))
    with step(page, f"step through {NOTEBOOK.stem} with the space bar"):
        page.goto((out / f"{NOTEBOOK.stem}.slides.html").as_uri())
        page.wait_for_selector(".reveal.ready")
        assert _current_slide(page) == 0
        page.screenshot(
            path=str(artifacts_dir() / f"slides-{NOTEBOOK.stem}-first.png"), animations="disabled"
        )
        seen = [0]
        for _ in range(expected + 2):  # two presses more than needed: the last must stay put
            page.keyboard.press("Space")
            seen.append(_current_slide(page))
        visited = sorted(set(seen))
        assert visited == list(range(expected)), f"visited slides {seen}; the metadata says {expected}"
        assert seen[-1] == seen[-2] == expected - 1, f"the space bar did not stop on the last slide: {seen}"
        page.screenshot(path=str(artifacts_dir() / f"slides-{NOTEBOOK.stem}-last.png"), animations="disabled")
    print(f"screenshots: {artifacts_dir()}/slides-{NOTEBOOK.stem}-first.png, slides-{NOTEBOOK.stem}-last.png")


def test_lab_command_is_the_makefiles_own():
    argv = make_lab_command(
        8123, ["--no-browser", "--IdentityProvider.token=a b", "--ServerApp.ip=127.0.0.1"]
    )
    recipe = next(
        ln
        for ln in (ROOT / "Makefile").read_text().splitlines()
        if ln.startswith("\t") and "jupyter lab" in ln
    )
    assert recipe == "\t$(VENV)/bin/jupyter lab --notebook-dir notebooks --port $(PORT) $(ROOT) $(ARGS)", (
        "the Makefile's lab recipe changed: check what running_lab expects of it"
    )
    root = ["--allow-root"] if os.geteuid() == 0 else []
    assert argv == [
        str(ROOT / ".venv" / "bin" / "jupyter"),
        "lab",
        "--notebook-dir",
        "notebooks",
        "--port",
        "8123",
        *root,
        "--no-browser",
        "--IdentityProvider.token=a b",
        "--ServerApp.ip=127.0.0.1",
    ]


def test_a_missing_chromium_fails_with_the_command_that_installs_it(monkeypatch, tmp_path):
    monkeypatch.setattr(browser_helpers, "CHROMIUM", tmp_path / "chromium")
    with pytest.raises(pytest.fail.Exception, match=re.escape(INSTALL_HINT)):
        browser_helpers.require_chromium()


def test_expected_slide_count_follows_nbconvert_rules():
    def cell(slide_type=None, tags=()):
        meta = {"tags": list(tags)}
        if slide_type:
            meta["slideshow"] = {"slide_type": slide_type}
        return {"cell_type": "markdown", "metadata": meta, "source": ""}

    nb = {
        "cells": [
            cell("skip"),  # hidden: the next visible cell starts the deck, whatever its type
            cell("-"),
            cell("subslide"),
            cell("notes"),
            cell("fragment"),
            cell("slide"),
            cell("subslide", tags=["notebook-only"]),  # dropped with its slide
            cell(),
        ]
    }
    assert expected_slide_count(nb) == 3
