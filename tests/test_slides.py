"""`labkit slides`: a reveal.js deck per course notebook, made for a room (labkit/slides.py).

The decks' structure against the cells' `slideshow` metadata, what a room sees of a cell (no plumbing, code only
where tagged, prose split into a lead and speaker notes), the index page (Markdown rendered, one run-time status
per row), links that resolve from the decks' folder wherever it is moved (the exercises copied beside the decks),
and the cheat sheets. The decks in a
real browser, built from the session's executed notebooks: tests/test_slides_browser.py.
"""

from __future__ import annotations

import html
import re
import shutil
import struct
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from labkit import slides

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
ALL = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def _cell(make, text, kind="-", tags=(), outputs=None):
    c = make(text)
    c.metadata = {"slideshow": {"slide_type": kind}, "tags": list(tags)}
    if outputs is not None:
        c.outputs = outputs
    return c


def _stdout(text):
    return new_output("stream", name="stdout", text=text)


def _expected_sections(nb: nbformat.NotebookNode) -> tuple[int, int]:
    """(slides, subslides) a deck of `nb` should have: the first shown cell opens a slide, then every
    `slide` cell opens one and every `subslide` cell a vertical one; `notebook-only` cells are dropped."""
    tops = subslides = 0
    for cell in nb.cells:
        if "notebook-only" in cell.metadata.get("tags", []):
            continue
        kind = cell.metadata.get("slideshow", {}).get("slide_type", "-")
        if kind == "skip":
            continue
        if tops == 0 or kind == "slide":
            tops += 1
            subslides += 1
        elif kind == "subslide":
            subslides += 1
    return tops, subslides


def _count_sections(deck: str) -> tuple[int, int]:
    """(top-level, innermost) <section>s of a reveal deck: reveal nests a slide's vertical subslides."""
    depth, top, inner = 0, 0, 0
    for tag in re.findall(r"<(/?)section\b", deck):
        if tag == "":
            depth += 1
            top += depth == 1
            inner += depth == 2
        else:
            depth -= 1
    return top, inner


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """`labkit slides` over the committed notebooks (no execution), its folder then moved elsewhere: whatever
    works there works wherever an instructor copies it."""
    from labkit.cli import main

    out = tmp_path_factory.mktemp("slides") / "out"
    assert main(["slides", "--out", str(out)]) == 0
    moved = tmp_path_factory.mktemp("elsewhere") / "decks"
    shutil.move(out, moved)
    return moved


def _rows(index: str) -> dict[str, list[str]]:
    """The index's table: {deck file: [its cells' inner HTML]}."""
    rows = {}
    for row in re.findall(r"<tr>(.*?)</tr>", index, re.S):
        cells = re.findall(r"<td>(.*?)</td>", row, re.S)
        if cells:
            rows[re.search(r'href="([^"]+\.slides\.html)"', cells[0])[1]] = cells
    return rows


def test_slides_build_one_deck_per_notebook_offline(built):
    decks = sorted(p.name for p in built.glob("*.slides.html"))
    assert decks == [n.replace(".ipynb", ".slides.html") for n in ALL]
    index = (built / "index.html").read_text()
    rows = _rows(index)
    assert sorted(rows) == decks
    benchmarked = slides.course_benchmark()[1]
    for (
        name
    ) in ALL:  # no outputs, no papermill record: the course benchmark's time, else the notebook's sentence
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        _, run_time, source, sheet = rows[name.replace(".ipynb", ".slides.html")]
        if name in benchmarked:
            assert (source, run_time) == (slides.BENCHMARKED, f"{benchmarked[name]} s"), name
        else:
            stated = " ".join(slides.STATED_RUN_TIME.search(nb.cells[0].source)["text"].split())
            assert source == slides.STATED and run_time and stated.startswith(html.unescape(run_time))
        assert name.replace(".ipynb", ".cheatsheet.html") in sheet
    assert (built / "reveal.js" / "dist" / "reveal.js").is_file() and (built / "require.js").is_file()
    for deck in decks:
        text = (built / deck).read_text()
        remote = re.findall(r"""(?:src|href)=["'](https?:[^"']+)""", text) + re.findall(
            r"""require\(\s*\{[^}]*\}\s*,\s*\[\s*"(https?:[^"]+)""", text
        )
        assert not remote, f"{deck} would fetch {remote[:3]} at view time"


