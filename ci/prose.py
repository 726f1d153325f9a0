"""Measure the lessons' prose: words and parentheses per sentence, and the longest claim.

Usage::

    python3 -m ci.prose              # one row per notebook of the manifest
    python3 -m ci.prose 06a 06b      # some of them

What counts (issue #45's rule, the ``prose`` rule of ``ci/lessons.py``): the markdown cells of a
notebook, less headings, table rows, fenced code, inline code spans, HTML comments and tags, the
generated blocks and link targets. A sentence ends in ``.``, ``!`` or ``?`` followed by a space
or the end of a paragraph; words are whitespace-separated tokens holding a letter or digit;
parentheses are the ``(`` left. A claim is a paragraph that starts with ``**Claim``.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

from helpers import lessons as manifest

NOTEBOOKS = manifest.REPO_ROOT / "notebooks"
#: the targets every lesson meets (the ``prose`` and ``claims`` rules of ci/lessons.py)
MAX_WORDS_PER_SENTENCE = 20.0
MAX_PARENS_PER_SENTENCE = 0.3
MAX_CLAIM_WORDS = 60

_BLOCKS = re.compile(r"<!-- (opening|next):start -->.*?<!-- \1:end -->", re.S)
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_TAG = re.compile(r"</?[a-zA-Z][^>]*>")
_CODE = re.compile(r"`[^`\n]*`")
_LINK_TARGET = re.compile(r"\]\([^)\s]*\)")
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def plain_text(markdown: str) -> str:
    """``markdown`` with what is not prose removed (see the module's docstring)."""
    text = _BLOCKS.sub(" ", markdown)
    text = _FENCE.sub(" ", text)
    text = _COMMENT.sub(" ", text)
    lines = [line for line in text.splitlines()
             if not line.lstrip().startswith(("#", "|"))]  # headings, table rows
    text = "\n".join(lines)
    text = _LINK_TARGET.sub("]", text)
    text = _CODE.sub("CODE", text)
    return _TAG.sub(" ", text)


def _words(text: str) -> int:
    return sum(1 for w in text.split() if re.search(r"\w", w))


@dataclass
class Figures:
    stem: str
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
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        text = plain_text(cell.source)
        for paragraph in re.split(r"\n\s*\n", text):
            if not paragraph.strip():
                continue
            n = _words(paragraph)
            words += n
            sentences += max(1, len(_SENTENCE_END.findall(paragraph.strip()))) if n else 0
            parens += paragraph.count("(")
            if paragraph.lstrip().startswith("**Claim"):
                longest = max(longest, n)
    return Figures(notebook.stem, words, sentences, parens, longest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m ci.prose", description=__doc__.splitlines()[0])
    parser.add_argument("labels", nargs="*", help="lesson labels (06a) or stems; default: every notebook")
    args = parser.parse_args(argv)
    stems = [s for s in manifest.stems(None)
             if not args.labels or s in args.labels or s.split("_", 1)[0] in args.labels]
    print(f"{'notebook':42} {'words':>6} {'sent.':>6} {'w/sent':>7} {'(/sent':>7} {'claim':>6}")
    worst = 0
    for stem in stems:
        f = measure(NOTEBOOKS / f"{stem}.ipynb")
        over = (f.words_per_sentence > MAX_WORDS_PER_SENTENCE or f.parens_per_sentence > MAX_PARENS_PER_SENTENCE
                or f.longest_claim > MAX_CLAIM_WORDS)
        worst |= over
        print(f"{stem:42} {f.words:6d} {f.sentences:6d} {f.words_per_sentence:7.1f} {f.parens_per_sentence:7.2f} "
              f"{f.longest_claim:6d}{'  over' if over else ''}")
    print(f"targets: at most {MAX_WORDS_PER_SENTENCE:g} words and {MAX_PARENS_PER_SENTENCE:g} parentheses per "
          f"sentence, claims of at most {MAX_CLAIM_WORDS} words")
    return 1 if worst else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
