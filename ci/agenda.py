"""docs/TEACHING.md's workshop agendas, from the manifest and the measured run times.

Part of ``python3 -m ci.generate``.

Each lesson of the manifest's path (``notebooks/lessons.toml``, kind ``lesson``) gets a slot: its
words of prose at :data:`ci.path_table.WORDS_PER_MIN` plus :data:`MIN_PER_EXERCISE` minutes per
``### Exercise`` heading, rounded up to 5 minutes (so most prose edits leave it as it is; every
lesson runs in about a minute, :func:`ci.path_table.run_time_line`). The 3-hour agenda is the
workshop path (:mod:`ci.workshop`: chosen sections of the lessons, timed section by section);
the whole course is two days, split where half its minutes are done, each day from 9:00 with
lunch (:data:`LUNCH_MIN`) before the first lesson that would start after :data:`LUNCH_AFTER_MIN`
minutes.
"""

from __future__ import annotations

import math
from pathlib import Path

import nbformat

from ci import marked, path_table, workshop
from ci.workshop import clock
from helpers import lessons as manifest

TEACHING = path_table.REPO_ROOT / "docs" / "TEACHING.md"
START = "<!-- agenda:start -->"
END = "<!-- agenda:end -->"
MIN_PER_EXERCISE = 8
LUNCH_MIN = 60
LUNCH_AFTER_MIN = 180  # 12:00 on a day that starts at 9:00


def slots(lessons: list[str], notebooks: Path) -> list[dict]:
    """One row per lesson: ``stem``, ``exercises`` and ``slot_min`` (minutes, a multiple of 5)."""
    rows = []
    for stem in lessons:
        nb = nbformat.read(str(notebooks / f"{stem}.ipynb"), as_version=4)
        exercises = sum(c.source.count("### Exercise") for c in nb.cells if c.cell_type == "markdown")
        minutes = path_table.prose_words(nb) / path_table.WORDS_PER_MIN + exercises * MIN_PER_EXERCISE
        rows.append(dict(stem=stem, exercises=exercises, slot_min=5 * math.ceil(minutes / 5)))
    return rows


def _schedule(rows: list[dict], start: int, breaks: dict[int, str]) -> list[str]:
    """Table lines from ``start`` (minutes after the start), a break row inserted before the
    lesson with index ``i`` when ``i in breaks`` (value: label, length after ``=``)."""
    lines = ["| starts | lesson | slot |", "| --- | --- | --- |"]
    t = start
    for i, row in enumerate(rows):
        if i in breaks:
            label, length = breaks[i].split("=")
            lines.append(f"| {clock(t)} | *{label}* | {length} min |")
            t += int(length)
        lines.append(f"| {clock(t)} | [{row['stem']}](../notebooks/{row['stem']}.ipynb) | {row['slot_min']} min |")
        t += row["slot_min"]
    lines.append(f"| {clock(t)} | *end* | |")
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


def block(rows: list[dict], times: dict, workshop_rows: list[dict] | None = None) -> str:
    """The generated text between the markers: the lesson table, the 3-hour workshop path
    (:mod:`ci.workshop`) and the two-day agenda."""
    out = ["| lesson | exercises | slot |", "| --- | --- | --- |"]
    out += [f"| {r['stem']} | {r['exercises']} | {r['slot_min']} min |" for r in rows]
    out += ["", f"A slot is an estimate: reading at {path_table.WORDS_PER_MIN} words/min and "
            f"{MIN_PER_EXERCISE} min per exercise, rounded up to 5 min. {path_table.run_time_line(times)} "
            "Written by `python3 -m ci.generate`, never by hand.", ""]
    if workshop_rows:
        table, buffer = workshop.block(workshop_rows)
        taught = {r["lesson"].stem for r in workshop_rows}
        out += [f"**3 hours: the workshop path** (times from the start; {buffer} min of the "
                f"{workshop.TEACHING_MIN} left as buffer). It reaches DDP on MNIST against one process and ends "
                "with a silent bug found by a check. Run times are the measured seconds of the cells of those "
                "sections (and of each lesson's set-up cells) in the `smoke` profile, as students run them; every "
                "section runs in CI as part of its lesson. The sections and exercises are chosen in "
                "`notebooks/lessons.toml` (`[[workshop]]`).", "", table, "",
                "Homework, or a second session: the sections not taught above, and "
                + ", ".join(r["stem"] for r in rows if r["stem"] not in taught) + "."]
    split = _first_after(rows, sum(r["slot_min"] for r in rows) / 2)
    for day, part in ((1, rows[:split]), (2, rows[split:])):
        lunch = _first_after(part, LUNCH_AFTER_MIN)
        out += ["", f"**The whole course, day {day}** (9:00 start):", ""]
        out += _schedule(part, 9 * 60, {lunch: f"lunch={LUNCH_MIN}"} if 0 < lunch < len(part) else {})
    return "\n".join(out)


def outputs(teaching: Path = TEACHING, times_file: Path = path_table.TIMES, notebooks: Path = path_table.NOTEBOOKS,
            manifest_file: Path | None = None) -> list[tuple[Path, str, str, str]]:
    """``[(teaching, current, wanted, what)]`` for docs/TEACHING.md's agendas.

    Raises:
        ManifestError, ValueError, OSError, KeyError: the manifest, a lesson, the record or the markers.
    """
    times = path_table.load_times(times_file)
    manifest_file = manifest_file or notebooks / manifest.MANIFEST.name
    rows = slots(manifest.stems("lesson", manifest_file), notebooks)
    path = workshop.rows(manifest.workshop(manifest_file), manifest.load(manifest_file), times, notebooks,
                         MIN_PER_EXERCISE)
    current = teaching.read_text(encoding="utf-8")
    return [(teaching, current, marked.render(current, block(rows, times, path), START, END), "the agendas")]
