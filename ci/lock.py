"""Refresh ``requirements.lock``: every package the course installs, pinned, for Python 3.10 to 3.13.

Usage (from the repository root; uv: ``python3 -m pip install uv``)::

    python3 -m ci.lock [--upgrade | --upgrade-package ipython ...]

Runs uv's resolver, ``uv pip compile requirements.txt --universal --python-version 3.10`` (one
file, with markers for each Python and platform). With no option it keeps every pin that
requirements.txt still allows; ``--upgrade`` moves every package to its newest allowed version.
``tests/course/test_lint.py`` checks that the lock agrees with requirements.txt;
``python3 -m ci.drift`` tests the newest versions before you upgrade (docs/TESTING.md).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPILE = ["pip", "compile", "requirements.txt", "--universal", "--python-version", "3.10",
           "--custom-compile-command", "python3 -m ci.lock", "-o", "requirements.lock", "--quiet"]


def uv() -> str:
    """The uv executable: the ``uv`` package's, else ``uv`` on PATH."""
    try:
        from uv import find_uv_bin
        return find_uv_bin()
    except ImportError:
        found = shutil.which("uv")
    if not found:
        raise SystemExit("error: uv is needed to refresh the lock: python3 -m pip install uv")
    return found


def main(argv: list[str] | None = None) -> int:
    return subprocess.run([uv(), *COMPILE, *(sys.argv[1:] if argv is None else argv)], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
