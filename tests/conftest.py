"""Shared fixtures and options. The repository root (for ``ci``) and tests/ (for worker modules
such as ``launch_workers``, which spawned workers import by name) are on ``sys.path`` through
``pythonpath`` in pyproject.toml's ``[tool.pytest.ini_options]``."""

import os
import signal

import pytest

from _support import leftover_processes


def pytest_addoption(parser):
    parser.addoption(
        "--full-profile-follows", action="store_true", default=False,
        help="CI's main job (python3 ci/run_notebooks.py --profile full) runs after the tests: skip "
        "the smoke run of a notebook whose smoke and full parameters are equal (.ci/run passes this)")


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core plus one (``--maxprocesses`` in pyproject.toml caps it).
    About a fifth of the suite's worker time is spent waiting, not computing (hang and timeout
    rows, a browser, papermill kernels starting): measured on 2 cores, 1,112 worker-seconds held
    869 CPU-seconds. With one worker per core a core sat idle through every such wait; the extra
    worker uses it."""
    return (os.cpu_count() or 1) + 1


def pytest_collection_modifyitems(items):
    """Longest tests first, so that no worker is left running a long one alone at the end.

    ``@pytest.mark.slow(seconds)`` gives a rough duration, used only for this order (a
    notebook's smoke run, the browser test); unmarked tests keep their collection order after
    them. pytest-xdist hands work out in this order (``--dist loadgroup``; the groups, such as the
    fault matrix or the tests on ``tests/test_ranks.py``'s warm ranks, go first, the largest
    first, as xdist orders work units by their number of tests)."""
    def seconds(item):
        mark = item.get_closest_marker("slow")
        return mark.args[0] if mark and mark.args else 0
    items.sort(key=lambda item: -seconds(item))  # stable: equal ones keep their order


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
