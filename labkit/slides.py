"""reveal.js decks of the course notebooks, made for a room: one deck per notebook and an index page, offline.

Each deck is nbconvert's `SlidesExporter` output of the notebook after `room_notebook`. The cells'
`slideshow.slide_type` metadata places them (slide, subslide, fragment, skip, notes; "-" continues the
current slide). For the room:
- code is hidden (outputs only) unless its cell is tagged `slide-code`; plumbing never shows: the papermill
  `parameters` cell, cells tagged `notebook-only` (live widgets, sliders), stderr output (warnings), and a
  continuing code cell left with no output;
- prose is split by one rule (`split_prose`): headings, tables and images stay on the slide, and so does the
  lead, the first sentence of the cell's first paragraph (of its first item, for a list), and the first
  sentence of each later paragraph that opens with a bold label (`**Remember:**`, `**Exercise:**`); a kept
  sentence over `LEAD_MAX_CHARS` is cut at a clause boundary with "…". Every paragraph not shown whole goes,
  in full, into the slide's speaker notes (`<aside class="notes">`, reveal.js's `s` key);
- a widget output shows its static PNG/HTML fallback (`static_outputs`); the template
  (`slides_template/labkit_reveal`) sets a 1280x720 slide with projector-sized type and fits each slide when it
  is shown: each figure is scaled to the output's width and to its share of the height the text leaves, then
  the slide's content is zoomed down until it fits (width and height).

The decks show the run's figures only if built from executed notebooks: point `notebooks_dir` at executed
copies (e.g. papermill's) or pass `execute=True` to run each one first (minutes: every notebook runs); with
`execute=True` figures are rendered at `SLIDE_DPI` (twice the notebook's) so they read from the back of a
room. Without either, the committed notebooks carry no outputs and the decks show prose only.

No asset is fetched at view time. nbconvert 7's reveal template loads reveal.js, RequireJS, jQuery, Mermaid
and MathJax from CDNs; labkit's template drops jQuery, Mermaid, MathJax and the widget manager (the course's
outputs are text and PNG) and uses a relative `reveal_url_prefix`, `reveal.js`, which `build` fills from
`labkit/slides_assets` (reveal.js 4.0.2 and RequireJS, vendored, MIT). The files a notebook links to (its
exercises, `../exercises/NN.ipynb`) are copied beside the decks (`exercises/NN.ipynb`) and the links point at
the copies; so the output folder is self-contained: copy it anywhere, open `index.html`. Pass
`reveal_url_prefix` (`--reveal-url-prefix`) to use another copy of reveal.js instead.

The index page lists each deck's title and run time (rendered from their Markdown), how that time is known (one
of `RUN_TIME_SOURCES`: measured in this build, measured by papermill in an executed copy, measured by the course
benchmark (`course_benchmark`: `benchmarks/results.md`, or the copy of its course section a student release
carries), else the head of the notebook's own "How long" sentence), and its cheat sheet. A notebook's own
"runs in" line is `runs_in(name)`, the same benchmark figure. The sheet, `<name>.cheatsheet.md` and
`.cheatsheet.html` (printable), comes from `docs/cheatsheets/<name>.md`: the key formula, the figure to
remember, the common mistake. Its `{{figure}}` becomes the line of the notebook's own output that its
`<!-- figure: REGEX -->` finds, so a sheet built from an executed notebook quotes that run.
"""

from __future__ import annotations

import copy
import html
import re
import shutil
import time
from pathlib import Path
from typing import NamedTuple

import nbformat

from labkit import KERNEL_NAME

