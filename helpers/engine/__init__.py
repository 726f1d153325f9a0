"""The notebook-safe engine: start DDP ranks from a notebook cell (or a script) and get their results back.

Notebooks, the course's helpers and the learner's docs use only this public surface
(``tests/course/test_fence.py`` checks it)::

    from helpers.engine import launch, worker_device    # fn(rank, world_size, ...) on N real ranks
    import helpers.mp as mp                             # torch.multiprocessing's spawn/Process, notebook-safe
    from helpers.engine import start_ranks              # warm ranks across cells (%%px)
    from helpers.engine import simulate                 # fn(rank, world_size, ...) on N simulated ranks (threads)
    import helpers.engine.cluster as cluster            # notebook 07a: torchrun agents, two-node rehearsal

This is the learner's surface: the names lessons teach and the course code they run uses. What only
the benchmarks, the doctor, ``ci/`` and the tests need is behind :mod:`helpers.engine.internal`.
Names (all loaded lazily, PEP 562: ``import helpers.engine`` does not import torch, nor do its
``fork_server``, ``run_dir`` and ``processes`` modules; the first name used imports what it needs):

- starting ranks: :func:`launch`, :func:`start_ranks` (warm ranks across cells, ``%%px``),
  :func:`simulate` (up to 1,024 ranks, ``MAX_SIMULATED_RANKS``, as threads of this process on
  torch's threaded process group: real values, no real time); ``helpers.mp`` for ``torch.multiprocessing``'s interface;
- inside a rank: :func:`worker_device` (``cuda:<local_rank>`` under nccl, else ``cpu``);
  :func:`main_from_env` (the torchrun entry for a worker written for :func:`launch`);
- rules: :func:`resolve_backend` (nccl with a GPU per rank, else gloo; one of :data:`BACKENDS`);
- processes: :func:`free_port`, :func:`loopback_interface`, :func:`leftover_children`;
- errors learners catch: :class:`LaunchError` (bad input, before any process starts),
  :class:`WorkerError` (a rank raised; names the root-cause rank), :class:`LaunchTimeout`,
  :class:`LaunchInterrupted`, :class:`RanksTimeout`, :class:`NoRanks`, :class:`RanksStopped`,
  :class:`SimulationUnavailable` (this torch lacks what :func:`simulate` needs);
  :class:`OversubscriptionWarning` (more ranks than cores), all defined in :mod:`helpers.engine.errors`;
- :mod:`faults`: deliberate faults (a rank that raises, hangs, exits, is killed) for tests and lessons.

The module map and the engine's guarantees are in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import importlib

#: public name -> the engine submodule that defines it
_WHERE = {
    "launch": "launcher",
    "simulate": "simulated",
    "SimulationUnavailable": "errors",
    "resolve_backend": "launcher",
    "BACKENDS": "launcher",
    "worker_device": "rank_main",
    "main_from_env": "processes",
    "free_port": "processes",
    "loopback_interface": "processes",
    "leftover_children": "processes",
    "start_ranks": "warm_ranks",
    "RanksTimeout": "errors",
    "NoRanks": "errors",
    "RanksStopped": "errors",
    "LaunchError": "errors",
    "WorkerError": "errors",
    "LaunchTimeout": "errors",
    "LaunchInterrupted": "errors",
    "OversubscriptionWarning": "errors",
}
#: public submodules (``from helpers.engine import faults``)
_MODULES = ("faults",)

__all__ = sorted([*_WHERE, *_MODULES])


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value  # next time a plain attribute (and never the submodule of the same name)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
