#!/usr/bin/env python3
"""Write docs/TEACHING.md's workshop agendas from the measured run times, never by hand.

Usage (from anywhere)::

    python3 ci/agenda.py            # rewrite the agendas between the markers
    python3 ci/agenda.py --check    # exit 1 if they are out of date

Each lesson of the README's path table (``ci.path_table.lessons``) gets: its run time, measured
(``docs/run_times.json``, the ``full`` profile, an upper bound for the smaller default
parameters students run); its reading time, estimated from its words of prose
(``ci.path_table.reading_estimate``, the same minutes its opening line shows); and its exercise time, estimated at
:data:`MIN_PER_EXERCISE` minutes per ``### Exercise`` heading. A lesson's slot is the three
summed, rounded up to 5 minutes. The 3-hour agenda takes the lessons in path order while they
fit in :data:`SHORT_TEACHING_MIN` minutes (a break after about 90), and lists the rest as
homework; the whole course is two days, split where half its minutes are done, each day from
9:00 with lunch (:data:`LUNCH_MIN`) before the first lesson that would start after
:data:`LUNCH_AFTER_MIN` minutes.

Exit codes: 0 written / up to date; 1 ``--check`` found it out of date; 2 missing markers, lesson
or record.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import nbformat

from ci import params_table, path_table

TEACHING = path_table.REPO_ROOT / "docs" / "TEACHING.md"
START = "<!-- agenda:start -->"
END = "<!-- agenda:end -->"
MIN_PER_EXERCISE = 8
SHORT_TEACHING_MIN = 165  # 3 hours less a 15-minute break
BREAK_AFTER_MIN = 90
LUNCH_MIN = 60
LUNCH_AFTER_MIN = 180  # 12:00 on a day that starts at 9:00


def slots(lessons: list[str], times: dict, notebooks: Path) -> list[dict]:
    """One row per lesson: ``stem``, ``run_min`` (measured, None when not recorded),
    ``read_min`` and ``exercise_min`` (estimates), ``slot_min`` (their sum rounded up to 5)."""
    rows = []
    for stem in lessons:
        nb = nbformat.read(str(notebooks / f"{stem}.ipynb"), as_version=4)
        entry = times.get("notebooks", {}).get(stem)
        run_min = math.ceil(float(entry["seconds"]) / 60) if entry else None
        read_min = path_table.reading_estimate(path_table.prose_words(nb))[1]  # the lesson's own line
        exercises = sum(c.source.count("### Exercise") for c in nb.cells if c.cell_type == "markdown")
        ex_min = exercises * MIN_PER_EXERCISE
        slot = 5 * math.ceil(((run_min or 0) + read_min + ex_min) / 5)
        rows.append(dict(stem=stem, run_min=run_min, read_min=read_min, exercises=exercises,
                         exercise_min=ex_min, slot_min=slot))
    return rows


def _clock(minutes: int) -> str:
    return f"{minutes // 60}:{minutes % 60:02d}"


def _schedule(rows: list[dict], start: int, breaks: dict[int, str]) -> list[str]:
    """Table lines from ``start`` (minutes after the start), a break row inserted before the
    lesson with index ``i`` when ``i in breaks`` (value: label, length after ``=``)."""
    lines = ["| starts | lesson | slot |", "| --- | --- | --- |"]
    t = start
    for i, row in enumerate(rows):
        if i in breaks:
            label, length = breaks[i].split("=")
            lines.append(f"| {_clock(t)} | *{label}* | {length} min |")
            t += int(length)
        lines.append(f"| {_clock(t)} | [{row['stem']}](../notebooks/{row['stem']}.ipynb) | {row['slot_min']} min |")
        t += row["slot_min"]
    lines.append(f"| {_clock(t)} | *end* | |")
    return lines


def _first_after(rows: list[dict], minutes: float) -> int:
    """Index of the first of ``rows`` that starts once ``minutes`` of slots are done; ``len(rows)``
    if none does."""
    done = 0
    for i, r in enumerate(rows):
        if done >= minutes:
            return i
        done += r["slot_min"]
    return len(rows)


def block(rows: list[dict], times: dict) -> str:
    """The generated text between the markers: the lesson table and the two agendas."""
    machines = sorted({e["machine"] for e in times.get("notebooks", {}).values()})
    out = ["| lesson | run time (measured) | reading (estimate) | exercises (estimate) | slot |",
           "| --- | --- | --- | --- | --- |"]
    for r in rows:
        run = f"{r['run_min']} min" if r["run_min"] is not None else "not measured yet"
        out.append(f"| {r['stem']} | {run} | {r['read_min']} min | {r['exercises']} × {MIN_PER_EXERCISE} min "
                   f"= {r['exercise_min']} min | {r['slot_min']} min |")
    out += ["", f"Run times: the `{times.get('profile', 'full')}` profile's, rounded up to the minute, measured on "
            f"{'; '.join(machines) or 'no machine'} (docs/run_times.json). Reading at "
            f"{path_table.WORDS_PER_MIN} words/min and {MIN_PER_EXERCISE} min per exercise are estimates. "
            "Written by `python3 ci/agenda.py`, never by hand.", ""]
    short, used = [], 0
    for r in rows:
        if used + r["slot_min"] > SHORT_TEACHING_MIN:
            break
        short.append(r)
        used += r["slot_min"]
    brk = _first_after(short, BREAK_AFTER_MIN)
    out += ["**3 hours** (times from the start):", ""]
    out += _schedule(short, 0, {brk: "break=15"} if 0 < brk < len(short) else {})
    rest = rows[len(short):]
    if rest:
        out += ["", "Homework, or a second session: " + ", ".join(r["stem"] for r in rest) + "."]
    split = _first_after(rows, sum(r["slot_min"] for r in rows) / 2)
    for day, part in ((1, rows[:split]), (2, rows[split:])):
        lunch = _first_after(part, LUNCH_AFTER_MIN)
        out += ["", f"**The whole course, day {day}** (9:00 start):", ""]
        out += _schedule(part, 9 * 60, {lunch: f"lunch={LUNCH_MIN}"} if 0 < lunch < len(part) else {})
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the agendas are out of date")
    parser.add_argument("--teaching", type=Path, default=TEACHING, help=argparse.SUPPRESS)
    parser.add_argument("--times", type=Path, default=path_table.TIMES, help=argparse.SUPPRESS)
    parser.add_argument("--notebooks", type=Path, default=path_table.NOTEBOOKS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        times = json.loads(args.times.read_text(encoding="utf-8"))
        rows = slots(path_table.lessons(), times, args.notebooks)
        current = args.teaching.read_text(encoding="utf-8")
        wanted = params_table.render(current, block(rows, times), START, END)
    except (ValueError, OSError, KeyError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return params_table.check_or_write(args.teaching, current, wanted, args.check, "the agendas",
                                       ": run python3 ci/agenda.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
