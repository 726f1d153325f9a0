"""One copy of the course, one install: which copy's ``helpers`` and ``ci`` a process runs.

``pip install -e .`` maps ``helpers`` and ``ci`` to one folder per Python: a second copy (another
clone, a worktree, the handout) used with the same Python would silently run the first copy's
code. So ``import helpers`` raises :class:`CheckoutMismatch` when the working folder is inside a
copy of the course and the ``helpers`` imported belongs to another (a copy written inside
another, the handout's default ``student/``, may use the outer copy's code); the runner puts its
own copy first on its kernels' ``PYTHONPATH`` (:func:`pythonpath_first`). A copy is a folder
with ``helpers/`` and a ``pyproject.toml`` whose project ``name`` is in :data:`PROJECT_NAMES`.
Standard library only (a few ``stat`` calls at ``import helpers``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

#: The repository's distribution name, and the handout's (``ci/student_copies.py`` writes it).
REPO_DIST, HANDOUT_DIST = "ddp-lab", "ddp-lab-student"
PROJECT_NAMES = (REPO_DIST, HANDOUT_DIST)
_NAME = re.compile(r'^name\s*=\s*"([^"]+)"', re.M)


class CheckoutMismatch(ImportError):
    """The working folder is in one copy of the course, the code imported is another copy's."""


def is_checkout(folder: str | os.PathLike) -> bool:
    """Is ``folder`` the root of a copy of the course (its ``pyproject.toml`` and ``helpers/``)?"""
    folder = Path(folder)
    try:
        text = (folder / "pyproject.toml").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    m = _NAME.search(text)
    return bool(m) and m.group(1) in PROJECT_NAMES and (folder / "helpers").is_dir()


def checkouts_around(path: str | os.PathLike) -> list[Path]:
    """The copies of the course that hold ``path`` (resolved), innermost first; ``[]`` outside any."""
    p = Path(path).resolve()
    return [d for d in (p, *p.parents) if is_checkout(d)]


def mismatch(code_root: str | os.PathLike, cwd: str | os.PathLike | None = None) -> str | None:
    """``None`` when the code of the copy at ``code_root`` may run in ``cwd`` (default: the working
    folder): ``cwd`` is in no copy of the course, or in ``code_root`` or a copy inside it. Otherwise
    the two-line message naming both folders and the fix."""
    try:
        here = checkouts_around(cwd if cwd is not None else os.getcwd())
    except OSError:  # the working folder was deleted
        return None
    code_root = Path(code_root).resolve()
    if not here or code_root in here:
        return None
    return (f"the working folder is in the copy of the course at {here[0]}, but `helpers` was imported from "
            f"another copy, {code_root}.\n"
            f"Use each copy with a venv of its own: `cd {here[0]} && python3 -m venv .venv && . .venv/bin/activate "
            f"&& python3 -m pip install -r requirements.lock`, then start JupyterLab (or the command) there.")


def pythonpath_first(root: str | os.PathLike, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default ``os.environ``) with ``root`` first on ``PYTHONPATH``, so that a
    child Python (a kernel, and the ranks it starts) imports that copy's ``helpers`` and ``ci``
    whatever the Python has installed."""
    env = dict(os.environ if env is None else env)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(root)]
    env["PYTHONPATH"] = os.pathsep.join([str(root), *rest])
    return env