PACKAGE_DIR = Path(__file__).resolve().parent
ASSETS_DIR = PACKAGE_DIR / "slides_assets"
TEMPLATE_DIR = PACKAGE_DIR / "slides_template"
TEMPLATE_NAME = "labkit_reveal"
FIGURE_SPEC = re.compile(r"^<!--\s*figure:\s*(?P<pattern>.+?)\s*-->\n", re.M)
FIGURE_SLOT = "{{figure}}"
LOCAL_REVEAL_PREFIX = "reveal.js"  # relative to the deck: `build` copies the vendored reveal.js there
DROP_TAG = "notebook-only"
PARAMETERS_TAG = "parameters"  # papermill's
SHOW_CODE_TAG = "slide-code"  # the rare cell whose code a slide must show
LEAD_MAX_CHARS = 200  # a sentence kept on a slide longer than this is cut at a clause boundary
SLIDE_DPI = 200  # figures of an `execute=True` build (the notebooks draw at 100)
STATED_RUN_TIME = re.compile(r"\*\*How long\.\*\*\s*(?P<text>.+?[.!?])(?=\s|$)", re.S)
NOTEBOOK_PATTERN = re.compile(r"^\d\d_.*\.ipynb$")


def default_notebooks_dir() -> Path:
    """The course's `notebooks/` (a checkout's, or the copy a wheel carries: `labkit.course`)."""
    from labkit.course import course_path

    return course_path("notebooks")


def default_cheatsheets_dir() -> Path:
    """The course's `docs/cheatsheets/` (`labkit.course`)."""
    from labkit.course import course_path

    return course_path("docs") / "cheatsheets"


def course_notebooks(notebooks_dir: str | Path | None = None) -> list[Path]:
    """The course's notebooks (`NN_*.ipynb`) in `notebooks_dir` (default: the course's `notebooks/`), sorted."""
    folder = Path(notebooks_dir) if notebooks_dir is not None else default_notebooks_dir()
    if not folder.is_dir():
        raise ValueError(
            f"notebooks folder {str(folder)!r} does not exist; pass --notebooks DIR with the .ipynb files"
        )
    found = sorted(p for p in folder.iterdir() if NOTEBOOK_PATTERN.match(p.name))
    if not found:
        raise ValueError(
            f"no NN_*.ipynb notebooks in {str(folder)!r}; pass --notebooks DIR with the course notebooks"
        )
    return found


