"""Make the repository root (for ``ci.run_notebooks``) and tests/ (for worker modules such as
``launch_workers``, which spawned workers import by name) importable without PYTHONPATH."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
for p in (str(Path(__file__).resolve().parent), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

from _support import leftover_processes  # noqa: E402


@pytest.fixture
def no_leftover_processes():
    """Fail the test if it leaves any child process running."""
    yield
    left = leftover_processes()
    assert not left, f"processes left behind: {[(p.pid, p.cmdline()) for p in left]}"
