#!/usr/bin/env python3
"""The handout for a workshop: the course's lessons without their solutions, ready to open.

Usage (from the repository root)::

    python3 -m ci.student_copies                       # every lesson -> student/ (git-ignored)
    python3 -m ci.student_copies 04 06a --output-dir /tmp/workshop

The lessons are the manifest's (``notebooks/lessons.toml``), in its order. Each is written to
``<output-dir>/notebooks/<stem>.ipynb`` by nbconvert's ``NotebookExporter``:
``TagRemovePreprocessor`` drops the cells tagged ``solution``, ``ClearOutputPreprocessor`` clears
outputs; exercise and check cells stay. :class:`StudentPreprocessor` keeps the copy a student's
own: an exercise's check runs inside ``check_exercise_N()`` with
:func:`helpers.notebook.sealed_check` (a digest of the expected value; no ``expected_N`` left in
the kernel), the jupytext pairing is dropped (a save writes no ``.py`` twin), and a lesson on the
workshop path (the manifest's ``[[workshop]]``) gets cells tagged ``workshop`` where the room
skips a part and where it stops (:func:`workshop_stops`).

Beside them: the docs the lessons link to and the Markdown those link to in turn, ``helpers``,
MNIST (``data/``), ``requirements.lock``, ``pyproject.toml`` (named :data:`HANDOUT_DIST`, so an
editable install of it leaves the repository's ``ddp-lab`` mapping alone),
``jupyter_lab_config.json`` and a README for students (venv, preflight, JupyterLab, the lessons
in order). The folder is also zipped as ``<output-dir>/ddp-lab-student.zip`` (one top folder).
The default ``student/`` sits in the repository root, which the README's ``jupyter lab`` serves.

Exit codes: 0 written; 2 an unknown notebook or one that is not a lesson (nothing written).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Iterable

import nbformat
from nbconvert.exporters import NotebookExporter
from nbconvert.preprocessors import ClearOutputPreprocessor, Preprocessor, TagRemovePreprocessor
from traitlets.config import Config

from ci import workshop
from ci.planning import REPO_ROOT, ConfigError, check_output_dir, resolve_notebooks
from helpers import lessons as manifest
from helpers.checkout import HANDOUT_DIST, REPO_DIST

SOLUTION_TAG = "solution"
DEFAULT_OUTPUT_DIR = REPO_ROOT / "student"
ARCHIVE_NAME = "ddp-lab-student"
#: The project name line of pyproject.toml.
PROJECT_NAME = re.compile(rf'^name = "{re.escape(REPO_DIST)}"$', re.M)
#: What the lessons need besides themselves (relative to the repository root): the packages
#: they import (never `ci/`: the handout ships what a learner runs), MNIST, the lesson list, the
#: install and the JupyterLab config.
SUPPORT = ("helpers", "data", "notebooks/lessons.toml", "requirements.lock", "pyproject.toml",
           "jupyter_lab_config.json")
#: Never copied: caches, MNIST decompressed at run time, temporary files.
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*-ubyte", "*.tmp*", ".ipynb_checkpoints")
#: A lesson's link to a repository file outside notebooks/: ``](../docs/GLOSSARY.md#rank)``.
LINK = re.compile(r"\]\(\.\./([^)#\s]+)")
#: A Markdown document's relative link: ``](RELIABILITY.md)``, ``](../README.md#start-here)``.
DOC_LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)#\s]+)")

HANDOUT = """# ddp-lab: the course, without the solutions

This folder holds the lessons (`notebooks/`, in the order below), the glossary and the other pages
the lessons link to (`docs/`), the helpers the lessons import (`helpers/`), and MNIST (`data/`,
nothing is downloaded).

## Before the workshop

In a terminal, from this folder:

```bash
python3 -m venv .venv && . .venv/bin/activate   # this folder's own Python (a new terminal: . .venv/bin/activate)
python3 -m pip install -r requirements.lock     # once
python3 -m helpers.doctor                       # the preflight: every line must say ok
```

If a line of the doctor does not say ok, it says what to do; if that does not help, show its
output to your instructor.

## Open the lessons

```bash
python3 -m jupyter lab --config=jupyter_lab_config.json {first}
```

JupyterLab opens in your browser on the first lesson. Run its cells from the top, in order
(Shift+Enter). In the 3-hour workshop, follow the cells that begin **Workshop:**: they say which
parts the room skips and where it stops. The lessons, in order:

{lessons}

