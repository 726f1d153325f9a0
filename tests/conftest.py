"""Shared fixtures and options. The repository root (for ``ci``) and tests/ (for worker modules
such as ``launch_workers``, which spawned workers import by name) are on ``sys.path`` through
``pythonpath`` in pyproject.toml's ``[tool.pytest.ini_options]``."""

import signal

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


@pytest.fixture(autouse=True)
def sigint_handler_left_alone():
    """No test, and nothing it calls, may leave this process's SIGINT handler changed: a notebook
    kernel whose handler is replaced can no longer be interrupted (and a later test that sends
    SIGINT would see something else happen)."""
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    assert after is before, f"the SIGINT handler was changed from {before!r} to {after!r}"
