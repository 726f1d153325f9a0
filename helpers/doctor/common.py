"""The doctor's results, constants and one-line formatting."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from helpers.doctor.run import Doctor

#: Fixed ``MASTER_PORT`` values of the tutorial code learners paste: the DDP tutorial's
#: ``setup()`` (12355) and torchrun's / dist_tuto's default (29500).
TUTORIAL_PORTS = {12355: "the DDP tutorial's MASTER_PORT", 29500: "torchrun's default port, dist_tuto's"}
WORLD_SIZE = 2
EXPECTED = [3.0, 3.0]  # all_reduce of rank + 1 over 2 ranks
REINSTALL = f"`{Path(sys.executable).name} -m pip install -r requirements.lock` from the repository root"
_INTERRUPT_GRACE_S = 60.0  # after the SIGINT at a check's deadline, how long it gets to stop (seconds)


# ---- results ---------------------------------------------------------------------------------

class Failed(Exception):
    """A check failed: ``detail`` says what happened, ``fix`` what to do (one line each)."""

    def __init__(self, detail: str, fix: str):
        super().__init__(detail)
        self.detail, self.fix = detail, fix


@dataclass
class Check:
    name: str
    run: Callable[[Doctor], str]  # returns the ok line's detail, raises Failed (or anything)
    timeout_s: float
    needs: tuple[str, ...] = ()  # checks that must be ok first
    fix: str = ""  # the fix for an unexpected exception


def one_line(text: str, limit: int = 160) -> str:
    """``text`` without ANSI colours, on one line, at most ``limit`` characters."""
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", str(text))
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _error_line(e: BaseException) -> str:
    """The most telling line of an exception: for a project ``WorkerError``, the rank's own
    exception (``PicklingError: ...``), else ``Type: message``."""
    text = str(e)
    inner = re.search(r"^\s*(\w+(?:Error|Exception)\b:.*)$", text, re.M)
    first = text.strip().splitlines()[0] if text.strip() else ""
    if inner and type(e).__name__ == "WorkerError":
        return one_line(f"{first} -- {inner.group(1)}")
    return one_line(f"{type(e).__name__}: {first}" if first else type(e).__name__)


def _cmdline(p) -> list[str]:
    """A psutil.Process's command line, or [] if it is gone."""
    try:
        return p.cmdline()
    except Exception:  # noqa: BLE001
        return []