def title_of(nb: nbformat.NotebookNode, fallback: str) -> str:
    """The first Markdown heading of the notebook, without its `#`s (or `fallback`)."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return fallback


# Run first in a kernel executing for slides: labkit's figures (and pyplot's) are drawn at SLIDE_DPI.
HIGH_DPI_CELL = f"""\
from IPython import get_ipython
from matplotlib.figure import Figure
from labkit import plots
get_ipython().display_formatter.formatters["image/png"].for_type(
    Figure, lambda fig: plots.figure_png(fig, dpi={SLIDE_DPI})
)
%config InlineBackend.print_figure_kwargs = {{"bbox_inches": "tight", "dpi": {SLIDE_DPI}}}
"""


def execute_notebook(path: Path, timeout_s: float = 600.0) -> nbformat.NotebookNode:
    """`path` executed top to bottom in its own folder with the `labkit` kernel, figures at `SLIDE_DPI`
    (nothing is written back; the set-up cell that raises the resolution is not in the result)."""
    from nbconvert.preprocessors import ExecutePreprocessor

    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(HIGH_DPI_CELL))
    ExecutePreprocessor(timeout=int(timeout_s), kernel_name=KERNEL_NAME).preprocess(
        nb, {"metadata": {"path": str(path.parent)}}
    )
    del nb.cells[0]
    return nb


# ------------------------------------------------------------------------------------------ prose

SENTENCE_END = re.compile(r"""(?<!e\.g)(?<!i\.e)(?<!\bvs)[.!?](?:\*\*)?(?=\s+[A-Z*`(\["']|\s*$)""")
CLAUSE_BREAK = re.compile(r"[,;:] | — ")
BOLD_LABEL_CHARS = 30  # a first "sentence" this short that is all bold ("**What you will see.**") is a label


def _blocks(source: str) -> list[str]:
    """Markdown paragraphs (blank-line separated), each heading line a block of its own."""
    blocks = []
    for para in re.split(r"\n\s*\n", source.strip()):
        lines: list[str] = []
        for line in para.splitlines():
            if line.startswith("#"):
                blocks += ["\n".join(lines)] if lines else []
                blocks.append(line)
                lines = []
            else:
                lines.append(line)
        blocks += ["\n".join(lines)] if lines else []
    return blocks


def _balanced(text: str) -> bool:
    """No code span, bold run, link or parenthesis left open (a cut there would break the Markdown)."""
    return (
        text.count("`") % 2 == 0
        and text.count("**") % 2 == 0
        and text.count("[") == text.count("]")
        and text.count("(") == text.count(")")
    )


def _shortened(sentence: str) -> str:
    """`sentence`, or its longest balanced clause prefix under LEAD_MAX_CHARS followed by "…"."""
    if len(sentence) <= LEAD_MAX_CHARS:
        return sentence
    cuts = [m.start() for m in CLAUSE_BREAK.finditer(sentence, 0, LEAD_MAX_CHARS)]
    cuts = [c for c in cuts if _balanced(sentence[:c])]
    return sentence[: cuts[-1]] + " …" if cuts else sentence


def first_sentence(paragraph: str) -> str:
    """The paragraph's first sentence on one line (two when the first is only a bold label), shortened."""
    text = " ".join(paragraph.split())
    ends = [m.end() for m in SENTENCE_END.finditer(text)]
    if not ends:
        return _shortened(text)
    end = ends[0]
    label = text[:end]
    if label.startswith("**") and label.endswith("**") and len(label) <= BOLD_LABEL_CHARS and len(ends) > 1:
        end = ends[1]
    return _shortened(text[:end])


def split_prose(source: str) -> tuple[str, str]:
    """(what a slide shows, its speaker notes) of one Markdown cell, by the rule in the module docstring."""
    shown, notes, lead_taken = [], [], False
    for block in _blocks(source):
        if block.startswith(("#", "|", "![")):
            shown.append(block)
            continue
        bullet = re.match(r"(\s*(?:[-*+]|\d+\.)\s+)", block)
        if not lead_taken or block.startswith("**"):
            body = re.split(r"\n\s*(?:[-*+]|\d+\.)\s+", block[bullet.end() :])[0] if bullet else block
            kept = (bullet.group(1).strip() + " " if bullet else "") + first_sentence(body)
            shown.append(kept)
            lead_taken = True
            if kept == " ".join(block.split()):
                continue
        notes.append(block)
    return "\n\n".join(shown), "\n\n".join(notes)


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def static_outputs(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Drop the live-widget view from outputs that carry a static fallback (labkit's widgets add PNG + HTML):
    a deck has no widget manager, and nbconvert would pick the view and show nothing."""
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_VIEW in data and set(data) - {WIDGET_VIEW, "text/plain"}:
                del data[WIDGET_VIEW]
    return nb


def _tags(cell) -> list[str]:
    return cell.metadata.get("tags", [])


def _opens_slide(cell) -> bool:
    return cell.metadata.get("slideshow", {}).get("slide_type", "-") in ("slide", "subslide")


def _room_cells(cell) -> list:
    """What a room sees of one cell: [] for plumbing, a code cell's output without stderr, a Markdown cell
    split into the slide's part and a `notes` cell (the rest of its prose)."""
    if DROP_TAG in _tags(cell) or PARAMETERS_TAG in _tags(cell):
        return []
    if cell.cell_type == "code":
        cell.outputs = [o for o in cell.get("outputs", []) if o.get("name") != "stderr"]
        shown = cell.outputs or SHOW_CODE_TAG in _tags(cell) or _opens_slide(cell)
        return [cell] if shown else []
    if cell.cell_type != "markdown":
        return [cell]
    slide_part, notes = split_prose(cell.source)
    cell.source = slide_part
    if not notes:
        return [cell]
    notes_cell = nbformat.v4.new_markdown_cell(notes, metadata={"slideshow": {"slide_type": "notes"}})
    notes_cell.id = f"{cell.get('id', 'cell')}-notes"
    return [cell, notes_cell]


def room_notebook(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of `nb` as a room sees it (the rule in the module docstring); widgets shown static."""
    room = copy.deepcopy(nb)
    # Dropped before the exporter reads the slide boundaries: a dropped cell must not open or end a slide.
    room.cells = [kept for cell in room.cells for kept in _room_cells(cell)]
    return static_outputs(room)


def slides_html(nb: nbformat.NotebookNode, reveal_url_prefix: str = LOCAL_REVEAL_PREFIX) -> str:
    """One notebook as a reveal.js deck for a room (HTML text): see `room_notebook`."""
    from nbconvert import SlidesExporter
    from traitlets.config import Config

    config = Config()
    config.SlidesExporter.reveal_url_prefix = reveal_url_prefix
    config.SlidesExporter.reveal_theme = "white"
    config.SlidesExporter.require_js_url = "require.js"  # beside the deck, always copied by `build`
    config.SlidesExporter.exclude_input_prompt = True
    config.SlidesExporter.exclude_output_prompt = True
    exporter = SlidesExporter(
        config=config, template_name=TEMPLATE_NAME, extra_template_basedirs=[str(TEMPLATE_DIR)]
    )
    body, _ = exporter.from_notebook_node(
        room_notebook(nb), resources={"labkit": {"show_code_tag": SHOW_CODE_TAG}}
    )
    return body


def output_text(nb: nbformat.NotebookNode) -> str:
    """Every stream and plain-text output of a notebook, joined (what its run printed)."""
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if o.output_type == "stream":
                out.append(o.text)
            elif o.output_type in ("execute_result", "display_data"):
                out.append(o.get("data", {}).get("text/plain", ""))
    return "\n".join(out)


def figure_line(source: str, nb: nbformat.NotebookNode) -> str | None:
    """The output line of `nb` that the cheat sheet's `<!-- figure: REGEX -->` finds (spaces squeezed), or None."""
    spec = FIGURE_SPEC.search(source)
    if spec is None:
        raise ValueError("a cheat sheet needs a first line <!-- figure: REGEX --> naming the line to quote")
    text = output_text(nb)
    found = re.search(spec["pattern"], text, re.M)
    if found is None:
        return None
    start = text.rfind("\n", 0, found.start()) + 1
    end = text.find("\n", found.end())
    return re.sub(r"\s+", " ", text[start : end if end >= 0 else len(text)]).strip()


NO_OUTPUTS = (
    "_this build has no outputs (the committed notebook): run it, or build with `labkit slides --execute`, to "
    "quote the figure here_"
)


def cheatsheet_markdown(source: str, nb: nbformat.NotebookNode, no_outputs: str = NO_OUTPUTS) -> str:
    """The printable cheat sheet: `source` with its figure spec removed and `{{figure}}` filled from `nb`, or
    with `no_outputs` (Markdown) where `nb` was never run."""
    line = figure_line(source, nb)
    if line is not None:
        figure = f"`{line}` (this run's output)"
    elif output_text(nb).strip():
        figure = "_not found in this run's output: the notebook no longer prints the line this sheet quotes_"
    else:
        figure = no_outputs
    return FIGURE_SPEC.sub("", source, count=1).replace(FIGURE_SLOT, figure)


def cheatsheet_html(markdown: str, title: str) -> str:
    """A cheat sheet as one printable HTML page (A4, no network)."""
    from nbconvert.filters.markdown_mistune import markdown2html_mistune

    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head><meta charset="utf-8">'
        f"<title>{html.escape(title)} — cheat sheet</title>\n<style>\n"
        "@page { size: A4; margin: 1.6cm; }\n"
        "body { font-family: sans-serif; font-size: 11pt; line-height: 1.4; max-width: 46em; margin: 1em auto; }\n"
        "code { font-size: 0.95em; background: #f3f3f3; padding: 0 0.2em; }\n"
        "table { border-collapse: collapse; } td, th { border: 1px solid #bbb; padding: 0.2em 0.6em; }\n"
        ".anchor-link { display: none; }\n"
        "</style></head>\n<body>\n"
        f"{markdown2html_mistune(markdown)}\n</body>\n</html>\n"
    )


# A Markdown link or image: [text](target "title") or ![alt](target).
MARKDOWN_LINK = re.compile(
    r"(?P<bang>!?)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)"
)
URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _relative(target: str) -> bool:
    """Whether a link's target is a path relative to the notebook (not a URL, an anchor or an absolute path)."""
    return not (URL_SCHEME.match(target) or target.startswith(("#", "/")))


def _beside_decks(target: str) -> str:
    """Where a linked file goes in the decks' folder: its relative path without the `..` and `.` steps
    (`../exercises/02.ipynb` -> `exercises/02.ipynb`)."""
    return "/".join(part for part in target.split("/") if part not in ("", ".", ".."))


def portable_links(
    nb: nbformat.NotebookNode, sources: list[Path], out_dir: Path, log=print
) -> nbformat.NotebookNode:
    """A copy of `nb` whose relative Markdown links work from `out_dir`: each linked file (looked for relative to
    each folder of `sources` in turn) is copied into `out_dir` at `_beside_decks(target)` and the link points
    there; a link to a file found nowhere keeps its text, drops its target, and is logged."""
    portable = copy.deepcopy(nb)

    def rewrite(m: re.Match) -> str:
        target, _, fragment = m["target"].partition("#")
        if not target or not _relative(m["target"]):
            return m[0]
        found = next((d / target for d in sources if (d / target).is_file()), None)
        if found is None:
            log(f"link to {target} left out: no such file beside {', '.join(str(d) for d in sources)}")
            return m["text"]
        copy_to = out_dir / _beside_decks(target)
        copy_to.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(found, copy_to)
        new = _beside_decks(target) + (f"#{fragment}" if fragment else "")
        return f"{m['bang']}[{m['text']}]({new}{m['title'] or ''})"

    for cell in portable.cells:
        if cell.cell_type == "markdown":
            cell.source = MARKDOWN_LINK.sub(rewrite, cell.source)
    return portable


def copy_assets(out_dir: Path, reveal: bool = True) -> None:
    """Put the vendored RequireJS (and, with `reveal`, reveal.js as `reveal.js/`) beside the decks."""
    shutil.copy2(ASSETS_DIR / "require.js", out_dir / "require.js")
    if reveal:
        target = out_dir / LOCAL_REVEAL_PREFIX
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(ASSETS_DIR / "reveal.js", target)


class RunTime(NamedTuple):
    """How long a notebook runs (`text`: "62 s", "About a minute on 2 CPU cores"; "" when unknown) and how
    that is known (`source`: one of RUN_TIME_SOURCES)."""

    text: str
    source: str


MEASURED_HERE = "measured in this build"
MEASURED_BY_PAPERMILL = "measured by papermill"
BENCHMARKED = "measured by the course benchmark"
STATED = "stated by the notebook"
NOT_STATED = "not stated"
RUN_TIME_SOURCES = (MEASURED_HERE, MEASURED_BY_PAPERMILL, BENCHMARKED, STATED, NOT_STATED)
STATED_HEAD_END = re.compile(r",\s|;\s|\s\(|[.!?]$")  # the duration ends where a clause or an aside begins
# The course benchmark's results: the instructor's copy's, else the course section a student release copies.
BENCHMARK_FILES = ("benchmarks/results.md", "docs/course_times.md")
BENCHMARK_TITLE = re.compile(r"# Benchmarks \((?P<date>\d{4}-\d\d-\d\d), (?P<machine>.+)\)$")
COURSE_SECTION = "## The course, end to end"
REMEASURED = (  # the course section's own first line when it was measured after the rest of the file
    "Re-measured alone (`run_all.py --course-only`) on {date}; the rest of this file is the earlier run of its title's date."
)
REMEASURED_ON = re.compile(re.escape(REMEASURED).replace(r"\{date\}", r"(?P<date>\d{4}-\d\d-\d\d)"))


def course_section(markdown: str) -> list[str]:
    """The title line and the "The course, end to end" section of a benchmark results file ([] without both)."""
    lines = markdown.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(COURSE_SECTION)), None)
    if not lines or not BENCHMARK_TITLE.match(lines[0]) or start is None:
        return []
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("#")), len(lines))
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1
    return [lines[0], "", *lines[start:end]]


