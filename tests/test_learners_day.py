"""Issue 43, "the learner's day": what a student met running the course, each fixed where it happens.

A headless run is told how to predict (`value=`); 07 asks which engine keeps more before its table, not a sum of
the numbers above; each notebook's "runs in" line is the course benchmark's figure; the student copy's cheat
sheets carry their figures; DeepSpeed's WARNING and INFO lines stay out of a cell, its errors do not; a build cell
goes back to its stub in one call; 08's roofline labels do not overlap.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit import release, slides
from labkit.buildalong import cells
from labkit.rank_output import shown_in_cell

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
COURSE = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def _cells(path: Path) -> list:
    return nbformat.read(path, as_version=4).cells


def _flat(text: str) -> str:
    """Prose with its line breaks and runs of spaces made one space (Markdown reads them so)."""
    return " ".join(text.split())


def _predicts(path: Path) -> list[int]:
    return [i for i, c in enumerate(_cells(path)) if "predict" in c.metadata.get("tags", [])]


# ------------------------------------------------------------------------------------------ predict headless


def test_the_first_notebook_that_predicts_says_how_a_headless_run_gives_its_prediction():
    """Said once, before the first `predict` cell of the course: a run nobody types into passes `value=`."""
    first = next(p for p in COURSE if _predicts(p))
    before = _cells(first)[: _predicts(first)[0]]
    said = [_flat(c.source) for c in before if c.cell_type == "markdown" and "value=X" in c.source]
    assert len(said) == 1 and "papermill" in said[0] and "slides --execute" in said[0], first.name
    later = [
        p.name
        for p in COURSE
        if p != first
        for c in _cells(p)
        if c.cell_type == "markdown" and "value=X" in c.source
    ]
    assert later == []


def test_a_prediction_given_in_the_call_is_revealed_where_nobody_typed(capsys):
    from labkit.predict import predict

    predict("Bytes one rank sends", "B", value=1536).reveal(1536)
    assert "You predicted 1,536 B: right" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ 07's prediction


def test_07_asks_which_engine_keeps_more_before_any_figure_of_the_run_is_printed():
    """07 predicts a direction the course taught (01's table itemised DeepSpeed's extra state), not the ratio of
    the numbers printed above; the formula and its terms come after the reveal."""
    nb = _cells(NOTEBOOKS / "07_head_to_head.ipynb")
    ask = next(i for i, c in enumerate(nb) if "state_guess = predict(" in c.source)
    assert "choices=(" in nb[ask].source and "DeepSpeed" in nb[ask].source
    heading = max(i for i in range(ask) if nb[i].cell_type == "markdown")
    assert not [c.source for c in nb[heading:ask] if c.cell_type == "code" and "print(" in c.source]
    assert "20 B x P/n" not in _flat(nb[heading].source)  # the formula is the answer's reason, shown after it
    shown = next(i for i, c in enumerate(nb) if "state_guess.reveal(" in c.source)
    formula = next(
        i for i, c in enumerate(nb) if c.cell_type == "markdown" and "20 B x P/n" in _flat(c.source)
    )
    assert ask < shown < formula


# ------------------------------------------------------------------------------------------ runs in


def test_each_runs_in_line_is_the_course_benchmarks_figure():
    run, seconds = slides.course_benchmark()
    assert run and seconds, "benchmarks/results.md has a course section"
    lines = 0
    for path in COURSE:
        nb = _cells(path)
        runs_in = [c for c in nb if 'runs_in("' in c.source]
        if not runs_in:
            continue
        lines += 1
        assert runs_in[0].source.endswith(f'print(runs_in("{path.stem}"))'), path.name
        assert "course benchmark" in _flat(nb[0].source), path.name
        assert not re.search(r"(?i)\bminute", nb[0].source), path.name
        if path.name in seconds:
            assert f"Runs in about {seconds[path.name]} s" in slides.runs_in(path.stem)
            assert run in slides.runs_in(path.stem)
    assert lines >= 4


def test_the_benchmarks_course_section_is_read_and_run_time_prefers_a_measurement():
    text = (
        "# Benchmarks (2031-01-02, aarch64, 8 threads)\n\n## Step time\n\n- a.ipynb: 1 s\n\n"
        "## The course, end to end (papermill)\n\n- 00_x.ipynb: 7 s\n- 01_y.ipynb: 123 s\n- total 130 s\n\n## Next\n"
    )
    assert slides.benchmark_run_times(text) == (
        "2031-01-02 on aarch64, 8 threads",
        {"00_x.ipynb": 7, "01_y.ipynb": 123},
    )
    assert slides.benchmark_run_times(text.replace("The course, end", "Another")) == ("", {})
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("**How long.** About a minute.")])
    assert slides.run_time_of(nb, benchmarked_s=7) == ("7 s", slides.BENCHMARKED)
    assert slides.run_time_of(nb, executed_s=9, benchmarked_s=7) == ("9 s", slides.MEASURED_HERE)


# ------------------------------------------------------------------------------------------ the student release


@pytest.fixture
def student(student_release: Path) -> Path:
    """The session's one student release (tests/conftest.py)."""
    return student_release


