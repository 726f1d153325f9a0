"""The README's path table, each lesson's opening block and its "Next" link, from the manifest.

Part of ``python3 -m ci.generate`` (the one command that writes every generated text). The
lessons, their titles, outcomes and needs come from ``notebooks/lessons.toml``
(:mod:`helpers.lessons`); the run times from ``docs/run_times.json``, which ``python3 -m
ci.generate --record build/<profile>/times.json --profile <profile>`` fills from a runner's
record (``ci.outputs.record_times``): ``{"profiles": {profile: {stem: {"seconds", "date",
"machine"}}}}``.

- README, between ``<!-- path:start -->`` and ``<!-- path:end -->``: the whole table (lesson
  link, outcome, needs), the casebook's table, and :func:`run_time_line`.
- Each notebook's first cell, between ``<!-- opening:start -->`` and ``<!-- opening:end -->``:
  what the learner will be able to do and what it needs (links); nothing measured or estimated,
  so a new record or a prose edit never touches it.
- Each notebook's last cell, between ``<!-- next:start -->`` and ``<!-- next:end -->``: a link
  to the next lesson of the path.

The ``.ipynb`` and its jupytext twin ``.py`` are written together (in the twin each line starts
with ``# ``).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import nbformat

from ci import marked
from helpers import lessons as manifest

REPO_ROOT = manifest.REPO_ROOT
README = REPO_ROOT / "README.md"
NOTEBOOKS = REPO_ROOT / "notebooks"
TIMES = REPO_ROOT / "docs" / "run_times.json"
START = "<!-- path:start -->"
END = "<!-- path:end -->"
OPEN_START = "<!-- opening:start -->"
OPEN_END = "<!-- opening:end -->"
NEXT_START = "<!-- next:start -->"
NEXT_END = "<!-- next:end -->"
STEM = re.compile(r"\(notebooks/([^)/]+)\.ipynb\)")
WORDS_PER_MIN = 200
COMMENT = re.compile(r"<!--.*?-->", re.S)
ABOUT_A_MINUTE_S = 90  # a run up to this long is "about a minute"


def load_times(path: Path = TIMES) -> dict:
    """``{profile: {stem: {"seconds", "date", "machine"}}}`` from ``docs/run_times.json``.

    Raises:
        OSError, ValueError: the file is missing or not JSON.
    """
    return json.loads(path.read_text(encoding="utf-8")).get("profiles", {})


def seconds(times: dict, profile: str, stem: str) -> float | None:
    entry = times.get(profile, {}).get(stem)
    return float(entry["seconds"]) if entry else None


def _link(lesson: manifest.Lesson, prefix: str = "") -> str:
    return f"[{lesson.name}]({prefix}{lesson.stem}.ipynb)"


def _needs(lesson: manifest.Lesson, labels: dict) -> str:
    return ", ".join(_link(labels[n]) for n in lesson.needs) or "PyTorch basics"


def run_time_line(times: dict) -> str:
    """The one line on run times (README, docs/TEACHING.md): every notebook runs in about a
    minute; those recorded longer in ``docs/run_times.json`` are named, per profile."""
    longer = [f"{stem.split('_', 1)[0]} takes {math.ceil(e['seconds'] / 60)} min in `{profile}`"
              for profile in ("smoke", "full") for stem, e in sorted(times.get(profile, {}).items())
              if e["seconds"] > ABOUT_A_MINUTE_S]
    machines = "; ".join(sorted({e["machine"] for p in times.values() for e in p.values()}))
    return ("**Run time:** every notebook runs in about a minute on a laptop, as you run it (the "
            f"`smoke` profile) and in the main job's larger `full` one; measured on "
            f"{machines or 'no machine yet'}" + (f". Longer: {', '.join(longer)}." if longer else "."))


def block(lessons: list[manifest.Lesson], times: dict) -> str:
    """The README's text between the path markers."""
    out = []
    for kind, head in (("lesson", "you will be able to"), ("casebook", "the cases")):
        chosen = [lesson for lesson in lessons if lesson.kind == kind]
        if not chosen:
            continue
        if kind == "casebook":
            out += ["", "**The casebook**: mistakes people report, each run with its wrong value, its fix and "
                    "the check that catches it; find yours [by symptom](docs/CASEBOOK.md).", ""]
        out += [f"| {kind} | {head} | needs |", "| --- | --- | --- |"]
        for lesson in chosen:
            needs = ", ".join(lesson.needs) or "PyTorch basics"
            out.append(f"| {_link(lesson, 'notebooks/')} | {lesson.outcome} | {needs} |")
    return "\n".join(out).strip("\n") + "\n\n" + run_time_line(times)


