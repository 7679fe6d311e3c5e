"""Sizes as typed and as printed: `parse_quantity` reads `80GB`, `70B`, `1.6TB/s`; `format_bytes` and
`format_count` write them back. The one parser of the CLI and the one printer of the tables.
"""

from __future__ import annotations

import re

# suffix -> scale, by what a unit counts. Decimal prefixes (1 GB = 1e9 B; k, M, G, T, P in either case) and
# binary ones (GiB = 2**30 B); a byte is a capital B, as a small b is a bit (a 400 Gb/s NIC moves 50 GB/s).
_PREFIXES = {"k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BYTE_SCALES = {
    "": 1,
    "B": 1,
    **{c + end: v for p, v in _PREFIXES.items() for c in {p.lower(), p.upper()} for end in ("", "B")},
    **{c + "iB": 2 ** (10 * (i + 1)) for i, p in enumerate("KMGT") for c in {p, p.lower()}},
}
_BANDWIDTH_SCALES = {"": 1, "MB/s": 1e-3, "GB/s": 1, "TB/s": 1e3}  # in GB/s
_COUNT_SCALES = {"": 1, "k": 1e3, "K": 1e3, "m": 1e6, "M": 1e6, "b": 1e9, "B": 1e9, "t": 1e12, "T": 1e12}
_COUNTED = ("parameters", "ranks", "tokens", "elements", "layers", "heads", "sequences")
_QUANTITY = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-z/]*)\s*")


def _scales(unit: str) -> tuple[dict[str, float], str]:
    """The suffixes a quantity of `unit` may carry, and how an error message shows them."""
    if unit == "bytes":
        return _BYTE_SCALES, "such as 80GB, 80e9 or 512GiB (decimal: 1 GB = 1e9 B; a capital B for bytes)"
    if unit == "GB/s":
        return (
            _BANDWIDTH_SCALES,
            "in bytes per second, such as 50, 50GB/s or 1.6TB/s (400 Gb/s of bits is 50GB/s)",
        )
    if unit in _COUNTED:
        return _COUNT_SCALES, "such as 70B, 125M, 16k or 7e9 (k, M, B, T: decimal)"
    if unit == "params/s":
        return {**_COUNT_SCALES, **{k + "/s": v for k, v in _COUNT_SCALES.items()}}, "such as 150M or 1.5e8"
    return {"": 1, unit: 1}, f"a plain number{f' of {unit}' if unit else ''}"


def parse_quantity(text: str, unit: str) -> float:
    """`text` as typed for an input measured in `unit`, its size suffix applied: the one parser of the CLI.

    Bytes take decimal prefixes (`80GB` = 8e10, `2TB`) or binary ones (`512GiB` = 512 x 2**30); counts
    (parameters, tokens, ...) take k, M, B, T (`70B` = 7e10 parameters); bandwidths are GB/s (`50GB/s`,
    `1.6TB/s` = 1600). Raises ValueError with one sentence that says what would do.
    """
    scales, examples = _scales(unit)
    match = _QUANTITY.fullmatch(str(text))
    if match is None or match.group(2) not in scales:
        raise ValueError(f"{text!r} is not a number of {unit or 'this input'}; write one {examples}.")
    return float(match.group(1)) * scales[match.group(2)]


def format_bytes(n_bytes: float) -> str:
    """`n_bytes` in decimal units with four significant digits: 1875000000 -> '1.875 GB'."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:.4g} {unit}"
    return f"{n_bytes:.0f} B"


def format_count(n: float) -> str:
    """A count with a decimal suffix and four significant digits: 30000000000 -> '30B', 1.5e8 -> '150M'."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return f"{n:g}"