def test_the_releases_cheat_sheets_hold_no_placeholder_and_say_where_the_figure_is(student: Path):
    sheets = sorted((student / "docs" / "cheatsheets").glob("[0-9][0-9]_*.md"))
    assert len(sheets) >= 9
    for sheet in sheets:
        text = sheet.read_text()
        assert "{{" not in text and "<!-- figure" not in text, sheet.name
        assert release.UNRUN_FIGURE in text, sheet.name


def test_the_release_fills_a_sheet_from_an_executed_notebook(tmp_path: Path):
    """The same filler as `labkit slides`: the line the executed notebook printed, found by the sheet's pattern."""
    sheets = tmp_path / "sheets"
    shutil.copytree(ROOT / "docs" / "cheatsheets", sheets)
    executed = tmp_path / "executed"
    executed.mkdir()
    nb = nbformat.read(NOTEBOOKS / "00_start_here.ipynb", as_version=4)
    printed = "full size      1 GB: all-gather 750 MB, reduce-scatter 750 MB, all-reduce 1.5 GB per rank"
    [printing] = [c for c in nb.cells if c.get("id") == "effafaaa"]  # What crossed the wire
    printing.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"{printed}\n")]
    nbformat.write(nb, executed / "00_start_here.ipynb")
    release.fill_cheatsheets(sheets, NOTEBOOKS, executed)
    assert f"`{' '.join(printed.split())}` (this run's output)" in (sheets / "00_start_here.md").read_text()
    assert release.UNRUN_FIGURE in (sheets / "01_memory.md").read_text()  # no executed copy of 01
    assert "{{" not in "".join(p.read_text() for p in sheets.glob("[0-9][0-9]_*.md"))


def test_the_release_carries_the_course_times_its_runs_in_lines_read(student: Path, monkeypatch):
    _, seconds = slides.course_benchmark()
    monkeypatch.setenv("LABKIT_COURSE", str(student))
    assert not (student / "benchmarks").exists()
    assert slides.course_benchmark()[1] == seconds
    assert f"Runs in about {seconds['00_start_here.ipynb']} s" in slides.runs_in("00_start_here")


# ------------------------------------------------------------------------------------------ DeepSpeed's chatter

RECORDED = {  # lines a rank printed, and whether a cell shows them
    "[2026-12-07 05:07:04,467] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.\n": False,
    "[2026-12-07 05:07:05,001] [INFO] [config.py:1003:print] DeepSpeedEngine configuration:\n": False,
    "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully\n": False,
    "[2026-12-07 05:07:05,002] [ERROR] [engine.py:12:step] the optimizer state could not be loaded\n": True,
    "Traceback (most recent call last):\n": True,
    "RuntimeError: a rank's own error\n": True,
    "step 1 loss 5.03 [WARNING] in my own words\n": True,
}


