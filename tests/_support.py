"""Shared test utilities (not a test module)."""

from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent
TESTS_DIR = Path(__file__).resolve().parent


def leftover_processes():
    """Child processes of this test process, except multiprocessing's shared resource tracker."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            pass
    return found