def markdown_words(text: str) -> int:
    """Tokens with a letter or digit in one markdown cell's ``text``, the generated blocks and
    HTML comments left out."""
    for start, end in ((OPEN_START, OPEN_END), (NEXT_START, NEXT_END)):
        if start in text and end in text:
            head, rest = text.split(start, 1)
            text = head + rest.split(end, 1)[1]
    return sum(1 for w in COMMENT.sub(" ", text).split() if re.search(r"\w", w))


def prose_words(nb) -> int:
    """:func:`markdown_words` of every markdown cell of ``nb``."""
    return sum(markdown_words(cell.source) for cell in nb.cells if cell.cell_type == "markdown")


def opening(lesson: manifest.Lesson, lessons: list[manifest.Lesson]) -> str:
    """The generated opening of ``lesson``'s first cell (markdown, one paragraph)."""
    does = f"**You will be able to** {lesson.outcome}. " if lesson.kind == "lesson" else ""
    return f"{does}**You need** {_needs(lesson, manifest.by_label(lessons))}."


def next_link(lesson: manifest.Lesson, lessons: list[manifest.Lesson]) -> str:
    """The generated "Next" line of ``lesson``'s last cell: links to notebooks only (the handout's
    README is not the repository's)."""
    same = [other for other in lessons if other.kind == lesson.kind]
    later = same[same.index(lesson) + 1:]
    if later:
        return f"**Next:** {_link(later[0])}: {later[0].outcome}."
    if lesson.kind == "lesson":
        book = [other for other in lessons if other.kind == "casebook"]
        more = f" When you meet a symptom, the casebook starts at {_link(book[0])}." if book else ""
        return f"**Next:** this is the last lesson of the path.{more}"
    return "**Next:** this is the casebook's last page; the others: " + ", ".join(
        _link(other) for other in same if other is not lesson) + "."


def lesson_texts(lesson: manifest.Lesson, lessons: list[manifest.Lesson],
                 notebooks: Path) -> list[tuple[Path, str, str]]:
    """``(path, current, wanted)`` for ``<stem>.ipynb`` and its twin ``<stem>.py``: the opening
    block of the first cell and the "Next" block of the last cell rewritten.

    Raises:
        ValueError: a file or its markers are missing, or the first or last cell is not markdown.
        OSError: a file cannot be read.
    """
    ipynb, twin = notebooks / f"{lesson.stem}.ipynb", notebooks / f"{lesson.stem}.py"
    if not ipynb.is_file() and twin.is_file():
        raise ValueError(f"{ipynb.name} is missing: pair the twin and write the notebook with `jupytext "
                         f"--set-formats ipynb,py:percent --set-kernel python3 notebooks/{twin.name}`")
    current_nb = ipynb.read_text(encoding="utf-8")
    nb = nbformat.reads(current_nb, as_version=nbformat.NO_CONVERT)
    if not nb.cells or nb.cells[0].cell_type != "markdown" or nb.cells[-1].cell_type != "markdown":
        raise ValueError(f"{ipynb.name}: the first cell (the opening) and the last (the next link) must be markdown")
    head, tail = opening(lesson, lessons), next_link(lesson, lessons)
    wanted_py = current_py = twin.read_text(encoding="utf-8")
    try:
        nb.cells[0].source = marked.replace_lines(nb.cells[0].source, head, OPEN_START, OPEN_END)
        nb.cells[-1].source = marked.replace_lines(nb.cells[-1].source, tail, NEXT_START, NEXT_END)
        for new, start, end in ((head, OPEN_START, OPEN_END), (tail, NEXT_START, NEXT_END)):
            wanted_py = marked.replace_lines(wanted_py, new, start, end, prefix="# ")
    except ValueError as e:
        raise ValueError(f"{lesson.stem}: {e}") from None
    return [(ipynb, current_nb, nbformat.writes(nb) + "\n"), (twin, current_py, wanted_py)]


def outputs(readme: Path, times_file: Path, notebooks: Path, manifest_file: Path | None = None
            ) -> list[tuple[Path, str, str, str]]:
    """``(path, current, wanted, what)`` for the README and every notebook of the manifest.

    Raises:
        ManifestError, ValueError, OSError, KeyError: see :func:`lesson_texts`.
    """
    lessons = manifest.load(manifest_file or notebooks / manifest.MANIFEST.name)
    times = load_times(times_file)
    current = readme.read_text(encoding="utf-8")
    out = [(readme, current, marked.render(current, block(lessons, times), START, END), "the README's path table")]
    for lesson in lessons:
        out += [(p, now, new, "the opening and next link") for p, now, new in
                lesson_texts(lesson, lessons, notebooks)]
    return out