@pytest.mark.parametrize(("line", "shown"), RECORDED.items())
def test_a_cell_shows_every_rank_line_but_deepspeeds_chatter(line, shown):
    assert shown_in_cell(line) is shown


def test_importing_deepspeed_after_labkit_prints_its_errors_only():
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # DeepSpeed then says what it picked
    code = (
        "import labkit, deepspeed\nfrom deepspeed.utils import logger\n"
        "logger.warning('chatter'); logger.info('chatter'); logger.error('a real error')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "a real error" in done.stdout and "[ERROR]" in done.stdout
    assert "chatter" not in done.stdout and "[WARNING]" not in done.stdout, done.stdout


@pytest.mark.slow
def test_a_real_deepspeed_run_keeps_its_chatter_out_of_the_output(capfd):
    from labkit.engines.base import RunConfig
    from labkit.engines.loop import run

    record = run("deepspeed", RunConfig(world_size=2, steps=1))
    out = capfd.readouterr().out
    assert record["losses"], record
    assert "built successfully" not in out and "[WARNING]" not in out and "[INFO]" not in out, out


def _warns_errs_and_raises():
    from deepspeed.utils import logger

    logger.warning("chatter from DeepSpeed")
    logger.error("DeepSpeed's own error")
    print("the rank's own line", flush=True)
    raise RuntimeError("the rank's own failure")


@pytest.mark.slow
def test_a_failing_rank_still_shows_deepspeeds_errors_and_its_own(capfd):
    import labkit

    with pytest.raises(labkit.LaunchError, match="the rank's own failure"):
        labkit.launch(_warns_errs_and_raises, 2)
    out = capfd.readouterr().out
    assert "DeepSpeed's own error" in out and "the rank's own line" in out, out
    assert "chatter from DeepSpeed" not in out, out


# ------------------------------------------------------------------------------------------ reset a build cell


@pytest.fixture
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    yield InteractiveShell.instance()
    InteractiveShell.clear_instance()


def _stub(notebook: str, name: str) -> str:
    for cell in _cells(NOTEBOOKS / notebook):
        stub = cell.get("metadata", {}).get("labkit", {}).get("stub", "")
        if "build" in cell.metadata.get("tags", []) and f"def {name}(" in stub:
            return stub.rstrip("\n")
    raise AssertionError(name)


def test_the_call_02_names_puts_the_cell_back_to_its_stub(shell, monkeypatch, capsys):
    monkeypatch.delenv(cells.SESSION_ENV, raising=False)
    said = next(c.source for c in _cells(NOTEBOOKS / "02_zero3_from_scratch.ipynb") if "reset(" in c.source)
    call = re.search(r"`(from labkit\.buildalong\.cells import reset; reset\(\"shard\"\))`", said)
    assert call, said
    replaced = []  # what the front end is asked to put in the cell (ipykernel sends it as a payload)
    monkeypatch.setattr(shell, "set_next_input", lambda text, replace=False: replaced.append((text, replace)))
    shell.run_cell(call[1])
    assert replaced == [(_stub("02_zero3_from_scratch.ipynb", "shard"), True)]
    out = capsys.readouterr().out
    assert "now holds the stub of `shard`" in out and "Out[" not in out  # nothing more under the cell
    ns = cells.notebook_namespace()  # the filled pieces; the stub, run, puts shard back to unwritten
    exec(replaced[0][0], ns)  # noqa: S102 (the course's own stub)
    assert cells.unwritten_pieces(
        cells.Pieces(**{n: ns.get(n) for n in cells.Pieces.__dataclass_fields__})
    ) == ["shard"]


def test_reset_picks_the_open_notebook_where_two_define_a_piece_and_refuses_in_a_sentence(
    monkeypatch, capsys
):
    monkeypatch.delenv(cells.SESSION_ENV, raising=False)
    with pytest.raises(
        ValueError,
        match=r"'before_forward' is a build cell of more than one notebook: pass notebook=\"02\" or \"03\"",
    ):
        cells.reset("before_forward")
    assert cells.stub_of("before_forward", "03") == _stub("03_prefetch_overlap.ipynb", "before_forward")
    opened = "course/notebooks/03_prefetch_overlap.ipynb"
    in_03 = cells.stub_of("before_forward", open_notebook=opened)
    assert in_03 == _stub("03_prefetch_overlap.ipynb", "before_forward")
    assert cells.stub_of("shard", open_notebook=opened) == _stub("02_zero3_from_scratch.ipynb", "shard")
    with pytest.raises(ValueError, match="no build cell defines 'shrad'; the pieces are shard, gather"):
        cells.reset("shrad")
    monkeypatch.setenv(cells.SESSION_ENV, opened)
    cells.reset("before_forward")  # no notebook front end here: the stub is printed, to paste
    out = capsys.readouterr().out
    assert out.startswith(in_03) and "paste it over your build cell" in out


# ------------------------------------------------------------------------------------------ 08's roofline


@pytest.mark.parametrize(
    "tokens",
    [
        [192, 384, 576, 768, 1152, 1536, 2304, 3072],  # 08's sweep: tiny on 2 ranks
        [24, 48, 96, 192, 384, 768, 1536, 3072, 6144, 12288, 24576],  # a sweep widened both ways
        [96, 98304],
    ],
)
def test_the_rooflines_labels_do_not_overlap(tokens):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from labkit import plots
    from labkit.measured import Measured

    rows = [
        {
            "tokens_per_rank": t,
            "compute": Measured.of([1e-5 * t, 1.1e-5 * t, 1.2e-5 * t]),
            "exposed": Measured.of([0.01, 0.012, 0.011]),
            "link_s": 0.02,
        }
        for t in tokens
    ]
    knee = tokens[len(tokens) // 2]
    fig = plots.roofline(
        rows,
        {"tokens_per_rank": knee, "floor_s": 0.005, "slope_s_per_token": 1e-6},
        {"tokens_per_rank": 1.1 * knee, "low_tokens_per_rank": 0.9 * knee},
    )
    FigureCanvasAgg(fig)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    ticks = [t for t in ax.get_xticklabels(which="both") if t.get_text() and x0 <= t.get_position()[0] <= x1]
    ticks += [t for t in ax.get_yticklabels(which="both") if t.get_text() and y0 <= t.get_position()[1] <= y1]
    labels = [*ticks, ax.xaxis.label, ax.yaxis.label, ax.title]
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in labels]
    overlapping = [
        (a, b) for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2) if box_a.overlaps(box_b)
    ]
    assert len([t for t in ticks if t in ax.get_xticklabels(which="both")]) >= 2
    assert overlapping == []


def test_a_rank_moves_inherited_log_handlers_even_off_a_closed_stream():
    """A handler made in the parent may write to a stream closed since (an earlier test's capture): the rank
    points it at its own streams without touching the old one (a flush there raised, and rank 0 exited)."""
    import io
    import logging
    import os

    from labkit.rank_output import follow_streams

    closed = open(os.devnull, "w")  # noqa: SIM115 (closed at once: the stream a finished capture leaves)
    closed.close()
    old_err, out, err = io.StringIO(), io.StringIO(), io.StringIO()
    logger = logging.getLogger("labkit-test-closed-stream")
    handlers = [logging.StreamHandler(closed), logging.StreamHandler(old_err)]
    for handler in handlers:
        logger.addHandler(handler)
    try:
        follow_streams(out, err, {id(old_err)})
        assert [h.stream for h in handlers] == [out, err]
    finally:
        for handler in handlers:
            logger.removeHandler(handler)