def benchmark_run_times(markdown: str) -> tuple[str, dict[str, int]]:
    """(the run, "DATE on MACHINE"; {notebook file name: wall seconds papermill took}) from a benchmark results
    file's course section; ("", {}) without one. DATE is the section's own (`REMEASURED`) or the file's."""
    section = course_section(markdown)
    if not section:
        return "", {}
    title = BENCHMARK_TITLE.match(section[0])
    date = next((m["date"] for line in section if (m := REMEASURED_ON.fullmatch(line))), title["date"])
    found = (re.fullmatch(r"- (\S+\.ipynb): (\d+) s", line) for line in section)
    return f"{date} on {title['machine']}", {m[1]: int(m[2]) for m in found if m}


def course_benchmark() -> tuple[str, dict[str, int]]:
    """`benchmark_run_times` of the course's benchmark results (`BENCHMARK_FILES`, the first found)."""
    from labkit.course import course_dir

    try:
        root = course_dir()
    except ValueError:  # no course folder: nothing was benchmarked
        return "", {}
    found = next((root / name for name in BENCHMARK_FILES if (root / name).is_file()), None)
    return benchmark_run_times(found.read_text(encoding="utf-8")) if found else ("", {})


def runs_in(notebook: str) -> str:
    """The notebook's "runs in" line: what the course benchmark measured for `notebook` (its file stem)."""
    run, seconds = course_benchmark()
    if f"{notebook}.ipynb" not in seconds:
        return f"Runs in: not measured yet (the course benchmark has no time for {notebook})."
    return (
        f"Runs in about {seconds[notebook + '.ipynb']} s: what the course benchmark measured (papermill, its run "
        f"of {run})."
    )


