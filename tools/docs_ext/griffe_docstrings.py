"""A griffe extension for the API pages: shardcache's docstrings, written in reST habits,
read as Markdown. ``>>>`` examples become ``pycon`` code blocks (Markdown would show them as
nested quotes) and Sphinx roles (``:class:`x```) become code spans."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|func|meth|attr|mod|exc|data|obj):`~?([^`]+)`")


def markdown(text: str) -> str:
    out: list[str] = []
    in_example = False
    for line in text.splitlines():
        prompt = line.lstrip().startswith((">>>", "... ")) or line.strip() == "..."
        if prompt and not in_example:
            out.append("```pycon")
            in_example = True
        elif in_example and not prompt:
            out.append("```")
            in_example = False
        out.append(line.strip() if in_example else line)
    if in_example:
        out.append("```")
    return ROLE.sub(r"`\1`", "\n".join(out))


class DocstringsAsMarkdown(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
