#!/usr/bin/env python3
"""Write the run times of the README's path table and of each lesson's opening from a recorded run.

Usage (from anywhere)::

    python3 ci/path_table.py --record build/full/times.json   # take a full run's times, rewrite
    python3 ci/path_table.py                                  # rewrite from docs/run_times.json
    python3 ci/path_table.py --check                          # exit 1 if README or a lesson is out of date

The runner (``ci/run_notebooks.py``) merges each passing notebook's seconds, date and machine
into ``build/<profile>/times.json`` (``ci.outputs.record_times``). ``--record FILE`` copies such a
record into ``docs/run_times.json`` (committed, so ``--check`` and the tests need no run); the
README is then rendered from that file. Between ``<!-- path:start -->`` and ``<!-- path:end -->``
the table's rows are typed by hand (lesson link ``notebooks/<stem>.ipynb`` first, run time
last); this script rewrites only each row's last cell, and the one line under the table that
says where and when the times were measured. A lesson without a recorded time reads "not
measured yet".

Each lesson the table names (``notebooks/<stem>.ipynb`` and its jupytext twin ``<stem>.py``)
holds, in its first (markdown) cell, one line between ``<!-- run-time:start -->`` and
``<!-- run-time:end -->``; this script writes it in both files, e.g. ``**Run time**
(measured): 36 s in the `full` profile on Linux x86_64, 2 CPU cores, no GPU (2026-12-03).
**Reading time** (estimate: about 3,400 words of prose at 200 words/min): about 17 min.``
The words are the whitespace-separated tokens holding a letter or digit in the lesson's
markdown cells (tables and links included, HTML comments and this line left out), rounded to
the nearest 100; the minutes are that count over 200, at least 1.

Exit codes: 0 written / up to date; 1 ``--check`` found the README or a lesson out of date;
2 the markers, the table, a lesson or a record is missing or unreadable.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import nbformat

from ci import params_table

REPO_ROOT = params_table.REPO_ROOT
README = REPO_ROOT / "README.md"
NOTEBOOKS = REPO_ROOT / "notebooks"
TIMES = REPO_ROOT / "docs" / "run_times.json"
START = "<!-- path:start -->"
END = "<!-- path:end -->"
NOTE = "Run times: "
STEM = re.compile(r"\(notebooks/([^)/]+)\.ipynb\)")
NB_START = "<!-- run-time:start -->"
NB_END = "<!-- run-time:end -->"
WORDS_PER_MIN = 200
COMMENT = re.compile(r"<!--.*?-->", re.S)


def fmt_seconds(seconds: float) -> str:
    """``57 s`` under 100 s, else whole minutes (``9 min``)."""
    return f"{round(seconds)} s" if seconds < 100 else f"{round(seconds / 60)} min"


def block(current: str, times: dict) -> str:
    """The new text between the markers: ``current``'s table with its last column from ``times``.

    ``times`` is a ``docs/run_times.json`` record: ``{"profile", "source" (optional),
    "notebooks": {stem: {"seconds", "date", "machine"}}}``.

    Raises:
        ValueError: no table between the markers, or a row names no ``notebooks/<stem>.ipynb``.
    """
    measured = times.get("notebooks", {})
    lines = [line for line in current.strip("\n").splitlines() if line.startswith("|")]
    if len(lines) < 3:
        raise ValueError(f"no table (header, rule, rows) between {START} and {END}")
    out = lines[:2]
    used = []
    for line in lines[2:]:
        cells = line.strip().strip("|").split(" | ")
        match = STEM.search(cells[0])
        if not match:
            raise ValueError(f"a path-table row names no notebooks/<stem>.ipynb: {line!r}")
        entry = measured.get(match.group(1))
        cells[-1] = fmt_seconds(float(entry["seconds"])) if entry else "not measured yet"
        if entry:
            used.append(entry)
        out.append("| " + " | ".join(c.strip() for c in cells) + " |")
    dates = sorted({e["date"] for e in used})
    machines = sorted({e["machine"] for e in used})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}" if dates else "no date"
    source = f" ({times['source']})" if times.get("source") else ""
    note = (f"{NOTE}the `{times.get('profile', 'full')}` profile's, measured on "
            f"{'; '.join(machines) or 'no machine'}, {when}{source}; written by "
            f"`python3 ci/path_table.py`, never by hand.")
    return "\n".join(out) + "\n\n" + note


def prose_words(nb) -> int:
    """Tokens with a letter or digit in ``nb``'s markdown cells, the run-time line and HTML
    comments left out."""
    words = 0
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        text = cell.source
        if NB_START in text and NB_END in text:
            head, rest = text.split(NB_START, 1)
            text = head + rest.split(NB_END, 1)[1]
        words += sum(1 for w in COMMENT.sub(" ", text).split() if re.search(r"\w", w))
    return words


def reading_estimate(words: int) -> tuple[int, int]:
    """``(words rounded to the nearest 100, at least 100; minutes at WORDS_PER_MIN, at least 1)``:
    the reading time a lesson's opening line and docs/TEACHING.md's agendas both show."""
    rounded = max(100, round(words / 100) * 100)
    return rounded, max(1, round(rounded / WORDS_PER_MIN))


def lesson_line(entry: dict | None, profile: str, words: int) -> str:
    """The one line a lesson's opening shows: measured run time (``entry`` from the record, or
    None) and the reading time estimated from ``words`` of prose."""
    if entry:
        run = (f"**Run time** (measured): {fmt_seconds(float(entry['seconds']))} in the `{profile}` profile "
               f"on {entry['machine']} ({entry['date']}).")
    else:
        run = "**Run time**: not measured yet."
    rounded, minutes = reading_estimate(words)
    return (f"{run} **Reading time** (estimate: about {rounded:,} words of prose at "
            f"{WORDS_PER_MIN} words/min): about {minutes} min.")


def _replace_marked(text: str, new: str, start: str, end: str, prefix: str = "") -> str:
    """``text`` with the lines between the lines ``prefix + start`` and ``prefix + end``
    replaced by ``prefix + new``.

    Raises:
        ValueError: either marker line is missing or repeated, or the end comes first.
    """
    lines = text.split("\n")
    starts = [i for i, line in enumerate(lines) if line.rstrip() == prefix + start]
    ends = [i for i, line in enumerate(lines) if line.rstrip() == prefix + end]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise ValueError(f"needs the lines {prefix + start!r} and {prefix + end!r} once each, in that order")
    return "\n".join(lines[:starts[0] + 1] + [prefix + new] + lines[ends[0]:])


def lesson_texts(stem: str, times: dict, notebooks: Path) -> list[tuple[Path, str, str]]:
    """``(path, current, wanted)`` for ``<stem>.ipynb`` and its twin ``<stem>.py``: the
    run-time line of the first cell rewritten from ``times``.

    Raises:
        ValueError: a file or its markers are missing, or the first cell is not markdown.
        OSError: a file cannot be read.
    """
    ipynb, twin = notebooks / f"{stem}.ipynb", notebooks / f"{stem}.py"
    current_nb = ipynb.read_text(encoding="utf-8")
    nb = nbformat.reads(current_nb, as_version=nbformat.NO_CONVERT)
    if not nb.cells or nb.cells[0].cell_type != "markdown":
        raise ValueError(f"{ipynb.name}: the first cell must be markdown (it holds the run-time line)")
    line = lesson_line(times.get("notebooks", {}).get(stem), times.get("profile", "full"), prose_words(nb))
    try:
        nb.cells[0].source = _replace_marked(nb.cells[0].source, line, NB_START, NB_END)
        current_py = twin.read_text(encoding="utf-8")
        wanted_py = _replace_marked(current_py, line, NB_START, NB_END, prefix="# ")
    except ValueError as e:
        raise ValueError(f"{stem}: its first cell {e}") from None
    return [(ipynb, current_nb, nbformat.writes(nb) + "\n"), (twin, current_py, wanted_py)]


def _between(text: str) -> str:
    if text.count(START) != 1 or text.count(END) != 1:
        raise ValueError(f"README.md must contain the lines {START} and {END} exactly once each")
    return text.split(START, 1)[1].split(END, 1)[0]


def lessons(readme: Path = README) -> list[str]:
    """The course's lessons, in path order: the stems the README's path table links to.

    Raises:
        ValueError: the README has no path table markers.
    """
    return STEM.findall(_between(readme.read_text(encoding="utf-8")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="exit 1 if the README's run times are out of date")
    group.add_argument("--record", type=Path, metavar="FILE",
                       help="a runner's times.json (e.g. build/full/times.json) to copy into docs/run_times.json")
    parser.add_argument("--profile", default="full", help="the profile --record's file comes from (default full)")
    parser.add_argument("--readme", type=Path, default=README, help=argparse.SUPPRESS)
    parser.add_argument("--times", type=Path, default=TIMES, help=argparse.SUPPRESS)
    parser.add_argument("--notebooks", type=Path, default=NOTEBOOKS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.record:
            notebooks = json.loads(args.record.read_text(encoding="utf-8"))
            times = {"profile": args.profile, "notebooks": notebooks}
            args.times.write_text(json.dumps(times, indent=1) + "\n", encoding="utf-8")
        else:
            times = json.loads(args.times.read_text(encoding="utf-8"))
        current = args.readme.read_text(encoding="utf-8")
        table = _between(current)
        wanted = params_table.render(current, block(table, times), START, END)
        lessons = [t for stem in STEM.findall(table) for t in lesson_texts(stem, times, args.notebooks)]
    except (ValueError, OSError, KeyError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    how = ": run python3 ci/path_table.py"
    rcs = [params_table.check_or_write(args.readme, current, wanted, args.check, "the path table", how)]
    for path, now, new in lessons:
        if args.check or new != now:  # a lesson already up to date is not listed when writing
            rcs.append(params_table.check_or_write(path, now, new, args.check, "the run-time line", how))
    return max(rcs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