def run_time_of(
    nb: nbformat.NotebookNode, executed_s: float | None = None, benchmarked_s: float | None = None
) -> RunTime:
    """How long the notebook runs: `executed_s` (this build's execution, seconds), else the duration papermill
    recorded in an executed copy, else `benchmarked_s` (the course benchmark's), else the head of the notebook's
    own "How long" sentence (up to its first clause or aside: "About half a minute on 2 CPU cores")."""
    if executed_s is not None:
        return RunTime(f"{executed_s:.0f} s", MEASURED_HERE)
    recorded_s = nb.metadata.get("papermill", {}).get("duration")
    if recorded_s is not None:
        return RunTime(f"{recorded_s:.0f} s", MEASURED_BY_PAPERMILL)
    if benchmarked_s is not None:
        return RunTime(f"{benchmarked_s:.0f} s", BENCHMARKED)
    stated = STATED_RUN_TIME.search(nb.cells[0].source) if nb.cells else None
    if stated is None:
        return RunTime("", NOT_STATED)
    sentence = " ".join(stated["text"].split())
    end = STATED_HEAD_END.search(sentence)
    return RunTime(sentence[: end.start()] if end else sentence, STATED)


class DeckEntry(NamedTuple):
    """One line of the index page: the deck's file name, its title (Markdown), its run time, its cheat sheet."""

    deck: str
    title: str
    run_time: RunTime
    sheet: str | None


