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


def write_report(path: str, lines: list[str], keep_others: bool = False) -> None:
    """Write `lines` as the markdown file at `path`, and print them. `keep_others`: the file's `## ` sections
    this report does not write (those other scripts put there with `write_section`) stay, after it."""
    text = "\n".join(lines) + "\n"
    print(text)
    if keep_others and os.path.exists(path):
        own = {line for line in lines if line.startswith("## ")}
        others = [block for block in _sections(open(path).read()) if block.split("\n", 1)[0] not in own]
        text = "\n".join([text.rstrip("\n"), *(block.rstrip("\n") for block in others)]) + "\n"
    with open(path, "w") as f:
        f.write(text)


def _sections(text: str) -> list[str]:
    """The `## ` sections of a markdown text, each from its heading line to the next one."""
    return [m.group(0) for m in re.finditer(r"^## .*?(?=^## |\Z)", text, re.S | re.M)]
