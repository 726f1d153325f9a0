"""Text between marker lines: the one way every generated block is found, replaced and checked.

``python3 -m ci.generate`` writes the blocks; each generator (``ci/path_table.py``,
``ci/params_table.py``, ``ci/agenda.py``, ``ci/changes_table.py``) returns what a file should
hold, and :func:`check_or_write` compares or writes it.
"""

from __future__ import annotations

import sys
from pathlib import Path


def between(text: str, start: str, end: str) -> str:
    """The text between ``start`` and ``end``.

    Raises:
        ValueError: a marker is missing or repeated, or the end comes first.
    """
    if text.count(start) != 1 or text.count(end) != 1 or text.index(end) < text.index(start):
        raise ValueError(f"the file must contain the lines {start} and {end} exactly once each, in that order")
    return text.split(start, 1)[1].split(end, 1)[0]


def render(text: str, block: str, start: str, end: str) -> str:
    """``text`` with the text between the markers replaced by ``block`` (on lines of its own).

    Raises:
        ValueError: as :func:`between`.
    """
    between(text, start, end)
    head, rest = text.split(start, 1)
    return f"{head}{start}\n{block.strip(chr(10))}\n{end}{rest.split(end, 1)[1]}"


def replace_lines(text: str, new: str, start: str, end: str, prefix: str = "") -> str:
    """``text`` with the lines between the lines ``prefix + start`` and ``prefix + end`` replaced
    by ``new``, each of its lines prefixed (``"# "`` in a jupytext twin).

    Raises:
        ValueError: either marker line is missing or repeated, or the end comes first.
    """
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if line.rstrip() == prefix + start]
    ends = [i for i, line in enumerate(lines) if line.rstrip() == prefix + end]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise ValueError(f"needs the lines {prefix + start!r} and {prefix + end!r} once each, in that order")
    return "\n".join(lines[:starts[0] + 1] + [(prefix + line).rstrip() for line in new.split("\n")]
                     + lines[ends[0]:])


def check_or_write(path: Path, current: str, wanted: str, check: bool, what: str) -> int:
    """``check``: 0 if ``path`` (holding ``current``) already holds ``wanted``, else 1 (saying
    so on stderr); otherwise write ``wanted`` there if it differs, and return 0."""
    if check:
        if wanted == current:
            return 0
        print(f"{path.name}: out of date ({what}): run python3 -m ci.generate", file=sys.stderr)
        return 1
    if wanted != current:
        path.write_text(wanted, encoding="utf-8")
        print(f"wrote {what} into {path.name}")
    return 0
