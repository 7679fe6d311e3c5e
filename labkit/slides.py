"""reveal.js decks of the course notebooks: one deck per notebook and an index page, viewable with no network.

Each deck is nbconvert's `SlidesExporter` output. The cells' `slideshow.slide_type` metadata places them
(slide, subslide, fragment, skip, notes; "-" continues the current slide), cells tagged `notebook-only`
(live widgets, sliders) are dropped with `TagRemovePreprocessor`, and a widget output that carries a static
PNG/HTML fallback (labkit's calculators do) shows the fallback.

No asset is fetched at view time. nbconvert 7's reveal template loads reveal.js from a CDN by default
(`SlidesExporter.reveal_url_prefix` = `https://unpkg.com/reveal.js@4.0.2`), RequireJS, jQuery and Mermaid from
cdnjs, and MathJax from cdnjs. Here the decks use labkit's own template (`slides_template/labkit_reveal`:
no jQuery, Mermaid, MathJax or widget manager — the course's outputs are text and PNG) and a relative
`reveal_url_prefix`, `reveal.js`, which `build` fills from `labkit/slides_assets` (reveal.js 4.0.2 and
RequireJS, vendored, MIT); so the output folder is self-contained: copy it anywhere, open `index.html`.
Pass `reveal_url_prefix` (`--reveal-url-prefix` on the CLI) to use another copy of reveal.js instead.

By default the decks are built from the notebooks as they are (committed notebooks carry no outputs, so
the decks show prose and code); point `notebooks_dir` at executed copies (e.g. papermill's) for decks with
figures, or pass `execute=True` to execute each notebook first (minutes on a laptop: every notebook runs).

Beside each deck goes its one-page cheat sheet, `<name>.cheatsheet.md` and `.cheatsheet.html` (printable),
from `docs/cheatsheets/<name>.md`: the key formula, the figure to remember, the common mistake. The sheet's
`{{figure}}` becomes the line of the notebook's own output that its `<!-- figure: REGEX -->` finds, so a
sheet built from an executed notebook quotes that run; without outputs it says so.
"""

from __future__ import annotations

import html
import re
import shutil
import time
from pathlib import Path

import nbformat

from labkit import KERNEL_NAME

PACKAGE_DIR = Path(__file__).resolve().parent
ASSETS_DIR = PACKAGE_DIR / "slides_assets"
TEMPLATE_DIR = PACKAGE_DIR / "slides_template"
TEMPLATE_NAME = "labkit_reveal"
DEFAULT_NOTEBOOKS_DIR = PACKAGE_DIR.parent / "notebooks"
DEFAULT_CHEATSHEETS_DIR = PACKAGE_DIR.parent / "docs" / "cheatsheets"
FIGURE_SPEC = re.compile(r"^<!--\s*figure:\s*(?P<pattern>.+?)\s*-->\n", re.M)
FIGURE_SLOT = "{{figure}}"
LOCAL_REVEAL_PREFIX = "reveal.js"  # relative to the deck: `build` copies the vendored reveal.js there
DROP_TAG = "notebook-only"
NOTEBOOK_PATTERN = re.compile(r"^\d\d_.*\.ipynb$")


def course_notebooks(notebooks_dir: str | Path | None = None) -> list[Path]:
    """The course's notebooks (`NN_*.ipynb`) in `notebooks_dir` (default: the checkout's `notebooks/`), sorted."""
    folder = Path(notebooks_dir) if notebooks_dir is not None else DEFAULT_NOTEBOOKS_DIR
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


def execute_notebook(path: Path, timeout_s: float = 600.0) -> nbformat.NotebookNode:
    """`path` executed top to bottom in its own folder with the `labkit` kernel (nothing is written back)."""
    from nbconvert.preprocessors import ExecutePreprocessor

    nb = nbformat.read(path, as_version=4)
    ExecutePreprocessor(timeout=int(timeout_s), kernel_name=KERNEL_NAME).preprocess(
        nb, {"metadata": {"path": str(path.parent)}}
    )
    return nb


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


