#!/usr/bin/env python3
"""Student copies of the notebooks for a workshop: the solution cells removed, outputs cleared.

Usage (from the repository root)::

    python3 -m ci.student_copies                       # every notebook -> build/student/*.ipynb
    python3 -m ci.student_copies 04 06 --output-dir /tmp/workshop

Each ``notebooks/NN_*.ipynb`` is written to ``<output-dir>/NN_*.ipynb`` by nbconvert's
``NotebookExporter`` with two of nbconvert's own preprocessors: ``TagRemovePreprocessor``
drops every cell tagged ``solution`` and ``ClearOutputPreprocessor`` clears outputs and
execution counts. Exercise cells (tag ``exercise``) and the cells that check an answer (tag
``check``) stay, so a learner fills in the exercise and runs its check. Notebook names are
those of ``ci/run_notebooks.py`` (stem, number prefix or path).

Exit codes: 0 written; 2 an unknown notebook (nothing written).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Iterable

import nbformat
from nbconvert.exporters import NotebookExporter
from nbconvert.preprocessors import ClearOutputPreprocessor, TagRemovePreprocessor
from traitlets.config import Config

from ci.planning import REPO_ROOT, ConfigError, check_output_dir, resolve_notebooks

SOLUTION_TAG = "solution"
DEFAULT_OUTPUT_DIR = REPO_ROOT / "build" / "student"


def student_exporter() -> NotebookExporter:
    """nbconvert's notebook exporter with the solution cells removed and outputs cleared."""
    config = Config()
    config.TagRemovePreprocessor.remove_cell_tags = {SOLUTION_TAG}
    exporter = NotebookExporter(config=config)
    exporter.register_preprocessor(TagRemovePreprocessor(config=config), enabled=True)
    exporter.register_preprocessor(ClearOutputPreprocessor(config=config), enabled=True)
    return exporter


def write_student_copies(names: Iterable[str] | None = None, output_dir: str | os.PathLike = DEFAULT_OUTPUT_DIR,
                         *, notebooks_dir: str | os.PathLike | None = None) -> list[Path]:
    """Write one student copy per notebook into ``output_dir``; returns the paths written.

    Raises :class:`ci.planning.ConfigError` for an unknown notebook name or an output folder that
    cannot be one (before writing)."""
    paths = resolve_notebooks(names, notebooks_dir)
    out = check_output_dir(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    exporter = student_exporter()
    written = []
    for path in paths:
        body, _ = exporter.from_filename(str(path))
        nbformat.validate(nbformat.reads(body, as_version=4))
        target = out / path.name
        target.write_text(body, encoding="utf-8")
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m ci.student_copies",
                                     description="Write the notebooks without their solution cells, outputs "
                                     "cleared, for a workshop.")
    parser.add_argument("notebooks", nargs="*", metavar="NOTEBOOK",
                        help="stem, number prefix (01) or path; default: all notebooks/*.ipynb")
    parser.add_argument("--output-dir", default=str(DEFAULT_OUTPUT_DIR), help=f"default {DEFAULT_OUTPUT_DIR}")
    args = parser.parse_args(argv)
    try:
        written = write_student_copies(args.notebooks, args.output_dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
