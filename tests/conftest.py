"""Shared fixtures and options. The repository root (for ``ci``) and tests/ (for worker modules
such as ``launch_workers``, which spawned workers import by name) are on ``sys.path`` through
``pythonpath`` in pyproject.toml's ``[tool.pytest.ini_options]``."""

import pytest

from _support import leftover_processes


def pytest_addoption(parser):
    parser.addoption(
        "--full-profile-follows", action="store_true", default=False,
        help="CI's main job (python3 ci/run_notebooks.py --profile full) runs after the tests: skip "
        "the smoke run of a notebook whose smoke and full parameters are equal (.ci/run passes this)")


@pytest.fixture
def no_leftover_processes():
    """Fail the test if it leaves any child process running."""
    yield
    left = leftover_processes()
    assert not left, f"processes left behind: {[(p.pid, p.cmdline()) for p in left]}"