def test_the_index_shows_no_raw_markup_and_one_status_per_row(built):
    rows = _rows((built / "index.html").read_text())
    for deck, (title, run_time, source, _) in rows.items():
        for cell in (title, run_time):
            text = re.sub(r"<[^>]+>", "", cell)
            assert not re.search(r"`|\*\*|\[[^\]]*\]\(", text), f"{deck}: raw Markdown in {cell!r}"
        assert source in slides.RUN_TIME_SOURCES, deck
        assert not re.search(r"measured|stated", run_time), f"{deck}: a second status in {run_time!r}"


class _Links(HTMLParser):
    """Every href and src of an HTML page."""

    def __init__(self):
        super().__init__()
        self.targets: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.targets += [value for name, value in attrs if name in ("href", "src") and value]


def test_every_relative_link_of_the_decks_index_and_sheets_resolves_inside_their_folder(built):
    pages = sorted(built.glob("*.html"))
    assert len(pages) == 2 * len(ALL) + 1  # the decks, the cheat sheets, the index
    checked = 0
    for page in pages:
        parser = _Links()
        parser.feed(page.read_text())
        for target in parser.targets:
            if re.match(
                r"^[A-Za-z][A-Za-z0-9+.-]*:|#", target
            ):  # a URL (remote ones are refused above), an anchor
                continue
            path = (built / unquote(target.split("#", 1)[0])).resolve()
            assert path.is_file() and path.is_relative_to(built.resolve()), (
                f"{page.name}: {target} does not resolve"
            )
            checked += 1
    assert checked > 3 * len(ALL)


@pytest.mark.parametrize("name", ALL)
def test_each_deck_links_its_exercises_beside_it(built, name):
    """The notebooks' `../exercises/NN.ipynb` links point at copies in the decks' folder, exercise for exercise."""
    linked = set(re.findall(r"\]\(\.\./exercises/([^)#\s]+)", (NOTEBOOKS / name).read_text()))
    deck = (built / name.replace(".ipynb", ".slides.html")).read_text()
    assert set(re.findall(r'href="exercises/([^"#]+)"', deck)) == linked
    for exercise in linked:
        assert (built / "exercises" / exercise).read_bytes() == (ROOT / "exercises" / exercise).read_bytes()


def test_a_link_to_a_missing_file_keeps_its_text_and_says_so(tmp_path):
    nb = new_notebook(
        cells=[
            new_markdown_cell(
                "See [the exercise](../exercises/01.ipynb#part-2), ![a figure](img/none.png), "
                "[the docs](https://example.org/x) and [below](#below)."
            )
        ]
    )
    for folder in ("notebooks", "exercises"):
        (tmp_path / "course" / folder).mkdir(parents=True)
    (tmp_path / "course" / "exercises" / "01.ipynb").write_text("{}")
    said = []
    out = slides.portable_links(nb, [tmp_path / "course" / "notebooks"], tmp_path / "out", log=said.append)
    assert out.cells[0].source == (
        "See [the exercise](exercises/01.ipynb#part-2), a figure, [the docs](https://example.org/x) and [below](#below)."
    )
    assert (tmp_path / "out" / "exercises" / "01.ipynb").read_text() == "{}"
    assert len(said) == 1 and "img/none.png" in said[0]
    assert "../exercises" in nb.cells[0].source  # the notebook given is left as it was


def test_slides_count_matches_cell_metadata(tmp_path):
    name = "03_prefetch_overlap.ipynb"  # has a notebook-only cell to drop
    work = tmp_path / "nbs"
    work.mkdir()
    (work / name).write_bytes((NOTEBOOKS / name).read_bytes())
    (deck,) = slides.build(tmp_path / "out", work, log=lambda *_: None)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    assert _count_sections(deck.read_text()) == _expected_sections(nb)
    assert "interact_manual" not in deck.read_text()  # the notebook-only widget cell is gone