def inline_html(markdown: str) -> str:
    """One line of Markdown as inline HTML: code spans, emphasis and entities rendered, no paragraph around it."""
    from nbconvert.filters.markdown_mistune import markdown2html_mistune

    rendered = markdown2html_mistune(markdown).strip()
    return re.sub(r"^<p>(.*)</p>$", r"\1", rendered, flags=re.S)


def index_html(entries: list[DeckEntry]) -> str:
    """The workshop's index page: a table of the decks with title, run time, how that time is known, and the
    cheat sheet (titles and run times rendered from their Markdown)."""

    def row(e: DeckEntry) -> str:
        sheet = f'<a href="{html.escape(e.sheet)}">cheat sheet</a>' if e.sheet else ""
        return (
            f'  <tr><td><a href="{html.escape(e.deck)}">{inline_html(e.title)}</a></td>'
            f"<td>{inline_html(e.run_time.text)}</td><td>{e.run_time.source}</td><td>{sheet}</td></tr>"
        )

    rows = "\n".join(row(e) for e in entries)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head><meta charset="utf-8"><title>labkit slides</title>\n'
        "<style>body { font-family: sans-serif; max-width: 60em; margin: 2em auto; }\n"
        "td, th { text-align: left; padding: 0.3em 1em 0.3em 0; }</style></head>\n<body>\n"
        "<h1>labkit: the course as slides</h1>\n<table>\n"
        "  <tr><th>deck</th><th>run time</th><th>how it is known</th><th>cheat sheet</th></tr>\n"
        f"{rows}\n</table>\n<p>Arrow keys move; <kbd>s</kbd> opens the speaker view (the notes); "
        "<kbd>Esc</kbd> shows the overview.</p>\n</body>\n</html>\n"
    )


