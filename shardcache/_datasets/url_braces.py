"""The brace grammar of shard specs: count a pattern's expansion, then expand it.

Patterns are expanded by the ``braceexpand`` package exactly as webdataset does (zero padding
included). Departures (each turns a silent surprise into a ``UrlError``):

- braces must balance and every ``{...}`` group must be a range or a comma list; a group
  that is neither (``{abc}``, ``{0...9}``) is rejected instead of kept literally (escape a
  literal brace as ``\\{``);
- the size of the expansion is computed before expanding (``braceexpand`` materialises
  every range), and more than ``MAX_EXPANSION`` URLs is an error.

A ``pipe:`` command's braces are expanded as plain ``braceexpand`` does: a group that is
neither a range nor a list (``awk '{print}'``, ``${VAR}``) stays literal instead of being an
error, and a backslash is dropped as braceexpand drops it. Every expanded URL is checked
(``_url_check``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from braceexpand import braceexpand

from .._base.url_check import brief_repr, checked_url, url_error
from .._base.url_kinds import is_pipe_url

MAX_EXPANSION = 10_000_000
"""Most URLs one spec (or one call) may expand to."""

# The same range grammar as braceexpand (the step's sign is ignored there too).
_INT_RANGE_RE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?$")
_CHAR_RANGE_RE = re.compile(r"^([A-Za-z])\.\.([A-Za-z])(?:\.\.-?(\d+))?$")
_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_HINT_BRACES = (
    "Write ranges as {000000..000999} and lists as {a,b,c}; balance every brace; "
    "escape a literal brace as \\{ or \\}."
)


def _scan(text: str, start: int = 0) -> Iterator[tuple[int, str, int]]:
    """(position, character, brace depth after it) of every unescaped character."""
    depth = 0
    pos = start
    while pos < len(text):
        char = text[pos]
        if char == "\\":
            pos += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
        yield pos, char, depth
        pos += 1


def _find_close(text: str, open_pos: int) -> int:
    """Index of the brace closing the one at ``open_pos``, or -1."""
    for pos, char, depth in _scan(text, open_pos):
        if char == "}" and depth == 0:
            return pos
    return -1


def _split_top_commas(text: str) -> list[str]:
    parts: list[str] = []
    start = 0
    for pos, char, depth in _scan(text):
        if char == "," and depth == 0:
            parts.append(text[start:pos])
            start = pos + 1
    parts.append(text[start:])
    return parts


def _range_count(expr: str) -> int | None:
    """Items in a braceexpand range expression, or None when ``expr`` is not a range."""
    match = _INT_RANGE_RE.match(expr)
    if match:
        start, end = int(match.group(1)), int(match.group(2))
        step = int(match.group(3) or 1) or 1
        return abs(end - start) // step + 1
    match = _CHAR_RANGE_RE.match(expr)
    if match:
        start, end = _ALPHABET.index(match.group(1)), _ALPHABET.index(match.group(2))
        step = int(match.group(3) or 1) or 1
        return abs(end - start) // step + 1
    return None


def _count(pattern: str, spec: object, where: str, *, literal_groups: bool = False) -> int:
    """How many strings braceexpand(pattern) yields; UrlError when it is malformed.

    Mirrors braceexpand's grammar (pattern = product of literals and groups; group =
    range or comma list of patterns) without expanding anything. ``literal_groups``: a
    group that is neither range nor list is kept literally, as braceexpand keeps it (its
    inner groups still expand); otherwise it is an error.
    """
    total = 1
    pos = 0
    while pos < len(pattern):
        char = pattern[pos]
        if char == "\\":
            pos += 2
            continue
        if char == "}":
            raise url_error(
                spec,
                "Unbalanced braces",
                "every '}' to close an earlier '{'",
                f"a stray '}}' at position {pos} of {brief_repr(pattern)}",
                _HINT_BRACES,
                where=where,
            )
        if char == "{":
            close = _find_close(pattern, pos)
            if close < 0:
                raise url_error(
                    spec,
                    "Unbalanced braces",
                    "every '{' to be closed by a '}'",
                    f"an unclosed '{{' at position {pos} of {brief_repr(pattern)}",
                    _HINT_BRACES,
                    where=where,
                )
            expr = pattern[pos + 1 : close]
            count = _range_count(expr)
            if count is None:
                alternatives = _split_top_commas(expr)
                if len(alternatives) < 2 and literal_groups:
                    alternatives = [expr]
                elif len(alternatives) < 2:
                    raise url_error(
                        spec,
                        "Malformed brace pattern",
                        "a range {first..last[..step]} or a list {a,b,...} in braces",
                        f"{{{expr}}}",
                        _HINT_BRACES,
                        where=where,
                    )
                count = sum(
                    _count(alt, spec, where, literal_groups=literal_groups) for alt in alternatives
                )
            total *= count
            pos = close + 1
            continue
        pos += 1
    return total


def expand_pattern(pattern: str, spec: object, where: str = "") -> list[str]:
    # A shell command's braces (awk '{print}', ${VAR}) are webdataset's business: kept.
    count = _count(pattern, spec, where, literal_groups=is_pipe_url(pattern))
    if count > MAX_EXPANSION:
        raise url_error(
            spec,
            "Brace pattern too large",
            f"at most {MAX_EXPANSION:,} URLs",
            f"{count:,}",
            "Check the range bounds (a typo such as an extra digit multiplies the count).",
            count=count,
            where=where,
        )
    return [checked_url(url, spec, where) for url in braceexpand(pattern)]


__all__ = ["MAX_EXPANSION", "expand_pattern"]
