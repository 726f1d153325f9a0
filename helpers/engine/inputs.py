"""The checks on a launcher's input, made before any process or thread starts: the world size, the
function, the timeout and free space in the temp folder. ``launch``, ``helpers.mp``, warm ranks and
``simulate`` share them, so each refuses bad input in the same words (:class:`LaunchError`)."""

from __future__ import annotations

import math
import numbers
import operator
import os
import shutil
import sys
import tempfile
import warnings
from typing import Any

from helpers.engine.errors import LaunchError, OversubscriptionWarning
from helpers.engine.tracebacks import HELPERS_DIR

#: ``world_size`` above ``MAX_RANKS_PER_CPU * os.cpu_count()`` is refused; above the CPU count
#: it is allowed with an :class:`OversubscriptionWarning` (ranks share cores: correct results,
#: meaningless timings).
MAX_RANKS_PER_CPU = 8

#: The least free space (bytes) a launch needs in the temp folder: its run folder (each rank's output, markers,
#: stacks) and torch's error files are written there.
MIN_FREE_TEMP = 1 << 20


class DefaultTimeout(float):
    """A call's default ``timeout`` (seconds; shown as a float): a timeout's message says it was the
    default and how to lift it."""

    def __repr__(self) -> str:
        return repr(float(self))


def temp_folder_full() -> str | None:
    """What to do when the temp folder (``TMPDIR``) has less than :data:`MIN_FREE_TEMP` bytes free, else ``None``."""
    folder = tempfile.gettempdir()
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    return None if free >= MIN_FREE_TEMP else (
        f"the temp folder {folder} (TMPDIR) is full: {free // 1024} KiB free; each rank writes its output, result "
        "and error there. Free space there (old checkpoints, data), or set TMPDIR to a folder with room "
        "(`export TMPDIR=$HOME/tmp` before starting Jupyter or Python).")


def as_int(value: Any) -> int | None:
    """``value`` as an int: any integer type (numpy's ``np.int64`` too), never a bool or a float; else ``None``."""
    try:
        return None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        return None


def check_world_size(world_size: Any, name: str = "world_size") -> int:
    if as_int(world_size) is None:
        raise LaunchError(
            f"{name} must be a positive int (the number of processes), got {world_size!r} "
            f"of type {type(world_size).__name__}. Pass e.g. {name}=2."
        )
    world_size = as_int(world_size)
    if world_size < 1:
        raise LaunchError(f"{name} must be >= 1, got {world_size}. Pass e.g. {name}=2.")
    cpus = os.cpu_count() or 1
    if world_size > MAX_RANKS_PER_CPU * cpus:
        raise LaunchError(
            f"{name}={world_size} is more than {MAX_RANKS_PER_CPU} ranks per CPU core on this "
            f"machine ({cpus} cores); that many processes would thrash memory and the scheduler. "
            f"Use {name} <= {MAX_RANKS_PER_CPU * cpus}."
        )
    if world_size > cpus:
        warnings.warn(
            f"{name}={world_size} ranks on {cpus} CPU cores: ranks share cores. Results are "
            "correct, but timings are not meaningful (oversubscription).",
            OversubscriptionWarning,
            stacklevel=_first_frame_outside_helpers(),
        )
    return world_size


def _first_frame_outside_helpers() -> int:
    """``warnings.warn``'s ``stacklevel`` that names the caller's own line (a cell), not ours."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(HELPERS_DIR + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def check_callable(fn: Any) -> None:
    if not callable(fn):
        raise LaunchError(f"fn must be callable (a function), got {fn!r} of type {type(fn).__name__}.")


def check_timeout(timeout: Any, name: str = "timeout", none: bool = True) -> float | None:
    """``timeout`` as float seconds (``None`` where ``none`` allows it); raises :class:`LaunchError`
    for a bool, a non-number, nan, inf, zero or a negative number."""
    if timeout is None and none:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 < timeout < math.inf:
        raise LaunchError(f"{name} must be a positive, finite number of seconds, got {timeout!r}. "
                          f"Pass e.g. {name}=60{', or None for no limit' if none else ''}.")
    return float(timeout)
