"""Shared machinery of the notebook generators ``ci/build_nbNN.py``.

Each generator defines ``CELLS`` with :func:`md` and :func:`code` and ends with::

    if __name__ == "__main__":
        sys.exit(run(OUT, CELLS, "nb01"))

``python ci/build_nbNN.py`` writes and validates the notebook (outputs cleared, kernelspec
``python3``, stable cell ids); ``--check`` exits 1 if the notebook on disk differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from textwrap import dedent

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook


def md(text: str):
    """A markdown cell from an indented triple-quoted string."""
    return new_markdown_cell(dedent(text).strip("\n"))


def code(text: str, tags: list[str] | None = None):
    """A code cell from an indented triple-quoted string, optionally tagged (e.g. ``["parameters"]``)."""
    cell = new_code_cell(dedent(text).strip("\n"))
    if tags:
        cell.metadata["tags"] = tags
    return cell


def build(cells: list, id_prefix: str) -> nbformat.NotebookNode:
    """The notebook: ``cells`` with ids ``<id_prefix>-NN``, kernelspec python3, validated."""
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):  # stable, readable ids (nbformat >= 4.5 wants one per cell)
        cell["id"] = f"{id_prefix}-{i:02d}"
    nbformat.validate(nb)
    return nb


def run(out: Path, cells: list, id_prefix: str, argv: list[str] | None = None) -> int:
    """Command line of a generator: write ``out`` (default) or ``--check`` it; returns the exit code."""
    script = Path(sys.argv[0]).name
    parser = argparse.ArgumentParser(description=f"Generate {out.name} (outputs cleared)")
    parser.add_argument("--check", action="store_true", help="only compare with the notebook on disk")
    args = parser.parse_args(argv)
    text = nbformat.writes(build(cells, id_prefix)) + "\n"
    if args.check:
        same = out.exists() and out.read_text() == text
        print(f"{out.name}: {'up to date' if same else f'DIFFERS from ci/{script}: regenerate it'}")
        return 0 if same else 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    nbformat.validate(nbformat.read(out, as_version=4))
    print(f"wrote {out.relative_to(out.parent.parent)} ({len(cells)} cells), valid")
    return 0
