"""The engine's internal door: what the benchmarks, the doctor, ``ci/`` and the tests need, and lessons do not.

Lessons and the course helpers they call use :mod:`helpers.engine` (the learner's surface);
``helpers/bench``, ``helpers/doctor``, ``ci/`` and ``helpers/ipc_kernel.py`` may also import the
names of ``_WHERE`` from here, lazily (``tests/course/test_fence.py`` checks both rules)::

    from helpers.engine.internal import end_processes, stop_fork_server
"""

from __future__ import annotations

import importlib

#: internal name -> the engine submodule that defines it
_WHERE = {
    "current_ranks": "warm_ranks",
    "WarmRanks": "warm_ranks",
    "threads_per_rank": "launcher",
    "MAX_RANKS_PER_CPU": "launcher",
    "QuietElastic": "launcher",
    "descendants": "processes",
    "end_processes": "processes",
    "is_live": "processes",
    "stop_fork_server": "fork_server",
    "is_reaper": "run_dir",
    "socket_dir": "socket_folder",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"helpers.engine.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