def link_sources(path: Path) -> list[Path]:
    """Where a notebook's relative links are looked for: its own folder, then the course's `notebooks/` (an
    executed copy elsewhere, papermill's, links as the course's notebook does)."""
    from labkit.course import course_path

    folders = [path.parent]
    try:
        folders.append(course_path("notebooks"))
    except ValueError:  # no course folder: the notebook's own folder only
        pass
    return list(dict.fromkeys(f.resolve() for f in folders))


def build(
    out_dir: str | Path,
    notebooks_dir: str | Path | None = None,
    *,
    execute: bool = False,
    timeout_s: float = 600.0,
    reveal_url_prefix: str | None = None,
    cheatsheets_dir: str | Path | None = None,
    log=print,
) -> list[Path]:
    """Write `<name>.slides.html` per course notebook and `index.html` into `out_dir`; return the deck paths.

    Each file a notebook links to (its exercise) is copied into `out_dir` and the link points at the copy
    (`portable_links`), so the folder works wherever it goes. `execute=True` runs each notebook first (timeout per notebook, seconds); `reveal_url_prefix=None` uses
    the vendored reveal.js copied into `out_dir` (no network at view time). Each notebook with a
    `<name>.md` in `cheatsheets_dir` (default: the checkout's `docs/cheatsheets/`) also gets
    `<name>.cheatsheet.md` and `<name>.cheatsheet.html`.
    """
    sheets_dir = Path(cheatsheets_dir) if cheatsheets_dir is not None else default_cheatsheets_dir()
    notebooks = course_notebooks(notebooks_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefix = reveal_url_prefix or LOCAL_REVEAL_PREFIX
    copy_assets(out, reveal=reveal_url_prefix is None)
    decks, entries = [], []
    benchmarked = course_benchmark()[1]
    for path in notebooks:
        start_s = time.perf_counter()
        nb = execute_notebook(path, timeout_s) if execute else nbformat.read(path, as_version=4)
        executed_s = time.perf_counter() - start_s if execute else None
        nb = portable_links(nb, link_sources(path), out, log)
        deck = out / f"{path.stem}.slides.html"
        deck.write_text(slides_html(nb, prefix), encoding="utf-8")
        decks.append(deck)
        title = title_of(nb, path.stem)
        source = sheets_dir / f"{path.stem}.md"
        page = None
        if source.is_file():
            sheet = cheatsheet_markdown(source.read_text(encoding="utf-8"), nb)
            (out / f"{path.stem}.cheatsheet.md").write_text(sheet, encoding="utf-8")
            page = out / f"{path.stem}.cheatsheet.html"
            page.write_text(cheatsheet_html(sheet, title), encoding="utf-8")
        run_time = run_time_of(nb, executed_s, benchmarked.get(path.name))
        entries.append(DeckEntry(deck.name, title, run_time, page and page.name))
        log(f"{deck} ({time.perf_counter() - start_s:.1f} s)")
    (out / "index.html").write_text(index_html(entries), encoding="utf-8")
    return decks
