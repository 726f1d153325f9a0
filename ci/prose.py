"""Measure the lessons' prose: words and parentheses per sentence, and the longest claim.

``python3 -m ci.lessons prose [NN ...]`` prints them, one row a notebook. What counts (issue
#45's rule, the ``prose`` rule of ``ci/lessons.py``): the markdown cells of a notebook, less
headings, table rows, fenced code, inline code spans, HTML comments and tags, the generated
blocks and link targets. A sentence ends in ``.``, ``!`` or ``?`` followed by a space or the end
of a paragraph; words are whitespace-separated tokens holding a letter or digit; parentheses
are the ``(`` left. A claim is a paragraph that starts with ``**Claim``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import nbformat

#: the targets every lesson meets (the ``prose`` and ``claims`` rules of ci/lessons.py)
MAX_WORDS_PER_SENTENCE = 20.0
MAX_PARENS_PER_SENTENCE = 0.3
MAX_CLAIM_WORDS = 60

#: the generated opening and "Next" blocks of a lesson
GENERATED = re.compile(r"<!-- (opening|next):start -->.*?<!-- \1:end -->", re.S)
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_TAG = re.compile(r"</?[a-zA-Z][^>]*>")
_CODE = re.compile(r"`[^`\n]*`")
_LINK_TARGET = re.compile(r"\]\([^)\s]*\)")
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def plain_text(markdown: str) -> str:
    """``markdown`` with what is not prose removed (see the module's docstring)."""
    text = _COMMENT.sub(" ", _FENCE.sub(" ", GENERATED.sub(" ", markdown)))
    text = "\n".join(line for line in text.splitlines()
                     if not line.lstrip().startswith(("#", "|")))  # headings, table rows
    return _TAG.sub(" ", _CODE.sub("CODE", _LINK_TARGET.sub("]", text)))


@dataclass
class Figures:
    words: int
    sentences: int
    parens: int
    longest_claim: int

    @property
    def words_per_sentence(self) -> float:
        return self.words / max(1, self.sentences)

    @property
    def parens_per_sentence(self) -> float:
        return self.parens / max(1, self.sentences)


def measure(notebook: Path, nb=None) -> Figures:
    """The prose figures of ``notebook`` (its cells ``nb`` when already read)."""
    nb = nb or nbformat.read(str(notebook), as_version=4)
    words = sentences = parens = longest = 0
    for cell in (c for c in nb.cells if c.cell_type == "markdown"):
        for paragraph in re.split(r"\n\s*\n", plain_text(cell.source)):
            n = sum(1 for w in paragraph.split() if re.search(r"\w", w))
            words += n
            sentences += max(1, len(_SENTENCE_END.findall(paragraph.strip()))) if n else 0
            parens += paragraph.count("(")
            if paragraph.lstrip().startswith("**Claim"):
                longest = max(longest, n)
    return Figures(words, sentences, parens, longest)
