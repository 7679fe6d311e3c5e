"""The workshop decks in a real browser (issue 18): every deck of the course, built from the session's executed
notebooks, opened in one headless Chromium at a projector's 1280x720 and checked slide by slide.

The decks come from the `executed` fixture's papermill copies (tests/conftest.py: each course notebook runs once
per session, shared with tests/test_notebooks.py and tests/test_claims.py), so this test executes nothing again.
On each slide: its content fits the viewport (top to bottom), the only code shown is that of cells tagged
`slide-code`, and each tagged cell shows its code; each deck has a figure and speaker notes on at least a third
of its slides. A screenshot of each deck (its last slide) goes to test-artifacts/browser/decks/. The index and
the decks' links as Chromium reads them (from decks built without execution): the index shows no raw Markdown and
one run-time status per row, and every link Chromium would follow from a page lands on a file in the folder.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

import nbformat
import pytest
from browser_helpers import artifacts_dir, chromium

from labkit import slides

ROOT = Path(__file__).resolve().parents[1]
ALL = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
VIEWPORT = {"width": 1280, "height": 720}
TOLERANCE_PX = 1  # sub-pixel rounding of reveal's scale
NOTES_SHARE = 1 / 3

# Shows each leaf slide in turn (no transition, its images decoded, two frames for the fit) and reports, per
# slide: the vertical extent of its visible content in viewport pixels, the ids of the code cells whose source
# is shown, its figures and the length of its speaker notes.
SLIDE_FACTS_JS = """
async () => {
  Reveal.configure({transition: "none", backgroundTransition: "none"});
  const frames = () => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)));
  const facts = [];
  for (const section of Reveal.getSlides()) {
    const at = Reveal.getIndices(section);
    Reveal.slide(at.h, at.v);
    await Promise.all([...section.querySelectorAll("img")].map(img => img.decode().catch(() => null)));
    await frames();
    let top = Infinity, bottom = -Infinity;
    for (const el of section.querySelectorAll("*")) {
      if (el.closest("aside.notes")) continue;
      const r = el.getBoundingClientRect();
      if (r.width === 0 && r.height === 0) continue;
      top = Math.min(top, r.top);
      bottom = Math.max(bottom, r.bottom);
    }
    const notes = section.querySelector("aside.notes");
    facts.push({
      slide: `${at.h}/${at.v}`,
      headline: (section.querySelector("h1, h2, h3") || {textContent: ""}).textContent.replace("¶", ""),
      top, bottom,
      code: [...section.querySelectorAll(".jp-CodeCell")]
        .filter(c => c.querySelector(".jp-InputArea")).map(c => c.id.replace("cell-id=", "")),
      figures: section.querySelectorAll(".jp-OutputArea-output img").length,
      notes: notes ? notes.textContent.trim().length : 0,
    });
  }
  return facts;
}
"""


@pytest.fixture(scope="module")
def decks(executed, tmp_path_factory) -> Path:
    """The course's decks, built from the session's executed notebooks (papermill's copies, run once)."""
    for name in ALL:
        executed(name)  # papermill writes the executed copy into executed.out_dir
    out = tmp_path_factory.mktemp("decks")
    slides.build(out, executed.out_dir, log=lambda *_: None)
    return out


def _tagged_code_cells(nb: nbformat.NotebookNode) -> set[str]:
    return {
        c.id for c in nb.cells if c.cell_type == "code" and slides.SHOW_CODE_TAG in c.metadata.get("tags", [])
    }


@pytest.mark.timeout(
    600
)  # the first test to ask for `executed` runs the course (minutes); the browser part is quick
def test_every_deck_fits_a_projector_shows_only_asked_code_and_carries_figures_and_notes(
    decks, executed, tmp_path
):
    shots = artifacts_dir() / "decks"
    shots.mkdir(exist_ok=True)
    problems, code_shown = [], 0
    with chromium(tmp_path / "profile", viewport=VIEWPORT) as context:
        page = context.new_page()
        for name in ALL:
            deck = decks / name.replace(".ipynb", ".slides.html")
            page.goto(deck.as_uri())
            page.wait_for_selector(".reveal.ready")
            facts = page.evaluate(SLIDE_FACTS_JS)
            page.screenshot(path=str(shots / f"{deck.stem}-last.png"))
            asked = _tagged_code_cells(executed(name))
            for f in facts:
                where = f"{deck.name} slide {f['slide']} ({f['headline'][:50]!r})"
                if f["top"] < -TOLERANCE_PX or f["bottom"] > VIEWPORT["height"] + TOLERANCE_PX:
                    problems.append(f"{where}: content spans {f['top']:.0f}..{f['bottom']:.0f} px of 720")
                unasked = set(f["code"]) - asked
                if unasked:
                    problems.append(f"{where}: shows the code of untagged cells {sorted(unasked)}")
            shown = {cell for f in facts for cell in f["code"]}
            if asked - shown:
                problems.append(
                    f"{deck.name}: cells tagged {slides.SHOW_CODE_TAG} show no code: {asked - shown}"
                )
            code_shown += len(shown)
            if not any(f["figures"] for f in facts):
                problems.append(f"{deck.name}: no figure on any slide")
            noted = sum(f["notes"] > 0 for f in facts)
            if noted < NOTES_SHARE * len(facts):
                problems.append(f"{deck.name}: speaker notes on {noted} of {len(facts)} slides")
    assert not problems, "\n".join(problems)
    assert code_shown > 0, f"no deck shows a {slides.SHOW_CODE_TAG} cell: the tag is never exercised"


# Every link and source of the page as Chromium resolves it (absolute URLs), and the index table's text by row.
PAGE_LINKS_JS = """
() => ({
  links: [...document.querySelectorAll("[href], [src]")]
    .map(el => (typeof el.href === "string" ? el.href : el.src)).filter(Boolean),
  rows: [...document.querySelectorAll("table tr")].slice(1).map(tr => [...tr.cells].map(td => td.innerText)),
})
"""


def test_the_index_reads_clean_and_every_link_lands_in_the_folder(tmp_path):
    out = tmp_path / "decks"
    slides.build(out, log=lambda *_: None)
    pages = [out / "index.html", *sorted(out.glob("*.slides.html"))]
    missing, followed = [], 0
    with chromium(tmp_path / "profile", viewport=VIEWPORT) as context:
        page = context.new_page()
        for html_page in pages:
            page.goto(html_page.as_uri())
            found = page.evaluate(PAGE_LINKS_JS)
            for url in (urlparse(u) for u in found["links"]):
                if url.scheme != "file":
                    missing.append(f"{html_page.name}: {url.geturl()} is not a file beside it")
                    continue
                path = Path(unquote(url.path))
                followed += 1
                if not (path.is_file() and path.is_relative_to(out)):
                    missing.append(f"{html_page.name}: {url.geturl()} does not land on a file in {out}")
            if html_page.name == "index.html":
                rows = found["rows"]
    assert not missing, "\n".join(missing)
    assert followed > 3 * len(ALL) and len(rows) == len(ALL)
    for title, run_time, source, _ in rows:
        assert "`" not in title + run_time and "**" not in title + run_time, (title, run_time)
        assert source in slides.RUN_TIME_SOURCES and "measured" not in run_time and "stated" not in run_time