def slides_html(nb: nbformat.NotebookNode, reveal_url_prefix: str = LOCAL_REVEAL_PREFIX) -> str:
    """One notebook as a reveal.js deck (HTML text), `notebook-only` cells dropped, widgets shown static."""
    from nbconvert import SlidesExporter
    from traitlets.config import Config

    config = Config()
    config.SlidesExporter.reveal_url_prefix = reveal_url_prefix
    config.SlidesExporter.reveal_theme = "white"
    config.SlidesExporter.require_js_url = "require.js"  # beside the deck, always copied by `build`
    exporter = SlidesExporter(
        config=config, template_name=TEMPLATE_NAME, extra_template_basedirs=[str(TEMPLATE_DIR)]
    )
    # Dropped before the exporter reads the slide boundaries: a dropped cell must not open or end a slide.
    kept = [c for c in nb.cells if DROP_TAG not in c.metadata.get("tags", [])]
    body, _ = exporter.from_notebook_node(static_outputs(nbformat.from_dict({**nb, "cells": kept})))
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


def cheatsheet_markdown(source: str, nb: nbformat.NotebookNode) -> str:
    """The printable cheat sheet: `source` with its figure spec removed and `{{figure}}` filled from `nb`."""
    line = figure_line(source, nb)
    if line is not None:
        figure = f"`{line}` (this run's output)"
    elif output_text(nb).strip():
        figure = "_not found in this run's output: the notebook no longer prints the line this sheet quotes_"
    else:
        figure = ("_this build has no outputs (the committed notebook): run it, or build with "
                  "`labkit slides --execute`, to quote the figure here_")  # fmt: skip
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


def copy_assets(out_dir: Path, reveal: bool = True) -> None:
    """Put the vendored RequireJS (and, with `reveal`, reveal.js as `reveal.js/`) beside the decks."""
    shutil.copy2(ASSETS_DIR / "require.js", out_dir / "require.js")
    if reveal:
        target = out_dir / LOCAL_REVEAL_PREFIX
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(ASSETS_DIR / "reveal.js", target)


def index_html(decks: list[tuple[str, str]], sheets: dict[str, str] | None = None) -> str:
    """A page linking each (file name, title) deck, and its cheat sheet (`sheets`: deck name -> sheet name)."""
    sheets = sheets or {}

    def item(name: str, title: str) -> str:
        sheet = sheets.get(name)
        extra = f' · <a href="{html.escape(sheet)}">cheat sheet</a>' if sheet else ""
        return f'  <li><a href="{html.escape(name)}">{html.escape(title)}</a>{extra}</li>'

    items = "\n".join(item(name, title) for name, title in decks)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head><meta charset="utf-8"><title>labkit slides</title></head>\n'
        '<body style="font-family: sans-serif; max-width: 46em; margin: 2em auto">\n'
        "<h1>labkit: the course as slides</h1>\n<ol>\n"
        f"{items}\n</ol>\n<p>Arrow keys move; <kbd>s</kbd> opens the speaker view; <kbd>Esc</kbd> shows the overview.</p>\n"
        "</body>\n</html>\n"
    )


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

    `execute=True` runs each notebook first (timeout per notebook, seconds); `reveal_url_prefix=None` uses
    the vendored reveal.js copied into `out_dir` (no network at view time). Each notebook with a
    `<name>.md` in `cheatsheets_dir` (default: the checkout's `docs/cheatsheets/`) also gets
    `<name>.cheatsheet.md` and `<name>.cheatsheet.html`.
    """
    sheets_dir = Path(cheatsheets_dir) if cheatsheets_dir is not None else DEFAULT_CHEATSHEETS_DIR
    notebooks = course_notebooks(notebooks_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefix = reveal_url_prefix or LOCAL_REVEAL_PREFIX
    copy_assets(out, reveal=reveal_url_prefix is None)
    decks, listed, sheets = [], [], {}
    for path in notebooks:
        start_s = time.perf_counter()
        nb = execute_notebook(path, timeout_s) if execute else nbformat.read(path, as_version=4)
        deck = out / f"{path.stem}.slides.html"
        deck.write_text(slides_html(nb, prefix), encoding="utf-8")
        decks.append(deck)
        listed.append((deck.name, title_of(nb, path.stem)))
        source = sheets_dir / f"{path.stem}.md"
        if source.is_file():
            sheet = cheatsheet_markdown(source.read_text(encoding="utf-8"), nb)
            (out / f"{path.stem}.cheatsheet.md").write_text(sheet, encoding="utf-8")
            page = out / f"{path.stem}.cheatsheet.html"
            page.write_text(cheatsheet_html(sheet, title_of(nb, path.stem)), encoding="utf-8")
            sheets[deck.name] = page.name
        log(f"{deck} ({time.perf_counter() - start_s:.1f} s)")
    (out / "index.html").write_text(index_html(listed, sheets), encoding="utf-8")
    return decks
