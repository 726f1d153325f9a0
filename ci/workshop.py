"""The 3-hour workshop path of docs/TEACHING.md: chosen sections of the lessons, each timed.

The path is the manifest's ``[[workshop]]`` records (``notebooks/lessons.toml``): per lesson, the
``## N.`` sections taught and the exercises done in the room. A lesson's cells fall into parts
(:func:`parts_of_cells`): ``setup`` (before the first ``##`` heading: opening, parameters,
imports, which always run), a section's label (``"1"``, ``"2b"``), ``exN`` (an exercise's cells,
from its ``### Exercise N`` heading) and ``summary`` (other ``##`` headings: what we saw, the
next link). A part's run time is the sum of its cells' ``papermill.duration`` in the smoke run
(recorded by ``python3 -m ci.generate --record build/smoke/times.json --profile smoke``);
its reading time, its markdown words at :data:`ci.path_table.WORDS_PER_MIN`; each exercise
:data:`ci.agenda.MIN_PER_EXERCISE` minutes.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import nbformat

from ci import path_table
from helpers import lessons as manifest

SECTION = re.compile(r"^## (\d+[a-z]?)\.", re.M)
OTHER_HEADING = re.compile(r"^## ", re.M)
EXERCISE = re.compile(r"^### Exercise (\d+)", re.M)
TEACHING_MIN = 180
BREAK_MIN = 15
BREAK_AFTER_MIN = 80
MIN_BUFFER = 10
#: Minutes the instructor talks at the projector before the room reads and runs a part (the set-up:
#: what the lesson is for), an estimate like the reading speed.
TALK_MIN = 1


def parts_of_cells(nb) -> list[str]:
    """The part of each cell of ``nb``, in order (see the module's docstring)."""
    current, out = "setup", []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            section, exercise = SECTION.search(cell.source), EXERCISE.search(cell.source)
            if exercise:
                current = f"ex{exercise.group(1)}"
            elif section:
                current = section.group(1)
            elif OTHER_HEADING.search(cell.source):
                current = "summary"
        out.append(current)
    return out


def part_seconds(executed: Path) -> dict[str, float]:
    """``{part: seconds}`` of an executed notebook (papermill's per-cell durations)."""
    nb = nbformat.read(str(executed), as_version=4)
    seconds: dict[str, float] = {}
    for part, cell in zip(parts_of_cells(nb), nb.cells):
        duration = cell.metadata.get("papermill", {}).get("duration")
        if duration is not None:
            seconds[part] = round(seconds.get(part, 0.0) + float(duration), 2)
    return seconds


def rows(parts: list[manifest.WorkshopPart], lessons: list[manifest.Lesson], times: dict,
         notebooks: Path, per_exercise_min: int) -> list[dict]:
    """One row per workshop part: ``lesson`` (the record), ``sections``, ``exercises``, ``run_min``
    (measured, None when not recorded), ``part_min`` (``{part:
    minutes}``: :data:`TALK_MIN` of talk, its reading and its measured run for the set-up and each
    section; ``per_exercise_min`` an exercise, its reading included) and ``slot_min``, their sum rounded up.

    Raises:
        ValueError: a section or exercise the lesson does not have.
    """
    by_label = manifest.by_label(lessons)
    out = []
    for part in parts:
        lesson = by_label[part.lesson]
        nb = nbformat.read(str(notebooks / f"{lesson.stem}.ipynb"), as_version=4)
        labels = parts_of_cells(nb)
        wanted = {"setup", *part.sections, *(f"ex{n}" for n in part.exercises)}
        missing = sorted(wanted - set(labels))
        if missing:
            raise ValueError(f"the workshop path names parts {missing} that {lesson.stem} has no "
                             f"section or exercise for (it has {sorted(set(labels))})")
        words = {p: sum(path_table.markdown_words(c.source) for c, lab in zip(nb.cells, labels)
                        if c.cell_type == "markdown" and lab == p) for p in wanted}
        entry = times.get("smoke", {}).get(lesson.stem, {})
        measured = entry.get("parts")
        run_min = math.ceil(sum(measured.get(p, 0.0) for p in wanted) / 60) if measured else None
        per_part = {p: TALK_MIN + words[p] / path_table.WORDS_PER_MIN + (measured or {}).get(p, 0.0) / 60
                    for p in ("setup", *part.sections)}
        per_part.update({f"ex{n}": per_exercise_min for n in part.exercises})  # its reading included
        out.append(dict(lesson=lesson, sections=part.sections, exercises=part.exercises, run_min=run_min,
                        part_min=per_part, slot_min=math.ceil(sum(per_part.values()))))
    return out


def clock(minutes: int) -> str:
    """``H:MM`` of ``minutes`` (after midnight, or after the start)."""
    return f"{minutes // 60}:{minutes % 60:02d}"


def _parts(minutes: dict[str, float]) -> str:
    """``set-up 3, §1 2, ex1 9``: each part's minutes, rounded to the minute."""
    name = {"setup": "set-up"}
    return ", ".join(f"{name.get(p, f'ex {p[2:]}' if p.startswith('ex') else f'§{p}')} {max(1, round(m))}"
                     for p, m in minutes.items())


def block(rows_: list[dict]) -> tuple[str, int]:
    """The workshop's agenda (markdown) and the minutes left as buffer in :data:`TEACHING_MIN`."""
    lines = ["| starts | lesson | sections taught | exercises | minutes per part (talk, reading, run; "
             "exercise) | slot |", "| --- | --- | --- | --- | --- | --- |"]
    t, broke = 0, False
    for r in rows_:
        if not broke and t >= BREAK_AFTER_MIN:
            lines.append(f"| {clock(t)} | *break* | | | | {BREAK_MIN} min |")
            t += BREAK_MIN
            broke = True
        lesson = r["lesson"]
        sections = ", ".join(f"§{s}" for s in r["sections"])
        exercises = ", ".join(str(n) for n in r["exercises"]) or "none"
        lines.append(f"| {clock(t)} | [{lesson.name}](../notebooks/{lesson.stem}.ipynb) | {sections} | {exercises} | "
                     f"{_parts(r['part_min'])} | {r['slot_min']} min |")
        t += r["slot_min"]
    if not broke:
        t += BREAK_MIN
    lines.append(f"| {clock(t)} | *end* | | | | |")
    return "\n".join(lines), TEACHING_MIN - t
