"""What counts as a measured figure in the documentation: a number with the unit of a speed or
of a cost per unit, outside the code blocks (a command's printed output is an example). Figures
belong on the benchmarks page, generated from ``bench/results.json``."""

from __future__ import annotations

import re

# A number with the unit of a measured speed or cost, or a measured duration to the second
# ("11 min 37 s": the suite's timings live on the contributing page). Settings and sizes
# (`10M`, "64 MiB parts", "a 30 s timeout") are not figures; these units only a measurement gives.
FIGURE = re.compile(
    r"\d[\d,.]*\s*(?:[KMG]i?B/s|samples/s\b|samples a second|s/GB|"
    r"(?:us|µs|ms) (?:a|per) (?:sample|call|miss|hit)|% (?:of|more) (?:the )?CPU)"
    r"|\b\d+ min \d+(?:\.\d+)? s\b"
)


def figures(text: str) -> list[str]:
    """The measured figures in ``text``: a number with a speed or cost unit."""
    return [m[0] for m in FIGURE.finditer(text)]


FENCE = re.compile(r"^(```|~~~).*?^\1", re.DOTALL | re.MULTILINE)


def prose(text: str) -> str:
    """``text`` without its fenced blocks: a command's printed output is an example, not a
    claim, so its speeds are not figures."""
    return FENCE.sub("", text)