Each lesson ends with exercises: write your answer in place of `None` and run the check cell
after it. When you finish a lesson, shut its kernel down (Kernel > Shut Down Kernel) before you
open the next: each lesson's kernel keeps its processes and memory until then.

The notebooks find MNIST in `data/` next to `helpers/` by themselves; keep this folder's layout
as it is.
"""
#: The call that marks an exercise's check cell: ``check_answer("ex2", answer_2, ...``.
EXERCISE_CHECK = re.compile(r'check_answer\("ex(\d+)", answer_\1\b')
#: The line that opens an exercise's check cell in a student copy (N: the exercise).
SCOPE_LINE = ("def check_exercise_{n}():  # a function: what it computes stays inside, out of your kernel's names\n"
              "    from helpers.notebook import sealed_check as check_answer  # compares digests: it shows no answer")
WORKSHOP_TAG = "workshop"


def scoped_check(source: str) -> str:
    """An exercise's check cell, run inside ``check_exercise_N()`` (see the module docstring);
    any other cell, and a cell magic (``%%px``), unchanged."""
    found = EXERCISE_CHECK.search(source)
    if not found or source.lstrip().startswith("%"):
        return source
    n = found.group(1)
    body = "\n".join(f"    {line}" if line.strip() else "" for line in source.strip("\n").splitlines())
    return f"{SCOPE_LINE.format(n=n)}\n{body}\n\n\ncheck_exercise_{n}()"


def workshop_stops(nb, stem: str) -> list[tuple[int, str]]:
    """``(index, text)``: the workshop's markdown before cell ``index`` of lesson ``stem``, where the
    path (the manifest's ``[[workshop]]``) skips a section or exercise and where it stops; none
    for a lesson off the path. Headings between parts (what we saw, the next link) are not skipped."""
    lessons, path = manifest.load(), manifest.workshop()
    by_label = manifest.by_label(lessons)
    order = [by_label[part.lesson].stem for part in path]
    if stem not in order:
        return []
    part = path[order.index(stem)]
    wanted = {"setup", "summary", *part.sections, *(f"ex{n}" for n in part.exercises)}
    labels = workshop.parts_of_cells(nb)
    last = max(i for i, lab in enumerate(labels) if lab in wanted - {"summary"})
    if order.index(stem) + 1 < len(order):
        following = path[order.index(stem) + 1]
        nxt = by_label[following.lesson]
        then = f"continue at [{nxt.label} §{following.sections[0]}]({nxt.stem}.ipynb)"
    else:
        then = "that is the end of the workshop"
    stops, skipping = [], False
    for i, lab in enumerate(labels):
        if lab == "summary":
            continue
        if lab not in wanted and not skipping:
            if i > last:
                return [*stops, (i, f"**Workshop: stop here**, {then}. The rest of this lesson is homework.")]
            resume = next(labels[j] for j in range(i, len(labels)) if labels[j] in wanted - {"summary"})
            where = f"exercise {resume[2:]}" if resume.startswith("ex") else f"§{resume}"
            stops.append((i, f"**Workshop: skip to {where}** below; the parts in between are homework."))
        skipping = lab not in wanted
    return [*stops, (len(labels), f"**Workshop: stop here**, {then}.")]


class StudentPreprocessor(Preprocessor):
    """Exercise checks in a function scope (:func:`scoped_check`), the workshop's stops
    (:func:`workshop_stops`), no jupytext pairing."""

    def preprocess(self, nb, resources):
        nb.metadata.pop("jupytext", None)
        stem = Path(resources.get("metadata", {}).get("name", "")).stem
        for index, text in reversed(workshop_stops(nb, stem)):
            nb.cells.insert(index, nbformat.v4.new_markdown_cell(text, metadata={"tags": [WORKSHOP_TAG]}))
        return super().preprocess(nb, resources)

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type == "code" and "check" in cell.get("metadata", {}).get("tags", []):
            cell.source = scoped_check(cell.source)
        return cell, resources


def student_exporter() -> NotebookExporter:
    """nbconvert's notebook exporter with the solution cells removed and outputs cleared."""
    config = Config()
    config.TagRemovePreprocessor.remove_cell_tags = {SOLUTION_TAG}
    exporter = NotebookExporter(config=config)
    exporter.register_preprocessor(TagRemovePreprocessor(config=config), enabled=True)
    exporter.register_preprocessor(ClearOutputPreprocessor(config=config), enabled=True)
    exporter.register_preprocessor(StudentPreprocessor(config=config), enabled=True)
    return exporter


def _with_linked_docs(root: Path, linked: set[str]) -> set[str]:
    """``linked`` (paths relative to ``root``) that are files, plus every Markdown file of the
    repository that a copied Markdown file links to, and so on, so that the handout's docs hold no
    link to a document left out (lessons are already in the handout)."""
    found, todo = set(), [rel for rel in linked if (root / rel).is_file()]
    while todo:
        rel = todo.pop()
        if rel in found:
            continue
        found.add(rel)
        if rel.endswith(".md"):
            here = (root / rel).parent
            for target in DOC_LINK.findall((root / rel).read_text(encoding="utf-8")):
                path = (here / target).resolve()
                if path.suffix == ".md" and path.is_file() and path.is_relative_to(root.resolve()):
                    todo.append(path.relative_to(root.resolve()).as_posix())
    return found


def write_student_copies(names: Iterable[str] | None = None, output_dir: str | os.PathLike = DEFAULT_OUTPUT_DIR,
                         *, notebooks_dir: str | os.PathLike | None = None, lessons: list[str] | None = None,
                         repo_root: str | os.PathLike = REPO_ROOT) -> list[Path]:
    """Write the handout into ``output_dir`` (see the module docstring); returns the lessons
    written (``<output_dir>/notebooks/<stem>.ipynb``), in path order.

    ``lessons``: the course's stems, default every notebook of the manifest. Raises
    :class:`ci.planning.ConfigError` for an unknown notebook, one that is not a lesson, or an
    output folder that cannot be one (before writing)."""
    lessons = list(lessons) if lessons is not None else manifest.stems(None)
    paths = resolve_notebooks(list(names or []) or lessons, notebooks_dir)
    strays = [p.stem for p in paths if p.stem not in lessons]
    if strays:
        raise ConfigError(f"not a notebook of the course (notebooks/lessons.toml): {', '.join(strays)}; "
                          f"the lessons: {', '.join(lessons)}")
    paths.sort(key=lambda p: lessons.index(p.stem))
    out = check_output_dir(output_dir)
    root = Path(repo_root)
    nb_out = out / "notebooks"
    if nb_out.exists():  # a lesson dropped from the course must not stay in the handout
        shutil.rmtree(nb_out)
    nb_out.mkdir(parents=True)
    exporter = student_exporter()
    written, linked = [], set()
    for path in paths:
        body, _ = exporter.from_filename(str(path))
        nbformat.validate(nbformat.reads(body, as_version=4))
        target = nb_out / path.name
        target.write_text(body, encoding="utf-8")
        written.append(target)
        linked.update(LINK.findall(body))
    for rel in sorted(_with_linked_docs(root, linked) - {"README.md"}):  # the docs the lessons link to, and theirs
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / rel, out / rel)
    for rel in SUPPORT:
        src = root / rel
        if src.is_dir():
            shutil.copytree(src, out / rel, ignore=IGNORE, dirs_exist_ok=True)
        elif src.is_file():
            shutil.copyfile(src, out / rel)
    pyproject = out / "pyproject.toml"  # its own distribution: pip must not take it for the repository
    text, n = PROJECT_NAME.subn(f'name = "{HANDOUT_DIST}"', pyproject.read_text(encoding="utf-8"), count=1)
    if n != 1:
        raise ConfigError(f"{root / 'pyproject.toml'}: no line `name = \"{REPO_DIST}\"` to rename for the handout")
    pyproject.write_text(text, encoding="utf-8")
    listing = "\n".join(f"{i}. `notebooks/{p.name}`" for i, p in enumerate(written, 1))
    (out / "README.md").write_text(HANDOUT.format(first=f"notebooks/{written[0].name}", lessons=listing),
                                    encoding="utf-8")
    archive = out / f"{ARCHIVE_NAME}.zip"
    archive.unlink(missing_ok=True)
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
        for f in sorted(out.rglob("*")):
            if f.is_file() and f != archive:
                z.write(f, f"{ARCHIVE_NAME}/{f.relative_to(out).as_posix()}")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m ci.student_copies",
                                     description="Write the handout: the course's lessons without their "
                                     "solution cells, outputs cleared, with what they need to run.")
    parser.add_argument("notebooks", nargs="*", metavar="NOTEBOOK",
                        help="stem, number prefix (01) or path; default: every notebook of the manifest")
    parser.add_argument("--output-dir", default=str(DEFAULT_OUTPUT_DIR), help=f"default {DEFAULT_OUTPUT_DIR}")
    args = parser.parse_args(argv)
    try:
        written = write_student_copies(args.notebooks, args.output_dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    print(Path(args.output_dir) / f"{ARCHIVE_NAME}.zip")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