def test_slides_cli_rejects_a_missing_folder(tmp_path, capsys):
    from labkit.cli import main

    assert main(["slides", "--out", str(tmp_path), "--notebooks", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--notebooks" in err[0]


def test_slides_show_a_widgets_static_fallback():
    cell = nbformat.v4.new_code_cell("calculator", metadata={"slideshow": {"slide_type": "slide"}})
    png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="
    cell.outputs = [
        nbformat.v4.new_output(
            "display_data",
            data={
                "application/vnd.jupyter.widget-view+json": {"model_id": "x"},
                "image/png": png,
                "text/plain": "c",
            },
        )
    ]
    deck = slides.slides_html(nbformat.v4.new_notebook(cells=[cell]))
    assert "widget-view" not in deck and f"data:image/png;base64,{png}" in deck


@pytest.mark.parametrize("name", ALL)
def test_cheat_sheet_finds_its_figure_in_the_executed_notebook(executed, name):
    """Each docs/cheatsheets/NN_name.md quotes a line its notebook prints: the line must still be printed."""
    source = (slides.default_cheatsheets_dir() / name.replace(".ipynb", ".md")).read_text()
    printed = slides.figure_line(source, executed(name))
    assert printed is not None, f"{name} no longer prints the line its cheat sheet quotes"


def test_a_dropped_cell_before_a_slide_opens_no_slide_of_its_own():
    nb = new_notebook(
        cells=[
            _cell(new_markdown_cell, "# one", "slide"),
            _cell(new_code_cell, "x = 1", "-"),
            _cell(new_code_cell, "slider()", "subslide", ["notebook-only"]),
            _cell(new_markdown_cell, "# two", "slide"),
        ]
    )
    assert _expected_sections(nb) == (2, 2)
    assert _count_sections(slides.slides_html(nb)) == (2, 2)


# ------------------------------------------------------------------------------------------ for a room


def test_prose_keeps_the_headline_and_lead_and_puts_the_rest_in_the_notes():
    source = (
        "## How many bytes?\nEach rank sends (n-1)/n of the tensor, e.g. three quarters on 4 ranks. The ring\n"
        "passes every chunk once.\n\nA second paragraph for the presenter.\n\n| a | b |\n|---|---|\n| 1 | 2 |"
    )
    shown, notes = slides.split_prose(source)
    assert shown == (
        "## How many bytes?\n\nEach rank sends (n-1)/n of the tensor, e.g. three quarters on 4 ranks.\n\n"
        "| a | b |\n|---|---|\n| 1 | 2 |"
    )
    assert notes == (
        "Each rank sends (n-1)/n of the tensor, e.g. three quarters on 4 ranks. The ring\npasses every chunk once."
        "\n\nA second paragraph for the presenter."
    )


def test_a_bold_label_keeps_its_sentence_and_callouts_stay_on_the_slide():
    source = (
        "**What you will see.** Ranks from a cell. **How long.** Seconds.\n\nMore prose here.\n\n"
        "**Remember:** one sentence to keep. And a detail.\n\n**Exercise:** [02](../exercises/02.ipynb)."
    )
    shown, notes = slides.split_prose(source)
    assert shown.split("\n\n") == [
        "**What you will see.** Ranks from a cell.",
        "**Remember:** one sentence to keep.",
        "**Exercise:** [02](../exercises/02.ipynb).",
    ]
    assert notes.split("\n\n") == [
        "**What you will see.** Ranks from a cell. **How long.** Seconds.",
        "More prose here.",
        "**Remember:** one sentence to keep. And a detail.",
    ]


def test_a_long_lead_is_cut_at_a_clause_outside_any_code_span():
    words = "word " * 40
    sentence = f"Short start, `a, b` then {words}and, finally, the end."
    shown, notes = slides.split_prose(sentence)
    assert shown.endswith(" …") and len(shown) <= slides.LEAD_MAX_CHARS + 2
    assert shown.count("`") % 2 == 0 and sentence.startswith(shown[:-2])
    assert notes == sentence  # the whole sentence is in the notes


def test_a_room_sees_outputs_and_tagged_code_but_no_plumbing():
    nb = new_notebook(
        cells=[
            _cell(new_markdown_cell, "# Title\nThe lead. The rest for the notes.", "slide"),
            _cell(new_code_cell, "world_size = 4", "skip", ["parameters"]),
            _cell(new_code_cell, "hidden_source_1 = 1", outputs=[_stdout("printed-42\n")]),
            _cell(new_code_cell, "import quiet_setup_2", outputs=[]),
            _cell(new_code_cell, "shown_source_3 = 3", tags=[slides.SHOW_CODE_TAG]),
            _cell(
                new_code_cell,
                "noisy_4()",
                outputs=[new_output("stream", name="stderr", text="UserWarning-5\n"), _stdout("kept-6\n")],
            ),
        ]
    )
    deck = slides.slides_html(nb)
    for absent in ("world_size", "hidden_source_1", "quiet_setup_2", "noisy_4", "UserWarning-5"):
        assert absent not in deck, absent
    for present in ("printed-42", "shown_source_3", "kept-6"):
        assert present in deck, present
    [notes] = re.findall(r'<aside class="notes">(.*?)</aside>', deck, re.S)
    assert "The rest for the notes." in notes
    assert "The rest for the notes." not in deck.replace(notes, "")
    assert len(re.findall(r"celltag_slide-code", deck)) == 1
    room = slides.room_notebook(nb)
    assert [c.source.split("\n")[0] for c in room.cells] == [
        "# Title",
        "The lead. The rest for the notes.",
        "hidden_source_1 = 1",
        "shown_source_3 = 3",
        "noisy_4()",
    ]


def test_run_time_is_measured_when_there_is_a_measurement():
    nb = new_notebook(cells=[new_markdown_cell("# t\n**How long.** About a minute on 2 cores.")])
    assert slides.run_time_of(nb) == ("About a minute on 2 cores", slides.STATED)
    nb.metadata["papermill"] = {"duration": 61.7}
    assert slides.run_time_of(nb) == ("62 s", slides.MEASURED_BY_PAPERMILL)
    assert slides.run_time_of(nb, executed_s=12.2) == ("12 s", slides.MEASURED_HERE)
    assert slides.run_time_of(new_notebook(cells=[new_markdown_cell("# t")])) == ("", slides.NOT_STATED)


def test_a_stated_run_time_is_the_sentences_head_without_its_asides():
    nb = new_notebook(
        cells=[
            new_markdown_cell(
                "**How long.** About half a minute on 2 CPU\ncores, measured (`run_x=False` skips)."
            )
        ]
    )
    assert slides.run_time_of(nb) == ("About half a minute on 2 CPU cores", slides.STATED)
    nb.cells[0].source = "**How long.** About a minute (each `start` costs seconds)."
    assert slides.run_time_of(nb).text == "About a minute"


def test_the_index_renders_inline_markdown():
    entry = slides.DeckEntry(
        "05.slides.html",
        "05 · `fully_shard`'s **surface** & more",
        slides.RunTime("About `n` s", slides.STATED),
        None,
    )
    page = slides.index_html([entry])
    assert "<code>fully_shard</code>" in page and "<strong>surface</strong>" in page and "&amp; more" in page
    assert "About <code>n</code> s" in page and "`" not in page


def _png_width_px(b64: str) -> int:
    import base64

    return struct.unpack(">I", base64.b64decode(b64)[16:20])[0]  # the IHDR chunk's width


@pytest.mark.timeout(180)
def test_execute_draws_labkits_figures_at_slide_dpi(tmp_path):
    """A 2-inch-wide Figure, shown through labkit.plots' formatter: 100 dpi in the notebook, SLIDE_DPI here."""
    path = tmp_path / "00_fig.ipynb"
    figure = (
        "from matplotlib.figure import Figure\nfrom labkit import plots\nfig = Figure(figsize=(2, 1))\nfig"
    )
    nbformat.write(new_notebook(cells=[new_code_cell(figure)]), path)
    nb = slides.execute_notebook(path, timeout_s=120)
    assert len(nb.cells) == 1  # the set-up cell is gone
    [out] = [o for o in nb.cells[0].outputs if "image/png" in o.get("data", {})]
    assert _png_width_px(out.data["image/png"]) == 2 * slides.SLIDE_DPI
