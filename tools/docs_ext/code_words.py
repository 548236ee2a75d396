"""A mkdocs hook for the site's inline code: a code span of several words
(``<temp dir>/shardcache-<uid>/node-locks``, ``shardcache warm --dry-run``) may wrap
between its words but never inside one (docs/stylesheets/extra.css keeps each word on one
line). Browsers would otherwise break such a span after any hyphen or slash (``--`` and
``help`` on two lines); a span of one word stays on one line by the stylesheet alone."""

from __future__ import annotations

import xml.etree.ElementTree as etree
from typing import Any

from markdown import Extension, Markdown
from markdown.treeprocessors import Treeprocessor
from markdown.util import AtomicString

CLASS = "words"  # the class extra.css gives the code spans split here


class CodeWords(Treeprocessor):
    def run(self, root: etree.Element) -> None:
        blocks = {id(code) for pre in root.iter("pre") for code in pre.iter("code")}
        for code in root.iter("code"):
            words = (code.text or "").split()
            if id(code) in blocks or len(code) or len(words) < 2:
                continue
            code.set("class", CLASS)
            code.text = None
            for index, word in enumerate(words):
                span = etree.SubElement(code, "span")
                span.text = AtomicString(word)
                span.tail = None if index == len(words) - 1 else " "


class CodeWordsExtension(Extension):
    def extendMarkdown(self, md: Markdown) -> None:
        # After the inline patterns (priority 20), which make the code spans.
        md.treeprocessors.register(CodeWords(md), "code_words", 5)


def on_config(config: Any) -> Any:
    config.markdown_extensions.append(CodeWordsExtension())
    return config
