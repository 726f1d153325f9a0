"""Shared fixtures and options. The repository root (for ``ci``) and tests/ (for worker modules
such as ``launch_workers``, which spawned workers import by name) are on ``sys.path`` through
``pythonpath`` in pyproject.toml's ``[tool.pytest.ini_options]``."""

import multiprocessing.util
import os
import signal
import tempfile

import pytest

from _support import leftover_processes

#: markers whose tests ``python3 -m pytest`` leaves out unless asked for: the 20-start warm-ranks
#: load test, and the smoke runs of the lessons (``.ci/run`` runs both as steps of their own; the
#: lessons through ``python3 ci/run_notebooks.py``, which prints the runner's table)
OPT_IN = ("stress", "lessons")


def _opted_in(config, marker: str) -> bool:
    """Whether this run asked for the ``marker`` tests: ``-m`` names it (``-m stress``), or an
    argument names one test by node id (``path::name``)."""
    return marker in (config.getoption("markexpr") or "") or any("::" in str(a) for a in config.args)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core plus one (``--maxprocesses`` in pyproject.toml caps it): about
    a fifth of worker time is waiting (hangs, kernels starting; on 2 cores 1,112 worker-seconds held
    869 CPU-seconds), which the extra worker uses."""
    return (os.cpu_count() or 1) + 1


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """``stress`` and ``lessons`` tests left out unless asked for (:func:`_opted_in`); then longest tests
    first (``@pytest.mark.slow(seconds)``, a rough duration; unmarked ones keep their order after
    them), so that no worker runs a long one alone at the end. A test using a module-scoped fixture
    (warm ranks, about 11 CPU-seconds to start) joins the ``xdist_group`` of its module and those
    fixtures unless it names one itself, so that the fixture is built once, not once per worker
    (``--dist loadgroup`` hands the groups out first, the largest first)."""
    for marker in OPT_IN:
        if not _opted_in(config, marker):
            left_out = [item for item in items if item.get_closest_marker(marker)]
            if left_out:
                config.hook.pytest_deselected(items=left_out)
                items[:] = [item for item in items if not item.get_closest_marker(marker)]

    def seconds(item):
        mark = item.get_closest_marker("slow")
        return mark.args[0] if mark and mark.args else 0
    items.sort(key=lambda item: -seconds(item))  # stable: equal ones keep their order
    for item in items:
        if item.get_closest_marker("xdist_group") or not hasattr(item, "_fixtureinfo"):
            continue
        shared = sorted(name for name, defs in item._fixtureinfo.name2fixturedefs.items()
                        if defs and defs[-1].scope == "module")
        if shared:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}:{'+'.join(shared)}"))


@pytest.fixture(scope="session", autouse=True)
def temp_state_outside_tmp_paths():
    """This process's temp state stays in the usual temp directory for the whole session: Python
    caches its temp directory at the first ``tempfile.gettempdir()``, multiprocessing makes its folder
    (``pymp-*``, the fork server's socket's too) at first use. Both outlive a test, so neither may land
    in a test's ``tmp_path`` (removed when it passes), where every later launch would fail with
    ``FileNotFoundError``."""
    tempfile.gettempdir()
    multiprocessing.util.get_temp_dir()
    yield


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
