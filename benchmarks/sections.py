"""What the benchmark scripts share: writing their results markdown, whole or one section in place."""

from __future__ import annotations

import os
import re


def write_section(path: str, heading: str, lines: list[str]) -> None:
    """Put `lines` (starting with `heading`'s line) into the markdown file at `path` in place of the section
    whose first line starts with `heading` (appended if absent); the rest of the file is left as it is."""
    text = open(path).read() if os.path.exists(path) else ""
    block = "\n".join(lines) + "\n"
    pattern = re.compile(rf"^{re.escape(heading)}.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: block + "\n", text, count=1).rstrip("\n") + "\n"
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block
    with open(path, "w") as f:
        f.write(text)


def write_report(path: str, lines: list[str]) -> None:
    """Write `lines` as the whole markdown file at `path`, and print them."""
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    print(text)
